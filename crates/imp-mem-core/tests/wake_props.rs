//! Staged wake, the sleep host buffer pinned ahead, and wake under pressure
//! (issue 24), on the fake backend.
//!
//! The state machine sleeps and wakes tiers by key or tag in any order
//! (`weights`, `activations`, `kv_cache`, ...), writes T1, and injects a
//! refused commit into wakes. After every operation:
//!
//! * no base moves (T1's, the activation pool's, the KV pool's reservation);
//! * `asleep()` is exactly the model's set, and a sleeping tier has nothing
//!   committed;
//! * after a level-1 sleep and its wake, T1's bytes are what was written
//!   (the fake poisons decommitted memory, so they came from the host copy);
//! * a refusal (a name that is no tier, a tier already asleep, a wake the
//!   backend cannot commit) changes nothing but the tiers it says it woke;
//! * the backend's ledger matches the fake device (nothing leaked).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use imp_mem_core::fake::POISON;
use imp_mem_core::planner::{
    plan_memory, Features, KvPolicy, Limits, MemoryPlan, ModelShape, PlanInput,
};
use imp_mem_core::system::{MemorySystem, SystemOptions};
use imp_mem_core::{
    ArenaSpan, FakeBackend, FakeConfig, FakePinnedHost, MemError, PinnedHost, PinnedHostOps,
    Placement, SharedArena, SourceError,
};
use proptest::prelude::*;
use serde_json::json;

const MIB: u64 = 1 << 20;

fn plan() -> MemoryPlan {
    let shape = ModelShape::from_hf_config(&json!({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }))
    .unwrap();
    let mut limits = Limits::new(4, 1024);
    limits.kv_policy = KvPolicy::Fit;
    plan_memory(&PlanInput {
        model: shape,
        limits,
        features: Features {
            engine_persistent_bytes: Some(4 * MIB),
            scratch_bytes: Some(2 * MIB),
            activation_bytes: Some(8 * MIB),
            ..Features::default()
        },
        tp: 1,
        budget: 96 * MIB,
        context_bytes: 8 * MIB,
        library_reserve_bytes: 4 * MIB,
    })
    .unwrap()
}

fn fake() -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity: 256 * MIB,
        granularity: 64 * 1024,
        ..FakeConfig::default()
    })
    .unwrap()
}

fn host() -> PinnedHost {
    PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)))
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| match ((seed * 31 + i * 7) % 251) as u8 {
            b if b == POISON => 1,
            b => b,
        })
        .collect()
}

/// The tiers that sleep, by key, and the names a caller may use for each.
const SLEEPERS: [(&str, &str); 3] = [
    ("model_resident", "weights"),
    ("activations", "activations"),
    ("kv_pool", "kv_cache"),
];

fn key_of(name: &str) -> &'static str {
    SLEEPERS
        .iter()
        .find(|(k, t)| *k == name || *t == name)
        .map(|(k, _)| *k)
        .unwrap()
}

struct Harness {
    fb: FakeBackend,
    host: PinnedHost,
    system: MemorySystem,
    t1: SharedArena,
    t1_written: Vec<(ArenaSpan, Vec<u8>)>,
    bases: Vec<(String, usize)>,
    /// The model: each sleeping tier's level.
    asleep: BTreeMap<String, u8>,
}

impl Harness {
    fn new() -> Self {
        let fb = fake();
        let system = MemorySystem::open(&fb, &plan(), SystemOptions::default()).unwrap();
        system.begin_serving().unwrap();
        let t1 = system.weights_arena().unwrap();
        let mut h = Self {
            fb,
            host: host(),
            system,
            t1,
            t1_written: Vec::new(),
            bases: Vec::new(),
            asleep: BTreeMap::new(),
        };
        h.bases = h.bases_now();
        h
    }

    fn bases_now(&self) -> Vec<(String, usize)> {
        vec![
            ("model_resident".into(), self.t1.base()),
            (
                "activations".into(),
                self.system.activations().unwrap().base(),
            ),
            (
                "kv_pool".into(),
                self.system.kv_pool().unwrap().reservation().unwrap().addr(),
            ),
        ]
    }

    fn write_t1(&mut self, len: usize) {
        match self.t1.take(len, 64) {
            Ok(ticket) => {
                assert!(!self.asleep.contains_key("model_resident"));
                let bytes = pattern(self.t1_written.len() + len, len);
                let addr = self.t1.span(&ticket).unwrap().addr();
                self.fb.write(addr, &bytes).unwrap();
                self.t1_written.push((ticket, bytes));
            }
            Err(MemError::Asleep(_)) => assert!(self.asleep.contains_key("model_resident")),
            Err(MemError::Capacity(_)) => {}
            Err(e) => panic!("take: {e}"),
        }
    }

    fn sleep(&mut self, level: u8, names: &[&str]) {
        let chosen: Vec<&str> = names.iter().map(|n| key_of(n)).collect();
        let result = self.system.sleep(level, Some(names), Some(&self.host));
        if chosen.iter().any(|k| self.asleep.contains_key(*k)) {
            let err = result.unwrap_err();
            assert!(err.to_string().contains("already sleeps"), "{err}");
            return;
        }
        let report = result.unwrap();
        for key in chosen {
            self.asleep.insert(key.to_string(), level);
        }
        let keys: Vec<&str> = report.tiers.iter().map(|t| t.key.as_str()).collect();
        assert!(keys.iter().all(|k| self.asleep.contains_key(*k)));
    }

    fn wake(&mut self, names: Option<&[&str]>, fail: bool) {
        // In open order, which is SLEEPERS' order.
        let keys: Vec<&str> = match names {
            None => SLEEPERS.iter().map(|(k, _)| *k).collect(),
            Some(n) => n.iter().map(|n| key_of(n)).collect(),
        };
        let wanted: Vec<String> = SLEEPERS
            .iter()
            .map(|(k, _)| k.to_string())
            .filter(|k| keys.contains(&k.as_str()) && self.asleep.contains_key(k))
            .collect();
        let needs = self.system.wake_needs(names).unwrap();
        if fail {
            self.fb.fail_commits(1);
        }
        let result = self.system.wake(names);
        self.fb.fail_commits(0);
        let woken = match result {
            Ok(woken) => {
                assert_eq!(woken, wanted, "woke what was not asked, or not all of it");
                woken
            }
            Err(err) => {
                assert!(fail && !wanted.is_empty(), "wake failed: {err}");
                assert!(matches!(err.error, MemError::OutOfMemory(_)), "{err}");
                assert!(err.needed > 0, "{err}");
                // Those woken before the refused commit are the first asked.
                assert_eq!(err.woken[..], wanted[..err.woken.len()], "{err}");
                if err.woken.is_empty() {
                    assert_eq!(err.needed, needs, "wake_needs said otherwise");
                }
                let still: Vec<&String> = self
                    .asleep
                    .keys()
                    .filter(|k| !err.woken.contains(k))
                    .collect();
                let mut reported: Vec<&String> = err.still_asleep.iter().collect();
                reported.sort();
                assert_eq!(reported, still);
                err.woken
            }
        };
        for key in &woken {
            let level = self.asleep.remove(key).unwrap();
            if key == "model_resident" {
                if level == 1 {
                    for (ticket, bytes) in &self.t1_written {
                        let addr = self.t1.span(ticket).unwrap().addr();
                        assert_eq!(&self.fb.read(addr, bytes.len()).unwrap(), bytes);
                    }
                } else {
                    // Level 2 dropped them; the caller reloads (here: forgets).
                    self.t1_written.clear();
                }
            }
        }
    }

    fn check(&self) {
        assert_eq!(self.bases_now(), self.bases, "a base moved");
        let asleep: BTreeMap<String, u8> = self.system.asleep().into_iter().collect();
        assert_eq!(asleep, self.asleep);
        let report = self.system.report(&Default::default());
        for line in &report.tiers {
            if self.asleep.contains_key(&line.key) {
                assert_eq!(line.committed, 0, "{} sleeps committed", line.key);
            }
        }
        self.system.check().unwrap();
        assert_eq!(self.fb.device_used(), self.fb.stats().total.committed);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Write(usize),
    Sleep(u8, Vec<&'static str>),
    Wake(Option<Vec<&'static str>>, bool),
    BadName,
}

fn names() -> impl Strategy<Value = Vec<&'static str>> {
    prop::collection::vec(
        prop::sample::select(vec![
            "model_resident",
            "weights",
            "activations",
            "kv_pool",
            "kv_cache",
        ]),
        1..3,
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..5000).prop_map(Op::Write),
        3 => ((1u8..=2), names()).prop_map(|(l, n)| Op::Sleep(l, n)),
        3 => (prop::option::of(names()), prop::bool::weighted(0.2))
            .prop_map(|(n, f)| Op::Wake(n, f)),
        1 => Just(Op::BadName),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn staged_sleep_and_wake_keep_addresses_bytes_and_the_asleep_set(
        ops in prop::collection::vec(op(), 1..30)
    ) {
        let mut h = Harness::new();
        for op in ops {
            match op {
                Op::Write(len) => h.write_t1(len),
                Op::Sleep(level, names) => h.sleep(level, &names),
                Op::Wake(names, fail) => h.wake(names.as_deref(), fail),
                Op::BadName => {
                    let err = h.system.wake(Some(&["nope"])).unwrap_err();
                    prop_assert!(matches!(err.error, MemError::InvalidArgument(_)));
                    prop_assert!(err.to_string().contains("tiers"));
                    prop_assert!(err.to_string().contains("model_resident"));
                }
            }
            h.check();
        }
        h.wake(None, false);
        h.check();
        prop_assert!(h.system.asleep().is_empty());
    }
}

#[test]
fn a_staged_wake_wakes_the_weights_first_and_the_kv_cache_later() {
    let mut h = Harness::new();
    h.write_t1(3000);
    h.sleep(1, &["weights", "kv_cache"]);
    assert_eq!(
        h.system.wake(Some(&["weights"])).unwrap(),
        ["model_resident"]
    );
    h.asleep.remove("model_resident");
    h.check();
    assert_eq!(
        h.system.asleep(),
        [("kv_pool".to_string(), 1)],
        "the KV pool still sleeps"
    );
    assert!(matches!(
        h.system.kv_pool().unwrap().allocate(),
        Err(MemError::Asleep(_))
    ));
    // Waking an awake tier is a no-op; T2 never sleeps, so naming it is an error.
    assert!(h.system.wake(Some(&["weights"])).unwrap().is_empty());
    let err = h.system.wake(Some(&["engine_persistent"])).unwrap_err();
    assert!(matches!(err.error, MemError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("nothing changed"), "{err}");
    assert_eq!(err.still_asleep, ["kv_pool"]);
    assert_eq!(h.system.wake(Some(&["kv_cache"])).unwrap(), ["kv_pool"]);
    h.asleep.clear();
    h.check();
}

#[test]
fn a_wake_the_device_refuses_says_what_it_needs_and_retries_later() {
    let mut h = Harness::new();
    h.write_t1(4000);
    h.sleep(1, &["weights", "activations", "kv_cache"]);
    let needed: u64 = h.system.report(&Default::default()).asleep_released;
    assert_eq!(h.system.wake_needs(None).unwrap(), needed);
    let t1 = h.t1.sleeping_committed() as u64;
    assert_eq!(h.system.wake_needs(Some(&["weights"])).unwrap(), t1);
    // Something outside the backend (a trainer) holds all but 1 KiB.
    let free = h.fb.stats().capacity - h.fb.device_used();
    h.fb.set_external_usage(free - 1024);
    let err = h.system.wake(None).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err.error, MemError::OutOfMemory(r) if r.device_refused),
        "{text}"
    );
    assert_eq!(err.needed, needed, "{text}");
    assert_eq!(
        err.still_asleep,
        ["model_resident", "activations", "kv_pool"]
    );
    assert!(err.woken.is_empty());
    assert!(text.contains("still asleep"), "{text}");
    assert!(text.contains("call wake again"), "{text}");
    h.check();
    // Nor can a part of it.
    let err = h.system.wake(Some(&["activations"])).unwrap_err();
    assert_eq!(err.still_asleep.len(), 3, "{err}");
    h.check();
    // The trainer lets go: the retry wakes everything, bytes intact.
    h.fb.set_external_usage(0);
    h.wake(None, false);
    h.check();
}

#[test]
fn a_wake_that_fails_part_way_names_what_it_woke() {
    let mut h = Harness::new();
    h.write_t1(1000);
    h.sleep(1, &["weights", "kv_cache"]);
    // Room for T1 but not for the KV pool after it.
    let kv = h.system.kv_pool().unwrap().sleeping_committed() as u64;
    let t1 = h.t1.sleeping_committed() as u64;
    let free = h.fb.stats().capacity - h.fb.device_used();
    h.fb.set_external_usage(free - t1 - kv / 2);
    let err = h.system.wake(None).unwrap_err();
    assert_eq!(err.woken, ["model_resident"], "{err}");
    assert_eq!(err.still_asleep, ["kv_pool"], "{err}");
    assert_eq!(err.needed, kv, "{err}");
    assert!(
        err.to_string().contains("woken before the failure"),
        "{err}"
    );
    h.asleep.remove("model_resident");
    h.check();
    h.fb.set_external_usage(0);
    h.wake(None, false);
    h.check();
}

#[test]
fn the_sleep_host_pinned_ahead_is_what_the_first_sleep_copies_into() {
    let mut h = Harness::new();
    let planned = h.system.plan().sleep_host;
    assert!(planned > 0);
    let held = h.system.pin_sleep_host(None, &h.host).unwrap();
    assert_eq!(held, planned, "exactly the plan's T1 weights bytes");
    assert_eq!(h.host.stats().live_bytes, planned);
    assert_eq!(h.system.report(&Default::default()).sleep_host, planned);
    // Pinning again pins nothing.
    assert_eq!(h.system.pin_sleep_host(None, &h.host).unwrap(), planned);
    assert_eq!(h.host.stats().buffers, 1);
    h.write_t1(5000);
    h.sleep(1, &["weights"]);
    let stats = h.host.stats();
    assert_eq!(
        (stats.buffers, stats.peak_bytes),
        (1, planned),
        "the sleep pinned again"
    );
    h.wake(None, false);
    h.check();
    assert_eq!(h.system.release_sleep_host(), planned);
    assert_eq!(h.host.stats().live_bytes, 0);
    assert_eq!(h.system.report(&Default::default()).sleep_host, 0);
}

#[test]
fn a_pinned_buffer_smaller_than_t1_is_replaced_by_one_of_t1s_bytes() {
    let mut h = Harness::new();
    assert_eq!(h.system.pin_sleep_host(Some(100), &h.host).unwrap(), 100);
    h.write_t1(5000);
    let used = h.t1.stats().used as u64;
    h.sleep(1, &["weights"]);
    assert_eq!(h.host.stats().live_bytes, used, "exactly T1's used bytes");
    h.wake(None, false);
    h.check();
}

#[test]
fn pin_sleep_host_arguments_are_checked_and_change_nothing() {
    let h = Harness::new();
    for bad in [Some(0), Some(1 << 40)] {
        let err = h.system.pin_sleep_host(bad, &h.host).unwrap_err();
        assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("nbytes"), "{err}");
    }
    assert_eq!(h.host.stats().live_bytes, 0);
    // A T1 that cannot sleep has no use for it.
    let fb = fake();
    let fixed = SystemOptions {
        sleepable: Some(false),
        ..SystemOptions::default()
    };
    let system = MemorySystem::open(&fb, &plan(), fixed).unwrap();
    let err = system.pin_sleep_host(None, &h.host).unwrap_err();
    assert!(matches!(err, MemError::BackendUnavailable(_)), "{err}");
    // A refused pin is the pinned host's OutOfMemory, and nothing is held.
    let small = PinnedHost::new(Arc::new(FakePinnedHost::new(1024)));
    let err = h.system.pin_sleep_host(None, &small).unwrap_err();
    assert!(matches!(err, MemError::OutOfMemory(_)), "{err}");
    assert_eq!(h.system.report(&Default::default()).sleep_host, 0);
}

/// Pinned-host operations that take from T1 while they pin, as a weight
/// load on another thread would: if the pin held the arena's lock, this
/// would deadlock.
struct TakesWhilePinning {
    inner: FakePinnedHost,
    arena: Mutex<Option<SharedArena>>,
    taken: Mutex<Vec<usize>>,
}

// SAFETY: every method forwards to `FakePinnedHost`, whose implementation
// keeps the trait's promises; the take in `allocate` touches only the arena.
unsafe impl PinnedHostOps for TakesWhilePinning {
    fn placement(&self) -> Placement {
        self.inner.placement()
    }

    fn allocate(&self, bytes: usize) -> Result<usize, SourceError> {
        if let Some(arena) = self.arena.lock().unwrap().as_ref() {
            let ticket = arena.take(4096, 256).unwrap();
            self.taken.lock().unwrap().push(ticket.len());
        }
        self.inner.allocate(bytes)
    }

    unsafe fn free(&self, addr: usize, bytes: usize) {
        // SAFETY: the caller's promise, forwarded.
        unsafe { self.inner.free(addr, bytes) }
    }

    fn register(&self, addr: usize, bytes: usize) -> Result<(), SourceError> {
        self.inner.register(addr, bytes)
    }

    unsafe fn unregister(&self, addr: usize, bytes: usize) {
        // SAFETY: the caller's promise, forwarded.
        unsafe { self.inner.unregister(addr, bytes) }
    }
}

#[test]
fn pinning_holds_no_lock_so_the_weight_load_goes_on() {
    let h = Harness::new();
    let ops = Arc::new(TakesWhilePinning {
        inner: FakePinnedHost::new(1 << 30),
        arena: Mutex::new(Some(h.t1.clone())),
        taken: Mutex::new(Vec::new()),
    });
    let host = PinnedHost::new(ops.clone());
    let pin = h.system.sleep_host_pin(None).unwrap();
    let held = std::thread::scope(|s| s.spawn(|| pin.pin(&host)).join().unwrap()).unwrap();
    assert_eq!(held, pin.bytes());
    assert_eq!(*ops.taken.lock().unwrap(), [4096]);
    assert_eq!(h.t1.stats().takes, 1);
    ops.arena.lock().unwrap().take();
}

#[test]
fn the_report_while_asleep_names_what_stays_on_the_device() {
    let mut h = Harness::new();
    h.system
        .set_charge("nccl", "NCCL buffers", 3 * MIB)
        .unwrap();
    h.write_t1(4000);
    let awake = h.system.report(&Default::default());
    assert!(awake.asleep_stays.is_empty());
    h.sleep(1, &["weights", "activations", "kv_cache"]);
    let report = h.system.report(&Default::default());
    let keys: Vec<&str> = report.asleep_stays.iter().map(|s| s.key.as_str()).collect();
    for key in ["engine_persistent", "scratch", "context", "nccl"] {
        assert!(keys.contains(&key), "{key} missing from {keys:?}");
    }
    for key in ["model_resident", "activations", "kv_pool"] {
        assert!(!keys.contains(&key), "{key} sleeps: {keys:?}");
    }
    let total: u64 = report.asleep_stays.iter().map(|s| s.bytes).sum();
    assert_eq!(
        total,
        report.attributed + report.planned_unclaimed,
        "the lines add up to what is attributed and estimated"
    );
    let text = report.text();
    assert!(text.contains("stays on the device while asleep"), "{text}");
    assert!(text.contains("NCCL buffers"), "{text}");
    assert!(text.contains("given back"), "{text}");
    h.wake(None, false);
    h.check();
}
