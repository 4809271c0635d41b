//! The VMM bookkeeping against the simulated driver, through the real
//! `Backend`.

use std::sync::Arc;

use imp_mem_core::{Backend, MemError, MemorySource, PhaseMode, SourceError, Tag};
use proptest::prelude::*;

use super::sim::{Op, SimDriver};
use super::*;
use crate::driver::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};

const MIB: usize = 1 << 20;
const GRANULE: usize = 2 * MIB;
const CHUNK: usize = 8 * MIB;

fn setup(cache_chunks: usize, capacity: u64) -> (SimDriver, Arc<VmmCore<SimDriver>>, Backend) {
    let sim = SimDriver::new(GRANULE, capacity);
    let source = Arc::new(
        VmmCore::with_driver(
            sim.clone(),
            VmmConfig {
                chunk_bytes: Some(CHUNK),
                cache_chunks,
            },
        )
        .unwrap(),
    );
    let backend = Backend::new(source.clone(), PhaseMode::Strict, None).unwrap();
    (sim, source, backend)
}

/// The simulated device's physical memory equals what the source believes
/// it holds (mapped + cached), every mapping is accessible, and the backend's
/// committed bytes equal what is mapped (tests with growable regions only:
/// a fixed region is counted at the size asked, mapped at the granule).
fn assert_consistent(sim: &SimDriver, source: &VmmCore<SimDriver>, backend: &Backend) {
    assert_device_matches(sim, source);
    let stats = backend.stats();
    assert_eq!(
        stats.total.committed,
        source.mapped_bytes(),
        "backend committed vs mapped"
    );
}

fn assert_device_matches(sim: &SimDriver, source: &VmmCore<SimDriver>) {
    let s = sim.lock();
    assert_eq!(
        s.physical(),
        source.mapped_bytes() + source.cached_bytes(),
        "physical vs mapped + cached"
    );
    assert_eq!(s.mapped_bytes(), source.mapped_bytes());
    assert!(s.all_accessible(), "a mapping without access");
}

#[test]
fn chunk_rounding_is_pure_and_positive() {
    assert_eq!(chunk_size(None, GRANULE).unwrap(), DEFAULT_CHUNK_BYTES);
    assert_eq!(chunk_size(Some(3 * MIB), GRANULE).unwrap(), 4 * MIB);
    assert_eq!(chunk_size(Some(1), GRANULE).unwrap(), GRANULE);
    assert!(matches!(
        chunk_size(Some(0), GRANULE),
        Err(MemError::InvalidArgument(_))
    ));
    assert_eq!(combined_granularity(2 * MIB, 2 * MIB), 2 * MIB);
    assert_eq!(combined_granularity(2 * MIB, 32 * MIB), 32 * MIB);
    assert_eq!(combined_granularity(4096, 0), 4096);
    assert!(check_sizes(CHUNK, 2, 1 << 30).is_ok());
    assert!(matches!(
        check_sizes(2 << 30, 0, 1 << 30),
        Err(MemError::InvalidArgument(_))
    ));
    assert!(matches!(
        check_sizes(CHUNK, 1 << 20, 1 << 30),
        Err(MemError::InvalidArgument(_))
    ));
    let sim = SimDriver::new(GRANULE, 64 * MIB as u64);
    let refused = VmmCore::with_driver(
        sim,
        VmmConfig {
            chunk_bytes: Some(CHUNK),
            cache_chunks: 100,
        },
    );
    assert!(refused.is_err());
}

#[test]
fn grow_shrink_grow_keeps_the_base_and_sets_access_on_new_chunks_only() {
    let (sim, source, backend) = setup(0, 1 << 30);
    let mut region = backend
        .acquire_growable(64 * MIB as u64, 0, Tag::KvCache)
        .unwrap();
    let base = region.base();
    assert_eq!(base % CHUNK, 0, "aligned to the chunk");
    region.commit(CHUNK as u64).unwrap();
    region.commit(3 * CHUNK as u64).unwrap();
    assert_eq!(region.base(), base);
    assert_eq!(source.mappings_of(base), Some(3));
    // One set-access per growth event, each over the new chunks only.
    assert_eq!(sim.lock().set_access_sizes, vec![CHUNK, 2 * CHUNK]);
    assert_consistent(&sim, &source, &backend);

    region.decommit(CHUNK as u64).unwrap();
    assert_eq!(region.base(), base);
    assert_eq!(source.committed_of(base), Some(CHUNK));
    assert_consistent(&sim, &source, &backend);

    region.commit(8 * CHUNK as u64).unwrap();
    assert_eq!(region.base(), base);
    assert_eq!(region.len(), 8 * CHUNK);
    assert_consistent(&sim, &source, &backend);
    drop(region);
    assert_eq!(sim.lock().physical(), 0);
    assert_eq!(sim.lock().reservations(), 0);
}

#[test]
fn released_chunks_are_reused_from_a_bounded_cache() {
    let (sim, source, backend) = setup(2, 1 << 30);
    let mut region = backend
        .acquire_growable(64 * MIB as u64, 5 * CHUNK as u64, Tag::KvCache)
        .unwrap();
    assert_eq!(source.counters().handles_created, 5);
    region.decommit(0).unwrap();
    // Two cached, three released.
    assert_eq!(source.cached_bytes(), 2 * CHUNK as u64);
    assert_eq!(source.counters().handles_released, 3);
    assert_consistent(&sim, &source, &backend);
    // Growth takes the cached handles first.
    region.commit(3 * CHUNK as u64).unwrap();
    let c = source.counters();
    assert_eq!(c.cache_hits, 2);
    assert_eq!(c.handles_created, 6);
    assert_eq!(source.cached_bytes(), 0);
    assert_consistent(&sim, &source, &backend);
    region.decommit(0).unwrap();
    source.trim_cache();
    assert_eq!(
        sim.lock().physical(),
        0,
        "full decommit + trim returns every byte"
    );
}

/// The report's two VMM lines, through the backend, as `(key, bytes)`.
fn charges(backend: &Backend) -> Vec<(String, u64)> {
    backend
        .extra_charges()
        .into_iter()
        .map(|c| (c.key, c.bytes))
        .collect()
}

#[test]
fn the_cache_and_the_rounding_are_charged_and_the_device_is_read() {
    let capacity = 1 << 30;
    let (sim, source, backend) = setup(2, capacity);
    let labels: Vec<String> = backend
        .extra_charges()
        .into_iter()
        .map(|c| c.label)
        .collect();
    assert_eq!(
        labels,
        [
            "VMM handle cache (kept for reuse)",
            "VMM mapping past the ledger (chunk rounding)"
        ]
    );
    assert_eq!(
        charges(&backend),
        [("vmm_handle_cache".into(), 0), ("vmm_rounding".into(), 0)]
    );
    let mut region = backend
        .acquire_growable(64 * MIB as u64, 4 * CHUNK as u64, Tag::KvCache)
        .unwrap();
    region.decommit(CHUNK as u64).unwrap();
    // A fixed region of 1 MiB is mapped as one 2 MiB granule.
    let fixed = backend.acquire(MIB as u64, 256, Tag::Other).unwrap();
    assert_eq!(
        charges(&backend),
        [
            ("vmm_handle_cache".into(), 2 * CHUNK as u64),
            ("vmm_rounding".into(), (GRANULE - MIB) as u64)
        ]
    );
    let reading = backend.mem_info().unwrap().unwrap();
    assert_eq!(reading.total, capacity);
    assert_eq!(reading.free, capacity - sim.lock().physical());
    assert_eq!(
        reading.free,
        capacity - source.mapped_bytes() - source.cached_bytes()
    );
    drop(fixed);
    source.trim_cache();
    assert_eq!(
        charges(&backend),
        [("vmm_handle_cache".into(), 0), ("vmm_rounding".into(), 0)]
    );
    drop(region);
}

#[test]
fn the_budget_leaves_room_for_the_cache() {
    let (_sim, source, backend) = setup(2, 1 << 30);
    assert_eq!(source.info().capacity, (1 << 30) - 2 * CHUNK as u64);
    assert_eq!(backend.budget(), (1 << 30) - 2 * CHUNK as u64);
}

#[test]
fn a_failed_commit_changes_nothing() {
    for (op, nth) in [(Op::Create, 2), (Op::Map, 3), (Op::SetAccess, 1)] {
        let (sim, source, backend) = setup(1, 1 << 30);
        let mut region = backend
            .acquire_growable(64 * MIB as u64, CHUNK as u64, Tag::KvCache)
            .unwrap();
        let before = backend.stats().total.committed;
        sim.fail_nth(op, nth, CUDA_ERROR_INVALID_VALUE);
        let err = region.commit(4 * CHUNK as u64).unwrap_err();
        assert!(matches!(err, MemError::Driver(_)), "{op:?}: {err:?}");
        assert_eq!(region.len(), CHUNK, "{op:?}");
        assert_eq!(backend.stats().total.committed, before);
        assert_eq!(source.committed_of(region.base()), Some(CHUNK));
        assert_consistent(&sim, &source, &backend);
        // And it still grows afterwards.
        region.commit(4 * CHUNK as u64).unwrap();
        assert_consistent(&sim, &source, &backend);
    }
}

#[test]
fn device_oom_is_out_of_memory_and_rolls_back() {
    let (sim, source, backend) = setup(0, (3 * CHUNK) as u64 + (2 * CHUNK) as u64);
    let mut region = backend
        .acquire_growable(64 * MIB as u64, 0, Tag::KvCache)
        .unwrap();
    // The device has 5 chunks; the budget (capacity) allows them all, but
    // something else took 3: the device refuses.
    sim.lock().capacity = 2 * CHUNK as u64;
    let err = region.commit(3 * CHUNK as u64).unwrap_err();
    match err {
        MemError::OutOfMemory(report) => assert!(report.device_refused),
        other => panic!("{other:?}"),
    }
    assert_eq!(region.len(), 0);
    assert_consistent(&sim, &source, &backend);
}

#[test]
fn oom_drains_the_cache_and_retries() {
    let (sim, source, backend) = setup(2, 1 << 30);
    let mut region = backend
        .acquire_growable(64 * MIB as u64, 2 * CHUNK as u64, Tag::KvCache)
        .unwrap();
    region.decommit(0).unwrap();
    assert_eq!(source.cached_bytes(), 2 * CHUNK as u64);
    // A fixed allocation of an odd size cannot use the cached chunks; the
    // device has room only once they are released.
    sim.lock().capacity = 2 * CHUNK as u64 + 2 * GRANULE as u64;
    let fixed = backend
        .acquire(3 * GRANULE as u64, 256, Tag::Workspace)
        .unwrap();
    assert_eq!(source.cached_bytes(), 0);
    assert_device_matches(&sim, &source);
    drop(fixed);
    assert_eq!(
        sim.lock().physical(),
        0,
        "an odd-sized handle is released, not cached"
    );
}

#[test]
fn fixed_allocations_round_to_the_granule() {
    let (sim, source, backend) = setup(2, 1 << 30);
    let odd = backend
        .acquire(3 * MIB as u64, 4096, Tag::Workspace)
        .unwrap();
    assert_eq!(source.mappings_of(odd.base()), Some(1));
    assert_eq!(sim.lock().physical(), 4 * MIB as u64);
    let whole = backend
        .acquire(2 * CHUNK as u64, 1 << 21, Tag::Workspace)
        .unwrap();
    assert_eq!(whole.base() % (1 << 21), 0);
    assert_eq!(source.mappings_of(whole.base()), Some(2));
    drop(odd);
    drop(whole);
    assert_eq!(
        source.cached_bytes(),
        2 * CHUNK as u64,
        "chunk-sized handles are cached"
    );
    assert_eq!(sim.lock().reservations(), 0);
}

#[test]
fn a_failed_decommit_restores_the_region() {
    let (sim, source, backend) = setup(2, 1 << 30);
    let mut region = backend
        .acquire_growable(64 * MIB as u64, 4 * CHUNK as u64, Tag::KvCache)
        .unwrap();
    let base = region.base();
    // The third unmap (of chunk 1, counting down from the tail) fails.
    sim.fail_nth(Op::Unmap, 3, CUDA_ERROR_INVALID_VALUE);
    let err = region.decommit(0).unwrap_err();
    assert!(matches!(err, MemError::Driver(_)), "{err:?}");
    assert_eq!(region.len(), 4 * CHUNK);
    assert_eq!(source.committed_of(base), Some(4 * CHUNK));
    assert_eq!(source.mappings_of(base), Some(4));
    assert_consistent(&sim, &source, &backend);
    region.decommit(CHUNK as u64).unwrap();
    assert_eq!(source.committed_of(base), Some(CHUNK));
    assert_consistent(&sim, &source, &backend);
}

#[test]
fn commits_and_decommits_outside_the_rules_are_invariant_errors() {
    let (_sim, source, backend) = setup(0, 1 << 30);
    let region = backend
        .acquire_growable(64 * MIB as u64, CHUNK as u64, Tag::KvCache)
        .unwrap();
    let base = region.base();
    assert!(matches!(
        source.commit(base, 0, CHUNK),
        Err(SourceError::Invariant(_))
    ));
    assert!(matches!(
        source.commit(base, CHUNK, CHUNK + GRANULE),
        Err(SourceError::Invariant(_))
    ));
    assert!(matches!(
        source.commit(base + 1, CHUNK, 2 * CHUNK),
        Err(SourceError::Invariant(_))
    ));
    // SAFETY: the calls are refused before touching anything.
    unsafe {
        assert!(matches!(
            source.decommit(base, 0, 2 * CHUNK),
            Err(SourceError::Invariant(_))
        ));
        assert!(matches!(
            source.decommit(base, GRANULE, CHUNK),
            Err(SourceError::Invariant(_))
        ));
    }
    assert_eq!(source.committed_of(base), Some(CHUNK));
}

#[test]
fn dropping_the_backend_returns_everything() {
    let (sim, source, backend) = setup(2, 1 << 30);
    let a = backend
        .acquire_growable(64 * MIB as u64, 3 * CHUNK as u64, Tag::KvCache)
        .unwrap();
    let b = backend
        .acquire(5 * MIB as u64, 256, Tag::Workspace)
        .unwrap();
    drop(a);
    drop(b);
    drop(backend);
    drop(source);
    let s = sim.lock();
    assert_eq!(s.physical(), 0);
    assert_eq!(s.reservations(), 0);
    assert_eq!(s.live_handles(), 0);
}

#[test]
fn a_failed_reservation_is_reported() {
    let (sim, _source, backend) = setup(0, 1 << 30);
    sim.fail_nth(Op::Reserve, 1, CUDA_ERROR_OUT_OF_MEMORY);
    assert!(backend
        .acquire_growable(64 * MIB as u64, 0, Tag::KvCache)
        .is_err());
    assert_eq!(backend.live(), 0);
}

#[derive(Debug, Clone)]
enum Step {
    Acquire { chunks: usize, initial: usize },
    Fixed { mib: usize },
    Commit { seed: usize, chunks: usize },
    Decommit { seed: usize, chunks: usize },
    Release { seed: usize },
    Fail { op: u8, nth: u32 },
    Trim,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1usize..8, 0usize..4).prop_map(|(chunks, initial)| Step::Acquire { chunks, initial }),
        (1usize..40).prop_map(|mib| Step::Fixed { mib }),
        (any::<usize>(), 1usize..8).prop_map(|(seed, chunks)| Step::Commit { seed, chunks }),
        (any::<usize>(), 0usize..8).prop_map(|(seed, chunks)| Step::Decommit { seed, chunks }),
        any::<usize>().prop_map(|seed| Step::Release { seed }),
        (0u8..4, 1u32..4).prop_map(|(op, nth)| Step::Fail { op, nth }),
        Just(Step::Trim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Under any sequence of acquisitions, commits, decommits, releases and
    /// injected driver failures: the device's physical memory equals mapped +
    /// cached, the backend's committed equals mapped, bases never move, and
    /// everything returns when the regions go.
    #[test]
    fn bookkeeping_matches_the_device(steps in proptest::collection::vec(step(), 1..40)) {
        let (sim, source, backend) = setup(2, 96 * CHUNK as u64);
        let mut regions: Vec<(usize, imp_mem_core::Region)> = Vec::new();
        for s in steps {
            match s {
                Step::Acquire { chunks, initial } => {
                    let initial = initial.min(chunks);
                    if let Ok(r) = backend.acquire_growable((chunks * CHUNK) as u64, (initial * CHUNK) as u64, Tag::KvCache) {
                        regions.push((r.base(), r));
                    }
                }
                Step::Fixed { mib } => {
                    if let Ok(r) = backend.acquire((mib * MIB) as u64, 256, Tag::Workspace) {
                        regions.push((r.base(), r));
                    }
                }
                Step::Commit { seed, chunks } if !regions.is_empty() => {
                    let n = regions.len();
                    let (_, r) = &mut regions[seed % n];
                    if r.is_growable() {
                        let target = (r.len() + chunks * CHUNK).min(r.reserved());
                        let _ = r.commit(target as u64);
                    }
                }
                Step::Decommit { seed, chunks } if !regions.is_empty() => {
                    let n = regions.len();
                    let (_, r) = &mut regions[seed % n];
                    if r.is_growable() {
                        let _ = r.decommit((chunks * CHUNK).min(r.len()) as u64);
                    }
                }
                Step::Release { seed } if !regions.is_empty() => {
                    let n = regions.len();
                    regions.swap_remove(seed % n);
                }
                Step::Fail { op, nth } => {
                    // Unmap failures have their own test: one during a release can
                    // only be counted, which this property would flag as a leak.
                    let op = [Op::Create, Op::Map, Op::SetAccess, Op::Reserve][op as usize];
                    sim.fail_nth(op, nth, CUDA_ERROR_INVALID_VALUE);
                }
                Step::Trim => source.trim_cache(),
                _ => {}
            }
            let mut expected_mapped = 0u64;
            for (base, r) in &regions {
                prop_assert_eq!(*base, r.base());
                if r.is_growable() {
                    prop_assert_eq!(source.committed_of(*base), Some(r.len()));
                    expected_mapped += r.len() as u64;
                } else {
                    expected_mapped += r.len().div_ceil(GRANULE) as u64 * GRANULE as u64;
                }
            }
            assert_device_matches(&sim, &source);
            prop_assert_eq!(source.mapped_bytes(), expected_mapped);
            prop_assert!(source.cached_bytes() <= 2 * CHUNK as u64);
        }
        regions.clear();
        source.trim_cache();
        prop_assert_eq!(sim.lock().physical(), 0);
        prop_assert_eq!(sim.lock().reservations(), 0);
    }
}

#[test]
fn concurrent_regions_stay_consistent() {
    let (sim, source, backend) = setup(2, 1 << 30);
    std::thread::scope(|s| {
        for t in 0..4usize {
            let backend = backend.clone();
            s.spawn(move || {
                let mut region = backend
                    .acquire_growable(16 * CHUNK as u64, 0, Tag::KvCache)
                    .unwrap();
                let base = region.base();
                for i in 0..50usize {
                    let chunks = (i * 7 + t) % 9;
                    if chunks * CHUNK >= region.len() {
                        region.commit((chunks * CHUNK) as u64).unwrap();
                    } else {
                        region.decommit((chunks * CHUNK) as u64).unwrap();
                    }
                    assert_eq!(region.base(), base);
                    assert_eq!(region.len(), chunks * CHUNK);
                }
            });
        }
    });
    assert_consistent(&sim, &source, &backend);
    source.trim_cache();
    assert_eq!(sim.lock().physical(), 0);
    assert_eq!(sim.lock().reservations(), 0);
}

#[test]
fn a_driver_with_no_device_gives_no_streams_and_no_host_tier() {
    // The simulation has no streams and no host memory to copy to: its
    // source orders nothing and refuses a host tier, as the fake's trait
    // defaults do; a device driver gives its events and its copy engine.
    let (_sim, core, backend) = setup(2, 64 * MIB as u64);
    assert!(core.stream_order().is_ok());
    assert!(backend.stream_order().is_ok());
    assert!(core.host_tier_io(4096, 4).unwrap().is_none());
    assert!(backend.host_tier_io(4096, 4).unwrap().is_none());
}
