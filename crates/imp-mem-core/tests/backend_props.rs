//! V1, V2 and V9 as proptest state machines over the fake backend, plus
//! fault injection at every position of a scripted load.
//!
//! Operations are generated as data; a release is `Release(seed)` resolved to
//! `live[seed % live.len()]` so that every generated sequence is valid.

use imp_mem_core::conformance::replay;
use imp_mem_core::{
    Backend, FakeBackend, FakeConfig, JournalOp, MemError, Phase, PhaseMode, Region, Tag,
};
use proptest::prelude::*;

const GRANULE: usize = 4096;

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        bytes: u64,
        align_log: u32,
        tag: usize,
    },
    AcquireGrowable {
        reserve: u64,
        initial: u64,
    },
    Release(usize),
    Resize {
        seed: usize,
        size: u64,
        fail: bool,
    },
    Advance,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..(1 << 20), 0u32..13, 0usize..Tag::ALL.len())
            .prop_map(|(bytes, align_log, tag)| Op::Acquire { bytes, align_log, tag }),
        2 => (1u64..(2 << 20), 0u64..(1 << 20))
            .prop_map(|(reserve, initial)| Op::AcquireGrowable { reserve, initial: initial.min(reserve) }),
        4 => any::<usize>().prop_map(Op::Release),
        3 => (any::<usize>(), 0u64..(2 << 20), any::<bool>())
            .prop_map(|(seed, size, fail)| Op::Resize { seed, size, fail }),
        1 => Just(Op::Advance),
    ]
}

struct Model {
    fake: FakeBackend,
    regions: Vec<(Region, usize)>, // region, base at acquisition
    live: u64,
}

fn run(ops: Vec<Op>, mode: PhaseMode) -> Result<(), TestCaseError> {
    let fake = FakeBackend::new(FakeConfig {
        capacity: 4 << 20,
        granularity: GRANULE,
        mode,
        ..FakeConfig::default()
    })
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut m = Model {
        fake,
        regions: Vec::new(),
        live: 0,
    };
    for op in ops {
        let serving = m.fake.phase() == Phase::Serving;
        match op {
            Op::Acquire {
                bytes,
                align_log,
                tag,
            } => match m.fake.acquire(bytes, 1 << align_log, Tag::ALL[tag]) {
                Ok(r) => {
                    prop_assert!(!serving || mode == PhaseMode::Production, "V2");
                    prop_assert_eq!(r.base() % (1usize << align_log), 0);
                    m.live += bytes;
                    let base = r.base();
                    m.regions.push((r, base));
                }
                Err(MemError::PhaseViolation { .. }) => {
                    prop_assert!(serving && mode == PhaseMode::Strict)
                }
                Err(MemError::OutOfMemory(report)) => {
                    prop_assert!(report.live + report.asked > report.budget)
                }
                Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
            },
            Op::AcquireGrowable { reserve, initial } => {
                if let Ok(r) = m.fake.acquire_growable(reserve, initial, Tag::KvCache) {
                    prop_assert!(!serving || mode == PhaseMode::Production, "V2");
                    m.live += r.len() as u64;
                    let base = r.base();
                    m.regions.push((r, base));
                }
            }
            Op::Release(seed) if !m.regions.is_empty() => {
                let (r, _) = m.regions.swap_remove(seed % m.regions.len());
                m.live -= r.len() as u64;
                m.fake
                    .release(r)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Resize { seed, size, fail } => {
                let growable: Vec<usize> = (0..m.regions.len())
                    .filter(|&i| m.regions[i].0.is_growable())
                    .collect();
                if growable.is_empty() {
                    continue;
                }
                let i = growable[seed % growable.len()];
                let (r, base) = &mut m.regions[i];
                let before = r.len() as u64;
                let grow = size > before;
                if fail {
                    if grow {
                        m.fake.fail_commits(1)
                    } else {
                        m.fake.fail_decommits(1)
                    }
                }
                let result = if grow {
                    r.commit(size.min(r.reserved() as u64))
                } else {
                    r.decommit(size)
                };
                m.fake.fail_commits(0);
                m.fake.fail_decommits(0);
                if result.is_err() {
                    prop_assert_eq!(r.len() as u64, before);
                }
                prop_assert_eq!(r.base(), *base, "V9: the base moved");
                prop_assert_eq!(r.len() % GRANULE, 0);
                m.live = m.live + r.len() as u64 - before;
            }
            Op::Advance => {
                let next = match m.fake.phase() {
                    Phase::Loading => Some(Phase::Planning),
                    Phase::Planning => Some(Phase::Serving),
                    Phase::Serving => None,
                };
                if let Some(next) = next {
                    m.fake
                        .advance(next)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
            Op::Release(_) => {}
        }
        // V1 after every operation, three ways: model, ledger, journal replay.
        let stats = m.fake.stats();
        prop_assert_eq!(stats.total.live, m.live);
        prop_assert_eq!(
            stats.acquired_bytes_total - stats.released_bytes_total,
            m.live
        );
        prop_assert_eq!(replay(&m.fake), m.live as i128);
        prop_assert!(m.fake.check_invariants().is_ok());
        if mode == PhaseMode::Strict {
            let journal = m.fake.journal().unwrap_or_default();
            prop_assert!(!journal
                .iter()
                .any(|e| e.phase == Phase::Serving && e.op == JournalOp::Acquire));
        }
    }
    drop(m.regions);
    prop_assert_eq!(m.fake.live(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn conservation_phase_and_stable_bases_strict(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, PhaseMode::Strict)?;
    }

    #[test]
    fn conservation_phase_and_stable_bases_production(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, PhaseMode::Production)?;
    }
}

/// A scripted load that holds every region it gets and unwinds on the first
/// error, as an engine would.
fn scripted_load(backend: &Backend) -> Result<Vec<Region>, MemError> {
    let mut held = Vec::new();
    for (i, tag) in Tag::ALL.iter().enumerate() {
        let bytes = 4096 * (i as u64 + 1);
        let region = if i % 3 == 2 {
            backend.acquire_growable(bytes * 4, bytes, *tag)?
        } else {
            backend.acquire(bytes, 256, *tag)?
        };
        held.push(region);
    }
    Ok(held)
}

#[test]
fn fail_nth_at_every_position_unwinds_to_zero() {
    for n in 1..=Tag::ALL.len() as u64 {
        let fake = FakeBackend::new(FakeConfig::default()).unwrap();
        fake.fail_nth(Some(n)).unwrap();
        let err = scripted_load(&fake).unwrap_err();
        assert!(
            matches!(err, MemError::OutOfMemory(r) if r.device_refused),
            "{err}"
        );
        assert_eq!(fake.live(), 0, "n = {n}");
        let stats = fake.stats();
        assert_eq!(stats.total.acquisitions, n - 1);
        assert_eq!(stats.total.releases, n - 1);
        assert_eq!(scripted_load(&fake).unwrap().len(), Tag::ALL.len());
    }
}

#[test]
fn poison_is_readable_from_quarantine() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let r = fake.acquire(64, 64, Tag::Other).unwrap();
    let addr = r.base();
    fake.write(addr, b"abc").unwrap();
    drop(r);
    assert!(fake.is_poisoned(addr, 64).unwrap());
    assert!(matches!(
        fake.write(addr, b"x"),
        Err(MemError::StaleSpan(_))
    ));
}

#[test]
fn region_copies_check_the_committed_range_before_touching_anything() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut r = fake
        .acquire_growable(4 * GRANULE as u64, GRANULE as u64, Tag::Other)
        .unwrap();
    r.copy_from_host(GRANULE - 3, b"abc").unwrap();
    assert_eq!(r.read_to_vec(GRANULE - 3, 3).unwrap(), b"abc");
    assert_eq!(fake.read(r.base() + GRANULE - 3, 3).unwrap(), b"abc");
    assert!(r.read_to_vec(GRANULE, 0).unwrap().is_empty());
    // Past the committed part (the reservation is larger): refused, one
    // rule for reads and writes, and a huge length is refused before any
    // buffer is reserved for it.
    for (offset, len) in [
        (GRANULE - 2, 3),
        (GRANULE + 1, 0),
        (0, usize::MAX / 2),
        (usize::MAX, 2),
    ] {
        let read = r.read_to_vec(offset, len).unwrap_err();
        assert!(matches!(read, MemError::InvalidArgument(_)), "{read:?}");
        assert!(read.to_string().contains("committed"), "{read}");
    }
    let write = r.copy_from_host(GRANULE - 2, b"abc").unwrap_err();
    assert!(matches!(write, MemError::InvalidArgument(_)), "{write:?}");
    // Committed further, the same range is in bounds.
    r.commit(2 * GRANULE as u64).unwrap();
    r.copy_from_host(GRANULE - 2, b"xyz").unwrap();
    assert_eq!(r.read_to_vec(GRANULE - 2, 3).unwrap(), b"xyz");
}
