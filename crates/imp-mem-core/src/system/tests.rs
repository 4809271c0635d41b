//! MemorySystem on the fake backend: the open order in the journal, a clean
//! failure at every step, the attribution arithmetic, the metrics format,
//! V8 against a journal, and close.

use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::accounting::JournalOp;
use crate::error::MemError;
use crate::fake::{FakeBackend, FakeConfig};
use crate::phase::Phase;
use crate::phase::PhaseMode;
use crate::planner::{
    plan_memory, Features, KvPlan, KvPolicy, Limits, ModelShape, PlanInput, PoolPlan,
};

/// A small Llama-shaped model: 2 KiB of KV per token.
fn shape() -> ModelShape {
    ModelShape::from_hf_config(&json!({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))
    .unwrap()
}

pub(super) fn plan(budget: u64) -> MemoryPlan {
    let mut limits = Limits::new(4, 1024);
    limits.kv_policy = KvPolicy::Fit;
    plan_memory(&PlanInput {
        model: shape(),
        limits,
        features: Features::default(),
        tp: 1,
        budget,
        context_bytes: 8 * MIB,
        library_reserve_bytes: 4 * MIB,
    })
    .unwrap()
}

/// The plan plus an SWA pool, a state pool and an activation pool, so
/// every step exists.
pub(super) fn full_plan() -> MemoryPlan {
    let mut p = plan(256 * MIB);
    p.activations = 2 * MIB;
    p.swa = Some(KvPlan {
        window: Some(128),
        blocks: 40,
        target_blocks: 40,
        block_bytes: 16 * 1024,
        bytes: MIB,
        ..p.kv.clone()
    });
    p.pools = vec![PoolPlan {
        name: "linear/SSM state".into(),
        slots: 4,
        bytes_per_slot: 64 * 1024,
        bytes: MIB,
    }];
    p
}

pub(super) fn fake(capacity: u64, backed: bool) -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity,
        backed,
        ..FakeConfig::default()
    })
    .unwrap()
}

const ORDER: [Tag; 7] = [
    Tag::Workspace,
    Tag::Weights,
    Tag::SwaCache,
    Tag::State,
    Tag::Scratch,
    Tag::Activations,
    Tag::KvCache,
];

#[test]
fn tiers_open_in_the_seed_order_and_the_journal_shows_it() {
    let fb = fake(GIB_TEST, false);
    let p = full_plan();
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    let acquired: Vec<Tag> = fb
        .journal()
        .unwrap()
        .iter()
        .filter(|e| e.op == JournalOp::Acquire)
        .map(|e| e.tag)
        .collect();
    assert_eq!(acquired, ORDER);
    assert_eq!(
        system.tier_keys(),
        [
            "engine_persistent",
            "model_resident",
            "swa_pool",
            "state",
            "scratch",
            "activations",
            "kv_pool"
        ]
    );
    // The fake is growable: the KV pool reserves the plan and commits a part.
    let kv = system.kv_pool().unwrap().stats();
    assert_eq!(u64::from(kv.max_blocks), p.kv.blocks);
    assert!(kv.capacity < kv.max_blocks, "{kv:?}");
    assert!(u64::from(kv.capacity) >= p.kv.blocks_per_sequence);
    let tags = fb.stats().tags;
    assert!(tags[&Tag::KvCache].reserved >= p.kv.blocks * p.kv.block_bytes);
    assert!(tags[&Tag::KvCache].committed < tags[&Tag::KvCache].reserved);
    assert_eq!(tags[&Tag::Weights].committed, p.model_resident);
    assert_eq!(tags[&Tag::Workspace].committed, p.engine_persistent);
    assert_eq!(tags[&Tag::Scratch].committed, p.scratch);
    assert_eq!(tags[&Tag::Activations].committed, p.activations);
    let pool = system.activations().unwrap();
    assert_eq!(pool.capacity(), p.activations);
    let a = pool.allocate(MIB, 0).unwrap();
    let report = system.report(&ReportInput::default());
    let line = report
        .tiers
        .iter()
        .find(|t| t.key == "activations")
        .unwrap();
    assert_eq!(
        (line.tier, line.tag, line.in_use),
        ("T4a", "activations", MIB)
    );
    assert!(report
        .metrics()
        .contains("imp_mem_tier_live_bytes{tier=\"activations\"} 1048576"));
    pool.free(a, 0).unwrap();
    system.check().unwrap();
}

pub(super) const GIB_TEST: u64 = 1 << 30;

#[test]
fn a_failure_at_every_step_leaves_nothing_acquired() {
    let p = full_plan();
    for n in 1..=ORDER.len() as u64 {
        let fb = fake(GIB_TEST, true);
        let budget = fb.budget();
        fb.fail_nth(Some(n)).unwrap();
        let err = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap_err();
        assert_eq!(err.step, n as usize, "{err}");
        assert!(matches!(err.error, MemError::OutOfMemory(_)), "{err}");
        assert!(err.to_string().contains("released"), "{err}");
        assert_eq!(fb.live(), 0, "step {n}");
        assert_eq!(fb.device_used(), 0, "step {n}");
        assert_eq!(fb.budget(), budget, "the budget is restored");
        fb.check_invariants().unwrap();
        // What was opened before the failing step was acquired, then released.
        let journal = fb.journal().unwrap();
        let acquired = journal
            .iter()
            .filter(|e| e.op == JournalOp::Acquire)
            .count();
        assert_eq!(acquired, n as usize - 1);
    }
    // A growable T1's first commit failing is T1's step (the second)...
    let fb = fake(GIB_TEST, true);
    fb.fail_commits(1);
    let err = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap_err();
    assert_eq!(err.step, 2, "{err}");
    assert_eq!(fb.live(), 0);
    // ... and with a fixed T1, a growable KV pool's is the last step's.
    let fb = fake(GIB_TEST, true);
    fb.fail_commits(1);
    let options = SystemOptions {
        sleepable: Some(false),
        ..SystemOptions::default()
    };
    let err = MemorySystem::open(&fb, &p, options).unwrap_err();
    assert_eq!(err.step, ORDER.len());
    assert_eq!(fb.live(), 0);
}

#[test]
fn a_plan_larger_than_the_backend_is_refused_before_anything_is_acquired() {
    let fb = fake(32 * MIB, false);
    let err = MemorySystem::open(&fb, &plan(256 * MIB), SystemOptions::default()).unwrap_err();
    assert_eq!(err.step, 0);
    assert!(matches!(err.error, MemError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("plan with this backend"), "{err}");
    assert!(fb.journal().unwrap().is_empty());
    assert_eq!(fb.budget(), 32 * MIB);
}

#[test]
fn opening_while_serving_is_a_phase_violation() {
    let fb = fake(GIB_TEST, false);
    fb.begin_planning().unwrap();
    fb.begin_serving().unwrap();
    let err = MemorySystem::open(&fb, &plan(256 * MIB), SystemOptions::default()).unwrap_err();
    assert!(
        matches!(err.error, MemError::PhaseViolation { .. }),
        "{err}"
    );
    assert!(fb.journal().unwrap().is_empty());
}

#[test]
fn the_budget_becomes_the_plans_and_is_restored_on_close() {
    let fb = fake(GIB_TEST, false);
    let p = plan(256 * MIB);
    let mut system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    assert_eq!(fb.budget(), p.budget - p.context - p.library_reserve);
    // The cap binds: one byte past it is refused, though the device has room.
    let room = fb.budget() - fb.stats().total.committed;
    let err = fb.acquire(room + 1, 256, Tag::Other).unwrap_err();
    assert!(
        matches!(err, MemError::OutOfMemory(r) if !r.device_refused),
        "{err}"
    );
    let closed = system.close();
    assert!(closed.still_held.is_empty(), "{closed:?}");
    assert_eq!(fb.budget(), GIB_TEST);
    assert_eq!(fb.live(), 0);
    assert!(system.is_closed());
}

/// Serves a small workload and checks every tier stays within its plan.
fn serve(system: &MemorySystem) -> Vec<SharedBlockRefsHolder> {
    let weights = system.weights_arena().unwrap();
    let cap = weights.stats().capacity;
    weights.take(cap / 2, 256).unwrap();
    weights.take(cap / 4, 256).unwrap();
    system.engine_arena().unwrap().take(1 << 20, 256).unwrap();
    system.begin_serving().unwrap();
    let scratch = system.scratch().unwrap();
    let kv = system.kv_pool().unwrap();
    let mut held = Vec::new();
    for step in 0..4u32 {
        let mark = scratch.mark().unwrap();
        mark.take(4096 * (step as usize + 1), 256).unwrap();
        held.push(SharedBlockRefsHolder(
            kv.allocate_many(kv.stats().max_blocks / 5).unwrap(),
        ));
        mark.rewind().unwrap();
    }
    held
}

/// Keeps refs alive in the tests without naming the block-pool type twice.
struct SharedBlockRefsHolder(#[allow(dead_code)] crate::SharedBlockRefs);

#[test]
fn serving_grows_the_kv_pool_inside_the_plan_and_acquires_nothing() {
    let fb = FakeBackend::new(FakeConfig {
        capacity: GIB_TEST,
        backed: false,
        mode: PhaseMode::Strict,
        ..FakeConfig::default()
    })
    .unwrap();
    let p = plan(256 * MIB);
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    let acquisitions = fb.stats().total.acquisitions;
    let held = serve(&system);
    assert_eq!(fb.phase(), Phase::Serving);
    assert_eq!(fb.stats().total.acquisitions, acquisitions);
    let kv = system.kv_pool().unwrap().stats();
    assert!(kv.growths > 0, "{kv:?}");
    system.check().unwrap();
    // V8: replay the journal; no tier's tag ever exceeds what the plan gave it.
    let granule = fb.info().granularity as u64;
    let planned: BTreeMap<Tag, u64> = [
        (Tag::Workspace, p.engine_persistent),
        (Tag::Weights, p.model_resident),
        (Tag::Scratch, p.scratch),
        (Tag::KvCache, p.kv.bytes),
    ]
    .into_iter()
    .collect();
    let mut running: BTreeMap<Tag, i128> = BTreeMap::new();
    let mut total: i128 = 0;
    let mut most: i128 = 0;
    for e in fb.journal().unwrap() {
        let delta = e.op.sign() as i128 * e.bytes as i128;
        *running.entry(e.tag).or_insert(0) += delta;
        total += delta;
        most = most.max(total);
        let limit = planned[&e.tag].div_ceil(granule) * granule;
        assert!(running[&e.tag] <= limit as i128, "{e:?}");
        assert!(total <= (p.budget - p.context - p.library_reserve) as i128);
    }
    let report = system.report(&ReportInput::default());
    // The report names the granule rounding the open decided: the tiers'
    // plan plus it bounds what they ever committed.
    let tiers_planned: u64 = planned.values().sum();
    assert!(report.granule_rounding < granule * planned.len() as u64);
    assert!(most <= (tiers_planned + report.granule_rounding) as i128);
    assert!(most > tiers_planned as i128 - granule as i128);
    assert_eq!(report.steady_state_allocations_total, 0);
    assert_eq!(report.phase, "SERVING");
    drop(held);
}

#[test]
fn attribution_is_backend_committed_plus_charges_against_the_device() {
    let fb = fake(GIB_TEST, false);
    let p = plan(256 * MIB);
    let options = SystemOptions {
        context_bytes: Some(10 * MIB),
        library_reserve_bytes: Some(6 * MIB),
        ..SystemOptions::default()
    };
    let mut system = MemorySystem::open(&fb, &p, options).unwrap();
    // Something outside the tiers, through the backend: attributed by tag.
    let _other = fb.acquire(MIB, 256, Tag::Other).unwrap();
    let _held = serve(&system);
    system
        .set_charge("torch", "torch caching allocator", 3 * MIB)
        .unwrap();
    let committed = fb.stats().total.committed;
    let attributed = committed + 10 * MIB + 6 * MIB + 3 * MIB;
    // The device: ours, 2 MiB no one names, and 100 MiB of another process.
    let used = attributed + 2 * MIB + 100 * MIB;
    let input = ReportInput {
        device: Some(DeviceReading {
            free: GIB_TEST - used,
            total: GIB_TEST,
        }),
        other_processes: 100 * MIB,
        extra: vec![],
    };
    let r = system.report(&input);
    assert_eq!(r.backend_committed, committed);
    assert_eq!(r.attributed, attributed);
    assert_eq!(
        r.outside,
        vec![OutsideLine {
            tag: "other",
            committed: MIB
        }]
    );
    let d = r.device.as_ref().unwrap();
    assert_eq!(d.used, used);
    assert_eq!(d.own_used, attributed + 2 * MIB);
    assert_eq!(d.unattributed, 2 * MIB as i64);
    let expected = attributed as f64 * 100.0 / (attributed + 2 * MIB) as f64;
    assert!((d.attribution_pct - expected).abs() < 1e-9);
    assert!(d.meets_target);
    let keys: Vec<&str> = r.charges.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(keys, ["context", "library_reserve", "torch"]);
    assert!(r.charges.iter().all(|c| c.measured));
    // An unnamed 20 % breaks criterion 6, and the report says so.
    let big = ReportInput {
        device: Some(DeviceReading {
            free: GIB_TEST - attributed * 5 / 4,
            total: GIB_TEST,
        }),
        ..ReportInput::default()
    };
    let r = system.report(&big);
    assert!(!r.device.as_ref().unwrap().meets_target);
    assert!(r.text().contains("NOT met"), "{}", r.text());
    // The plan's per-tier figures are in the report, in open order.
    let keys: Vec<&str> = r.tiers.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(
        keys,
        ["engine_persistent", "model_resident", "scratch", "kv_pool"]
    );
    let t1 = &r.tiers[1];
    assert_eq!(
        (t1.tier, t1.tag, t1.planned, t1.committed),
        ("T1", "weights", p.model_resident, p.model_resident)
    );
    assert_eq!(t1.in_use, t1.high_water);
    let kv = r.tiers[3].blocks.unwrap();
    assert_eq!(kv.live, 4 * (kv.max_blocks / 5));
    assert_eq!(r.tiers[3].in_use, u64::from(kv.live) * kv.block_bytes);
}

#[test]
fn without_measured_charges_the_plans_are_reported_as_estimates() {
    let fb = fake(GIB_TEST, false);
    let p = plan(256 * MIB);
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    let r = system.report(&ReportInput::default());
    assert!(r.device.is_none());
    assert_eq!(r.charges[0].bytes, p.context);
    assert!(!r.charges[0].measured);
    // Estimates nobody measured or claimed are shown, not attributed.
    let estimated: u64 = r
        .charges
        .iter()
        .filter(|c| !c.measured)
        .map(|c| c.bytes)
        .sum();
    assert!(estimated > 0);
    assert_eq!(r.planned_unclaimed, estimated);
    assert_eq!(r.attributed, r.backend_committed);
    let text = r.text();
    for needle in [
        "model-resident arena",
        "KV pool (growable)",
        "CUDA context + driver (plan)",
        "no device reading",
        "steady-state allocations while serving: 0",
        "planned, not claimed (estimate)",
    ] {
        assert!(text.contains(needle), "{needle}\n{text}");
    }
    let json: serde_json::Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
    assert_eq!(json["tiers"][1]["key"], "model_resident");
    assert_eq!(json["plan_total"], p.total);
}

/// Parses one exposition: every line is `# HELP name text`, `# TYPE name
/// kind`, or `name{labels} value` of a declared family.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    let ident = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            && !s.starts_with(|c: char| c.is_ascii_digit())
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            assert!(ident(name) && !help.is_empty(), "{line}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(ident(name), "{line}");
            assert!(kind == "gauge" || kind == "counter", "{line}");
            assert_eq!(kind == "counter", name.ends_with("_total"), "{line}");
            assert!(
                families.insert(name.into(), kind.into()).is_none(),
                "{line}"
            );
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
            let name = match series.split_once('{') {
                Some((name, labels)) => {
                    let labels = labels.strip_suffix('}').unwrap();
                    let (key, v) = labels.split_once('=').unwrap();
                    assert!(key == "tier" || key == "tag", "{line}");
                    assert!(
                        v.starts_with('"') && v.ends_with('"') && v.len() > 2,
                        "{line}"
                    );
                    name
                }
                None => series,
            };
            assert!(families.contains_key(name), "undeclared: {line}");
            assert!(
                name.ends_with("_bytes")
                    || name.ends_with("_total")
                    || name.ends_with("_blocks")
                    || name.ends_with("_ratio"),
                "{line}"
            );
            assert!(
                samples.insert(series.to_string(), value).is_none(),
                "dup: {line}"
            );
        }
    }
    samples
}

#[test]
fn metrics_are_prometheus_text_from_one_snapshot() {
    let fb = fake(GIB_TEST, false);
    let p = full_plan();
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    let _held = serve(&system);
    let input = ReportInput {
        device: Some(DeviceReading {
            free: GIB_TEST / 2,
            total: GIB_TEST,
        }),
        ..ReportInput::default()
    };
    let report = system.report(&input);
    let m = parse_metrics(&report.metrics());
    let kv = system.kv_pool().unwrap().stats();
    assert_eq!(
        m["imp_mem_pool_live_blocks{tag=\"kv_cache\"}"],
        f64::from(kv.live)
    );
    assert_eq!(
        m["imp_mem_pool_free_blocks{tag=\"kv_cache\"}"],
        f64::from(kv.free)
    );
    assert_eq!(
        m["imp_mem_pool_capacity_blocks{tag=\"kv_cache\"}"],
        f64::from(kv.capacity)
    );
    assert_eq!(m["imp_mem_pool_capacity_blocks{tag=\"swa_cache\"}"], 40.0);
    assert_eq!(
        m["imp_mem_steady_state_allocations_total{tag=\"kv_cache\"}"],
        0.0
    );
    assert_eq!(m["imp_mem_budget_bytes"], fb.budget() as f64);
    assert_eq!(
        m["imp_mem_tier_committed_bytes{tier=\"model_resident\"}"],
        p.model_resident as f64
    );
    assert_eq!(
        m["imp_mem_tier_planned_bytes{tier=\"pooled\"}"],
        (p.kv.bytes + MIB + MIB) as f64
    );
    assert_eq!(
        m["imp_mem_live_bytes{tag=\"weights\"}"],
        p.model_resident as f64
    );
    assert_eq!(m["imp_mem_acquisitions_total{tag=\"kv_cache\"}"], 1.0);
    assert_eq!(m["imp_mem_attributed_bytes"], report.attributed as f64);
    let ratio = m["imp_mem_attribution_ratio"];
    assert!((ratio - report.attributed as f64 / (GIB_TEST / 2) as f64).abs() < 1e-9);
    // Every tag has its steady-state series, so criterion 3 reads as 0.
    for tag in Tag::ALL {
        assert!(m.contains_key(&format!(
            "imp_mem_steady_state_allocations_total{{tag=\"{tag}\"}}"
        )));
    }
}

#[test]
fn production_mode_counts_an_acquisition_while_serving() {
    let fb = FakeBackend::new(FakeConfig {
        capacity: GIB_TEST,
        backed: false,
        mode: PhaseMode::Production,
        ..FakeConfig::default()
    })
    .unwrap();
    let system = MemorySystem::open(&fb, &plan(256 * MIB), SystemOptions::default()).unwrap();
    system.begin_serving().unwrap();
    system.begin_serving().unwrap();
    let _late = fb.acquire(4096, 256, Tag::Workspace).unwrap();
    let r = system.report(&ReportInput::default());
    assert_eq!(r.steady_state_allocations_total, 1);
    let m = parse_metrics(&r.metrics());
    assert_eq!(
        m["imp_mem_steady_state_allocations_total{tag=\"workspace\"}"],
        1.0
    );
}

#[test]
fn a_fixed_kv_pool_commits_the_whole_plan_at_open() {
    let fb = fake(GIB_TEST, false);
    let p = plan(256 * MIB);
    let options = SystemOptions {
        kv_growable: Some(false),
        ..SystemOptions::default()
    };
    let system = MemorySystem::open(&fb, &p, options).unwrap();
    let kv = system.kv_pool().unwrap().stats();
    assert_eq!(u64::from(kv.capacity), p.kv.blocks);
    let t = fb.stats().tags[&Tag::KvCache];
    assert_eq!(t.committed, p.kv.blocks * p.kv.block_bytes);
    assert_eq!(t.reserved, t.committed);
}

#[test]
fn a_kv_pool_that_does_not_grow_sleeps_and_wakes_at_its_addresses_and_never_shrinks() {
    let fb = fake(GIB_TEST, true);
    let p = plan(256 * MIB);
    let options = SystemOptions {
        kv_growable: Some(false),
        ..SystemOptions::default()
    };
    let system = MemorySystem::open(&fb, &p, options).unwrap();
    let pool = system.kv_pool().unwrap();
    let before = pool.stats();
    assert_eq!(u64::from(before.capacity), p.kv.blocks);
    assert_eq!(before.max_blocks, before.capacity, "it does not grow");
    let base = pool.reservation().unwrap().addr();
    // Idle steps never shrink it: it is held in a growable region only to sleep.
    system.begin_serving().unwrap();
    for _ in 0..64 {
        system.step(crate::decommit::NothingInFlight).unwrap();
    }
    assert_eq!(pool.stats().committed_bytes, before.committed_bytes);
    let report = system.sleep(1, Some(&["kv_cache"]), None).unwrap();
    assert_eq!(report.released(), before.committed_bytes);
    assert_eq!(fb.stats().tags[&Tag::KvCache].committed, 0);
    assert!(pool.allocate().is_err(), "a sleeping pool refuses");
    system.wake(None).unwrap();
    assert_eq!(pool.reservation().unwrap().addr(), base);
    assert_eq!(pool.stats().committed_bytes, before.committed_bytes);
    let block = pool.allocate().unwrap();
    drop(block);
    // Without the option (a backend that cannot grow) it stays fixed.
    let plain = MemorySystem::open(
        &fake(GIB_TEST, true),
        &p,
        SystemOptions {
            kv_growable: Some(false),
            sleepable: Some(false),
            ..SystemOptions::default()
        },
    )
    .unwrap();
    assert!(plain.sleep(1, Some(&["kv_cache"]), None).is_err());
}

#[test]
fn close_reports_what_a_ref_still_holds_and_frees_it_when_dropped() {
    let fb = fake(GIB_TEST, true);
    let mut system = MemorySystem::open(&fb, &plan(256 * MIB), SystemOptions::default()).unwrap();
    let block = system.kv_pool().unwrap().allocate().unwrap();
    let closed = system.close();
    assert_eq!(closed.still_held.len(), 1);
    assert_eq!(closed.still_held[0].0, Tag::KvCache);
    assert!(closed.released > 0);
    assert!(system.kv_pool().is_none());
    assert!(system.begin_serving().is_err());
    drop(block);
    assert_eq!(fb.live(), 0);
    fb.check_invariants().unwrap();
    // A second close is harmless.
    assert_eq!(system.close(), CloseReport::default());
}

#[test]
fn dropping_the_system_releases_everything() {
    let fb = fake(GIB_TEST, true);
    let system = MemorySystem::open(&fb, &full_plan(), SystemOptions::default()).unwrap();
    assert!(fb.live() > 0);
    drop(system);
    assert_eq!(fb.live(), 0);
    assert_eq!(fb.budget(), GIB_TEST);
}

#[test]
fn a_kv_pool_grows_only_where_the_headroom_covers_the_granule_rounding() {
    // 96 blocks of 32 KiB = 3 MiB; a 2 MiB granule rounds the reservation
    // to 4 MiB, one more than the plan charged.
    let mut p = plan(256 * MIB);
    p.kv.blocks = 96;
    p.kv.bytes = 3 * MIB;
    let open = |headroom: u64| {
        let mut p = p.clone();
        p.budget = p.budget - p.headroom + headroom;
        p.headroom = headroom;
        let fb = FakeBackend::new(FakeConfig {
            capacity: GIB_TEST,
            backed: false,
            granularity: 2 << 20,
            ..FakeConfig::default()
        })
        .unwrap();
        let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
        let kv = system.kv_pool().unwrap();
        // Every planned block is reachable within the budget either way.
        let all = kv.allocate_many(96).unwrap();
        system.check().unwrap();
        let stats = kv.stats();
        drop(all);
        let rounding = system.report(&ReportInput::default()).granule_rounding;
        (
            stats.capacity,
            stats.growths,
            fb.stats().tags[&Tag::KvCache].reserved,
            rounding,
        )
    };
    let (capacity, growths, reserved, rounding) = open(0);
    assert_eq!(
        (capacity, growths, reserved, rounding),
        (96, 0, 3 * MIB, 0),
        "fixed: exact bytes"
    );
    let (capacity, growths, reserved, rounding) = open(MIB);
    assert_eq!(capacity, 96);
    assert!(growths > 0);
    assert_eq!(reserved, 4 * MIB, "growable: whole granules");
    // The report names the rounding the open took from the headroom.
    assert_eq!(rounding, MIB);
}

#[test]
fn a_kv_manager_serves_from_the_systems_kv_pool_and_the_report_attributes_it() {
    let fb = fake(GIB_TEST, true);
    let p = plan(256 * MIB);
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    let config = system.kv_config().unwrap();
    assert_eq!(config.block_size, p.kv.block_size as usize);
    assert_eq!(u64::from(config.num_blocks), p.kv.blocks);
    assert_eq!(config.dtype, p.kv.dtype.name());
    system.begin_serving().unwrap();
    let mut m = system.kv_manager(config).unwrap();
    let pool = system.kv_pool().unwrap();
    assert_eq!(m.pool().id(), pool.id());
    let bs = p.kv.block_size as usize;
    let per_seq = p.kv.blocks_per_sequence as usize;
    let prompt: Vec<u32> = (0..(per_seq * bs) as u32).collect();
    let initial = pool.stats().capacity;
    // More sequences than the pool committed at open: it grows, and the
    // blocks stay inside the region the system reserved.
    let mut admitted = 0u64;
    while m.can_admit(&prompt, &crate::kv::ExtraKeys::default()) && admitted < 6 {
        m.admit(admitted, &prompt, crate::kv::ExtraKeys::default())
            .unwrap();
        admitted += 1;
    }
    assert!(pool.stats().capacity > initial, "{:?}", pool.stats());
    // Every block sits at the pool's base + id * stride, below its maximum.
    let stride = p.kv.block_bytes as usize;
    let (first, _) = m.block_span(0, 0).unwrap().unwrap();
    let base = first - m.block_table(0).unwrap()[0] as usize * stride;
    for seq in 0..admitted {
        let table = m.block_table(seq).unwrap().to_vec();
        for (i, &id) in table.iter().enumerate() {
            let (addr, len) = m.block_span(seq, i).unwrap().unwrap();
            assert_eq!((addr, len), (base + id as usize * stride, stride));
            assert!((id as u64) < p.kv.blocks);
        }
    }
    assert!(fb.stats().tags[&Tag::KvCache].reserved >= p.kv.blocks * p.kv.block_bytes);
    // The report charges the manager's blocks to the KV pool's tier.
    let report = system.report(&ReportInput::default());
    let line = report.tiers.iter().find(|t| t.key == "kv_pool").unwrap();
    let live = u64::from(m.stats().live);
    assert_eq!(line.in_use, live * p.kv.block_bytes);
    assert_eq!(line.blocks.as_ref().unwrap().live, m.stats().live);
    assert_eq!(report.steady_state_allocations_total, 0);
    system.check().unwrap();
    m.check_invariants().unwrap();
    // A second request with the same prompt hits the cached prefix.
    for seq in 0..admitted {
        m.free(seq, None).unwrap();
    }
    let hit = m
        .admit(100, &prompt, crate::kv::ExtraKeys::default())
        .unwrap();
    assert_eq!(hit.cached_tokens, (per_seq - 1) * bs);
    m.abort(100).unwrap();
    drop(m);
}

#[test]
fn step_shrinks_the_kv_pool_once_the_manager_gives_its_blocks_back() {
    let fb = fake(GIB_TEST, true);
    let p = plan(256 * MIB);
    let options = SystemOptions {
        kv_initial_blocks: Some(32),
        kv_grow_blocks: Some(16),
        ..SystemOptions::default()
    };
    let system = MemorySystem::open(&fb, &p, options).unwrap();
    let pool = system.kv_pool().unwrap();
    assert_eq!(system.growable_pools().len(), 1);
    pool.set_decommit_policy(crate::decommit::DecommitPolicy {
        min_idle_steps: 3,
        keep_chunks: 0,
    });
    let mut m = system.kv_manager(system.kv_config().unwrap()).unwrap();
    let opened = pool.stats().capacity;
    let bs = p.kv.block_size as usize;
    let tokens = (p.kv.blocks as usize - 1) * bs;
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    m.admit(1, &prompt, crate::kv::ExtraKeys::default())
        .unwrap();
    assert!(pool.stats().capacity > opened);
    assert_eq!(system.step(crate::decommit::NothingInFlight).unwrap(), 0);
    // Freed into the prefix cache, the blocks are still live: no shrink.
    m.free(1, None).unwrap();
    for _ in 0..8 {
        assert_eq!(system.step(crate::decommit::NothingInFlight).unwrap(), 0);
    }
    assert_eq!(pool.stats().shrinks, 0);
    // Evicted, they are free: the hysteresis decides, and the tail goes.
    m.evict(u32::MAX);
    let mut freed = 0;
    for _ in 0..8 {
        freed += system.step(crate::decommit::NothingInFlight).unwrap();
    }
    let s = pool.stats();
    assert!(freed > 0 && s.shrinks == 1, "{s:?}");
    assert_eq!(s.capacity, opened);
    assert_eq!(m.stats().capacity, opened);
    // Admission still counts the room, and grows back into it.
    assert!(m.can_admit(&prompt, &crate::kv::ExtraKeys::default()));
    m.admit(2, &prompt, crate::kv::ExtraKeys::default())
        .unwrap();
    m.check_invariants().unwrap();
    system.check().unwrap();
    // A step behind a fence not yet complete leaves the decommit pending;
    // the system's flush waits for the fence and decommits.
    m.free(2, None).unwrap();
    m.evict(u32::MAX);
    let fence = std::sync::Arc::new(Latch::default());
    let mut freed = 0;
    for _ in 0..8 {
        freed += system.step(fence.clone()).unwrap();
    }
    assert_eq!(freed, 0);
    let pending = pool.stats().pending_blocks;
    assert!(pending > 0, "{:?}", pool.stats());
    assert!(!fence.0.load(std::sync::atomic::Ordering::SeqCst));
    let flushed = system.flush_decommit().unwrap();
    assert!(fence.0.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(flushed, u64::from(pending) * p.kv.block_bytes);
    assert_eq!(pool.stats().pending_blocks, 0);
    assert_eq!(system.flush_decommit().unwrap(), 0);
    drop(m);
}

/// A fence that completes when it is waited on.
#[derive(Default)]
struct Latch(std::sync::atomic::AtomicBool);

impl crate::decommit::FenceLike for Latch {
    fn is_complete(&self) -> Result<bool, MemError> {
        Ok(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }

    fn wait(&self) -> Result<(), MemError> {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn kv_manager_refuses_what_does_not_match_the_plan() {
    let fb = fake(GIB_TEST, false);
    let p = full_plan();
    let mut system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    let config = system.kv_config().unwrap();
    assert_eq!(config.swa_window, 128);
    let mut wrong = config.clone();
    wrong.block_size += 1;
    let err = system.kv_manager(wrong).unwrap_err();
    assert!(err.to_string().contains("plan's KV blocks"), "{err}");
    let mut no_window = config.clone();
    no_window.swa_window = 0;
    let err = system.kv_manager(no_window).unwrap_err();
    assert!(err.to_string().contains("SWA pool"), "{err}");
    let m = system.kv_manager(config).unwrap();
    assert_eq!(m.swa_pool().unwrap().id(), system.swa_pool().unwrap().id());
    assert_eq!(
        u64::from(m.config().swa_blocks),
        p.swa.as_ref().unwrap().blocks
    );
    drop(m);
    // A fixed pool is not stepped; a closed system refuses.
    assert!(system.kv_config().is_ok());
    system.close();
    assert!(system.kv_config().is_err());
    assert!(system.step(crate::decommit::NothingInFlight).is_err());
    assert!(system.flush_decommit().is_err());
}

fn charging(
    held: std::sync::Arc<std::sync::atomic::AtomicU64>,
    reading: Option<DeviceReading>,
    fail_reading: Option<crate::source::SourceError>,
) -> Backend {
    let config = FakeConfig {
        capacity: GIB_TEST,
        backed: false,
        ..FakeConfig::default()
    };
    // A fake that also reads a device and holds memory past its ledger, as
    // a VMM source does: a cache of `held` bytes and mappings rounded up to
    // whole MiB.
    let mut source = crate::test_source::TestSource::over(std::sync::Arc::new(
        crate::fake::FakeSource::new(&config),
    ));
    source.held = Some(held);
    source.reading = match fail_reading {
        Some(err) => Err(err),
        None => Ok(reading),
    };
    Backend::new(std::sync::Arc::new(source), PhaseMode::Strict, None).unwrap()
}

#[test]
fn the_fake_has_no_device_reading_and_no_charges_of_its_own() {
    let fb = fake(GIB_TEST, false);
    let system = MemorySystem::open(&fb, &plan(256 * MIB), SystemOptions::default()).unwrap();
    assert_eq!(fb.mem_info().unwrap(), None);
    assert!(fb.extra_charges().is_empty());
    let input = system.report_input(DeviceQuery::Backend, 0).unwrap();
    assert_eq!(input, ReportInput::default());
    // A reading passed in is the one used; `Skip` leaves the line out.
    let given = DeviceReading {
        free: GIB_TEST / 2,
        total: GIB_TEST,
    };
    let input = system
        .report_input(DeviceQuery::Given(given), 7 * MIB)
        .unwrap();
    assert_eq!(input.device, Some(given));
    assert_eq!(input.other_processes, 7 * MIB);
    let r = system.report(&input);
    assert_eq!(r.device.as_ref().unwrap().other_processes, 7 * MIB);
    assert_eq!(
        system.report_input(DeviceQuery::Skip, 0).unwrap().device,
        None
    );
}

#[test]
fn a_sources_reading_and_charges_are_in_the_report() {
    let reading = DeviceReading {
        free: GIB_TEST / 4,
        total: GIB_TEST,
    };
    let held = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(3 * MIB));
    let backend = charging(held.clone(), Some(reading), None);
    let p = plan(256 * MIB);
    let system = MemorySystem::open(&backend, &p, SystemOptions::default()).unwrap();
    // A fixed region of a size that is not whole MiB: the source maps more.
    let odd = backend.acquire(MIB + 4096, 256, Tag::Other).unwrap();
    let committed = backend.stats().total.committed;
    let rounding = committed.div_ceil(MIB) * MIB - committed;
    assert!(rounding > 0, "{committed}");
    let input = system.report_input(DeviceQuery::Backend, 0).unwrap();
    assert_eq!(input.device, Some(reading));
    assert_eq!(
        input.extra,
        vec![
            ("held".to_string(), "kept for reuse".to_string(), 3 * MIB),
            (
                "rounding".to_string(),
                "mapped past the ledger".to_string(),
                rounding
            ),
        ]
    );
    let r = system.report(&input);
    let before = r.charges.len() - 2;
    let line = &r.charges[before];
    assert_eq!((line.key.as_str(), line.bytes), ("held", 3 * MIB));
    assert!(line.measured && line.planned.is_none());
    assert_eq!(r.charges[before + 1].bytes, rounding);
    let named: u64 = r
        .charges
        .iter()
        .filter(|c| c.measured)
        .map(|c| c.bytes)
        .sum();
    assert_eq!(r.attributed, committed + named);
    assert!(named >= 3 * MIB + rounding);
    let d = r.device.as_ref().unwrap();
    assert_eq!((d.total, d.free), (GIB_TEST, GIB_TEST / 4));
    assert!(r.text().contains("kept for reuse"), "{}", r.text());
    // The figures are read at each report: the cache emptied, its line
    // (0 B) leaves the report, and the rounding follows the ledger.
    drop(odd);
    held.store(0, std::sync::atomic::Ordering::Relaxed);
    let committed = backend.stats().total.committed;
    let rounding = committed.div_ceil(MIB) * MIB - committed;
    let r = system.report(&system.report_input(DeviceQuery::Skip, 0).unwrap());
    assert!(r.device.is_none());
    let keys: Vec<&str> = r.charges.iter().map(|c| c.key.as_str()).collect();
    assert!(!keys.contains(&"held"), "{keys:?}");
    assert_eq!(keys.contains(&"rounding"), rounding > 0, "{keys:?}");
}

#[test]
fn a_failed_device_reading_is_the_sources_error() {
    let backend = charging(
        Default::default(),
        None,
        Some(crate::source::SourceError::Driver(
            "cuMemGetInfo failed".into(),
        )),
    );
    let system = MemorySystem::open(&backend, &plan(256 * MIB), SystemOptions::default()).unwrap();
    let err = system.report_input(DeviceQuery::Backend, 0).unwrap_err();
    assert!(
        matches!(&err, MemError::Driver(m) if m == "cuMemGetInfo failed"),
        "{err:?}"
    );
    // A caller's reading, or none, does not read the device.
    assert!(system.report_input(DeviceQuery::Skip, 0).is_ok());
    let unavailable = charging(
        Default::default(),
        None,
        Some(crate::source::SourceError::Unsupported("no device".into())),
    );
    assert!(matches!(
        unavailable.mem_info(),
        Err(MemError::BackendUnavailable(m)) if m == "no device"
    ));
    let oom = charging(
        Default::default(),
        None,
        Some(crate::source::SourceError::OutOfMemory),
    );
    assert!(matches!(oom.mem_info(), Err(MemError::Driver(_))));
}

#[test]
fn the_activation_pool_keeps_the_order_its_source_gives_unless_told_otherwise() {
    use std::sync::Arc;

    use crate::activations::{FakeStreamOrder, NoStreams};
    let over = |order: &FakeStreamOrder| {
        let config = FakeConfig {
            capacity: GIB_TEST,
            ..FakeConfig::default()
        };
        let mut source =
            crate::test_source::TestSource::over(Arc::new(crate::fake::FakeSource::new(&config)));
        source.order = Some(order.clone());
        Backend::new(Arc::new(source), PhaseMode::Strict, None).unwrap()
    };
    let cross_stream_reuse = |system: &MemorySystem| {
        let pool = system.activations().unwrap();
        let a = pool.allocate(pool.capacity(), 1).unwrap();
        pool.free(a, 1).unwrap();
        let b = pool.allocate(4096, 2).unwrap();
        pool.free(b, 2).unwrap();
    };
    // By default the system asks the source, once, at open.
    let order = FakeStreamOrder::new();
    let system = MemorySystem::open(&over(&order), &full_plan(), SystemOptions::default()).unwrap();
    assert!(system.options().activation_order.is_some());
    cross_stream_reuse(&system);
    assert_eq!(order.calls(), vec![(2, 1)]);
    // An order passed in is the one kept.
    let order = FakeStreamOrder::new();
    let options = SystemOptions {
        activation_order: Some(ActivationOrder(Arc::new(NoStreams))),
        ..SystemOptions::default()
    };
    let system = MemorySystem::open(&over(&order), &full_plan(), options).unwrap();
    cross_stream_reuse(&system);
    assert!(order.is_empty());
    // A plan with no activation pool asks nothing.
    let system = MemorySystem::open(&over(&order), &plan(256 * MIB), SystemOptions::default());
    assert_eq!(system.unwrap().options().activation_order, None);
}

#[test]
fn the_kv_host_tier_is_the_plans_unless_told_otherwise_and_its_sources() {
    let mut limits = Limits::new(4, 1024);
    limits.kv_policy = KvPolicy::Fit;
    let p = plan_memory(&PlanInput {
        model: shape(),
        limits,
        features: Features {
            kv_host_bytes: 4 * MIB,
            ..Features::default()
        },
        tp: 1,
        budget: 256 * MIB,
        context_bytes: 8 * MIB,
        library_reserve_bytes: 4 * MIB,
    })
    .unwrap();
    let planned = p.kv_host.as_ref().unwrap().blocks;
    assert!(planned > 0);
    let fb = fake(GIB_TEST, true);
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    assert_eq!(u64::from(system.planned_host_blocks()), planned);
    let host = |blocks: Option<u32>| {
        let config = system.kv_config().unwrap();
        let m = system.kv_manager_with_host_tier(config, blocks).unwrap();
        m.stats().host_capacity
    };
    assert_eq!(u64::from(host(None)), planned);
    assert_eq!(host(Some(3)), 3);
    assert_eq!(host(Some(0)), 0);
    // The plain system of the same plan has no host tier.
    assert_eq!(
        MemorySystem::open(
            &fake(GIB_TEST, true),
            &plan(256 * MIB),
            SystemOptions::default()
        )
        .unwrap()
        .planned_host_blocks(),
        0
    );
    // Over a source with no host tier, the plan's tier is refused.
    let config = FakeConfig {
        capacity: GIB_TEST,
        ..FakeConfig::default()
    };
    let plain = Backend::new(
        std::sync::Arc::new(crate::test_source::TestSource::over(std::sync::Arc::new(
            crate::fake::FakeSource::new(&config),
        ))),
        PhaseMode::Strict,
        None,
    )
    .unwrap();
    let system = MemorySystem::open(&plain, &p, SystemOptions::default()).unwrap();
    let err = system
        .kv_manager_with_host_tier(system.kv_config().unwrap(), None)
        .unwrap_err();
    assert!(err.to_string().contains("host_blocks="), "{err}");
    assert!(system
        .kv_manager_with_host_tier(system.kv_config().unwrap(), Some(0))
        .is_ok());
}

#[test]
fn a_measured_activation_tier_grows_then_freezes_at_begin_serving_with_no_kv_pool() {
    let mut limits = Limits::new(4, 1024);
    limits.kv_policy = KvPolicy::None;
    let plan = plan_memory(&PlanInput {
        model: shape(),
        limits,
        features: Features {
            activation_bytes: Some(64 * MIB),
            ..Features::default()
        },
        tp: 1,
        budget: 256 * MIB,
        context_bytes: 8 * MIB,
        library_reserve_bytes: 4 * MIB,
    })
    .unwrap();
    assert_eq!(plan.kv.blocks, 0);
    let fb = fake(1 << 30, true);
    let chunk = 2 * MIB;
    let options = SystemOptions {
        activation_measure: Some(chunk),
        activation_margin: 3 * MIB,
        activation_strict: Some(true),
        ..SystemOptions::default()
    };
    let sys = MemorySystem::open(&fb, &plan, options).unwrap();
    assert!(
        !sys.tier_keys().contains(&"kv_pool"),
        "{:?}",
        sys.tier_keys()
    );
    let act = sys.activations().unwrap();
    let committed = |sys: &MemorySystem| sys.backend().stats().tags[&Tag::Activations].committed;
    assert_eq!(committed(&sys), 0);
    sys.begin_planning().unwrap();
    // The warm-up: 5 MiB live at its peak, 1 MiB after.
    let a = act.allocate(4 * MIB, 0).unwrap();
    let b = act.allocate(MIB, 0).unwrap();
    assert_eq!(committed(&sys), 6 * MIB);
    act.free(a, 0).unwrap();
    let line = &sys.measured()[0];
    assert_eq!(
        (line.state, line.high_water, line.size),
        ("measuring", 5 * MIB, 64 * MIB)
    );
    sys.begin_serving().unwrap();
    let line = sys.measured()[0].clone();
    assert_eq!(line.state, "frozen");
    assert_eq!(
        (line.high_water, line.margin, line.size),
        (5 * MIB, 3 * MIB, 8 * MIB)
    );
    assert_eq!((committed(&sys), line.committed), (8 * MIB, 8 * MIB));
    // `b` did not move; serving takes what the frozen size holds, no more.
    assert_eq!(act.requested_size(b), Some(MIB));
    let c = act.allocate(4 * MIB, 0).unwrap();
    let d = act.allocate(3 * MIB, 0).unwrap();
    assert!(act.allocate(512, 0).is_err());
    assert_eq!(committed(&sys), 8 * MIB);
    let report = sys.report(&ReportInput::default());
    assert_eq!(report.measured, vec![line]);
    assert!(
        report.text().contains("measured tier activations: frozen"),
        "{}",
        report.text()
    );
    act.free(b, 0).unwrap();
    act.free(c, 0).unwrap();
    act.free(d, 0).unwrap();
    sys.check().unwrap();
}

#[test]
fn a_model_whose_every_layer_slides_serves_from_its_swa_pool() {
    // Mistral-7B-v0.1's shape in small: one window over every layer, so the
    // plan gives full attention no bytes (issue 55: "this system has no KV pool").
    let shape = ModelShape::from_hf_config(&json!({
        "model_type": "mistral", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "sliding_window": 128, "vocab_size": 1000, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))
    .unwrap();
    let p = plan_memory(&PlanInput {
        model: shape,
        limits: Limits::new(4, 1024),
        features: Features::default(),
        tp: 1,
        budget: 256 * MIB,
        context_bytes: 8 * MIB,
        library_reserve_bytes: 4 * MIB,
    })
    .unwrap();
    assert_eq!((p.kv.bytes_per_token, p.kv.blocks), (0, 0));
    let fb = fake(GIB_TEST, false);
    let system = MemorySystem::open(&fb, &p, SystemOptions::default()).unwrap();
    assert!(system.kv_pool().is_none() && system.swa_pool().is_some());
    let config = system.kv_config().unwrap();
    assert_eq!(config.swa_window, 128);
    assert_eq!(config.num_blocks as u64, p.kv.blocks_per_sequence * 4);
    let mut m = system.kv_manager(config).unwrap();
    let prompt: Vec<u32> = (0..1000).collect();
    m.admit(1, &prompt, crate::kv::ExtraKeys::default())
        .unwrap();
    assert!(system.swa_pool().unwrap().stats().live > 0);
    m.free(1, None).unwrap();
}
