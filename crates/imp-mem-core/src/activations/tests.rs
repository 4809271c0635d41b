use std::sync::Arc;

use super::*;
use crate::error::MemError;
use crate::fake::{FakeBackend, FakeConfig};
use crate::phase::PhaseMode;
use crate::tag::Tag;

const KIB: u64 = 1024;

fn fake(mode: PhaseMode) -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity: 64 << 20,
        mode,
        ..FakeConfig::default()
    })
    .unwrap()
}

fn pool(fb: &FakeBackend, capacity: u64, order: Arc<dyn StreamOrder>) -> ActivationPool {
    ActivationPool::new(fb, &ActivationConfig::new(capacity), order).unwrap()
}

#[test]
fn allocate_rounds_to_the_alignment_and_free_coalesces_back() {
    let fb = fake(PhaseMode::Strict);
    let p = pool(&fb, 64 * KIB, Arc::new(NoStreams));
    let a = p.allocate(1, 0).unwrap();
    let b = p.allocate(513, 0).unwrap();
    let c = p.allocate(4096, 0).unwrap();
    assert_eq!(a % 512, 0);
    assert_eq!(b, a + 512);
    assert_eq!(c, b + 1024);
    let s = p.stats();
    assert_eq!(s.allocated, 512 + 1024 + 4096);
    assert_eq!(s.requested, 1 + 513 + 4096);
    p.check_invariants().unwrap();
    p.free(b, 0).unwrap();
    p.free(a, 0).unwrap();
    p.free(c, 0).unwrap();
    p.check_invariants().unwrap();
    let s = p.stats();
    assert_eq!((s.free_blocks, s.largest_free), (1, 64 * KIB));
    assert_eq!(s.allocated_peak, 512 + 1024 + 4096);
}

#[test]
fn refused_frees_change_nothing_and_are_told_apart() {
    let fb = fake(PhaseMode::Strict);
    let p = pool(&fb, 64 * KIB, Arc::new(NoStreams));
    let a = p.allocate(1000, 0).unwrap();
    assert_eq!(p.try_free(a + 512, 0), Err(RefusedFree::NotLive));
    assert_eq!(p.try_free(a + 1, 0), Err(RefusedFree::NotLive));
    assert_eq!(p.try_free(12345, 0), Err(RefusedFree::Foreign));
    assert_eq!(p.try_free(a, 0).map(|f| f.requested), Ok(1000));
    assert_eq!(p.try_free(a, 0), Err(RefusedFree::NotLive));
    let s = p.stats();
    assert_eq!((s.refused_frees, s.frees_total), (4, 1));
    p.check_invariants().unwrap();
}

#[test]
fn strict_exhaustion_is_out_of_memory_and_production_falls_back() {
    let fb = fake(PhaseMode::Strict);
    let p = pool(&fb, 8 * KIB, Arc::new(NoStreams));
    let a = p.allocate(8 * KIB, 0).unwrap();
    assert!(matches!(p.allocate(1, 0), Err(MemError::OutOfMemory(_))));
    assert_eq!(p.stats().ooms, 1);
    p.free(a, 0).unwrap();

    let fb = fake(PhaseMode::Production);
    fb.begin_planning().unwrap();
    let p = pool(&fb, 8 * KIB, Arc::new(NoStreams));
    assert!(!p.is_strict());
    fb.begin_serving().unwrap();
    let a = p.allocate(8 * KIB, 0).unwrap();
    let b = p.allocate(3000, 0).unwrap();
    assert!(!p.contains(b));
    let s = p.stats();
    assert_eq!((s.fallbacks_total, s.fallback_bytes, s.live), (1, 3072, 2));
    let tag = fb.stats().tags[&Tag::Activations];
    assert_eq!(tag.live, 8 * KIB + 3072);
    assert_eq!(
        fb.stats().steady_state_allocations_total[&Tag::Activations],
        1
    );
    p.check_invariants().unwrap();
    let freed = p.free(b, 0).unwrap();
    assert!(freed.fallback);
    assert_eq!(fb.stats().tags[&Tag::Activations].live, 8 * KIB);
    p.free(a, 0).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn another_streams_block_is_reused_only_after_an_order() {
    let fb = fake(PhaseMode::Strict);
    let order = FakeStreamOrder::new();
    let p = pool(&fb, 16 * KIB, Arc::new(order.clone()));
    let a = p.allocate(16 * KIB, 1).unwrap();
    p.free(a, 1).unwrap();
    // Same stream: no order.
    let a = p.allocate(4 * KIB, 1).unwrap();
    assert!(order.is_empty());
    p.free(a, 1).unwrap();
    // Another stream: one order, waiter 2 after producer 1.
    let b = p.allocate(4 * KIB, 2).unwrap();
    assert_eq!(order.calls(), vec![(2, 1)]);
    assert_eq!(p.stats().cross_stream_reuses, 1);
    // The tail stayed stream 1's; freeing b on 2 does not merge with it.
    p.free(b, 2).unwrap();
    let s = p.stats();
    assert_eq!((s.free_blocks, s.streams), (2, 2));
    p.check_invariants().unwrap();
    // A request only the union fits reclaims: order 3 after 1 and 2.
    let c = p.allocate(16 * KIB, 3).unwrap();
    let calls = order.calls();
    assert_eq!(&calls[1..], &[(3, 1), (3, 2)]);
    assert_eq!(p.stats().reclaims, 1);
    p.free(c, 3).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn a_failed_order_leaves_the_block_with_its_stream() {
    let fb = fake(PhaseMode::Strict);
    let order = FakeStreamOrder::new();
    let p = pool(&fb, 16 * KIB, Arc::new(order.clone()));
    let a = p.allocate(16 * KIB, 1).unwrap();
    p.free(a, 1).unwrap();
    order.fail_next(1);
    assert!(matches!(p.allocate(512, 2), Err(MemError::Driver(_))));
    p.check_invariants().unwrap();
    let s = p.stats();
    assert_eq!(
        (s.allocs_total, s.free_blocks, s.largest_free),
        (1, 1, 16 * KIB)
    );
    assert!(p.allocate(512, 2).is_ok());
}

#[test]
fn freed_memory_is_scrubbed_on_the_fake() {
    let fb = fake(PhaseMode::Strict);
    let p = pool(&fb, 16 * KIB, Arc::new(NoStreams));
    let a = p.allocate(1024, 0).unwrap();
    fb.write(a, &[7u8; 1024]).unwrap();
    p.free(a, 0).unwrap();
    assert!(fb.is_poisoned(a, 1024).unwrap());
}

#[test]
fn bad_configurations_are_refused() {
    let fb = fake(PhaseMode::Strict);
    let mut cfg = ActivationConfig::new(100);
    assert!(ActivationPool::new(&fb, &cfg, Arc::new(NoStreams)).is_err());
    cfg.capacity = 1 << 20;
    cfg.align = 3;
    assert!(ActivationPool::new(&fb, &cfg, Arc::new(NoStreams)).is_err());
    let p = pool(&fb, 1 << 20, Arc::new(NoStreams));
    assert!(p.allocate(0, 0).is_err());
    assert!(p.allocate(u64::MAX, 0).is_err());
    assert!(matches!(
        p.allocate(2 << 20, 0),
        Err(MemError::OutOfMemory(_))
    ));
}

#[test]
fn the_pool_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ActivationPool>();
}

#[test]
fn threads_sharing_one_pool_keep_it_consistent() {
    let fb = fake(PhaseMode::Strict);
    let order = FakeStreamOrder::new();
    let p = pool(&fb, 4 << 20, Arc::new(order.clone()));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                let mut x = 0x9E37_79B9u64 ^ t;
                for i in 0..5_000u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if held.len() < 16 && (x % 3 != 0 || held.is_empty()) {
                        // Each thread uses its own stream, and sometimes
                        // another's, so every path runs concurrently.
                        let stream = if i % 7 == 0 { (t + 1) % 4 } else { t };
                        if let Ok(a) = p.allocate(1 + x % (64 * KIB), stream) {
                            held.push(a);
                        }
                    } else if let Some(a) = held.pop() {
                        p.free(a, t).unwrap();
                    }
                }
                for a in held {
                    p.free(a, t).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    p.check_invariants().unwrap();
    let s = p.stats();
    assert_eq!((s.live, s.allocated, s.allocs_total), (0, 0, s.frees_total));
    assert!(s.allocs_total > 1000, "{s:?}");
}

#[test]
fn a_fallback_goes_back_only_after_its_streams_are_waited_for() {
    let fb = fake(PhaseMode::Production);
    fb.begin_planning().unwrap();
    let order = FakeStreamOrder::new();
    let p = pool(&fb, 8 * KIB, Arc::new(order.clone()));
    fb.begin_serving().unwrap();
    let a = p.allocate(8 * KIB, 7).unwrap();
    let held = |fb: &FakeBackend| fb.stats().tags[&Tag::Activations].live;
    // Allocated on stream 7, freed on stream 9: both waited for, then released.
    let b = p.allocate(3000, 7).unwrap();
    assert!(p.free(b, 9).unwrap().fallback);
    assert_eq!(order.waits(), vec![7, 9]);
    assert_eq!(held(&fb), 8 * KIB);
    // Same stream: one wait.
    let b = p.allocate(3000, 7).unwrap();
    p.free(b, 7).unwrap();
    assert_eq!(order.waits(), vec![7, 9, 7]);
    // A wait that fails keeps the region (parked), never unmapped under a
    // kernel; the free itself succeeds and the counters say so.
    let b = p.allocate(3000, 7).unwrap();
    order.fail_waits(1);
    assert!(p.free(b, 7).unwrap().fallback);
    assert_eq!(held(&fb), 8 * KIB + 3072, "parked, still the backend's");
    let s = p.stats();
    assert_eq!((s.fallback_live, s.fallback_bytes, s.live), (0, 0, 1));
    p.check_invariants().unwrap();
    p.free(a, 7).unwrap();
    // The region's own blocks never wait: only fallbacks are released.
    assert_eq!(order.waits().len(), 3);
    drop(p);
    assert_eq!(held(&fb), 0, "the parked region goes back with the pool");
}
