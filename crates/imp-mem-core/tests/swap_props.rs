//! Model swap and sleep / wake as a proptest state machine on the fake
//! backend (issue 19): serve / swap / sleep / wake / admit / free / write /
//! export, with faults injected into swaps. After every operation:
//!
//! * T2's address and bytes are what they were (no swap or sleep touches T2);
//! * V1 (the journal replays to the ledger) and V4 (every pool's counters)
//!   hold, through `MemorySystem::check`, and the fake device's used bytes
//!   are exactly what the backend has committed (nothing leaked);
//! * while asleep every sleeping tier refuses use with `MemError::Asleep`
//!   (T1 takes and spans, KV admissions, acquisitions for the tags);
//! * after sleep(1) + wake, T1's bytes are what was written and every base is
//!   the same; the fake poisons decommitted memory, so the bytes really came
//!   back from the host copy (after sleep(2) they read as poison);
//! * a swap with a fault injected either fails with the old model serving —
//!   plan, tiers and T1's bytes unchanged — or, where it had to reset T1
//!   first, says so and restores the old layout.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::Arc;

use imp_mem_core::fake::POISON;
use imp_mem_core::planner::{
    plan_memory, Features, KvPolicy, Limits, MemoryPlan, ModelShape, PlanInput,
};
use imp_mem_core::system::{MemorySystem, SystemOptions};
use imp_mem_core::{
    ArenaExport, ArenaSpan, ExtraKeys, FakeBackend, FakeConfig, FakePinnedHost, KVCacheManager,
    MemError, PinnedHost, Tag,
};
use proptest::prelude::*;
use serde_json::json;

const MIB: u64 = 1 << 20;
const BUDGET: u64 = 96 * MIB;

fn shape(layers: u32, hidden: u32) -> ModelShape {
    ModelShape::from_hf_config(&json!({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))
    .unwrap()
}

/// Three models with one budget, T2, context and library reserve, and
/// different T1 sizes and KV geometries.
fn plans() -> Vec<MemoryPlan> {
    [(4, 256), (8, 512), (2, 256)]
        .iter()
        .map(|&(layers, hidden)| {
            let mut limits = Limits::new(4, 1024);
            limits.kv_policy = KvPolicy::Fit;
            let features = Features {
                engine_persistent_bytes: Some(4 * MIB),
                scratch_bytes: Some(2 * MIB),
                ..Features::default()
            };
            plan_memory(&PlanInput {
                model: shape(layers, hidden),
                limits,
                features,
                tp: 1,
                budget: BUDGET,
                context_bytes: 8 * MIB,
                library_reserve_bytes: 4 * MIB,
            })
            .unwrap()
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Admit(usize),
    Free(usize),
    Evict,
    DropManager,
    WriteT1(usize),
    Export,
    DropExports,
    Sleep(u8),
    Wake,
    Swap(usize, Fault),
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    None,
    Commit,
    Acquisition(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..80).prop_map(Op::Admit),
        3 => any::<usize>().prop_map(Op::Free),
        2 => Just(Op::Evict),
        2 => Just(Op::DropManager),
        4 => (1usize..5000).prop_map(Op::WriteT1),
        1 => Just(Op::Export),
        1 => Just(Op::DropExports),
        3 => (1u8..=2).prop_map(Op::Sleep),
        3 => Just(Op::Wake),
        3 => (0usize..3, prop_oneof![
            3 => Just(Fault::None),
            1 => Just(Fault::Commit),
            1 => (1u64..4).prop_map(Fault::Acquisition),
        ]).prop_map(|(p, f)| Op::Swap(p, f)),
    ]
}

struct Harness {
    fb: FakeBackend,
    host: PinnedHost,
    plans: Vec<MemoryPlan>,
    current: usize,
    system: MemorySystem,
    manager: Option<KVCacheManager>,
    seqs: Vec<u64>,
    next_seq: u64,
    /// T1 takes of this generation and the bytes written there.
    t1: Vec<(ArenaSpan, Vec<u8>)>,
    exports: Vec<ArenaExport>,
    t2: (ArenaSpan, usize, Vec<u8>),
    /// The sleep level, and each tier's base before it slept.
    asleep: Option<(u8, Vec<(String, usize)>)>,
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let b = ((seed * 31 + i * 7) % 251) as u8;
            if b == POISON {
                1
            } else {
                b
            }
        })
        .collect()
}

impl Harness {
    fn new() -> Self {
        let fb = FakeBackend::new(FakeConfig {
            capacity: 256 * MIB,
            granularity: 64 * 1024,
            ..FakeConfig::default()
        })
        .unwrap();
        let plans = plans();
        let system = MemorySystem::open(&fb, &plans[0], SystemOptions::default()).unwrap();
        let t2 = system.engine_arena().unwrap();
        let ticket = t2.take(4096, 256).unwrap();
        let addr = t2.span(&ticket).unwrap().addr();
        let bytes = pattern(99, 4096);
        fb.write(addr, &bytes).unwrap();
        system.begin_serving().unwrap();
        Self {
            fb,
            host: PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30))),
            plans,
            current: 0,
            system,
            manager: None,
            seqs: Vec::new(),
            next_seq: 1,
            t1: Vec::new(),
            exports: Vec::new(),
            t2: (ticket, addr, bytes),
            asleep: None,
        }
    }

    fn bases(&self) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        if let Some(a) = self.system.weights_arena() {
            out.push(("model_resident".to_string(), a.base()));
        }
        if let Some(p) = self.system.kv_pool() {
            // The reservation's base (block 0's address). Not a block's
            // span: a live KV manager claims the pool, so its own API
            // allocates nothing.
            if let Ok(span) = p.reservation() {
                out.push(("kv_pool".to_string(), span.addr()));
            }
        }
        out
    }

    fn kv_live(&self) -> u32 {
        self.system.kv_pool().map_or(0, |p| p.stats().live)
    }

    fn t1_bytes_intact(&self) -> bool {
        let t1 = self.system.weights_arena().unwrap();
        self.t1.iter().all(|(ticket, bytes)| {
            let addr = t1.span(ticket).unwrap().addr();
            self.fb.read(addr, bytes.len()).unwrap() == *bytes
        })
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Admit(len) => {
                if self.manager.is_none() {
                    let config = self.system.kv_config().unwrap();
                    self.manager = Some(self.system.kv_manager(config).unwrap());
                }
                let id = self.next_seq;
                self.next_seq += 1;
                let tokens: Vec<u32> = (0..len as u32).map(|t| t % 7).collect();
                let m = self.manager.as_mut().unwrap();
                match m.admit(id, &tokens, ExtraKeys::default()) {
                    Ok(_) => {
                        assert!(self.asleep.is_none(), "admitted while the KV pool sleeps");
                        self.seqs.push(id);
                    }
                    Err(MemError::Asleep(_)) => assert!(self.asleep.is_some()),
                    Err(MemError::KvCapacity(_)) => {}
                    Err(e) => panic!("admit: {e}"),
                }
            }
            Op::Free(i) => {
                if !self.seqs.is_empty() {
                    let id = self.seqs.remove(i % self.seqs.len());
                    let len = self.manager.as_ref().unwrap().num_tokens(id).unwrap();
                    self.manager.as_mut().unwrap().free(id, Some(len)).unwrap();
                }
            }
            Op::Evict => {
                if let Some(m) = self.manager.as_mut() {
                    m.evict(u32::MAX);
                }
            }
            Op::DropManager => {
                self.manager = None;
                self.seqs.clear();
            }
            Op::WriteT1(len) => {
                let t1 = self.system.weights_arena().unwrap();
                match t1.take(len, 64) {
                    Ok(ticket) => {
                        assert!(self.asleep.is_none(), "T1 took while asleep");
                        let bytes = pattern(self.t1.len() + len, len);
                        let addr = t1.span(&ticket).unwrap().addr();
                        self.fb.write(addr, &bytes).unwrap();
                        self.t1.push((ticket, bytes));
                    }
                    Err(MemError::Asleep(_)) => assert!(self.asleep.is_some()),
                    Err(MemError::Capacity(_)) => {}
                    Err(e) => panic!("take: {e}"),
                }
            }
            Op::Export => {
                if let Some((ticket, _)) = self.t1.first() {
                    let t1 = self.system.weights_arena().unwrap();
                    match t1.export(ticket) {
                        Ok(e) => self.exports.push(e),
                        Err(MemError::Asleep(_)) => assert!(self.asleep.is_some()),
                        Err(e) => panic!("export: {e}"),
                    }
                }
            }
            Op::DropExports => self.exports.clear(),
            Op::Sleep(level) => self.sleep(level),
            Op::Wake => self.wake(),
            Op::Swap(to, fault) => self.swap(to, fault),
        }
    }

    fn sleep(&mut self, level: u8) {
        let bases = self.bases();
        let live = self.kv_live();
        let used = self.system.weights_arena().unwrap().stats().used as u64;
        let result = self.system.sleep(level, None, Some(&self.host));
        match result {
            Ok(report) => {
                assert!(self.asleep.is_none(), "slept twice");
                assert_eq!(live, 0, "the KV pool slept with {live} live blocks");
                let keys: Vec<&str> = report.tiers.iter().map(|t| t.key.as_str()).collect();
                assert_eq!(keys, ["model_resident", "kv_pool"]);
                assert_eq!(report.host_bytes(), if level == 1 { used } else { 0 });
                self.asleep = Some((level, bases));
                self.check_refusals();
            }
            Err(e) => {
                assert!(self.asleep.is_some() || live > 0, "sleep refused: {e}");
                if self.asleep.is_none() {
                    assert!(
                        self.system.asleep().is_empty(),
                        "a refused sleep left tiers asleep"
                    );
                }
            }
        }
    }

    /// Every sleeping tier refuses use, with the typed error.
    fn check_refusals(&self) {
        let t1 = self.system.weights_arena().unwrap();
        assert!(matches!(t1.take(8, 8), Err(MemError::Asleep(_))));
        if let Some((ticket, _)) = self.t1.first() {
            assert!(matches!(t1.span(ticket), Err(MemError::Asleep(_))));
        }
        let kv = self.system.kv_pool().unwrap();
        if self.manager.is_some() {
            // The manager's claim refuses the pool's own API first; its
            // admissions meet the sleep (`Op::Admit`).
            assert!(matches!(kv.allocate(), Err(MemError::InvalidArgument(_))));
        } else {
            assert!(matches!(kv.allocate(), Err(MemError::Asleep(_))));
        }
        for tag in [Tag::Weights, Tag::KvCache] {
            assert!(matches!(
                self.fb.acquire(4096, 256, tag),
                Err(MemError::Asleep(_))
            ));
        }
        let report = self.system.report(&Default::default());
        assert_eq!(report.asleep, ["model_resident", "kv_pool"]);
        for line in report
            .tiers
            .iter()
            .filter(|t| report.asleep.contains(&t.key))
        {
            assert_eq!(
                line.committed, 0,
                "{} sleeps with memory committed",
                line.key
            );
        }
    }

    fn wake(&mut self) {
        let woken = self.system.wake(None).unwrap();
        let Some((level, bases)) = self.asleep.take() else {
            assert!(woken.is_empty());
            return;
        };
        assert_eq!(woken, ["model_resident", "kv_pool"]);
        assert!(self.system.asleep().is_empty());
        assert!(self.fb.asleep().is_empty());
        assert_eq!(self.bases(), bases, "an address moved across sleep");
        if level == 1 {
            assert!(self.t1_bytes_intact(), "T1's bytes did not come back");
        } else {
            let t1 = self.system.weights_arena().unwrap();
            for (ticket, bytes) in &self.t1 {
                let addr = t1.span(ticket).unwrap().addr();
                assert!(self.fb.is_poisoned(addr, bytes.len()).unwrap());
            }
            // Level 2 dropped them: the caller reloads, here by forgetting.
            self.t1.clear();
        }
    }

    fn swap(&mut self, to: usize, fault: Fault) {
        let plan = self.plans[to].clone();
        let keys: Vec<String> = self
            .system
            .tier_keys()
            .iter()
            .map(|k| k.to_string())
            .collect();
        let live = self.kv_live();
        let t1_base = self.system.weights_arena().map(|a| a.base());
        match fault {
            Fault::None => {}
            Fault::Commit => self.fb.fail_commits(1),
            Fault::Acquisition(n) => self.fb.fail_nth(Some(n)).unwrap(),
        }
        let result = self.system.swap_model(&plan);
        self.fb.fail_commits(0);
        self.fb.fail_nth(None).unwrap();
        match result {
            Ok(report) => {
                assert!(self.asleep.is_none(), "swapped while asleep");
                assert!(self.exports.is_empty(), "swapped with live T1 exports");
                assert_eq!(live, 0, "swapped with live KV blocks");
                assert_eq!(self.system.plan(), &plan);
                assert!(report.t1_in_place, "T1 is growable here");
                assert_eq!(self.system.weights_arena().map(|a| a.base()), t1_base);
                assert!(report.kept.contains(&"engine_persistent".to_string()));
                let t1 = self.system.weights_arena().unwrap();
                for (ticket, _) in &self.t1 {
                    assert!(matches!(t1.span(ticket), Err(MemError::StaleSpan(_))));
                }
                assert_eq!(t1.stats().capacity as u64, plan.model_resident);
                self.t1.clear();
                if report.prefix_cache_dropped {
                    assert!(self.manager.is_none(), "a manager survived a re-laid pool");
                }
                // A manager on a kept pool is idle and may stay.
                if let Some(kv) = self.system.kv_pool() {
                    assert_eq!(kv.stats().block_bytes as u64, plan.kv.block_bytes);
                }
                self.current = to;
            }
            Err(e) => {
                let refused = self.asleep.is_some()
                    || !self.exports.is_empty()
                    || live > 0
                    || self.manager.is_some()
                    || !matches!(fault, Fault::None);
                assert!(refused, "swap failed with nothing to refuse it: {e}");
                assert_eq!(self.system.plan(), &self.plans[self.current]);
                let after: Vec<String> = self
                    .system
                    .tier_keys()
                    .iter()
                    .map(|k| k.to_string())
                    .collect();
                assert_eq!(after, keys, "a failed swap changed the tiers");
                assert!(e.missing.is_empty(), "{e}");
                assert_eq!(self.system.weights_arena().map(|a| a.base()), t1_base);
                if e.old_model_kept {
                    if self.asleep.is_none() {
                        assert!(self.t1_bytes_intact(), "a failed swap touched T1: {e}");
                    }
                } else {
                    assert!(matches!(fault, Fault::Commit | Fault::Acquisition(_)));
                    self.t1.clear();
                }
            }
        }
    }

    fn check(&self) {
        self.system.check().unwrap();
        assert_eq!(
            self.fb.device_used(),
            self.fb.stats().total.committed,
            "the fake device holds memory the backend does not account"
        );
        let t2 = self.system.engine_arena().unwrap();
        let (ticket, addr, bytes) = &self.t2;
        assert_eq!(t2.span(ticket).unwrap().addr(), *addr, "T2 moved");
        assert_eq!(
            &self.fb.read(*addr, bytes.len()).unwrap(),
            bytes,
            "T2 changed"
        );
        if let Some(m) = &self.manager {
            m.check_invariants().unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn swap_sleep_and_wake_keep_their_promises(ops in prop::collection::vec(op(), 1..40)) {
        let mut h = Harness::new();
        for op in ops {
            h.apply(op);
            h.check();
        }
        h.exports.clear();
        h.manager = None;
        h.wake();
        h.check();
    }
}

/// The paths the state machine reaches only by chance, once each.
#[test]
fn a_swap_keeps_t2_and_t1_base_and_a_failed_one_keeps_the_old_model() {
    let mut h = Harness::new();
    h.apply(Op::WriteT1(3000));
    let t1_base = h.system.weights_arena().unwrap().base();
    // A refused commit (the new KV pool's first) rolls back.
    h.apply(Op::Swap(1, Fault::Commit));
    assert_eq!(h.current, 0);
    assert!(h.t1_bytes_intact());
    h.check();
    h.apply(Op::Swap(1, Fault::None));
    assert_eq!(h.current, 1, "the swap to the larger model succeeded");
    assert_eq!(h.system.weights_arena().unwrap().base(), t1_base);
    h.check();
    // Back to the smaller one, then sleep and wake over new weights.
    h.apply(Op::Swap(2, Fault::None));
    assert_eq!(h.current, 2);
    h.apply(Op::WriteT1(1000));
    h.apply(Op::Sleep(1));
    assert!(h.asleep.is_some());
    h.apply(Op::Wake);
    assert!(h.t1_bytes_intact());
    h.check();
}

#[test]
fn a_swap_that_changes_what_survives_is_refused_item_by_item() {
    let mut h = Harness::new();
    let mut plan = h.plans[1].clone();
    plan.engine_persistent += MIB;
    plan.context += MIB;
    let err = h.system.swap_model(&plan).unwrap_err();
    assert!(err.old_model_kept);
    let text = err.to_string();
    assert!(text.contains("T2 engine-persistent"), "{text}");
    assert!(text.contains("CUDA context"), "{text}");
    assert!(!text.contains("- library reserve"), "{text}");
    h.check();
    // Live exports of T1 refuse it too, until they are dropped.
    h.apply(Op::WriteT1(64));
    h.apply(Op::Export);
    let err = h.system.swap_model(&h.plans[1].clone()).unwrap_err();
    assert!(err.to_string().contains("export"), "{err}");
    h.apply(Op::DropExports);
    h.system.swap_model(&h.plans[1].clone()).unwrap();
}

#[test]
fn a_fixed_t1_cannot_sleep_and_says_why() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let plan = plans().remove(0);
    let options = SystemOptions {
        sleepable: Some(false),
        ..SystemOptions::default()
    };
    let system = MemorySystem::open(&fb, &plan, options).unwrap();
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)));
    let err = system.sleep(1, None, Some(&host)).unwrap_err();
    assert!(matches!(err, MemError::BackendUnavailable(_)), "{err}");
    assert!(
        system.asleep().is_empty(),
        "a refused sleep left a tier asleep"
    );
    let err = system
        .sleep(1, Some(&["engine_persistent"]), Some(&host))
        .unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
    let err = system.sleep(3, None, Some(&host)).unwrap_err();
    assert!(err.to_string().contains("level=3"), "{err}");
    system.check().unwrap();
}

/// A fixed T1 (a backend or an option without growable T1) is replaced by a
/// new region: beside the old one when the budget holds both (a failure
/// keeps the old model), else after releasing it (a failure restores the
/// old layout with T1 reset, and says so).
#[test]
fn a_fixed_t1_is_replaced_and_a_late_failure_says_t1_was_reset() {
    let plans = plans();
    let fixed = SystemOptions {
        sleepable: Some(false),
        kv_growable: Some(false),
        ..SystemOptions::default()
    };
    let fb = FakeBackend::new(FakeConfig {
        capacity: 256 * MIB,
        granularity: 64 * 1024,
        ..FakeConfig::default()
    })
    .unwrap();
    // Beside the old T1 (the budget holds both once the old KV pool is
    // gone), a refused acquisition keeps the old model, bytes and all.
    {
        let mut system = MemorySystem::open(&fb, &plans[0], fixed.clone()).unwrap();
        let t1 = system.weights_arena().unwrap();
        let ticket = t1.take(512, 64).unwrap();
        let addr = t1.span(&ticket).unwrap().addr();
        fb.write(addr, &[9u8; 512]).unwrap();
        drop(t1);
        fb.fail_nth(Some(2)).unwrap();
        let err = system.swap_model(&plans[1]).unwrap_err();
        fb.fail_nth(None).unwrap();
        assert!(err.old_model_kept, "{err}");
        assert_eq!(fb.read(addr, 512).unwrap(), vec![9u8; 512]);
        assert!(system.weights_arena().unwrap().is_valid(&ticket));
        system.check().unwrap();
    }
    assert_eq!(fb.live(), 0);
    // The new plan's KV pool takes all its headroom, so its T1 cannot sit
    // beside the old one.
    let mut big_kv = plans[1].clone();
    let extra = (big_kv.headroom - MIB) / big_kv.kv.block_bytes;
    big_kv.kv.blocks += extra;
    big_kv.kv.bytes += extra * big_kv.kv.block_bytes;
    big_kv.total += extra * big_kv.kv.block_bytes;
    big_kv.headroom -= extra * big_kv.kv.block_bytes;
    let plans = [plans[0].clone(), big_kv];
    let mut system = MemorySystem::open(&fb, &plans[0], fixed.clone()).unwrap();
    system.begin_serving().unwrap();
    let t2_base = system.engine_arena().unwrap().base();
    // T1 goes first, and a refused acquisition after that restores the old
    // layout with T1 empty.
    fb.fail_nth(Some(1)).unwrap();
    let err = system.swap_model(&plans[1]).unwrap_err();
    fb.fail_nth(None).unwrap();
    assert!(!err.old_model_kept, "{err}");
    assert!(err.missing.is_empty(), "{err}");
    assert!(err.to_string().contains("reload"), "{err}");
    assert_eq!(system.plan(), &plans[0]);
    assert_eq!(system.weights_arena().unwrap().stats().used, 0);
    system.check().unwrap();
    assert_eq!(fb.device_used(), fb.stats().total.committed);
    // Without a fault it goes through, T2 where it was.
    let report = system.swap_model(&plans[1]).unwrap();
    assert!(!report.t1_in_place);
    assert_eq!(system.plan(), &plans[1]);
    assert_eq!(system.engine_arena().unwrap().base(), t2_base);
    assert_eq!(
        system.weights_arena().unwrap().stats().capacity as u64,
        plans[1].model_resident
    );
    system.check().unwrap();
    assert_eq!(system.backend().phase(), imp_mem_core::Phase::Serving);
    drop(system);
    assert_eq!(fb.live(), 0, "nothing leaked");
}

/// The activation pool (T4a, torch's segments) sleeps with T1 and the KV
/// pool by default: its bytes are dropped, its blocks' bookkeeping kept, so
/// a live allocation (a graph's intermediate) has the same address after
/// the wake; while asleep it refuses allocations with `Asleep`.
#[test]
fn the_activation_pool_sleeps_and_wakes_at_the_same_addresses() {
    let mut limits = Limits::new(4, 1024);
    limits.kv_policy = KvPolicy::Fit;
    let features = Features {
        engine_persistent_bytes: Some(4 * MIB),
        scratch_bytes: Some(2 * MIB),
        activation_bytes: Some(8 * MIB),
        ..Features::default()
    };
    let plan = plan_memory(&PlanInput {
        model: shape(4, 256),
        limits,
        features,
        tp: 1,
        budget: BUDGET,
        context_bytes: 8 * MIB,
        library_reserve_bytes: 4 * MIB,
    })
    .unwrap();
    let fb = FakeBackend::new(FakeConfig {
        capacity: 256 * MIB,
        granularity: 64 * 1024,
        ..FakeConfig::default()
    })
    .unwrap();
    let system = MemorySystem::open(&fb, &plan, SystemOptions::default()).unwrap();
    let pool = system.activations().unwrap();
    let live = pool.allocate(4096, 0).unwrap();
    fb.write(live, &[3u8; 4096]).unwrap();
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)));
    let report = system.sleep(1, None, Some(&host)).unwrap();
    let keys: Vec<&str> = report.tiers.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(keys, ["model_resident", "activations", "kv_pool"]);
    assert_eq!(pool.committed(), 0);
    assert!(
        fb.is_poisoned(live, 4096).unwrap(),
        "the bytes were given back"
    );
    assert!(matches!(pool.allocate(512, 0), Err(MemError::Asleep(_))));
    system.check().unwrap();
    system.wake(None).unwrap();
    assert!(pool.committed() >= plan.activations);
    let again = pool.allocate(4096, 0).unwrap();
    assert!(again != live, "the live block kept its place");
    pool.free(live, 0).unwrap();
    pool.free(again, 0).unwrap();
    pool.check_invariants().unwrap();
    system.check().unwrap();
    assert_eq!(fb.device_used(), fb.stats().total.committed);
}
