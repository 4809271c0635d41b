//! Planned passes (`activations/plan.rs`): a pass recorded, laid out and
//! replayed by hints. The same pass again follows the layout to the block
//! and needs no more than its top; any other work beside the hints (extra
//! blocks, missing ones, another stream) leaves a consistent pool, since a
//! hint only ever chooses among the free ranges the ordinary search could.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use imp_mem_core::activations::{
    ActivationConfig, ActivationPool, FakeStreamOrder, NoStreams, StreamOrder,
};
use imp_mem_core::{FakeBackend, MemError};

mod common;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone, Copy)]
enum Op {
    Alloc(usize, u64),
    Free(usize),
}

fn fake() -> FakeBackend {
    common::fake_gpu_sized()
}

fn measuring(fb: &FakeBackend, order: Arc<dyn StreamOrder>) -> ActivationPool {
    let mut config = ActivationConfig::new(32 << 30);
    config.measure_chunk = Some(2 * MIB);
    config.strict = Some(true);
    ActivationPool::new(fb, &config, order).unwrap()
}

/// Runs `ops` on `pool` (stream 0); every block is freed by the end.
fn run(pool: &ActivationPool, ops: &[Op]) -> Result<(), MemError> {
    let mut live = HashMap::new();
    for &op in ops {
        match op {
            Op::Alloc(id, bytes) => {
                live.insert(id, pool.allocate(bytes, 0)?);
            }
            Op::Free(id) => {
                pool.free(live.remove(&id).unwrap(), 0)?;
            }
        }
    }
    for (_, addr) in live {
        pool.free(addr, 0)?;
    }
    Ok(())
}

/// A pass shaped like a compiled generate() with a static cache: each
/// layer makes its cache block (alive to the end) between two larger
/// temporaries, then the decode steps make logits larger than any of them.
fn static_cache_pass(layers: usize, steps: usize) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut id = 0;
    let mut next = || {
        id += 1;
        id
    };
    let mut caches = Vec::new();
    for _ in 0..layers {
        let a = next();
        ops.push(Op::Alloc(a, 64 * MIB));
        let c = next();
        ops.push(Op::Alloc(c, 68 * MIB));
        caches.push(c);
        let b = next();
        ops.push(Op::Alloc(b, 128 * MIB));
        ops.push(Op::Free(a));
        ops.push(Op::Free(b));
    }
    let t = next();
    ops.push(Op::Alloc(t, 192 * MIB));
    ops.push(Op::Free(t));
    for _ in 0..steps {
        let l = next();
        ops.push(Op::Alloc(l, 136 * MIB));
        let s = next();
        ops.push(Op::Alloc(s, MIB / 2));
        ops.push(Op::Free(l));
        ops.push(Op::Free(s));
    }
    for c in caches {
        ops.push(Op::Free(c));
    }
    ops
}

#[test]
fn a_static_cache_pass_planned_needs_its_live_peak_and_replays_on_its_hints() {
    let fb = fake();
    let pool = measuring(&fb, Arc::new(NoStreams));
    let weights = pool.allocate(1200 * MIB, 0).unwrap();
    let pass = static_cache_pass(28, 16);
    run(&pool, &pass).unwrap();
    pool.reset_high_water();
    pool.record_pass();
    run(&pool, &pass).unwrap();
    let plan = pool.plan_pass().unwrap();
    let n = pass.iter().filter(|o| matches!(o, Op::Alloc(..))).count() as u64;
    assert_eq!((plan.allocations, plan.hinted), (n, n));
    assert!(plan.installed);
    assert!(plan.top >= plan.live_peak);
    assert!(
        plan.top < plan.recorded_high_water,
        "layout {} B not under the ordinary search's {} B",
        plan.top,
        plan.recorded_high_water
    );
    assert!(
        plan.top as f64 <= plan.live_peak as f64 * 1.005,
        "layout {} B over a live peak of {} B",
        plan.top,
        plan.live_peak
    );
    assert_eq!(pool.high_water(), plan.top);
    let frozen = pool.freeze(0).unwrap();
    assert_eq!(frozen.size, plan.top.div_ceil(2 * MIB) * 2 * MIB);
    for round in 1..=3 {
        run(&pool, &pass).unwrap();
        let hints = pool.pass_hints().unwrap();
        assert_eq!(hints.hits, n * round, "round {round}: {hints:?}");
        assert_eq!((hints.misses, hints.refused), (0, 0));
        pool.check_invariants().unwrap();
    }
    let s = pool.stats();
    assert_eq!((s.fallbacks_total, s.ooms), (0, 0));
    pool.free(weights, 0).unwrap();
}

#[test]
fn a_plan_is_refused_without_a_recording_and_dropped_on_request() {
    let fb = fake();
    let pool = measuring(&fb, Arc::new(NoStreams));
    assert!(matches!(
        pool.plan_pass(),
        Err(MemError::InvalidArgument(_))
    ));
    pool.record_pass();
    assert!(pool.recording());
    run(&pool, &static_cache_pass(4, 2)).unwrap();
    let plan = pool.plan_pass().unwrap();
    assert!(!pool.recording());
    assert_eq!(plan.installed, pool.pass_hints().is_some());
    pool.drop_pass_plan();
    assert!(pool.pass_hints().is_none());
    assert!(matches!(
        pool.plan_pass(),
        Err(MemError::InvalidArgument(_))
    ));
}

/// A random pass: allocations of 1-64 KiB-ish sizes, each freed a few ops
/// later or at the end.
fn pass_strategy() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec((1u64..=96, 0usize..24, prop::bool::weighted(0.15)), 1..120).prop_map(
        |spec| {
            let mut ops = Vec::new();
            let mut pending: Vec<(usize, usize)> = Vec::new();
            for (i, &(units, after, long)) in spec.iter().enumerate() {
                ops.push(Op::Alloc(i, units * 512 - (i as u64 % 7)));
                if !long {
                    pending.push((i + after, i));
                }
                pending.sort_unstable();
                while let Some(&(due, id)) = pending.first() {
                    if due > i {
                        break;
                    }
                    ops.push(Op::Free(id));
                    pending.remove(0);
                }
            }
            for (_, id) in pending {
                ops.push(Op::Free(id));
            }
            ops
        },
    )
}

/// Work beside a pass: the pass's ops with some allocations (and their
/// frees) left out, extra blocks made and freed, some on stream 1.
#[derive(Debug, Clone)]
struct Noise {
    skip: Vec<bool>,
    extra: Vec<(usize, u64, bool)>,
}

fn noise_strategy() -> impl Strategy<Value = Noise> {
    (
        prop::collection::vec(prop::bool::weighted(0.1), 120),
        prop::collection::vec((0usize..200, 1u64..=200_000, any::<bool>()), 0..12),
    )
        .prop_map(|(skip, extra)| Noise { skip, extra })
}

/// Runs `ops` with `noise` on `pool`, checking after every op that every
/// live block lies inside the pool or a fallback and overlaps no other.
fn run_noisy(pool: &ActivationPool, ops: &[Op], noise: &Noise) {
    let mut live: HashMap<usize, (usize, u64, u64)> = HashMap::new();
    let mut extra_live: Vec<(usize, u64, u64)> = Vec::new();
    let skipped = |id: usize| noise.skip.get(id % noise.skip.len()).copied() == Some(true);
    for (k, &op) in ops.iter().enumerate() {
        for &(at, bytes, other) in &noise.extra {
            if at == k {
                let stream = u64::from(other);
                if let Ok(addr) = pool.allocate(bytes, stream) {
                    extra_live.push((addr, bytes, stream));
                }
            }
        }
        if k % 5 == 4 {
            if let Some((addr, _, stream)) = extra_live.pop() {
                pool.free(addr, stream).unwrap();
            }
        }
        match op {
            Op::Alloc(id, bytes) if !skipped(id) => {
                if let Ok(addr) = pool.allocate(bytes, 0) {
                    live.insert(id, (addr, bytes, 0));
                }
            }
            Op::Free(id) if !skipped(id) => {
                if let Some((addr, _, stream)) = live.remove(&id) {
                    pool.free(addr, stream).unwrap();
                }
            }
            _ => {}
        }
        let mut spans: Vec<(usize, usize)> = live
            .values()
            .chain(extra_live.iter())
            .map(|&(a, b, _)| (a, a + b as usize))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "live blocks overlap: {w:?}");
        }
    }
    for (_, (addr, _, stream)) in live {
        pool.free(addr, stream).unwrap();
    }
    for (addr, _, stream) in extra_live {
        pool.free(addr, stream).unwrap();
    }
    pool.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The same pass again, on a frozen pool or a fixed one, follows its
    /// hints to the block (every allocation a hit) and stays inside the
    /// layout's top; the pool's invariants hold after each round.
    #[test]
    fn the_same_pass_follows_its_layout(pass in pass_strategy(), frozen in any::<bool>()) {
        let fb = fake();
        let pool = if frozen {
            measuring(&fb, Arc::new(NoStreams))
        } else {
            let mut config = ActivationConfig::new(64 * MIB);
            config.strict = Some(true);
            ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap()
        };
        let keep = pool.allocate(3000, 0).unwrap();
        pool.record_pass();
        run(&pool, &pass).unwrap();
        let plan = pool.plan_pass().unwrap();
        let n = pass.iter().filter(|o| matches!(o, Op::Alloc(..))).count() as u64;
        prop_assert_eq!(plan.allocations, n);
        prop_assert!(plan.top >= plan.live_peak);
        if frozen && plan.installed {
            pool.freeze(0).unwrap();
        }
        for round in 1..=2u64 {
            run(&pool, &pass).unwrap();
            pool.check_invariants().unwrap();
            if plan.installed {
                let h = pool.pass_hints().unwrap();
                prop_assert_eq!(h.hits, n * round, "{:?}", h);
                prop_assert!(pool.stats().allocated_peak <= plan.top);
            }
        }
        pool.free(keep, 0).unwrap();
        prop_assert_eq!(pool.stats().fallbacks_total, 0);
    }

    /// Other work beside the hints (blocks left out, extra ones, another
    /// stream's) never makes two live blocks overlap nor breaks the pool,
    /// and every block frees.
    #[test]
    fn work_beside_the_hints_keeps_the_pool_consistent(
        pass in pass_strategy(),
        noise in noise_strategy(),
    ) {
        let fb = fake();
        let mut config = ActivationConfig::new(64 * MIB);
        config.strict = Some(true);
        let order: Arc<dyn StreamOrder> = Arc::new(FakeStreamOrder::new());
        let pool = ActivationPool::new(&fb, &config, order).unwrap();
        pool.record_pass();
        run(&pool, &pass).unwrap();
        pool.plan_pass().unwrap();
        run_noisy(&pool, &pass, &noise);
        run_noisy(&pool, &pass, &noise);
        let s = pool.stats();
        prop_assert_eq!(s.live, 0);
        prop_assert_eq!(s.allocated, 0);
    }
}
