//! The growable block pool's shrink, as a proptest state machine on the
//! fake backend: V4 (`free + live == capacity`) and the refcounts hold
//! across grow / shrink / allocate / free / share, and no live block ever
//! sits in a decommitted range — every live block carries a marker written
//! when it was handed out, and the fake poisons decommitted bytes (`0xDE`),
//! so a decommit under a live block would show as a changed marker.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use imp_mem_core::decommit::{DecommitPolicy, FenceLike, NothingInFlight};
use imp_mem_core::{
    FakeBackend, FakeConfig, MemError, PoolConfig, SharedBlockPool, SharedBlockRef,
};
use proptest::prelude::*;

const BLOCK: usize = 256;

/// A stand-in fence: complete when its flag is set; `wait` sets it.
#[derive(Clone)]
struct Flag(Arc<AtomicBool>);

impl FenceLike for Flag {
    fn is_complete(&self) -> Result<bool, MemError> {
        Ok(self.0.load(Ordering::SeqCst))
    }
    fn wait(&self) -> Result<(), MemError> {
        self.0.store(true, Ordering::SeqCst);
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Allocate,
    AllocateMany(u32),
    Share(usize),
    Free(usize),
    /// Frees all but every `n`-th live ref: a load dip.
    Dip(usize),
    /// One step; with an open fence when true.
    Step(bool),
    ShrinkNow(bool),
    CompleteFences,
    Flush,
    FailNextDecommit,
    FailNextGrowth,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Allocate),
        3 => (0u32..20).prop_map(Op::AllocateMany),
        2 => any::<usize>().prop_map(Op::Share),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (1usize..6).prop_map(Op::Dip),
        6 => any::<bool>().prop_map(Op::Step),
        1 => any::<bool>().prop_map(Op::ShrinkNow),
        2 => Just(Op::CompleteFences),
        1 => Just(Op::Flush),
        1 => Just(Op::FailNextDecommit),
        1 => Just(Op::FailNextGrowth),
    ]
}

fn marker(id: u32) -> Vec<u8> {
    // Never the poison byte: 0xDE would hide a decommit.
    let b = (id as u8).wrapping_mul(13) | 1;
    let b = if b == 0xDF || b == 0xDE { 0x11 } else { b };
    vec![b; BLOCK]
}

struct Harness {
    fb: FakeBackend,
    pool: SharedBlockPool,
    live: Vec<SharedBlockRef>,
    fences: Vec<Flag>,
}

impl Harness {
    fn fence(&mut self, open: bool) -> Flag {
        let f = Flag(Arc::new(AtomicBool::new(!open)));
        if open {
            self.fences.push(f.clone());
        }
        f
    }

    fn adopt(&mut self, r: SharedBlockRef) {
        if r.refcount() == 1 {
            self.fb
                .write(r.span().unwrap().addr(), &marker(r.id()))
                .unwrap();
        }
        self.live.push(r);
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let s = self.pool.stats();
        prop_assert_eq!(s.free + s.live, s.capacity, "V4: free + live == capacity");
        prop_assert_eq!(s.refs, self.live.len() as u64);
        prop_assert!(s.capacity >= s.min_blocks, "below the floor: {:?}", s);
        prop_assert!(s.capacity as u64 * BLOCK as u64 <= s.committed_bytes);
        prop_assert_eq!(
            self.fb.stats().total.committed,
            s.committed_bytes,
            "the backend's ledger follows the pool"
        );
        let mut ids: Vec<u32> = self.live.iter().map(SharedBlockRef::id).collect();
        ids.sort_unstable();
        ids.dedup();
        prop_assert_eq!(ids.len() as u32, s.live);
        for r in &self.live {
            prop_assert!(r.id() < s.capacity);
            let held = self.live.iter().filter(|o| o.id() == r.id()).count() as u32;
            prop_assert_eq!(r.refcount(), held);
            let bytes = self.fb.read(r.span().unwrap().addr(), BLOCK).unwrap();
            prop_assert_eq!(bytes, marker(r.id()), "block {} lost its bytes", r.id());
        }
        self.pool
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.fb
            .backend()
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// V4, refcounts, the floor, the ledger and every live block's bytes,
    /// after every operation, across growth, fenced shrinks, cancelled
    /// shrinks and failed driver calls.
    #[test]
    fn shrink_never_touches_a_live_block(
        ops in prop::collection::vec(op(), 1..160),
        idle in 1u32..4,
        keep in 0usize..2,
        initial in 1u32..12,
        grow in 2u32..12,
    ) {
        let fb = FakeBackend::new(FakeConfig { granularity: 1024, ..FakeConfig::default() }).unwrap();
        let pool = SharedBlockPool::new(&fb, &PoolConfig::growable(BLOCK, initial, 96, grow)).unwrap();
        pool.set_decommit_policy(DecommitPolicy { min_idle_steps: idle, keep_chunks: keep });
        let mut h = Harness { fb, pool, live: Vec::new(), fences: Vec::new() };
        for op in ops {
            match op {
                Op::Allocate => match h.pool.allocate() {
                    Ok(r) => h.adopt(r),
                    Err(MemError::Capacity(_) | MemError::OutOfMemory(_)) => {}
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                Op::AllocateMany(n) => match h.pool.allocate_many(n) {
                    Ok(batch) => {
                        for r in batch.into_refs() {
                            h.adopt(r);
                        }
                    }
                    Err(MemError::Capacity(_) | MemError::OutOfMemory(_)) => {}
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                Op::Share(seed) if !h.live.is_empty() => {
                    let r = h.live[seed % h.live.len()].share().unwrap();
                    h.live.push(r);
                }
                Op::Free(seed) if !h.live.is_empty() => {
                    let i = seed % h.live.len();
                    drop(h.live.swap_remove(i));
                }
                Op::Share(_) | Op::Free(_) => {}
                Op::Dip(n) => {
                    let kept: Vec<_> = std::mem::take(&mut h.live)
                        .into_iter()
                        .enumerate()
                        .filter_map(|(i, r)| (i % n == 0).then_some(r))
                        .collect();
                    h.live = kept;
                }
                Op::Step(open) => {
                    let f = h.fence(open);
                    let before = h.pool.stats().committed_bytes;
                    match h.pool.step(f) {
                        Ok(returned) => {
                            prop_assert_eq!(before - h.pool.stats().committed_bytes, returned);
                        }
                        // An armed decommit failure; the decommit stays pending.
                        Err(e) => prop_assert!(!matches!(e, MemError::Invariant(_)), "{e}"),
                    }
                }
                Op::ShrinkNow(open) => {
                    let f = h.fence(open);
                    if let Err(e) = h.pool.shrink_now(f) {
                        prop_assert!(!matches!(e, MemError::Invariant(_)), "{e}");
                    }
                }
                Op::CompleteFences => {
                    for f in h.fences.drain(..) {
                        f.0.store(true, Ordering::SeqCst);
                    }
                }
                Op::Flush => {
                    // A decommit fails only when told to; it then stays pending.
                    let _ = h.pool.flush_decommit();
                }
                Op::FailNextDecommit => h.fb.fail_decommits(1),
                Op::FailNextGrowth => h.fb.fail_commits(1),
            }
            h.check()?;
        }
        // Everything freed and flushed: the pool goes back to its floor.
        h.live.clear();
        h.fb.fail_decommits(0);
        for f in h.fences.drain(..) {
            f.0.store(true, Ordering::SeqCst);
        }
        let _ = h.pool.flush_decommit();
        h.pool.shrink_now(NothingInFlight).unwrap();
        let s = h.pool.stats();
        prop_assert_eq!(s.capacity, s.min_blocks);
        prop_assert_eq!(s.pending_blocks, 0);
        h.check()?;
    }
}
