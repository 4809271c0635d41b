//! The conformance suite's sequence check: a proptest that runs generated
//! sequences of operations ([`Op`], drawn by [`op`]) through a backend and
//! holds its books against a model after every step ([`check_sequence`]).

use proptest::prelude::*;

use super::{granule, growable, open, overlaps, replay, Open};
use crate::backend::Region;
use crate::error::MemError;
use crate::tag::Tag;
use crate::units::round_up;

/// One generated operation of [`check_sequence`]. Sizes are in 1/16 of a
/// granule so that one strategy fits every source.
#[derive(Debug, Clone)]
pub enum Op {
    /// A fixed region of `sixteenths / 16` granules (at least 1 B).
    Acquire {
        /// Size in 1/16 granule.
        sixteenths: u64,
        /// log2 of the alignment.
        align_log: u32,
        /// Index into [`Tag::ALL`].
        tag: usize,
    },
    /// A growable region of `granules` reserved, `initial` committed.
    AcquireGrowable {
        /// Reserved granules.
        granules: u64,
        /// Initially committed, in 1/16 granule.
        initial: u64,
    },
    /// Resize the growable region `live[seed % n]` to `sixteenths / 16`
    /// granules.
    Resize {
        /// Picks the region.
        seed: usize,
        /// New length in 1/16 granule.
        sixteenths: u64,
    },
    /// Release `live[seed % n]`.
    Release(usize),
    /// Something outside takes the device's memory until `percent` of its
    /// capacity is free beyond what the source holds (`None`: gives it back).
    Occupy(Option<u64>),
}

/// The operations [`check_sequence`] draws from.
pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..64, 0u32..17, 0usize..Tag::ALL.len())
            .prop_map(|(sixteenths, align_log, tag)| Op::Acquire { sixteenths, align_log, tag }),
        3 => (1u64..12, 0u64..64).prop_map(|(granules, initial)| Op::AcquireGrowable {
            granules,
            initial: initial.min(granules * 16),
        }),
        5 => (any::<usize>(), 0u64..200).prop_map(|(seed, sixteenths)| Op::Resize { seed, sixteenths }),
        3 => any::<usize>().prop_map(Op::Release),
        1 => prop_oneof![Just(None), (0u64..30).prop_map(Some)].prop_map(Op::Occupy),
    ]
}

fn oom(err: MemError, committed: u64, asked: u64, budget: u64) -> Result<(), TestCaseError> {
    match err {
        MemError::OutOfMemory(report) => {
            prop_assert_eq!(report.asked, asked);
            // The budget refuses exactly past the budget; the device may
            // refuse earlier (rounding, other users), never past it.
            prop_assert_eq!(!report.device_refused, committed + asked > budget);
            Ok(())
        }
        other => Err(TestCaseError::fail(format!(
            "expected OutOfMemory, got {other:?}"
        ))),
    }
}

/// The books over any sequence of operations: after every step the model's
/// live, committed and reserved bytes and counts equal the backend's stats,
/// the journal replays to live, the device holds at least what is
/// committed, bases never move, growable lengths are whole granules; a
/// refusal is typed, budget refusals happen exactly past the budget, and
/// a refused operation changes nothing. At the end everything returns to
/// the device.
pub fn check_sequence(
    o: Open<'_>,
    budget_granules: u64,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let probe = open(o, None);
    let g = granule(&probe);
    let capacity = probe.backend.info().capacity;
    drop(probe);
    let budget = (budget_granules * g).min(capacity);
    let s = open(o, Some(budget));
    let mut live: Vec<(Region, usize)> = Vec::new();
    let (mut acquisitions, mut releases) = (0u64, 0u64);
    let bytes = |sixteenths: u64| (sixteenths * g / 16).max(1);
    for op in ops {
        let committed: u64 = live.iter().map(|(r, _)| r.len() as u64).sum();
        let before = s.backend.stats().total;
        match op {
            Op::Acquire {
                sixteenths,
                align_log,
                tag,
            } => {
                let n = bytes(sixteenths);
                match s.backend.acquire(n, 1 << align_log, Tag::ALL[tag]) {
                    Ok(r) => {
                        prop_assert!(committed + n <= budget);
                        prop_assert_eq!(r.base() % (1usize << align_log), 0);
                        prop_assert_eq!(r.len() as u64, n);
                        acquisitions += 1;
                        let base = r.base();
                        live.push((r, base));
                    }
                    Err(e) => oom(e, committed, n, budget)?,
                }
            }
            Op::AcquireGrowable { granules, initial } => {
                let initial = initial * g / 16;
                let granularity = s.backend.info().granularity.max(1);
                let want = round_up(initial as usize, granularity).unwrap() as u64;
                match s
                    .backend
                    .acquire_growable(granules * g, initial, Tag::KvCache)
                {
                    Ok(r) => {
                        prop_assert!(committed + want <= budget);
                        prop_assert_eq!(r.len() as u64, want);
                        prop_assert_eq!(r.reserved() as u64, granules * g);
                        acquisitions += 1;
                        let base = r.base();
                        live.push((r, base));
                    }
                    // A source with no growable regions refuses them (past
                    // the budget check, which comes first).
                    Err(MemError::InvalidArgument(_)) if !growable(&s) => {}
                    Err(e) => oom(e, committed, want, budget)?,
                }
            }
            Op::Resize { seed, sixteenths } => {
                let growable: Vec<usize> = (0..live.len())
                    .filter(|&i| live[i].0.is_growable())
                    .collect();
                if growable.is_empty() {
                    continue;
                }
                let (r, _) = &mut live[growable[seed % growable.len()]];
                let len = r.len() as u64;
                let target = (sixteenths * g / 16).min(r.reserved() as u64);
                let want = round_up(target as usize, g as usize).unwrap() as u64;
                if want > len {
                    match r.commit(target) {
                        Ok(()) => prop_assert_eq!(r.len() as u64, want),
                        Err(e) => {
                            prop_assert_eq!(
                                r.len() as u64,
                                len,
                                "a refused commit changed the length"
                            );
                            oom(e, committed, want - len, budget)?;
                        }
                    }
                } else {
                    r.decommit(target)
                        .map_err(|e| TestCaseError::fail(format!("decommit: {e}")))?;
                    prop_assert_eq!(r.len() as u64, want.min(len));
                }
                prop_assert_eq!(r.len() as u64 % g, 0);
            }
            Op::Release(seed) => {
                if live.is_empty() {
                    continue;
                }
                let (r, _) = live.swap_remove(seed % live.len());
                s.backend
                    .release(r)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                releases += 1;
            }
            Op::Occupy(percent) => s.probe.leave_free(percent.map(|p| capacity * p / 100)),
        }
        // The model against the books.
        let stats = s.backend.stats();
        let committed: u64 = live.iter().map(|(r, _)| r.len() as u64).sum();
        let reserved: u64 = live.iter().map(|(r, _)| r.reserved() as u64).sum();
        for (r, base) in &live {
            prop_assert_eq!(r.base(), *base, "V9: a base moved");
        }
        prop_assert!(
            !overlaps(&live.iter().map(|(r, _)| r).collect::<Vec<_>>()),
            "live regions overlap"
        );
        prop_assert_eq!(stats.total.live, committed);
        prop_assert_eq!(stats.total.committed, committed);
        prop_assert_eq!(stats.total.reserved, reserved);
        prop_assert_eq!(stats.total.acquisitions, acquisitions);
        prop_assert_eq!(stats.total.releases, releases);
        prop_assert!(stats.total.peak >= before.peak.max(committed));
        prop_assert!(committed <= budget);
        prop_assert_eq!(replay(&s.backend), committed as i128, "journal vs live");
        prop_assert!(
            s.probe.physical() >= committed,
            "the device holds less than is committed"
        );
        s.backend
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    s.probe.leave_free(None);
    live.clear();
    let stats = s.backend.stats();
    prop_assert_eq!(stats.total.live, 0);
    prop_assert_eq!(stats.total.reserved, 0);
    prop_assert_eq!(stats.total.acquisitions, stats.total.releases);
    s.probe.settle();
    prop_assert_eq!(
        s.probe.physical(),
        0,
        "released memory went back to the device"
    );
    Ok(())
}
