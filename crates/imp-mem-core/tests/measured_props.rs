//! The measured activation pool (T4a grown in chunks, then frozen), over the
//! fake backend with growth.
//!
//! * While measuring: every live block lies in committed memory (its marker
//!   is written through the fake, which refuses an uncommitted byte); the
//!   commit is whole chunks, never past the reservation nor the backend's
//!   budget, and only as far as the highest end a block reached (rounded up
//!   to a chunk): no chunk is committed that no block needed.
//! * The freeze keeps the high-water (the frozen size is `high_water +
//!   margin` rounded up to a chunk, at most the reservation), decommits the
//!   rest (the backend's committed bytes for the tier are exactly that size,
//!   rounded up to the granularity), moves no live block (every address and
//!   marker intact) and commits nothing after: later requests are served
//!   inside the frozen size or refused.
//! * A reset of the high-water brings it down to the highest live end; the
//!   freeze after it decommits the chunks only the earlier peak needed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::Arc;

use imp_mem_core::activations::{ActivationConfig, ActivationPool, NoStreams};
use imp_mem_core::{FakeBackend, FakeConfig, MemError, PhaseMode, Tag};
use proptest::prelude::*;

const GRANULE: u64 = 4096;
const CHUNK: u64 = 4 * GRANULE;
const RESERVE: u64 = 64 * CHUNK;

#[derive(Debug, Clone)]
enum Op {
    Alloc { bytes: u64, stream: u64 },
    Free { pick: usize },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (1u64..=3 * CHUNK, 1u64..=2).prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => Just(Op::Reset),
    ]
}

struct Live {
    addr: usize,
    bytes: u64,
    marker: u8,
}

fn fill(fb: &FakeBackend, l: &Live) {
    fb.write(l.addr, &vec![l.marker; l.bytes as usize])
        .expect("a live block lies in committed memory");
}

fn intact(fb: &FakeBackend, l: &Live) -> Result<(), TestCaseError> {
    let bytes = fb.read(l.addr, l.bytes as usize).unwrap();
    prop_assert!(
        bytes.iter().all(|&b| b == l.marker),
        "block at {:#x} changed",
        l.addr
    );
    Ok(())
}

fn committed(fb: &FakeBackend) -> u64 {
    fb.stats()
        .tags
        .get(&Tag::Activations)
        .map_or(0, |t| t.committed)
}

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn growth_then_freeze_keeps_the_high_water_and_moves_nothing(
        ops in prop::collection::vec(op(), 1..80),
        after in prop::collection::vec(op(), 0..30),
        margin in 0u64..=6 * CHUNK,
        budget_chunks in 8u64..=80,
    ) {
        let budget = budget_chunks * CHUNK;
        let fb = FakeBackend::new(FakeConfig {
            capacity: 1 << 30,
            budget: Some(budget),
            granularity: GRANULE as usize,
            mode: PhaseMode::Strict,
            ..FakeConfig::default()
        })
        .unwrap();
        let mut config = ActivationConfig::new(RESERVE);
        config.measure_chunk = Some(CHUNK);
        config.strict = Some(true);
        let pool = ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap();
        prop_assert!(pool.measuring());
        prop_assert_eq!(committed(&fb), 0);
        let mut live: Vec<Live> = Vec::new();
        let mut marker = 0u8;
        // The most the high-water has been (a reset lowers the figure, never
        // the commit).
        let mut ever = 0u64;
        for op in &ops {
            match *op {
                Op::Alloc { bytes, stream } => match pool.allocate(bytes, stream) {
                    Ok(addr) => {
                        marker = marker.wrapping_add(1).max(1);
                        let l = Live { addr, bytes, marker };
                        fill(&fb, &l);
                        live.push(l);
                    }
                    Err(MemError::OutOfMemory(_)) => {
                        // Refused only when no free block fits, or the
                        // chunks up to a fitting block's end (it starts at
                        // the high-water at most) pass the budget.
                        let c = committed(&fb);
                        let need = round_up(bytes, 512);
                        prop_assert!(
                            pool.stats().largest_free < need
                                || round_up(pool.high_water() + need, CHUNK) > budget,
                            "refused {bytes} B with {c} committed of budget {budget}"
                        );
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                },
                Op::Free { pick } => {
                    if !live.is_empty() {
                        let l = live.swap_remove(pick % live.len());
                        intact(&fb, &l)?;
                        pool.free(l.addr, 1).unwrap();
                    }
                }
                Op::Reset => {
                    pool.reset_high_water();
                    let top = live.iter().map(|l| (l.addr - pool.base()) as u64 + round_up(l.bytes, 512)).max();
                    prop_assert_eq!(pool.high_water(), top.unwrap_or(0));
                }
            }
            ever = ever.max(pool.high_water());
            pool.check_invariants().unwrap();
            let c = committed(&fb);
            prop_assert!(c <= budget && c <= RESERVE, "committed {c} past budget {budget}");
            prop_assert_eq!(c % CHUNK, 0);
            // Only the chunks a block reached.
            prop_assert_eq!(c, round_up(ever, CHUNK).min(RESERVE));
        }
        let high_water = pool.high_water();
        let end = |l: &Live| (l.addr - pool.base()) as u64 + round_up(l.bytes, 512);
        prop_assert!(live.iter().all(|l| end(l) <= high_water));
        let before = committed(&fb);
        let addrs: Vec<usize> = live.iter().map(|l| l.addr).collect();
        match pool.freeze(margin) {
            Ok(frozen) => {
                let size = round_up(high_water + margin, CHUNK).clamp(CHUNK, RESERVE);
                prop_assert_eq!(frozen.high_water, high_water);
                prop_assert_eq!(frozen.size, size);
                prop_assert_eq!(frozen.committed_before, before);
                prop_assert_eq!(frozen.decommitted, before.saturating_sub(size));
                prop_assert_eq!(pool.capacity(), size);
                prop_assert_eq!(committed(&fb), size);
                prop_assert!(!pool.measuring());
            }
            Err(MemError::OutOfMemory(_)) | Err(MemError::Capacity(_)) => {
                // The margin did not fit the budget: still measuring, as it was.
                prop_assert!(round_up(high_water + margin, CHUNK).clamp(CHUNK, RESERVE) > budget);
                prop_assert!(pool.measuring());
                prop_assert_eq!(committed(&fb), before);
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
        }
        pool.check_invariants().unwrap();
        prop_assert_eq!(live.iter().map(|l| l.addr).collect::<Vec<_>>(), addrs);
        for l in &live {
            intact(&fb, l)?;
        }
        // Frozen: served inside the size or refused; nothing more committed.
        let size = pool.capacity();
        for op in &after {
            match *op {
                Op::Alloc { bytes, stream } => match pool.allocate(bytes, stream) {
                    Ok(addr) => {
                        prop_assert!((addr - pool.base()) as u64 + bytes <= size);
                        marker = marker.wrapping_add(1).max(1);
                        let l = Live { addr, bytes, marker };
                        fill(&fb, &l);
                        live.push(l);
                    }
                    Err(MemError::OutOfMemory(_)) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                },
                Op::Free { pick } => {
                    if !live.is_empty() {
                        let l = live.swap_remove(pick % live.len());
                        intact(&fb, &l)?;
                        pool.free(l.addr, 1).unwrap();
                    }
                }
                Op::Reset => {
                    // A no-op once frozen.
                    let before = pool.high_water();
                    pool.reset_high_water();
                    prop_assert_eq!(pool.high_water(), before);
                    prop_assert!(before <= size);
                }
            }
            prop_assert_eq!(committed(&fb), size);
            pool.check_invariants().unwrap();
        }
        prop_assert!(pool.freeze(0).is_err());
    }
}

#[test]
fn a_fixed_pool_does_not_freeze_and_a_fixed_backend_cannot_measure() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool =
        ActivationPool::new(&fb, &ActivationConfig::new(RESERVE), Arc::new(NoStreams)).unwrap();
    assert!(!pool.measuring());
    let err = pool.freeze(0).unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
    assert!(!err.to_string().contains("  "), "{err}");
    let mut config = ActivationConfig::new(RESERVE);
    config.measure_chunk = Some(0);
    let err = ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("measure_chunk") && !err.to_string().contains("  "));
}

#[test]
fn an_idle_measured_pool_freezes_at_one_chunk_plus_the_margin() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut config = ActivationConfig::new(RESERVE);
    config.measure_chunk = Some(CHUNK);
    let pool = ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap();
    let a = pool.allocate(CHUNK + 1, 0).unwrap();
    assert_eq!(committed(&fb), 2 * CHUNK);
    pool.free(a, 0).unwrap();
    let f = pool.freeze(CHUNK).unwrap();
    assert_eq!(f.high_water, CHUNK + 512);
    assert_eq!(f.size, 3 * CHUNK);
    assert_eq!(committed(&fb), 3 * CHUNK);
    assert!(pool.allocate(3 * CHUNK, 0).is_ok());
    assert!(matches!(pool.allocate(1, 0), Err(MemError::OutOfMemory(_))));
}

#[derive(Debug, Clone)]
enum Step {
    Alloc { bytes: u64, stream: u64 },
    Free { pick: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (1u64..=3 * CHUNK).prop_map(|bytes| Step::Alloc { bytes, stream: 1 }),
        4 => any::<usize>().prop_map(|pick| Step::Free { pick }),
    ]
}

/// Runs `steps` on `pool`: each allocation's offset, or None where refused.
fn replay(pool: &ActivationPool, steps: &[Step]) -> Vec<Option<u64>> {
    let mut live: Vec<(usize, u64)> = Vec::new();
    let mut out = Vec::new();
    for s in steps {
        match *s {
            Step::Alloc { bytes, stream } => match pool.allocate(bytes, stream) {
                Ok(addr) => {
                    out.push(Some((addr - pool.base()) as u64));
                    live.push((addr, stream));
                }
                Err(MemError::OutOfMemory(_)) => out.push(None),
                Err(e) => panic!("{e}"),
            },
            Step::Free { pick } => {
                if !live.is_empty() {
                    let (addr, stream) = live.swap_remove(pick % live.len());
                    pool.free(addr, stream).unwrap();
                }
            }
        }
        pool.check_invariants().unwrap();
    }
    out
}

fn strict_fake() -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity: 1 << 30,
        granularity: GRANULE as usize,
        mode: PhaseMode::Strict,
        ..FakeConfig::default()
    })
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// The size a measuring pool records is enough for the same work in a
    /// pool of that fixed size (a second start plans the tier at it): the
    /// fixed pool places every block where the measuring one did. Its top
    /// block is small where the measuring pool's is its whole reservation;
    /// listed by its size it won searches over larger holes, and the work
    /// reached past the measured size (an H200 generate() fell back). One
    /// stream, as torch's forward pass runs: with two, the order in which
    /// the streams' lanes are searched can still part the two pools.
    #[test]
    fn a_pool_of_the_measured_size_replays_the_work_in_place(
        steps in prop::collection::vec(step(), 1..150),
    ) {
        let fb = strict_fake();
        let mut config = ActivationConfig::new(RESERVE);
        config.measure_chunk = Some(CHUNK);
        config.strict = Some(true);
        let measuring = ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap();
        let first = replay(&measuring, &steps);
        let size = measuring.high_water().max(512);
        let fixed_fb = strict_fake();
        let mut fixed_config = ActivationConfig::new(size);
        fixed_config.strict = Some(true);
        let fixed = ActivationPool::new(&fixed_fb, &fixed_config, Arc::new(NoStreams)).unwrap();
        prop_assert!(!fixed.measuring());
        prop_assert_eq!(replay(&fixed, &steps), first);
    }
}
