//! Tests of the block pool: refcounts and batches, growth, the shrink
//! policy and its fences, and the churn measurement the module's opening
//! paragraph cites.

use super::*;
use std::sync::Arc;

use super::free_list::{Entry, FreeLists};
use crate::decommit::{DecommitPolicy, FenceLike};
use crate::error::MemError;
use crate::fake::{FakeBackend, FakeConfig};

fn fake() -> FakeBackend {
    FakeBackend::new(FakeConfig::default()).unwrap()
}

#[test]
fn allocate_share_release_balance() {
    let fb = fake();
    let pool = BlockPool::new(&fb, &PoolConfig::fixed(256, 4)).unwrap();
    let a = pool.allocate().unwrap();
    let b = a.share().unwrap();
    assert_eq!((a.id(), a.refcount()), (0, 2));
    let s = pool.stats();
    assert_eq!((s.free, s.live, s.refs), (3, 1, 2));
    drop(a);
    assert_eq!(pool.refcount(0), 1);
    drop(b);
    assert_eq!(pool.refcount(0), 0);
    assert_eq!(pool.stats().free, 4);
    pool.check_invariants().unwrap();
}

#[test]
fn blocks_sit_at_base_plus_id_times_stride_and_are_poisoned_on_release() {
    let fb = fake();
    let pool = BlockPool::new(&fb, &PoolConfig::fixed(96, 8)).unwrap();
    let refs = pool.allocate_many(3).unwrap();
    let base = refs[0].span().unwrap().addr();
    for r in &refs {
        let span = r.span().unwrap();
        assert_eq!(span.addr(), base + r.id() as usize * 96);
        assert_eq!(span.len(), 96);
    }
    let addr = refs[1].span().unwrap().addr();
    fb.write(addr, &[1u8; 96]).unwrap();
    drop(refs);
    assert!(fb.is_poisoned(addr, 96).unwrap());
}

#[test]
fn allocate_many_is_all_or_nothing() {
    let pool = BlockPool::slots(5).unwrap();
    let held = pool.allocate_many(3).unwrap();
    let err = pool.allocate_many(3).unwrap_err();
    assert!(matches!(err, MemError::Capacity(_)), "{err}");
    assert_eq!(pool.stats().free, 2);
    drop(held);
    assert_eq!(pool.allocate_many(5).unwrap().len(), 5);
}

#[test]
fn slots_mode_has_ids_but_no_memory() {
    let pool = BlockPool::slots(2).unwrap();
    let r = pool.allocate().unwrap();
    assert!(matches!(r.span(), Err(MemError::InvalidArgument(_))));
}

#[test]
fn a_ref_is_refused_by_another_pool_and_still_released_once() {
    let one = BlockPool::slots(2).unwrap();
    let two = BlockPool::slots(2).unwrap();
    let r = one.allocate().unwrap();
    assert!(matches!(two.release(r), Err(MemError::InvalidArgument(_))));
    assert_eq!(one.stats().free, 2);
    assert_eq!(two.stats().free, 2);

    let one = SharedBlockPool::slots(2).unwrap();
    let two = SharedBlockPool::slots(2).unwrap();
    let r = one.allocate().unwrap();
    assert!(two.check_owner(&r).is_err());
    assert!(matches!(two.release(r), Err(MemError::InvalidArgument(_))));
    assert_eq!((one.stats().free, two.stats().free), (2, 2));
}

#[test]
fn batched_release_and_share_keep_the_counts_of_one_by_one() {
    let pool = SharedBlockPool::slots(8).unwrap();
    let mut refs = pool.allocate_many(4).unwrap().into_refs();
    let borrowed: Vec<&SharedBlockRef> = refs.iter().take(3).collect();
    let mut shared = pool.share_all(&borrowed).unwrap();
    assert_eq!(shared.len(), 3);
    assert_eq!(pool.stats().refs, 7);
    assert_eq!(refs[0].refcount(), 2);
    // Each ref releases exactly once: the shares first, then the rest.
    pool.release_all(&mut shared).unwrap();
    assert!(shared.is_empty());
    let s = pool.stats();
    assert_eq!((s.refs, s.live, s.free), (4, 4, 4));
    pool.release_all(&mut refs).unwrap();
    let s = pool.stats();
    assert_eq!((s.refs, s.live, s.free), (0, 0, 8));
    pool.check_invariants().unwrap();
    assert_eq!(pool.room(), (8, 0));

    // A foreign ref is refused by both, and still released into its own
    // pool exactly once.
    let other = SharedBlockPool::slots(2).unwrap();
    let theirs = other.allocate().unwrap();
    assert!(pool.share_all(&[&theirs]).is_err());
    assert_eq!(theirs.refcount(), 1);
    let ours = pool.allocate().unwrap();
    let mut mixed = vec![ours, theirs];
    assert!(matches!(
        pool.release_all(&mut mixed),
        Err(MemError::InvalidArgument(_))
    ));
    assert_eq!((pool.stats().live, other.stats().live), (0, 0));
    pool.check_invariants().unwrap();
    other.check_invariants().unwrap();
}

#[test]
fn a_failed_batched_share_shares_nothing() {
    let pool = SharedBlockPool::slots(4).unwrap();
    let a = pool.allocate().unwrap();
    // The last share of a full count fails; the earlier ones are undone.
    let b = pool.allocate().unwrap();
    {
        let mut core = pool.core();
        if let Some(Entry::Occupied { refs }) = core.entries.get_mut(b.id() as usize) {
            *refs = u32::MAX;
        }
    }
    assert!(pool.share_all(&[&a, &b]).is_err());
    assert_eq!(a.refcount(), 1);
    {
        let mut core = pool.core();
        if let Some(Entry::Occupied { refs }) = core.entries.get_mut(b.id() as usize) {
            *refs = 1;
        }
    }
    drop((a, b));
    pool.check_invariants().unwrap();
}

#[test]
fn growable_pool_grows_in_chunks_without_moving() {
    let fb = FakeBackend::new(FakeConfig {
        granularity: 1024,
        ..FakeConfig::default()
    })
    .unwrap();
    let pool = BlockPool::new(&fb, &PoolConfig::growable(512, 2, 64, 8)).unwrap();
    let first = pool.allocate().unwrap();
    let addr = first.span().unwrap().addr();
    let more = pool.allocate_many(20).unwrap();
    assert_eq!(first.span().unwrap().addr(), addr);
    let s = pool.stats();
    assert!(s.capacity >= 21 && s.capacity <= 64, "{s:?}");
    assert!(s.growths >= 1);
    assert_eq!(s.free + s.live, s.capacity);
    assert!(pool.allocate_many(64).is_err());
    drop(more);
    pool.check_invariants().unwrap();
}

#[test]
fn failed_growth_leaves_the_pool_unchanged() {
    let fb = fake();
    let pool = BlockPool::new(&fb, &PoolConfig::growable(4096, 1, 16, 4)).unwrap();
    let held = pool.allocate().unwrap();
    fb.fail_commits(1);
    let before = pool.stats();
    assert!(matches!(pool.allocate(), Err(MemError::OutOfMemory(_))));
    assert_eq!(pool.stats(), before);
    assert!(pool.allocate().is_ok());
    drop(held);
}

#[test]
fn shared_batches_release_once_and_split() {
    let pool = SharedBlockPool::slots(16).unwrap();
    let batch = pool.allocate_many(4).unwrap();
    let shared = batch.share().unwrap();
    assert_eq!(pool.stats().refs, 8);
    drop(batch);
    assert_eq!(pool.stats().live, 4);
    let refs = shared.into_refs();
    assert_eq!(refs.len(), 4);
    assert_eq!(pool.stats().refs, 4);
    drop(refs);
    assert_eq!(pool.stats().free, 16);
    pool.check_invariants().unwrap();
}

#[test]
fn batches_past_the_inline_size_keep_every_id() {
    let pool = SharedBlockPool::slots(64).unwrap();
    for n in [0u32, 1, 16, 17, 40] {
        let batch = pool.allocate_many(n).unwrap();
        let mut sorted = batch.ids().to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        let twin = batch.share().unwrap();
        assert_eq!(twin.ids(), batch.ids());
        let refs = batch.into_refs();
        assert_eq!(
            refs.iter().map(SharedBlockRef::id).collect::<Vec<_>>(),
            twin.ids()
        );
        assert_eq!(pool.stats().refs, 2 * n as u64);
        drop((refs, twin));
        assert_eq!(pool.stats().free, 64);
    }
}

// ------------------------------------------------------------ shrink

use std::sync::atomic::{AtomicBool, Ordering};

use crate::decommit::NothingInFlight;

/// A stand-in fence: complete when its flag is set.
#[derive(Clone)]
struct Flag(Arc<AtomicBool>);

impl Flag {
    fn new() -> Self {
        Self(Arc::new(AtomicBool::new(false)))
    }
    fn complete(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl FenceLike for Flag {
    fn is_complete(&self) -> Result<bool, MemError> {
        Ok(self.0.load(Ordering::SeqCst))
    }
    fn wait(&self) -> Result<(), MemError> {
        self.complete();
        Ok(())
    }
}

/// 256-byte blocks over 1 KiB granules: 4 blocks a granule, chunks of
/// 8 blocks (the growth step), 8 blocks to start, 64 at most.
fn growable(fb: &FakeBackend, idle: u32, keep: usize) -> SharedBlockPool {
    let pool = SharedBlockPool::new(fb, &PoolConfig::growable(256, 8, 64, 8)).unwrap();
    pool.set_decommit_policy(DecommitPolicy {
        min_idle_steps: idle,
        keep_chunks: keep,
    });
    pool
}

fn granular() -> FakeBackend {
    FakeBackend::new(FakeConfig {
        granularity: 1024,
        ..FakeConfig::default()
    })
    .unwrap()
}

#[test]
fn fastdiv_matches_division() {
    for cb in [2u32, 3, 7, 8, 48, 100, 1000, 65_537, u32::MAX / 3] {
        let lists = FreeLists::try_new(cb, cb).unwrap();
        for id in [
            0u32,
            1,
            cb - 1,
            cb,
            cb + 1,
            12_345_678,
            MAX_BLOCKS - 1,
            u32::MAX,
        ] {
            assert_eq!(lists.chunk_of(id), (id / cb) as usize, "{id} / {cb}");
        }
    }
}

#[test]
fn allocation_prefers_the_lowest_chunk() {
    let fb = granular();
    let pool = growable(&fb, 1, 0);
    let all = pool.allocate_many(32).unwrap();
    assert_eq!(pool.stats().capacity, 32);
    let mut refs = all.into_refs();
    // Free one block in each of chunks 3, 1 and 2, in that order.
    for id in [25u32, 9, 17] {
        let at = refs.iter().position(|r| r.id() == id).unwrap();
        drop(refs.swap_remove(at));
    }
    // LIFO would give 17 first; the lowest chunk wins.
    let order: Vec<u32> = (0..3)
        .map(|_| pool.allocate().unwrap())
        .map(|r| {
            let id = r.id();
            refs.push(r);
            id
        })
        .collect();
    assert_eq!(order, vec![9, 17, 25]);
    drop(refs);
    pool.check_invariants().unwrap();
}

#[test]
fn no_shrink_before_the_idle_window_then_down_to_the_floor() {
    let fb = granular();
    let pool = growable(&fb, 5, 0);
    let burst = pool.allocate_many(40).unwrap();
    let s = pool.stats();
    assert_eq!((s.capacity, s.min_blocks, s.chunk_blocks), (40, 8, 8));
    assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
    drop(burst);
    for i in 0..4 {
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0, "idle step {i}");
        assert_eq!(pool.stats().capacity, 40);
    }
    assert_eq!(pool.step(NothingInFlight).unwrap(), 32 * 256);
    let s = pool.stats();
    assert_eq!((s.capacity, s.free, s.shrinks), (8, 8, 1));
    assert_eq!(
        (s.decommitted_bytes, s.committed_bytes),
        (32 * 256, 8 * 256)
    );
    assert_eq!(fb.stats().total.committed, 8 * 256);
    // Never below the floor, however long it idles.
    for _ in 0..20 {
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
    }
    assert_eq!(pool.stats().capacity, 8);
    pool.check_invariants().unwrap();
}

#[test]
fn shrinks_to_the_peak_of_the_window_plus_the_spare_chunks() {
    let fb = granular();
    let pool = growable(&fb, 4, 1);
    let mut held = pool.allocate_many(48).unwrap().into_refs();
    pool.step(NothingInFlight).unwrap();
    // Keep blocks 0..20 live: chunks 0, 1, 2 (needs 3 chunks).
    held.retain(|r| r.id() < 20);
    for _ in 0..3 {
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
    }
    // 3 needed + 1 spare = 4 chunks = 32 blocks.
    assert_eq!(pool.step(NothingInFlight).unwrap(), 16 * 256);
    assert_eq!(pool.stats().capacity, 32);
    drop(held);
    pool.check_invariants().unwrap();
}

#[test]
fn flapping_load_does_not_thrash() {
    let fb = granular();
    let pool = growable(&fb, 16, 1);
    let mut decommitted = 0;
    for round in 0..50 {
        let burst = pool.allocate_many(48).unwrap();
        for _ in 0..3 {
            decommitted += pool.step(NothingInFlight).unwrap();
        }
        drop(burst);
        // Quiet for fewer steps than the window: never enough to shrink.
        for _ in 0..(round % 15) {
            decommitted += pool.step(NothingInFlight).unwrap();
        }
    }
    let s = pool.stats();
    assert_eq!((decommitted, s.shrinks), (0, 0));
    assert_eq!(s.growths, 1, "grew once and kept it: {s:?}");
    pool.check_invariants().unwrap();
}

#[test]
fn the_decommit_waits_for_the_fence_and_its_blocks_are_withheld() {
    let fb = granular();
    let pool = growable(&fb, 1, 0);
    drop(pool.allocate_many(40).unwrap());
    pool.step(NothingInFlight).unwrap();
    let fence = Flag::new();
    assert_eq!(pool.step(fence.clone()).unwrap(), 0);
    let s = pool.stats();
    assert_eq!((s.capacity, s.pending_blocks, s.free), (8, 32, 8));
    assert_eq!(
        s.committed_bytes,
        40 * 256,
        "nothing decommitted before the fence"
    );
    // While pending, the withdrawn blocks are not handed out.
    let low = pool.allocate_many(8).unwrap();
    assert!(low.ids().iter().all(|&id| id < 8));
    drop(low);
    for _ in 0..5 {
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0, "fence still open");
    }
    assert_eq!(pool.stats().committed_bytes, 40 * 256);
    fence.complete();
    assert_eq!(pool.step(NothingInFlight).unwrap(), 32 * 256);
    let s = pool.stats();
    assert_eq!((s.capacity, s.pending_blocks, s.shrinks), (8, 0, 1));
    assert_eq!(s.committed_bytes, 8 * 256);
    pool.check_invariants().unwrap();
}

#[test]
fn demand_while_pending_cancels_and_reuses_the_withdrawn_blocks() {
    let fb = granular();
    let pool = growable(&fb, 1, 0);
    let base = {
        let r = pool.allocate().unwrap();
        r.span().unwrap().addr()
    };
    drop(pool.allocate_many(40).unwrap());
    let fence = Flag::new();
    pool.shrink_now(fence.clone()).unwrap();
    assert_eq!(pool.stats().pending_blocks, 32);
    let commits = fb.stats().total.committed;
    let big = pool.allocate_many(20).unwrap();
    let s = pool.stats();
    assert_eq!((s.capacity, s.cancelled_shrinks, s.growths), (40, 1, 1));
    assert_eq!(
        fb.stats().total.committed,
        commits,
        "no driver call to take them back"
    );
    fence.complete();
    assert_eq!(
        pool.step(NothingInFlight).unwrap(),
        0,
        "the decommit was cancelled"
    );
    assert_eq!(pool.stats().committed_bytes, 40 * 256);
    // Same base, same addresses after grow -> shrink -> grow.
    let refs = big.into_refs();
    for r in &refs {
        assert_eq!(r.span().unwrap().addr(), base + r.id() as usize * 256);
    }
    drop(refs);
    assert_eq!(pool.shrink_now(NothingInFlight).unwrap(), 32 * 256);
    let again = pool.allocate_many(30).unwrap();
    assert_eq!(pool.stats().growths, 2);
    for i in 0..again.len() {
        let span = again.span(i).unwrap();
        assert_eq!(span.addr(), base + again.ids()[i] as usize * 256);
    }
    drop(again);
    // The reservation's span starts at the base and spans max_blocks,
    // across grow -> shrink -> grow.
    let whole = pool.reservation().unwrap();
    assert_eq!(whole.addr(), base);
    assert_eq!(whole.len(), pool.stats().max_blocks as usize * 256);
    assert!(SharedBlockPool::slots(4).unwrap().reservation().is_err());
    pool.check_invariants().unwrap();
}

#[test]
fn a_live_block_in_the_tail_pins_it_and_its_bytes_survive() {
    let fb = granular();
    let pool = growable(&fb, 1, 0);
    let mut refs = pool.allocate_many(40).unwrap().into_refs();
    // Keep block 30 (chunk 3) live, and a share of 5 (as a DLPack export
    // would hold).
    refs.retain(|r| r.id() == 30 || r.id() == 5);
    let export = refs[0].share().unwrap();
    for r in &refs {
        fb.write(r.span().unwrap().addr(), &[0x5A; 256]).unwrap();
    }
    assert_eq!(
        pool.shrink_now(NothingInFlight).unwrap(),
        8 * 256,
        "only chunk 4 goes"
    );
    assert_eq!(pool.stats().capacity, 32);
    for r in &refs {
        assert_eq!(
            fb.read(r.span().unwrap().addr(), 256).unwrap(),
            vec![0x5A; 256]
        );
    }
    drop(refs);
    assert_eq!(pool.shrink_now(NothingInFlight).unwrap(), 24 * 256);
    assert_eq!(export.refcount(), 1);
    assert_eq!(
        fb.read(export.span().unwrap().addr(), 256).unwrap(),
        vec![0x5A; 256]
    );
    drop(export);
    pool.check_invariants().unwrap();
}

#[test]
fn flush_waits_for_the_fence_and_a_failed_decommit_retries() {
    let fb = granular();
    let pool = growable(&fb, 1, 0);
    drop(pool.allocate_many(40).unwrap());
    let fence = Flag::new();
    pool.shrink_now(fence.clone()).unwrap();
    fb.fail_decommits(1);
    assert!(pool.flush_decommit().is_err());
    assert_eq!(
        pool.stats().pending_blocks,
        32,
        "still pending after the failure"
    );
    pool.check_invariants().unwrap();
    assert_eq!(pool.step(NothingInFlight).unwrap(), 32 * 256);
    assert_eq!(pool.flush_decommit().unwrap(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn fixed_and_slots_pools_never_shrink() {
    let fb = granular();
    let fixed = SharedBlockPool::new(&fb, &PoolConfig::fixed(256, 16)).unwrap();
    let slots = SharedBlockPool::slots(16).unwrap();
    for pool in [&fixed, &slots] {
        pool.set_decommit_policy(DecommitPolicy {
            min_idle_steps: 1,
            keep_chunks: 0,
        });
        for _ in 0..4 {
            assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
        }
        assert_eq!(pool.shrink_now(NothingInFlight).unwrap(), 0);
        assert_eq!(pool.stats().capacity, 16);
    }
}

#[test]
fn the_borrowed_pool_shrinks_too() {
    let fb = granular();
    let pool = BlockPool::new(&fb, &PoolConfig::growable(256, 8, 64, 8)).unwrap();
    pool.set_decommit_policy(DecommitPolicy {
        min_idle_steps: 2,
        keep_chunks: 0,
    })
    .unwrap();
    drop(pool.allocate_many(40).unwrap());
    assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
    assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
    let fence = Flag::new();
    assert_eq!(pool.step(fence.clone()).unwrap(), 0);
    assert_eq!(pool.stats().pending_blocks, 32);
    assert_eq!(pool.flush_decommit().unwrap(), 32 * 256);
    assert_eq!(pool.decommit_policy().min_idle_steps, 2);
    pool.check_invariants().unwrap();
}

/// The measurement behind lowest-chunk-first: a churn workload (ramp to
/// 900 live blocks, then 3000 steps of random frees and allocations
/// around a load that wanders between 100 and 500) on the real pool, and
/// the same decisions on a plain LIFO free list. Counted per step: the
/// chunks above the highest live block (what a shrink could return).
/// `cargo test -p imp-mem-core churn -- --nocapture` prints the figures.
#[test]
fn churn_lets_the_tail_drain() {
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }
    const CB: u32 = 64;
    let fb = FakeBackend::new(FakeConfig {
        granularity: 64 * 256,
        ..FakeConfig::default()
    })
    .unwrap();
    let pool = SharedBlockPool::new(&fb, &PoolConfig::growable(256, 64, 1024, CB)).unwrap();
    let mut lifo: Vec<u32> = Vec::new();
    let mut lifo_cap = 0u32;
    let (mut live, mut live_lifo): (Vec<SharedBlockRef>, Vec<u32>) = (Vec::new(), Vec::new());
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut ours, mut theirs, mut ours_steps, mut theirs_steps) = (0u64, 0u64, 0u64, 0u64);
    let mut load = 900usize;
    for step in 0..3300 {
        if step >= 300 && step % 50 == 0 {
            load = 100 + rng.below(400);
        }
        // Free about 5 % of the live blocks (the same indices on both).
        for _ in 0..live.len() / 20 {
            let i = rng.below(live.len());
            drop(live.swap_remove(i));
            lifo.push(live_lifo.swap_remove(i));
        }
        while live.len() > load {
            let i = rng.below(live.len());
            drop(live.swap_remove(i));
            lifo.push(live_lifo.swap_remove(i));
        }
        while live.len() < load {
            live.push(pool.allocate().unwrap());
            if lifo.is_empty() {
                lifo.extend((lifo_cap..lifo_cap + CB).rev());
                lifo_cap += CB;
            }
            live_lifo.push(lifo.pop().unwrap());
        }
        if step >= 300 {
            let top = |ids: &mut dyn Iterator<Item = u32>| ids.max().map_or(0, |m| m / CB + 1);
            // Both grew to the ramp's 900 blocks: 15 chunks.
            let committed = pool.stats().capacity.div_ceil(CB);
            assert_eq!((committed, lifo_cap / CB), (15, 15));
            let a = committed - top(&mut live.iter().map(SharedBlockRef::id));
            let b = committed - top(&mut live_lifo.iter().copied());
            ours += a as u64;
            theirs += b as u64;
            ours_steps += (a > 0) as u64;
            theirs_steps += (b > 0) as u64;
        }
    }
    let steps = 3000.0;
    eprintln!(
        "churn: lowest-chunk-first frees {:.2} chunks/step on average ({:.0} % of steps \
         have a free tail chunk); LIFO {:.2} ({:.0} %)",
        ours as f64 / steps,
        100.0 * ours_steps as f64 / steps,
        theirs as f64 / steps,
        100.0 * theirs_steps as f64 / steps,
    );
    assert!(ours > 4 * theirs.max(1), "{ours} vs {theirs}");
    drop(live);
    pool.check_invariants().unwrap();
}

#[test]
fn bad_configs_say_what_to_change() {
    let fb = fake();
    for config in [
        PoolConfig::fixed(0, 4),
        PoolConfig::fixed(64, 0),
        PoolConfig::growable(64, 8, 4, 1),
        PoolConfig::growable(64, 2, 8, 0),
    ] {
        assert!(
            matches!(
                BlockPool::new(&fb, &config),
                Err(MemError::InvalidArgument(_))
            ),
            "{config:?}"
        );
    }
}

// ------------------------------------------------------- host copies of a block

#[test]
fn a_block_copies_out_and_in_through_its_pools_region() {
    let fb = fake();
    let pool = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(48, 4)).unwrap();
    let refs = pool.allocate_many(2).unwrap().into_refs();
    let (a, b) = (&refs[0], &refs[1]);
    let bytes: Vec<u8> = (0..48).collect();
    a.write_from(&bytes).unwrap();
    b.write_from(&[7; 48]).unwrap();
    // The bytes landed at the block's own span, and nowhere else.
    let span = a.span().unwrap();
    assert_eq!(fb.read(span.addr(), 48).unwrap(), bytes);
    let mut out = vec![0u8; 48];
    a.read_into(&mut out).unwrap();
    assert_eq!(out, bytes);
    b.read_into(&mut out).unwrap();
    assert_eq!(out, [7; 48]);
    // Another ref to the block reads what the first wrote.
    let again = a.share().unwrap();
    again.read_into(&mut out).unwrap();
    assert_eq!(out, bytes);
    pool.check_invariants().unwrap();
}

#[test]
fn a_block_copy_moves_exactly_one_block() {
    let fb = fake();
    let pool = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(48, 4)).unwrap();
    let a = pool.allocate().unwrap();
    a.write_from(&[3; 48]).unwrap();
    for len in [0, 47, 49, 96] {
        let err = a.write_from(&vec![9; len]).unwrap_err();
        assert!(
            matches!(&err, MemError::InvalidArgument(m) if m.contains("48 B") && m.contains(&format!("not {len} B"))),
            "{len}: {err}"
        );
        let err = a.read_into(&mut vec![0; len]).unwrap_err();
        assert!(matches!(err, MemError::InvalidArgument(_)), "{len}: {err}");
    }
    // A refused write changed nothing, in the block or past it.
    let mut out = vec![0u8; 48];
    a.read_into(&mut out).unwrap();
    assert_eq!(out, [3; 48]);
    let next = a.span().unwrap().addr() + 48;
    assert!(fb.read(next, 48).unwrap().iter().all(|&x| x != 9));
}

#[test]
fn the_last_block_of_a_grown_pool_copies_and_the_refusals_are_errors() {
    let fb = fake();
    let pool = SharedBlockPool::new(fb.backend(), &PoolConfig::growable(4096, 1, 3, 1)).unwrap();
    let refs = pool.allocate_many(3).unwrap().into_refs();
    let last = &refs[2];
    last.write_from(&[5; 4096]).unwrap();
    let mut out = vec![0u8; 4096];
    last.read_into(&mut out).unwrap();
    assert!(out.iter().all(|&x| x == 5));

    // Slots mode has no bytes to copy.
    let slots = SharedBlockPool::slots(2).unwrap();
    let s = slots.allocate().unwrap();
    let err = s.read_into(&mut []).unwrap_err();
    assert!(
        matches!(&err, MemError::InvalidArgument(m) if m.contains("slots mode")),
        "{err}"
    );
    assert!(s.write_from(&[]).is_err());

    // An unbacked fake has addresses and no bytes: refused, not zeros.
    let (_pool, u) = unbacked_block();
    assert_copies_refused(&u, 16, "backed=True");
}

/// A pool of two 16-byte blocks on an unbacked fake (addresses, no bytes),
/// and one of its blocks.
fn unbacked_block() -> (SharedBlockPool, SharedBlockRef) {
    let unbacked = FakeBackend::new(FakeConfig {
        backed: false,
        ..FakeConfig::default()
    })
    .unwrap();
    let pool = SharedBlockPool::new(unbacked.backend(), &PoolConfig::fixed(16, 2)).unwrap();
    let block = pool.allocate().unwrap();
    (pool, block)
}

/// Asserts that a copy of `block` (`len` bytes) is refused both ways as
/// `BackendUnavailable`, the read's message naming `needle`.
fn assert_copies_refused(block: &SharedBlockRef, len: usize, needle: &str) {
    let err = block.read_into(&mut vec![0; len]).unwrap_err();
    assert!(
        matches!(&err, MemError::BackendUnavailable(m) if m.contains(needle)),
        "{err}"
    );
    assert!(matches!(
        block.write_from(&vec![1; len]),
        Err(MemError::BackendUnavailable(_))
    ));
}

#[test]
fn a_source_without_host_copies_refuses_a_block_copy() {
    let fb = fake();
    let backend = crate::Backend::new(
        Arc::new(crate::test_source::TestSource {
            copies: false,
            ..crate::test_source::TestSource::over(fb.source().clone())
        }),
        crate::PhaseMode::Strict,
        None,
    )
    .unwrap();
    let pool = SharedBlockPool::new(&backend, &PoolConfig::fixed(64, 2)).unwrap();
    let a = pool.allocate().unwrap();
    assert_copies_refused(&a, 64, "cannot copy");
    drop(a);
    pool.check_invariants().unwrap();
}

/// The bytes of every block of `refs`, read one block at a time.
fn contents(refs: &[SharedBlockRef], bb: usize) -> Vec<Vec<u8>> {
    refs.iter()
        .map(|r| {
            let mut out = vec![0u8; bb];
            r.read_into(&mut out).unwrap();
            out
        })
        .collect()
}

#[test]
fn a_batch_copy_lands_where_the_single_copies_do() {
    let fb = fake();
    let pool = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(48, 6)).unwrap();
    let refs = pool.allocate_many(4).unwrap().into_refs();
    let (one, two, three) = ([1u8; 48], [2u8; 48], [3u8; 48]);
    let base = refs[0].span().unwrap().addr();
    let untouched = fb.read(base + 3 * 48, 3 * 48).unwrap();
    // Out of order, and block 1 twice: the later copy wins.
    pool.write_blocks(&[
        (&refs[2], &three),
        (&refs[1], &one),
        (&refs[0], &one),
        (&refs[1], &two),
    ])
    .unwrap();
    for (i, want) in [(0, 1u8), (1, 2), (2, 3)] {
        let at = refs[i].span().unwrap().addr();
        assert_eq!(at, base + i * 48);
        assert_eq!(fb.read(at, 48).unwrap(), [want; 48], "block {i}");
    }
    // Nothing past the blocks written moved (block 3 and the free ones).
    assert_eq!(fb.read(base + 3 * 48, 3 * 48).unwrap(), untouched);

    // A batch read gives what the single reads give, into each buffer.
    let single = contents(&refs, 48);
    let mut bufs = vec![vec![0u8; 48]; 4];
    let mut copies: Vec<_> = refs
        .iter()
        .rev()
        .zip(bufs.iter_mut())
        .map(|(r, b)| (r, b.as_mut_slice()))
        .collect();
    pool.read_blocks(&mut copies).unwrap();
    bufs.reverse();
    assert_eq!(bufs, single);
    pool.read_blocks(&mut []).unwrap();
    pool.write_blocks(&[]).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn a_batch_with_one_bad_copy_copies_nothing() {
    let fb = fake();
    let pool = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(32, 4)).unwrap();
    let refs = pool.allocate_many(3).unwrap().into_refs();
    for (i, r) in refs.iter().enumerate() {
        r.write_from(&[i as u8 + 1; 32]).unwrap();
    }
    let before = contents(&refs, 32);
    let new = [9u8; 32];

    // A buffer of the wrong length, last in the batch.
    let err = pool
        .write_blocks(&[(&refs[0], &new), (&refs[1], &new), (&refs[2], &new[..31])])
        .unwrap_err();
    assert!(
        matches!(&err, MemError::InvalidArgument(m) if m.contains("not 31 B")),
        "{err}"
    );
    let mut short = [0u8; 16];
    let mut full = [0u8; 32];
    let err = pool
        .read_blocks(&mut [(&refs[0], &mut full[..]), (&refs[1], &mut short[..])])
        .unwrap_err();
    assert!(matches!(&err, MemError::InvalidArgument(_)), "{err}");
    assert_eq!(full, [0; 32], "a refused read fills no buffer either");

    // A ref of another pool.
    let other = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(32, 1)).unwrap();
    let theirs = other.allocate().unwrap();
    let err = pool
        .write_blocks(&[(&refs[0], &new), (&theirs, &new)])
        .unwrap_err();
    assert!(
        matches!(&err, MemError::InvalidArgument(m) if m.contains("belongs to pool")),
        "{err}"
    );

    // A block that is not live, and an id out of the pool's range (the
    // pool's own batch, below the refs).
    let freed = pool.allocate().unwrap();
    let freed_id = freed.id();
    drop(freed);
    for bad in [freed_id, 4, 1 << 20] {
        let err = pool
            .core()
            .write_blocks(&[(refs[0].id(), &new), (bad, &new)])
            .unwrap_err();
        assert!(
            matches!(&err, MemError::Invariant(m) if m.contains("not live")),
            "{bad}: {err}"
        );
        let err = pool
            .core()
            .read_blocks(&mut [(refs[0].id(), &mut full[..]), (bad, &mut [0u8; 32][..])])
            .unwrap_err();
        assert!(matches!(&err, MemError::Invariant(_)), "{bad}: {err}");
    }
    assert_eq!(full, [0; 32]);
    assert_eq!(contents(&refs, 32), before, "no refused batch wrote a byte");
    // Nor into the block freed meanwhile (still poisoned).
    let freed_at = refs[0].span().unwrap().addr() + freed_id as usize * 32;
    assert!(fb.read(freed_at, 32).unwrap().iter().all(|&x| x != 9));
    drop(theirs);
    pool.check_invariants().unwrap();
}

#[test]
fn a_region_batch_past_the_committed_part_copies_nothing() {
    let fb = fake();
    let mut region = fb.backend().acquire(256, 256, crate::Tag::Other).unwrap();
    region.copy_from_host(0, &[1; 256]).unwrap();
    let err = region
        .copy_from_host_many(&[(0, &[7; 16][..]), (250, &[7; 16][..])])
        .unwrap_err();
    assert!(
        matches!(&err, MemError::InvalidArgument(m) if m.contains("runs past")),
        "{err}"
    );
    let err = region
        .copy_from_host_many(&[(0, &[7; 16][..]), (usize::MAX, &[7; 2][..])])
        .unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)));
    assert_eq!(region.read_to_vec(0, 256).unwrap(), vec![1; 256]);
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    assert!(region
        .copy_to_host_many(&mut [(0, &mut a[..]), (252, &mut b[..])])
        .is_err());
    assert_eq!(a, [0; 8], "a refused read copies nothing either");
    region
        .copy_from_host_many(&[(8, &[5; 8][..]), (248, &[6; 8][..]), (100, &[][..])])
        .unwrap();
    region
        .copy_to_host_many(&mut [(248, &mut a[..]), (8, &mut b[..])])
        .unwrap();
    assert_eq!((a, b), ([6; 8], [5; 8]));
}

#[test]
fn batches_are_refused_where_single_copies_are() {
    let slots = SharedBlockPool::slots(2).unwrap();
    let s = slots.allocate().unwrap();
    let err = slots.write_blocks(&[(&s, &[])]).unwrap_err();
    assert!(
        matches!(&err, MemError::InvalidArgument(m) if m.contains("slots mode")),
        "{err}"
    );
    assert!(slots.read_blocks(&mut [(&s, &mut [][..])]).is_err());
    assert!(
        slots.write_blocks(&[]).is_err(),
        "no memory to copy even nothing into"
    );

    let (pool, u) = unbacked_block();
    assert!(matches!(
        pool.write_blocks(&[(&u, &[1; 16])]),
        Err(MemError::BackendUnavailable(_))
    ));
    assert!(matches!(
        pool.read_blocks(&mut [(&u, &mut [0; 16][..])]),
        Err(MemError::BackendUnavailable(_))
    ));
}

mod batch_props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random sets of blocks (repeats allowed, any order), each with its
        /// own bytes: one batch leaves the pool exactly as the same copies
        /// one by one do, and a batch read gives what single reads give.
        #[test]
        fn batched_and_single_copies_give_the_same_pool(
            bb in 1usize..80,
            blocks in 1u32..12,
            writes in proptest::collection::vec((0usize..64, any::<u8>()), 0..24),
            reads in proptest::collection::vec(0usize..64, 0..24),
        ) {
            let fb = fake();
            let single = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(bb, blocks)).unwrap();
            let batched = SharedBlockPool::new(fb.backend(), &PoolConfig::fixed(bb, blocks)).unwrap();
            let a = single.allocate_many(blocks).unwrap().into_refs();
            let b = batched.allocate_many(blocks).unwrap().into_refs();
            let n = blocks as usize;
            let bytes: Vec<Vec<u8>> = writes
                .iter()
                .map(|&(_, seed)| (0..bb).map(|k| seed.wrapping_add(k as u8)).collect())
                .collect();
            for (&(at, _), src) in writes.iter().zip(&bytes) {
                a[at % n].write_from(src).unwrap();
            }
            let copies: Vec<_> = writes
                .iter()
                .zip(&bytes)
                .map(|(&(at, _), src)| (&b[at % n], src.as_slice()))
                .collect();
            batched.write_blocks(&copies).unwrap();
            let (got, want) = (contents(&b, bb), contents(&a, bb));
            prop_assert_eq!(&got, &want);

            let mut bufs = vec![vec![0u8; bb]; reads.len()];
            let mut copies: Vec<_> = reads
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&at, buf)| (&b[at % n], buf.as_mut_slice()))
                .collect();
            batched.read_blocks(&mut copies).unwrap();
            for (&at, buf) in reads.iter().zip(&bufs) {
                prop_assert_eq!(buf, &want[at % n]);
            }
            single.check_invariants().unwrap();
            batched.check_invariants().unwrap();
        }
    }
}

#[test]
fn a_limited_pool_grows_to_its_new_maximum_and_no_further() {
    let fb = fake();
    let pool = SharedBlockPool::new(&fb, &PoolConfig::growable(512, 2, 64, 8)).unwrap();
    let base = pool.reservation().unwrap().addr();
    let held = pool.allocate_many(10).unwrap();
    let committed = pool.stats().capacity;
    assert!((10..64).contains(&committed));
    // Below what is committed, or above the maximum: refused, unchanged.
    assert!(pool.limit_blocks(committed - 1).is_err());
    assert!(pool.limit_blocks(65).is_err());
    assert_eq!(pool.stats().max_blocks, 64);
    pool.limit_blocks(24).unwrap();
    assert_eq!(pool.room(), (committed - 10, 24 - committed));
    pool.reserve_free(14).unwrap();
    let s = pool.stats();
    assert_eq!((s.capacity, s.max_blocks, s.free), (24, 24, 14));
    assert!(
        pool.reserve_free(15).is_err(),
        "no growth past the new maximum"
    );
    assert!(pool.allocate_many(15).is_err());
    let rest = pool.allocate_many(14).unwrap();
    assert_eq!(
        pool.reservation().unwrap().addr(),
        base,
        "the base never moves"
    );
    drop((held, rest));
    pool.check_invariants().unwrap();
}
