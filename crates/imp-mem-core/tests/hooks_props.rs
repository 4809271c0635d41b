//! The allocator hooks' routing against a shadow model: random sequences of
//! installs, uninstalls, regions added, removed and selected, mallocs, frees
//! from this thread and from a worker that keeps a copy of the slot, and
//! the test letting go of its own handles to the pools.
//!
//! * A malloc lands in the pool the model says (the thread's region, else
//!   the installed pool) or is refused; never anywhere else.
//! * Every free of a live block goes home, whatever is installed then and
//!   whichever thread frees it: no free is ever taken for a foreign, an
//!   unknown or a double one.
//! * A pool's memory is held exactly while something can still reach it:
//!   the test's handle, the slot, a region, the worker's copy of the slot,
//!   or a live block of it; never longer (no leak), never shorter (nothing
//!   live in released memory).
//!
//! Its own test binary: the hooks are process-wide.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use imp_mem_core::activations::hooks;
use imp_mem_core::{ActivationConfig, ActivationPool, FakeBackend, FakeConfig, NoStreams, Tag};
use proptest::prelude::*;

const POOLS: usize = 3;
const POOL_BYTES: u64 = 64 * 1024;

#[derive(Debug, Clone)]
enum Op {
    Install(usize),
    Uninstall,
    AddRegion(usize),
    RemoveRegion(usize),
    Select(Option<usize>),
    Malloc(u64),
    Free(usize),
    FreeOnWorker(usize),
    /// The worker makes a call: its copy of the slot becomes the current one.
    WorkerCalls,
    DropHandle(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 0..POOLS;
    prop_oneof![
        2 => pool.clone().prop_map(Op::Install),
        1 => Just(Op::Uninstall),
        2 => pool.clone().prop_map(Op::AddRegion),
        1 => pool.clone().prop_map(Op::RemoveRegion),
        2 => proptest::option::of(pool.clone()).prop_map(Op::Select),
        6 => (1u64..24_576).prop_map(Op::Malloc),
        3 => any::<usize>().prop_map(Op::Free),
        2 => any::<usize>().prop_map(Op::FreeOnWorker),
        2 => Just(Op::WorkerCalls),
        1 => pool.prop_map(Op::DropHandle),
    ]
}

/// What the worker thread is asked to do.
enum Ask {
    /// One malloc and its free: a call that refreshes its copy of the slot.
    Call,
    Free(usize),
    Stop,
}

fn worker() -> (Sender<Ask>, Receiver<()>, std::thread::JoinHandle<()>) {
    let (ask, asked) = channel::<Ask>();
    let (done, finished) = channel::<()>();
    let handle = std::thread::spawn(move || {
        while let Ok(a) = asked.recv() {
            match a {
                Ask::Call => {
                    let p = hooks::malloc(512, 0, 0);
                    hooks::free(p, Some(512), 0, 0);
                }
                Ask::Free(addr) => hooks::free(addr, None, 0, 0),
                Ask::Stop => {
                    // The thread's copy of the slot goes as it ends.
                    let _ = done.send(());
                    return;
                }
            }
            let _ = done.send(());
        }
    });
    (ask, finished, handle)
}

fn count(name: &str) -> u64 {
    hooks::stats()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map_or(u64::MAX, |(_, v)| v)
}

/// The counters a correct routing never moves here.
fn misroutes() -> [u64; 4] {
    [
        count("foreign_frees"),
        count("double_frees"),
        count("free_not_installed"),
        count("panics"),
    ]
}

#[derive(Default)]
struct Model {
    /// Each pool's region: (base, bytes).
    spans: Vec<(usize, u64)>,
    ids: Vec<u64>,
    held: Vec<Option<ActivationPool>>,
    slot: Option<usize>,
    regions: Vec<usize>,
    selected: Option<usize>,
    /// The slot as the worker last read it.
    worker_copy: Option<usize>,
    /// Live blocks: (address, pool).
    live: Vec<(usize, usize)>,
    /// The live blocks served past their pool's region (the last pool falls
    /// back when full): address and the bytes of their own backend region.
    fallbacks: Vec<(usize, u64)>,
}

impl Model {
    fn owner(&self, addr: usize) -> Option<usize> {
        self.spans
            .iter()
            .position(|&(base, len)| addr >= base && ((addr - base) as u64) < len)
    }

    fn reachable(&self, i: usize) -> bool {
        self.held[i].is_some()
            || self.slot == Some(i)
            || self.regions.contains(&i)
            || self.worker_copy == Some(i)
            || self.live.iter().any(|&(_, p)| p == i)
    }
}

fn activations_live(fb: &FakeBackend) -> u64 {
    fb.stats().tags.get(&Tag::Activations).map_or(0, |t| t.live)
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut m = Model::default();
    for i in 0..POOLS {
        let mut config = ActivationConfig::new(POOL_BYTES);
        // The last pool falls back to the backend when full, as a serve()
        // or engine tier does: its blocks past the region go home by address.
        config.strict = Some(i + 1 < POOLS);
        let pool = ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap();
        m.spans.push((pool.base(), pool.capacity()));
        m.ids.push(pool.id());
        m.held.push(Some(pool));
    }
    let (ask, finished, handle) = worker();
    let before = misroutes();
    let steps = steps(ops, &fb, &mut m, &ask, &finished);
    // Everything let go, whatever the steps found: nothing may stay (and
    // the next case starts from empty hooks).
    for (addr, _) in std::mem::take(&mut m.live) {
        hooks::free(addr, None, 0, 0);
    }
    hooks::set_region(None).unwrap();
    hooks::uninstall();
    for id in &m.ids {
        hooks::remove_region(*id);
    }
    m.held.clear();
    ask.send(Ask::Stop).unwrap();
    finished.recv().unwrap();
    handle.join().unwrap();
    steps?;
    prop_assert_eq!(misroutes(), before);
    prop_assert_eq!(activations_live(&fb), 0, "a pool outlived everything");
    prop_assert!(hooks::retired_pool_ids().is_empty());
    Ok(())
}

fn steps(
    ops: &[Op],
    fb: &FakeBackend,
    m: &mut Model,
    ask: &Sender<Ask>,
    finished: &Receiver<()>,
) -> Result<(), TestCaseError> {
    let call_worker = |a: Ask| {
        ask.send(a).unwrap();
        finished.recv().unwrap();
    };
    let before = misroutes();
    for op in ops {
        match *op {
            Op::Install(i) => {
                let Some(pool) = m.held[i].clone() else {
                    continue;
                };
                hooks::install(pool, 0, None);
                m.slot = Some(i);
            }
            Op::Uninstall => {
                prop_assert_eq!(hooks::uninstall(), m.slot.is_some());
                m.slot = None;
            }
            Op::AddRegion(i) => {
                let Some(pool) = m.held[i].clone() else {
                    continue;
                };
                hooks::add_region(pool, 0);
                if !m.regions.contains(&i) {
                    m.regions.push(i);
                }
            }
            Op::RemoveRegion(i) => {
                prop_assert_eq!(hooks::remove_region(m.ids[i]), m.regions.contains(&i));
                m.regions.retain(|&r| r != i);
            }
            Op::Select(i) => {
                let got = hooks::set_region(i.map(|i| m.ids[i]));
                match i {
                    Some(i) if !m.regions.contains(&i) => prop_assert!(got.is_err()),
                    _ => {
                        prop_assert_eq!(got.unwrap(), m.selected.map(|s| m.ids[s]));
                        m.selected = i;
                    }
                }
            }
            Op::Malloc(bytes) => {
                let target = match m.selected {
                    Some(r) => m.regions.contains(&r).then_some(r),
                    None => m.slot,
                };
                let ooms = count("ooms");
                let held = activations_live(fb);
                let addr = hooks::malloc(bytes, 0, 0);
                match target {
                    None => prop_assert_eq!(addr, 0, "nothing to route {} B to", bytes),
                    Some(_) if addr == 0 => {
                        prop_assert_eq!(count("ooms"), ooms + 1, "refused without an OOM")
                    }
                    Some(t) if m.owner(addr).is_none() => {
                        // Past its region: only the pool that falls back.
                        prop_assert!(t + 1 == POOLS, "pool {} is strict: nothing past it", t);
                        if let Some(pool) = &m.held[t] {
                            prop_assert_eq!(pool.requested_size(addr), Some(bytes));
                        }
                        m.fallbacks.push((addr, activations_live(fb) - held));
                        m.live.push((addr, t));
                    }
                    Some(t) => {
                        prop_assert_eq!(m.owner(addr), Some(t), "landed outside pool {}", t);
                        m.live.push((addr, t));
                    }
                }
            }
            Op::Free(k) | Op::FreeOnWorker(k) => {
                if m.live.is_empty() {
                    continue;
                }
                let (addr, p) = m.live.swap_remove(k % m.live.len());
                m.fallbacks.retain(|&(a, _)| a != addr);
                if matches!(op, Op::Free(_)) {
                    hooks::free(addr, None, 0, 0);
                } else {
                    // A free found on the retired list or by its region
                    // never reads the slot; only one reaching the installed
                    // pool refreshes the worker's copy. Whether a pool is
                    // listed is the hooks' own bookkeeping (a pool that left
                    // a region stays listed while blocks of it are live, even
                    // while it is installed), so it is read, not modelled.
                    let listed = hooks::retired_pool_ids().contains(&m.ids[p]);
                    call_worker(Ask::Free(addr));
                    if !listed && !m.regions.contains(&p) {
                        m.worker_copy = m.slot;
                    }
                }
            }
            Op::WorkerCalls => {
                call_worker(Ask::Call);
                m.worker_copy = m.slot;
            }
            Op::DropHandle(i) => m.held[i] = None,
        }
        prop_assert_eq!(misroutes(), before, "a free missed its pool after {:?}", op);
        for (i, held) in m.held.iter().enumerate() {
            if let Some(pool) = held {
                let live = m.live.iter().filter(|&&(_, p)| p == i).count() as u64;
                prop_assert_eq!(pool.stats().live, live, "pool {}'s live blocks", i);
                pool.check_invariants().unwrap();
            }
        }
        let reachable = (0..POOLS).filter(|&i| m.reachable(i)).count() as u64;
        let past: u64 = m.fallbacks.iter().map(|&(_, n)| n).sum();
        prop_assert_eq!(
            activations_live(fb),
            reachable * POOL_BYTES + past,
            "memory held after {:?}: reachable pools {}",
            op,
            reachable
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_hooks_route_every_block_home_and_hold_a_pool_exactly_while_it_is_reachable(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        run(&ops)?;
    }
}
