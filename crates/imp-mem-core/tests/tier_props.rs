//! V3–V6 as proptest state machines over the tier allocators on the fake
//! backend.
//!
//! Operations are generated as data; an operation on "some live handle" is
//! `Op(seed)` resolved to `live[seed % live.len()]` (sharded-slab's shape),
//! so every generated sequence is valid and shrinks well.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::panic::{catch_unwind, AssertUnwindSafe};

use imp_mem_core::{
    Arena, ArenaSpan, BlockPool, BlockRef, FakeBackend, FakeConfig, MemError, PoolConfig,
    SharedArena, SharedMark, SharedScratchStack, Tier,
};
use proptest::prelude::*;

fn fake() -> FakeBackend {
    FakeBackend::new(FakeConfig::default()).unwrap()
}

// ---------------------------------------------------------------- V3 arena

#[derive(Debug, Clone)]
enum ArenaOp {
    Take { bytes: usize, align_log: u32 },
    Reset,
    Use(usize),
}

fn arena_op() -> impl Strategy<Value = ArenaOp> {
    prop_oneof![
        6 => (1usize..3000, 0u32..10).prop_map(|(bytes, align_log)| ArenaOp::Take { bytes, align_log }),
        1 => Just(ArenaOp::Reset),
        3 => any::<usize>().prop_map(ArenaOp::Use),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// V3: a reset frees wholesale (used 0, backend unchanged), and every span
    /// of an older generation is refused, never resolved.
    #[test]
    fn v3_reset_frees_wholesale_and_refuses_old_spans(ops in prop::collection::vec(arena_op(), 1..80)) {
        let fb = fake();
        let arena = SharedArena::new(&fb, Tier::ModelResident, 16 << 10, None).unwrap();
        let backend_live = fb.live();
        let journal_len = fb.journal().unwrap().len();
        let mut tickets: Vec<(ArenaSpan, u64)> = Vec::new();
        let mut generation = 0u64;
        for op in ops {
            match op {
                ArenaOp::Take { bytes, align_log } => {
                    let before = arena.stats();
                    match arena.take(bytes, 1 << align_log) {
                        Ok(t) => {
                            let span = arena.span(&t).unwrap();
                            prop_assert_eq!(span.addr() % (1 << align_log), 0);
                            tickets.push((t, generation));
                        }
                        Err(MemError::Capacity(_)) => prop_assert_eq!(arena.stats(), before),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                ArenaOp::Reset => {
                    arena.reset();
                    generation += 1;
                    let s = arena.stats();
                    prop_assert_eq!((s.used, s.takes, s.generation), (0, 0, generation));
                }
                ArenaOp::Use(seed) if !tickets.is_empty() => {
                    let (t, g) = tickets[seed % tickets.len()];
                    match arena.span(&t) {
                        Ok(_) => prop_assert_eq!(g, generation),
                        Err(MemError::StaleSpan(_)) => prop_assert!(g < generation),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                ArenaOp::Use(_) => {}
            }
            // Takes never reach the backend: the arena's region is all it holds.
            prop_assert_eq!(fb.live(), backend_live);
            prop_assert_eq!(fb.journal().unwrap().len(), journal_len);
            // Live spans of the current generation never overlap.
            let mut current: Vec<(usize, usize)> = tickets
                .iter()
                .filter(|(_, g)| *g == generation)
                .map(|(t, _)| { let s = arena.span(t).unwrap(); (s.addr(), s.addr() + s.len()) })
                .collect();
            current.sort_unstable();
            prop_assert!(current.windows(2).all(|w| w[0].1 <= w[1].0));
        }
    }
}

// ---------------------------------------------------------------- V4 pool

#[derive(Debug, Clone)]
enum PoolOp {
    Allocate,
    AllocateMany(u32),
    Share(usize),
    Free(usize),
    FailNextGrowth,
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        4 => Just(PoolOp::Allocate),
        2 => (0u32..12).prop_map(PoolOp::AllocateMany),
        3 => any::<usize>().prop_map(PoolOp::Share),
        5 => any::<usize>().prop_map(PoolOp::Free),
        1 => Just(PoolOp::FailNextGrowth),
    ]
}

fn check_pool(pool: &BlockPool, live: &[BlockRef<'_>]) -> Result<(), TestCaseError> {
    let s = pool.stats();
    prop_assert_eq!(s.free + s.live, s.capacity, "V4: free + live == capacity");
    prop_assert_eq!(s.refs, live.len() as u64);
    let mut ids: Vec<u32> = live.iter().map(BlockRef::id).collect();
    ids.sort_unstable();
    ids.dedup();
    prop_assert_eq!(ids.len() as u32, s.live);
    for r in live {
        let held = live.iter().filter(|o| o.id() == r.id()).count() as u32;
        prop_assert_eq!(r.refcount(), held);
    }
    pool.check_invariants()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// V4 on a fixed, a growable and a slots pool: free + live == capacity,
    /// and every block's count equals the refs that name it, after every op.
    #[test]
    fn v4_free_plus_live_is_capacity(
        ops in prop::collection::vec(pool_op(), 1..120),
        kind in 0u8..3,
    ) {
        let fb = FakeBackend::new(FakeConfig { granularity: 1024, ..FakeConfig::default() }).unwrap();
        let pool = match kind {
            0 => BlockPool::new(&fb, &PoolConfig::fixed(128, 24)).unwrap(),
            1 => BlockPool::new(&fb, &PoolConfig::growable(256, 4, 40, 4)).unwrap(),
            _ => BlockPool::slots(24).unwrap(),
        };
        let mut live: Vec<BlockRef<'_>> = Vec::new();
        for op in ops {
            let before = pool.stats();
            match op {
                PoolOp::Allocate => match pool.allocate() {
                    Ok(r) => live.push(r),
                    Err(MemError::Capacity(_) | MemError::OutOfMemory(_)) => {
                        prop_assert_eq!(pool.stats().live, before.live)
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                PoolOp::AllocateMany(n) => match pool.allocate_many(n) {
                    Ok(refs) => {
                        prop_assert_eq!(refs.len() as u32, n);
                        live.extend(refs);
                    }
                    Err(MemError::Capacity(_) | MemError::OutOfMemory(_)) => {
                        let after = pool.stats();
                        prop_assert_eq!((after.live, after.refs), (before.live, before.refs), "all or nothing");
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                PoolOp::Share(seed) if !live.is_empty() => {
                    let alias = live[seed % live.len()].share().unwrap();
                    live.push(alias);
                }
                PoolOp::Free(seed) if !live.is_empty() => {
                    let r = live.swap_remove(seed % live.len());
                    pool.release(r).unwrap();
                }
                PoolOp::FailNextGrowth => fb.fail_commits(1),
                PoolOp::Share(_) | PoolOp::Free(_) => {}
            }
            check_pool(&pool, &live)?;
        }
        drop(live);
        let s = pool.stats();
        prop_assert_eq!((s.free, s.refs), (s.capacity, 0));
    }
}

// ---------------------------------------------------------------- V5 unwinding

/// One step of a request's life.
#[derive(Debug, Clone)]
enum Step {
    Allocate(u32),
    ShareIntoCache(usize),
    DropFromCache(usize),
    Evict(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1u32..6).prop_map(Step::Allocate),
        2 => any::<usize>().prop_map(Step::ShareIntoCache),
        1 => any::<usize>().prop_map(Step::DropFromCache),
        1 => any::<usize>().prop_map(Step::Evict),
    ]
}

/// How the request is cut short at step `at`.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Error,
    Panic,
    DeviceRefusesGrowth,
}

/// Runs a request: its blocks live in its own table (the sequence slot);
/// `cache` is a longer-lived holder (the prefix cache) that takes shares.
fn request<'p>(
    pool: &'p BlockPool,
    fb: &FakeBackend,
    cache: &mut Vec<BlockRef<'p>>,
    steps: &[Step],
    fault_at: usize,
    fault: Fault,
) -> Result<(), MemError> {
    let mut table: Vec<Option<BlockRef<'p>>> = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        if i == fault_at {
            match fault {
                Fault::Error => return Err(MemError::invalid("injected")),
                Fault::Panic => panic!("injected panic at step {i}"),
                Fault::DeviceRefusesGrowth => fb.fail_commits(1),
            }
        }
        match step {
            Step::Allocate(n) => table.extend(pool.allocate_many(*n)?.into_iter().map(Some)),
            Step::ShareIntoCache(seed) if !table.is_empty() => {
                if let Some(r) = &table[seed % table.len()] {
                    cache.push(r.share()?);
                }
            }
            Step::DropFromCache(seed) if !cache.is_empty() => {
                drop(cache.swap_remove(seed % cache.len()));
            }
            // StreamingLLM middle eviction: a hole, not a shorter table.
            Step::Evict(seed) if !table.is_empty() => {
                let n = table.len();
                table[seed % n] = None;
            }
            _ => {}
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// V5: whatever step an error, a panic or a refused growth cuts a request
    /// short at, its refs unwind: afterwards the pool holds exactly the refs
    /// of the longer-lived cache, and nothing else.
    #[test]
    fn v5_refcounts_balance_when_a_request_unwinds(
        steps in prop::collection::vec(step(), 1..30),
        fault_at in 0usize..32,
        fault in prop_oneof![Just(Fault::Error), Just(Fault::Panic), Just(Fault::DeviceRefusesGrowth)],
    ) {
        let fb = fake();
        let pool = BlockPool::new(&fb, &PoolConfig::growable(4096, 8, 64, 8)).unwrap();
        let mut cache: Vec<BlockRef<'_>> = Vec::new();
        let outcome = catch_unwind(AssertUnwindSafe(|| request(&pool, &fb, &mut cache, &steps, fault_at, fault)));
        fb.fail_commits(0);
        if matches!(fault, Fault::Panic) && fault_at < steps.len() {
            // It panicked at the step, unless a real error (the pool full)
            // ended it at an earlier one.
            match &outcome {
                Err(_) => {}
                Ok(Err(e)) => prop_assert!(
                    !e.to_string().contains("injected"),
                    "ended before the panic by {e}"
                ),
                Ok(Ok(())) => prop_assert!(false, "ran past the injected panic"),
            }
        }
        let s = pool.stats();
        prop_assert_eq!(s.refs, cache.len() as u64, "only the cache's refs remain");
        prop_assert_eq!(s.free + s.live, s.capacity);
        pool.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        drop(cache);
        prop_assert_eq!(pool.stats().free, pool.stats().capacity);
    }
}

// ---------------------------------------------------------------- V6 scratch

#[derive(Debug, Clone)]
enum ScratchOp {
    Open,
    Take(usize),
    Close(usize),
}

fn scratch_op() -> impl Strategy<Value = ScratchOp> {
    prop_oneof![
        2 => Just(ScratchOp::Open),
        3 => (1usize..700).prop_map(ScratchOp::Take),
        2 => any::<usize>().prop_map(ScratchOp::Close),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// V6: closing the innermost mark rewinds exactly to where it opened;
    /// closing any other is a hard error that refuses all further work until
    /// reset, while the offsets stay coherent as the inner marks close.
    #[test]
    fn v6_marks_rewind_lifo_and_out_of_order_is_a_hard_error(ops in prop::collection::vec(scratch_op(), 1..80)) {
        let fb = fake();
        let stack = SharedScratchStack::new(&fb, 8 << 10, None).unwrap();
        let mut marks: Vec<(SharedMark, usize)> = Vec::new();
        let mut broken = false;
        for op in ops {
            match op {
                ScratchOp::Open => match stack.mark() {
                    Ok(m) => {
                        prop_assert!(!broken);
                        marks.push((m, stack.stats().used));
                    }
                    Err(MemError::InvalidArgument(_)) => prop_assert!(broken),
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                ScratchOp::Take(bytes) => {
                    if let Some((m, _)) = marks.last() {
                        let before = stack.stats();
                        match m.take(bytes, 16) {
                            Ok(t) => prop_assert!(!broken && stack.is_valid(&t)),
                            Err(MemError::Capacity(_)) => prop_assert_eq!(stack.stats(), before),
                            Err(MemError::InvalidArgument(_)) => prop_assert!(broken),
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                }
                ScratchOp::Close(seed) if !marks.is_empty() => {
                    let i = seed % marks.len();
                    let innermost = i + 1 == marks.len();
                    let (m, opened_at) = marks.remove(i);
                    let result = m.rewind();
                    if innermost {
                        prop_assert!(result.is_ok());
                        // Rewound to this mark's offset, or further if marks
                        // below it were closed early and are now on top.
                        prop_assert!(stack.stats().used <= opened_at);
                    } else {
                        prop_assert!(matches!(result, Err(MemError::InvalidArgument(ref m)) if m.contains("V6")));
                        broken = true;
                    }
                }
                ScratchOp::Close(_) => {}
            }
            prop_assert_eq!(stack.stats().violations > 0, broken);
            prop_assert_eq!(stack.stats().open_marks, marks.len());
        }
        // Closing what is left innermost-first always unwinds to zero.
        while let Some((m, _)) = marks.pop() {
            prop_assert!(m.rewind().is_ok());
        }
        prop_assert_eq!(stack.stats().used, 0);
        stack.reset();
        prop_assert!(stack.mark().is_ok());
    }
}

/// The borrowed arena obeys V3 too: what the type system cannot see (the
/// bytes), the fake's poison shows.
#[test]
fn v3_borrowed_arena_reset_poisons_what_it_frees() {
    let fb = fake();
    let mut arena = Arena::new(&fb, Tier::EnginePersistent, 8192, None).unwrap();
    let mut addrs = Vec::new();
    for n in [100usize, 200, 300] {
        let s = arena.take(n, 64).unwrap();
        fb.write(s.addr(), &vec![9u8; n]).unwrap();
        addrs.push((s.addr(), n));
    }
    arena.reset();
    for (addr, n) in addrs {
        assert!(fb.is_poisoned(addr, n).unwrap());
    }
    assert_eq!(arena.stats().used, 0);
}
