//! The process-wide routing behind the C allocator hooks (the `extern "C"`
//! entry points themselves are exported by the Python extension,
//! `imp-mem-py/src/hooks.rs`, which calls these functions).
//!
//! One pool is installed for the process ([`install`]), as an
//! `Arc` in an `RwLock<Option<..>>` with a generation number bumped by every
//! install and uninstall. Each thread keeps its own copy of the `Arc` and
//! the generation it read; a call compares generations (one load) and uses
//! its copy, re-reading the slot only when it changed. A call therefore
//! always runs on a whole pool it holds a reference to, and the last
//! reference — the slot's or a thread's copy — releases it. While a thread's route is [`Route::Weights`] (set per thread, as torch's MemPool scopes are), its mallocs are takes from the
//! installed T1 arena instead; a free of such a pointer cannot give bytes
//! back to a bump arena and is counted as stranded.
//!
//! Regions ([`add_region`], issue 24's `imp_mem.torch.region`) are further
//! pools, each a scope routes its own thread's mallocs to
//! ([`set_region`]); a free finds its region by address first (one relaxed
//! load when none is added), so a region's segments go back to it whichever
//! thread frees them, and the installed pool serves everything else.
//!
//! A pool that leaves the hooks (replaced or uninstalled, or a region
//! removed) while blocks it handed out are still live is *retired*, not
//! released: torch keeps some blocks for the process's life (its cuBLAS
//! workspace, made at the first GEMM), and releasing the memory under them
//! would leave torch reading released memory. A free of a retired pool's
//! address goes back to it whatever is installed then (counted as
//! `retired_frees`), and the pool goes with its last live block. A pool
//! is put on the retired list *as it leaves*, before the slot or the
//! regions let go of it, whatever it holds then ([`depart`]): another
//! thread's copy of the slot may still place a block in it, and a free of
//! its block must never meet a gap where nothing knows it (found as a
//! foreign pointer, the block would stay live and the pool held for the
//! process's life). It leaves the list once every departed handle to it
//! has gone (`Drop for Installed`, `Drop for RegionEntry`: a block another
//! thread's call was still placing then counts too; tracked by handle
//! serial, so an old copy going cannot stand for a newer departure) and no
//! block of it is live. A free looks at the retired list first, then the
//! regions, then the slot, and looks again while installs move the slot
//! under it (a pool can go from the slot to the list, or back, between
//! two of those looks): a miss is counted only when the slot held still
//! across a whole look. A T1 arena
//! that leaves the hooks while takes of the weights route are live (the
//! model's tensors) is kept the same way until the last is freed.
//!
//! Nothing here panics or blocks on anything but the locks (the slot's,
//! the regions', and the pool's). Misuse — a foreign pointer, a double free, size 0, a
//! negative or absurd size, the wrong device, a free whose size disagrees,
//! nothing installed — is refused and counted. The counters are per-thread
//! shards, written by their thread without a locked instruction (a relaxed
//! load and store) and summed on read, so counting costs the hot path
//! almost nothing and no count is lost. A malloc returns 0 for "null".

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use super::{ActivationPool, RefusedFree};
use crate::arena::SharedArena;
use crate::error::MemError;

/// The alignment of a weights-route take (torch's block alignment).
const WEIGHTS_ALIGN: usize = 512;

/// Where the hooks' mallocs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The installed activation pool.
    Activations,
    /// The installed T1 arena (while loading weights).
    Weights,
}

impl Route {
    /// The route's name: `activations` or `weights`.
    pub const fn name(self) -> &'static str {
        match self {
            Route::Activations => "activations",
            Route::Weights => "weights",
        }
    }
}

struct Installed {
    pool: ActivationPool,
    device: i32,
    /// This handle's serial (`depart`, `departed`).
    serial: u64,
    /// The device's capacity: a request above it is absurd, whatever the
    /// mode.
    device_capacity: u64,
    weights: Option<Arc<WeightTakes>>,
}

/// A T1 arena the weights route takes from, and the pointers it handed out
/// (with their sizes). Kept past an uninstall while any is live: torch's
/// tensors over them (the model's weights) need the arena's memory.
struct WeightTakes {
    arena: SharedArena,
    ptrs: Mutex<HashMap<usize, u64>>,
}

/// The last handle to an installed pool goes (uninstalled or replaced,
/// and no thread's copy or call still on it): the pool stays retired while
/// blocks of it are live, and so does its arena's record while takes of it
/// are. Judged here, not at the uninstall, so that a malloc another
/// thread was finishing on it then is counted too.
impl Drop for Installed {
    fn drop(&mut self) {
        departed(&self.pool, self.device, self.serial);
        if let Some(w) = self.weights.take() {
            let gone = {
                let mut all = retired_weights();
                let gone = match all.iter().position(|r| Arc::ptr_eq(r, &w)) {
                    Some(at) => {
                        // Listed as it left: this handle goes under the
                        // list's lock (never the last: the list holds one),
                        // so the free of its last take, deciding under it
                        // too, sees the count this leaves.
                        drop(w);
                        let r = &all[at];
                        (Arc::strong_count(r) == 1 && r.ptrs().is_empty())
                            .then(|| all.swap_remove(at))
                    }
                    // Shared: the arena is installed again. Alone with
                    // takes live: kept for them.
                    None if Arc::strong_count(&w) == 1 && !w.ptrs().is_empty() => {
                        all.push(w);
                        None
                    }
                    None => Some(w),
                };
                RETIRED_WEIGHTS_COUNT.store(all.len(), Ordering::Release);
                gone
            };
            // The arena's last handle may go here, outside the lock.
            drop(gone);
        }
    }
}

impl WeightTakes {
    fn ptrs(&self) -> std::sync::MutexGuard<'_, HashMap<usize, u64>> {
        self.ptrs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static SLOT: RwLock<Option<Arc<Installed>>> = RwLock::new(None);
/// Bumped, under the slot's write lock, by every install and uninstall.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// A thread's copy of the slot and the generation it was read at.
struct Cached {
    generation: u64,
    installed: Option<Arc<Installed>>,
}

thread_local! {
    static CACHE: RefCell<Cached> = const {
        RefCell::new(Cached { generation: 0, installed: None })
    };
}
thread_local! {
    /// This thread's route (torch's MemPool scopes are per thread too: a
    /// loading thread's route must not take another thread's forward into
    /// the bump arena).
    static ROUTE: Cell<u8> = const { Cell::new(0) };
}

macro_rules! counters {
    ($( $name:ident, )*) => {
        /// The counters, as indices into a shard.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy)]
        enum C { $( $name, )* }

        const NAMES: &[&str] = &[$( stringify!($name), )*];
    };
}

const N: usize = 24;
const _: () = assert!(NAMES.len() == N, "N must count the counters");

/// One thread's counters. Only its thread writes them (a load and a store,
/// no read-modify-write: the hot path pays no locked instruction); readers
/// sum every shard.
struct Shard([AtomicU64; N]);

impl Shard {
    fn new() -> Self {
        Shard(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// Every thread's shard, kept after the thread exits so its counts stay.
static SHARDS: Mutex<Vec<Arc<Shard>>> = Mutex::new(Vec::new());
/// Counts from threads whose shard is gone (a hook called while the
/// thread's locals are being destroyed): shared, so read-modify-write.
static SHARED: Mutex<Option<Arc<Shard>>> = Mutex::new(None);
/// What `reset_stats` subtracts.
static BASELINE: Mutex<[u64; N]> = Mutex::new([0; N]);

thread_local! {
    static MINE: Arc<Shard> = {
        let shard = Arc::new(Shard::new());
        SHARDS.lock().unwrap_or_else(|p| p.into_inner()).push(shard.clone());
        shard
    };
}

#[inline]
fn add(c: C, n: u64) {
    let i = c as usize;
    let done = MINE.try_with(|s| {
        let v = s.0[i].load(Ordering::Relaxed);
        s.0[i].store(v.wrapping_add(n), Ordering::Relaxed);
    });
    if done.is_err() {
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        shared.get_or_insert_with(|| Arc::new(Shard::new())).0[i].fetch_add(n, Ordering::Relaxed);
    }
}

#[inline]
fn bump(c: C) {
    add(c, 1);
}

fn sums() -> [u64; N] {
    let mut out = [0u64; N];
    let shards = SHARDS.lock().unwrap_or_else(|p| p.into_inner());
    let shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    for shard in shards.iter().chain(shared.iter()) {
        for (o, c) in out.iter_mut().zip(shard.0.iter()) {
            *o = o.wrapping_add(c.load(Ordering::Relaxed));
        }
    }
    out
}

/// Every counter by name, in a fixed order, since the last `reset_stats`.
pub fn stats() -> Vec<(&'static str, u64)> {
    let now = sums();
    let base = *BASELINE.lock().unwrap_or_else(|p| p.into_inner());
    NAMES
        .iter()
        .zip(now.iter().zip(base.iter()))
        .map(|(name, (n, b))| (*name, n.wrapping_sub(*b)))
        .collect()
}

/// Starts every counter from zero (by remembering the current sums).
pub fn reset_stats() {
    let now = sums();
    *BASELINE.lock().unwrap_or_else(|p| p.into_inner()) = now;
}

counters! {
    mallocs,
    malloc_ok,
    frees,
    free_ok,
    not_installed,
    free_not_installed,
    zero_size,
    negative_size,
    absurd_size,
    wrong_device,
    ooms,
    malloc_errors,
    null_frees,
    foreign_frees,
    double_frees,
    bad_stream_frees,
    size_mismatches,
    weights_takes,
    weights_bytes,
    weights_refused,
    stranded_frees,
    stranded_bytes,
    panics,
    retired_frees,
}

fn slot() -> RwLockReadGuard<'static, Option<Arc<Installed>>> {
    // A poisoned lock means a panic while installing; the slot still holds
    // a whole value (an Option is replaced in one move).
    SLOT.read().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on the installed pool. The common case touches no shared
/// cache line: one relaxed-cost load of the generation, compared with the
/// thread's cached copy. When it changed, the thread re-reads the slot
/// under its read lock. Without thread locals (a thread being torn down)
/// the slot is read directly.
#[inline]
fn with_installed<R>(f: impl Fn(Option<&Installed>) -> R) -> R {
    let generation = GENERATION.load(Ordering::Acquire);
    let cached = CACHE.try_with(|cell| {
        let stale = cell
            .try_borrow()
            .map(|c| c.generation != generation)
            .unwrap_or(true);
        if stale {
            let fresh = {
                let guard = slot();
                Cached {
                    generation: GENERATION.load(Ordering::Acquire),
                    installed: guard.clone(),
                }
            };
            // Replaced outside any borrow; the old copy is dropped here,
            // which may release the last handle to an uninstalled pool.
            let old = cell
                .try_borrow_mut()
                .map(|mut c| std::mem::replace(&mut *c, fresh));
            drop(old);
        }
        cell.try_borrow().ok().map(|c| f(c.installed.as_deref()))
    });
    match cached {
        Ok(Some(r)) => r,
        _ => f(slot().as_deref()),
    }
}

/// Drops the calling thread's cached copy of the slot.
fn forget_cached() {
    let old = CACHE.try_with(|cell| {
        cell.try_borrow_mut().ok().and_then(|mut c| {
            c.generation = 0;
            c.installed.take()
        })
    });
    drop(old);
}

/// Routes the hooks to `pool` for `device` (and, on the weights route, to
/// `weights`), replacing what was installed. A call already running on
/// another thread finishes on the pool it started with (it holds it); every
/// thread's next call sees the new one.
pub fn install(pool: ActivationPool, device: i32, weights: Option<SharedArena>) {
    let device_capacity = pool.backend().info().capacity;
    let id = pool.id();
    let old = {
        let mut slot = SLOT.write().unwrap_or_else(|p| p.into_inner());
        // The same arena again keeps its takes' record (installed now, or
        // retired): their frees are still the arena's.
        let weights = weights.map(|arena| {
            let current = slot
                .as_ref()
                .and_then(|o| o.weights.clone())
                .filter(|w| w.arena.id() == arena.id());
            current
                .or_else(|| unretire_weights(arena.id()))
                .unwrap_or_else(|| {
                    Arc::new(WeightTakes {
                        arena,
                        ptrs: Mutex::new(HashMap::new()),
                    })
                })
        });
        let new = Installed {
            pool,
            device,
            serial: next_serial(),
            device_capacity,
            weights,
        };
        if let Some(o) = slot.as_ref() {
            // The same pool installed again departs too: another thread's
            // call still running on the old handle may place a block.
            depart(&o.pool, o.device, o.serial);
            if let Some(ow) = o.weights.as_ref() {
                let kept = new.weights.as_ref().is_some_and(|w| Arc::ptr_eq(w, ow));
                if !kept {
                    depart_weights(ow);
                }
            }
        }
        let old = slot.replace(Arc::new(new));
        GENERATION.fetch_add(1, Ordering::Release);
        old
    };
    forget_cached();
    // Installed again: its frees go through the slot, not the retired list.
    let back = unretire(id);
    // Released outside the lock: the last handle may release a region, or
    // retire the pool (`Drop for Installed`).
    drop((old, back));
}

/// Removes the installed pool; true if one was installed. Every thread's
/// next call refuses. The pool itself is released once no thread holds a
/// copy: the calling thread's is dropped here, another thread's at its next
/// call (or when it exits); if blocks of it are live, it is retired and
/// kept until the last of them is freed.
pub fn uninstall() -> bool {
    let old = {
        let mut slot = SLOT.write().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = slot.as_ref() {
            depart(&o.pool, o.device, o.serial);
            if let Some(ow) = o.weights.as_ref() {
                depart_weights(ow);
            }
        }
        let old = slot.take();
        GENERATION.fetch_add(1, Ordering::Release);
        old
    };
    forget_cached();
    old.is_some()
}

/// The id of the installed pool, if any.
pub fn installed_pool_id() -> Option<u64> {
    slot().as_ref().map(|i| i.pool.id())
}

/// Sets the calling thread's route.
pub fn set_route(route: Route) {
    let _ = ROUTE.try_with(|r| r.set(route as u8));
}

/// The calling thread's route (the activations while its locals are being
/// torn down).
pub fn route() -> Route {
    if ROUTE.try_with(Cell::get) == Ok(Route::Weights as u8) {
        Route::Weights
    } else {
        Route::Activations
    }
}

struct RegionEntry {
    pool: ActivationPool,
    device: i32,
    serial: u64,
}

/// A region's last handle goes (removed, and no call still on it): kept
/// on the retired list while blocks of it are live.
impl Drop for RegionEntry {
    fn drop(&mut self) {
        departed(&self.pool, self.device, self.serial);
    }
}

static REGIONS: RwLock<Vec<Arc<RegionEntry>>> = RwLock::new(Vec::new());
/// `REGIONS.len()`, read without the lock by every free.
static REGION_COUNT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The pool id this thread's mallocs go to; 0 for the installed pool.
    static CURRENT_REGION: Cell<u64> = const { Cell::new(0) };
}

fn regions() -> RwLockReadGuard<'static, Vec<Arc<RegionEntry>>> {
    REGIONS.read().unwrap_or_else(|p| p.into_inner())
}

/// Adds `pool` as a region for `device` (replacing a region of the same
/// pool): mallocs of a thread that selects it ([`set_region`]) go to it,
/// and frees of its addresses come back to it from any thread.
pub fn add_region(pool: ActivationPool, device: i32) {
    let id = pool.id();
    let replaced: Vec<Arc<RegionEntry>> = {
        let mut all = REGIONS.write().unwrap_or_else(|p| p.into_inner());
        let gone = take_where(&mut all, |r| r.pool.id() == id);
        all.push(Arc::new(RegionEntry {
            pool,
            device,
            serial: next_serial(),
        }));
        REGION_COUNT.store(all.len(), Ordering::Release);
        gone
    };
    // A region again: its frees go through the regions, not the retired
    // list (left there, the retired entry never saw its last free and held
    // the pool for the process's life).
    let back = unretire(id);
    // Dropped outside the lock (`Drop for RegionEntry` reads the regions).
    drop((replaced, back));
}

/// Removes the region of pool `pool_id`; true if there was one. Frees of
/// its addresses go back to it while blocks of it are live (it is
/// retired); once none is, they are refused (foreign).
pub fn remove_region(pool_id: u64) -> bool {
    let removed: Vec<Arc<RegionEntry>> = {
        let mut all = REGIONS.write().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = all.iter().find(|r| r.pool.id() == pool_id) {
            depart(&r.pool, r.device, r.serial);
        }
        let gone = take_where(&mut all, |r| r.pool.id() == pool_id);
        REGION_COUNT.store(all.len(), Ordering::Release);
        gone
    };
    // Dropped outside the lock: the last handle may release the region or
    // retire it (`Drop for RegionEntry`).
    !removed.is_empty()
}

/// Takes the entries `matches` picks out of `all`, the rest kept in order.
/// Nothing is dropped here: the caller drops what it took outside its lock.
fn take_where<T>(all: &mut Vec<T>, matches: impl Fn(&T) -> bool) -> Vec<T> {
    let (gone, kept) = std::mem::take(all).into_iter().partition(|t| matches(t));
    *all = kept;
    gone
}

/// A pool that left the hooks (or is leaving them), and its device.
struct Retiree {
    pool: ActivationPool,
    device: i32,
    /// The serials of the hooks' handles to it that have left the slot or
    /// the regions and are not dropped yet (a thread's copy of the slot may
    /// hold one): while any is, a block may still be placed in the pool, so
    /// it stays listed. By serial, not a count: a copy of an older handle
    /// (the pool installed, replaced and installed again) going must not
    /// take a newer departure's place.
    departing: Mutex<Vec<u64>>,
}

impl Retiree {
    fn departing(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.departing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Serials of the hooks' handles (`Installed`, `RegionEntry`).
static SERIALS: AtomicU64 = AtomicU64::new(1);

fn next_serial() -> u64 {
    SERIALS.fetch_add(1, Ordering::Relaxed)
}

/// The retired pools.
static RETIRED: RwLock<Vec<Arc<Retiree>>> = RwLock::new(Vec::new());
/// `RETIRED.len()`, read without the lock by every free.
static RETIRED_COUNT: AtomicUsize = AtomicUsize::new(0);

fn retired() -> RwLockReadGuard<'static, Vec<Arc<Retiree>>> {
    RETIRED.read().unwrap_or_else(|p| p.into_inner())
}

/// Lists `pool` as leaving the hooks through handle `serial`, before the
/// slot or the regions let go of it (called under their write lock): from
/// here a free of its address finds it on the retired list, whatever any
/// thread's copy of the slot says.
fn depart(pool: &ActivationPool, device: i32, serial: u64) {
    let mut all = RETIRED.write().unwrap_or_else(|p| p.into_inner());
    match all.iter().find(|r| r.pool.id() == pool.id()) {
        Some(r) => r.departing().push(serial),
        None => {
            all.push(Arc::new(Retiree {
                pool: pool.clone(),
                device,
                departing: Mutex::new(vec![serial]),
            }));
            RETIRED_COUNT.store(all.len(), Ordering::Release);
        }
    }
}

/// The hooks' handle `serial` to `pool` is gone (the last copy of an
/// installed one, or a removed region's): the pool stays on the retired
/// list while another departed handle is left or blocks of it are live.
fn departed(pool: &ActivationPool, device: i32, serial: u64) {
    let id = pool.id();
    let serving = installed_pool_id() == Some(id) || regions().iter().any(|r| r.pool.id() == id);
    let gone = {
        let mut all = RETIRED.write().unwrap_or_else(|p| p.into_inner());
        // Read under the list's lock: a free that empties the pool decides
        // under it too, so one of the two sees the other's change.
        let live = pool.stats().live;
        let gone = match all.iter().position(|r| r.pool.id() == id) {
            Some(i) => {
                let left = {
                    let mut departing = all[i].departing();
                    departing.retain(|&s| s != serial);
                    departing.len()
                };
                // Not "or serving": that was read before this lock, and the
                // pool may have left the slot again since (listed under a
                // handle that has gone meanwhile). A pool that serves and is
                // still listed sees its frees here first (`left_pool_free`
                // looks at this list before the regions and the slot) and
                // leaves the list with its last block.
                (left == 0 && live == 0).then(|| all.remove(i))
            }
            None => {
                if live > 0 && !serving {
                    all.push(Arc::new(Retiree {
                        pool: pool.clone(),
                        device,
                        departing: Mutex::new(Vec::new()),
                    }));
                }
                None
            }
        };
        RETIRED_COUNT.store(all.len(), Ordering::Release);
        gone
    };
    // The entry's handle goes outside the lock.
    drop(gone);
}

/// Lists T1 arena `w` as leaving the hooks, before the slot lets go of it
/// (called under its write lock): a free of one of its takes finds it
/// here whatever any thread's copy of the slot says. It leaves the list
/// once no install holds it and no take of it is live.
fn depart_weights(w: &Arc<WeightTakes>) {
    let mut all = retired_weights();
    if !all.iter().any(|r| Arc::ptr_eq(r, w)) {
        all.push(w.clone());
        RETIRED_WEIGHTS_COUNT.store(all.len(), Ordering::Release);
    }
}

/// Takes pool `pool_id` off the retired list (it serves the hooks again),
/// unless a departed handle of it is still held somewhere: that entry stays
/// until such handles are gone and its last block is freed through it (the
/// list is looked at before the slot and the regions, so it sees them).
fn unretire(pool_id: u64) -> Vec<Arc<Retiree>> {
    if RETIRED_COUNT.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    let mut all = RETIRED.write().unwrap_or_else(|p| p.into_inner());
    let gone = take_where(&mut all, |r| {
        r.pool.id() == pool_id && r.departing().is_empty()
    });
    RETIRED_COUNT.store(all.len(), Ordering::Release);
    gone
}

/// The ids of the retired pools (left the hooks, blocks still live).
pub fn retired_pool_ids() -> Vec<u64> {
    retired().iter().map(|r| r.pool.id()).collect()
}

/// T1 arenas that left the hooks while tensors over their takes were live.
static RETIRED_WEIGHTS: Mutex<Vec<Arc<WeightTakes>>> = Mutex::new(Vec::new());
/// `RETIRED_WEIGHTS.len()`, read without the lock by every free.
static RETIRED_WEIGHTS_COUNT: AtomicUsize = AtomicUsize::new(0);

fn retired_weights() -> std::sync::MutexGuard<'static, Vec<Arc<WeightTakes>>> {
    RETIRED_WEIGHTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes the retired record of arena `arena_id` back, if there is one.
fn unretire_weights(arena_id: u64) -> Option<Arc<WeightTakes>> {
    if RETIRED_WEIGHTS_COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let mut all = retired_weights();
    let at = all.iter().position(|r| r.arena.id() == arena_id)?;
    let found = all.swap_remove(at);
    RETIRED_WEIGHTS_COUNT.store(all.len(), Ordering::Release);
    Some(found)
}

/// How many T1 arenas are kept for live weight takes after leaving the hooks.
pub fn retired_arena_count() -> usize {
    retired_weights().len()
}

/// Counts `ptr`'s free if a retired arena handed it out (stranded: a bump
/// arena takes nothing back), dropping the arena with its last take; false
/// if none did.
fn retired_weights_free(ptr: usize) -> bool {
    let (bytes, gone) = {
        let mut all = retired_weights();
        // The take's record, and whether it was the arena's last.
        let found = all.iter().enumerate().find_map(|(at, r)| {
            let mut ptrs = r.ptrs();
            ptrs.remove(&ptr).map(|bytes| (at, bytes, ptrs.is_empty()))
        });
        let Some((at, bytes, last)) = found else {
            return false;
        };
        // Kept while an install still holds it (another thread's copy of
        // the slot): its handle goes under this lock (`Drop for Installed`).
        let gone = (last && Arc::strong_count(&all[at]) == 1).then(|| all.swap_remove(at));
        RETIRED_WEIGHTS_COUNT.store(all.len(), Ordering::Release);
        (bytes, gone)
    };
    // The arena's last handle may go here, outside the lock.
    drop(gone);
    bump(C::retired_frees);
    bump(C::stranded_frees);
    add(C::stranded_bytes, bytes);
    true
}

/// Frees `ptr` in the retired pool that holds it, dropping the pool with
/// its last live block; false if none holds it.
fn retired_free(ptr: usize, size: Option<i64>, device: i32, stream: u64) -> bool {
    // A fallback block lies outside the region: its address is a key.
    let entry = retired()
        .iter()
        .find(|r| {
            r.pool.contains(ptr) || (r.pool.has_fallbacks() && r.pool.requested_size(ptr).is_some())
        })
        .cloned();
    let Some(entry) = entry else {
        return false;
    };
    let live_after = pool_free(&entry.pool, entry.device, ptr, size, device, stream);
    if live_after.is_some() {
        bump(C::retired_frees);
    }
    // Its last block: the entry may go (judged again under the list's lock).
    if live_after == Some(0) {
        let id = entry.pool.id();
        let gone = {
            let mut all = RETIRED.write().unwrap_or_else(|p| p.into_inner());
            let gone = take_where(&mut all, |r| {
                r.pool.id() == id && r.departing().is_empty() && r.pool.stats().live == 0
            });
            RETIRED_COUNT.store(all.len(), Ordering::Release);
            gone
        };
        // The last handles go outside the lock, after the entry's own.
        drop(entry);
        drop(gone);
    }
    true
}

/// Routes the calling thread's mallocs to the region of pool `pool_id`
/// (`None`: back to the installed pool). Refuses an id that is no region.
/// Returns the previous choice.
pub fn set_region(pool_id: Option<u64>) -> Result<Option<u64>, MemError> {
    if let Some(id) = pool_id {
        if !regions().iter().any(|r| r.pool.id() == id) {
            return Err(MemError::invalid(format!(
                "pool #{id} is no region of the allocator hooks; add it first"
            )));
        }
    }
    let previous = current_region();
    let _ = CURRENT_REGION.try_with(|c| c.set(pool_id.unwrap_or(0)));
    Ok(previous)
}

/// The region the calling thread's mallocs go to, if any.
pub fn current_region() -> Option<u64> {
    match CURRENT_REGION.try_with(Cell::get) {
        Ok(0) | Err(_) => None,
        Ok(id) => Some(id),
    }
}

/// malloc in the region of pool `pool_id`, whatever the calling thread
/// selected (CuPy's allocator, which names its tier in the call); 0 is
/// null.
pub fn malloc_in(pool_id: u64, size: u64, device: i32, stream: u64) -> usize {
    bump(C::mallocs);
    if size == 0 {
        bump(C::zero_size);
        return 0;
    }
    region_malloc(pool_id, size, device, stream)
}

fn region_malloc(pool_id: u64, size: u64, device: i32, stream: u64) -> usize {
    let entry = regions().iter().find(|r| r.pool.id() == pool_id).cloned();
    let Some(entry) = entry else {
        bump(C::not_installed);
        return 0;
    };
    if device != entry.device {
        bump(C::wrong_device);
        return 0;
    }
    allocated(entry.pool.allocate(size, stream))
}

fn allocated(result: Result<usize, MemError>) -> usize {
    match result {
        Ok(addr) => {
            bump(C::malloc_ok);
            addr
        }
        Err(MemError::OutOfMemory(_)) | Err(MemError::PhaseViolation { .. }) => {
            bump(C::ooms);
            0
        }
        Err(_) => {
            bump(C::malloc_errors);
            0
        }
    }
}

/// Frees `ptr` in the region that holds it (inside its range, or one of
/// its fallback blocks outside it); false if none does.
fn region_free(ptr: usize, size: Option<i64>, device: i32, stream: u64) -> bool {
    let entry = {
        let all = regions();
        let owns = |r: &&Arc<RegionEntry>| r.pool.contains(ptr);
        // A fallback block lies outside the region: its address is a key.
        let falls_back =
            |r: &&Arc<RegionEntry>| r.pool.has_fallbacks() && r.pool.requested_size(ptr).is_some();
        all.iter()
            .find(owns)
            .or_else(|| all.iter().find(falls_back))
            .cloned()
    };
    let Some(entry) = entry else {
        return false;
    };
    pool_free(&entry.pool, entry.device, ptr, size, device, stream);
    true
}

/// Frees `ptr` in `pool` (of device `owner`), counting the outcome; the
/// pool's live blocks after the free, or None if nothing was freed.
fn pool_free(
    pool: &ActivationPool,
    owner: i32,
    ptr: usize,
    size: Option<i64>,
    device: i32,
    stream: u64,
) -> Option<u64> {
    if device != owner {
        bump(C::wrong_device);
        return None;
    }
    match pool.try_free(ptr, stream) {
        Ok(freed) => {
            counted_free(freed.requested, size);
            return Some(freed.live_after);
        }
        Err(RefusedFree::Foreign) => bump(C::foreign_frees),
        Err(RefusedFree::NotLive) => bump(C::double_frees),
        Err(RefusedFree::ReservedStream) => bump(C::bad_stream_frees),
    }
    None
}

fn counted_free(requested: u64, size: Option<i64>) {
    bump(C::free_ok);
    if let Some(size) = size {
        if u64::try_from(size).ok() != Some(requested) {
            bump(C::size_mismatches);
        }
    }
}

/// Counts a panic the caller caught around one of these functions.
pub fn count_panic() {
    bump(C::panics);
}

/// malloc with a signed size (torch's `ssize_t`); 0 is null.
#[inline]
pub fn malloc_signed(size: i64, device: i32, stream: u64) -> usize {
    if size < 0 {
        bump(C::mallocs);
        bump(C::negative_size);
        return 0;
    }
    malloc(size as u64, device, stream)
}

/// malloc; 0 is null.
#[inline]
pub fn malloc(size: u64, device: i32, stream: u64) -> usize {
    bump(C::mallocs);
    if size == 0 {
        bump(C::zero_size);
        return 0;
    }
    if let Some(region) = current_region() {
        return region_malloc(region, size, device, stream);
    }
    with_installed(|inst| malloc_on(inst, size, device, stream))
}

fn malloc_on(inst: Option<&Installed>, size: u64, device: i32, stream: u64) -> usize {
    let Some(inst) = inst else {
        bump(C::not_installed);
        return 0;
    };
    if device != inst.device {
        bump(C::wrong_device);
        return 0;
    }
    if size > inst.device_capacity {
        bump(C::absurd_size);
        return 0;
    }
    if route() == Route::Weights {
        return weights_take(inst, size);
    }
    allocated(inst.pool.allocate(size, stream))
}

fn weights_take(inst: &Installed, size: u64) -> usize {
    let taken = inst.weights.as_ref().and_then(|w| {
        let arena = &w.arena;
        let len = usize::try_from(size).ok()?;
        let ticket = arena.take(len, WEIGHTS_ALIGN).ok()?;
        arena.span(&ticket).ok().map(|s| s.addr())
    });
    let Some(addr) = taken else {
        bump(C::weights_refused);
        return 0;
    };
    if let Some(w) = inst.weights.as_ref() {
        w.ptrs().insert(addr, size);
    }
    bump(C::weights_takes);
    add(C::weights_bytes, size);
    bump(C::malloc_ok);
    addr
}

/// free; `size` is what the caller says it allocated, if it says.
#[inline]
pub fn free(ptr: usize, size: Option<i64>, device: i32, stream: u64) {
    bump(C::frees);
    if ptr == 0 {
        bump(C::null_frees);
        return;
    }
    // The block's pool may move while we look: from the slot to the
    // retired list (listed before the slot changes, `depart`: a second look
    // at the lists finds it), or back into the slot (taken off the list as
    // it is installed again: another look at the slot finds it). A miss is
    // counted only when the slot held still across a whole look.
    let mut missed = C::foreign_frees;
    for _ in 0..FREE_LOOKS {
        let generation = GENERATION.load(Ordering::Acquire);
        if left_pool_free(ptr, size, device, stream) {
            return;
        }
        match with_installed(|inst| free_on(inst, ptr, size, device, stream)) {
            None => return,
            Some(miss) => missed = miss,
        }
        if left_pool_free(ptr, size, device, stream) {
            return;
        }
        if GENERATION.load(Ordering::Acquire) == generation {
            break;
        }
    }
    bump(missed);
}

/// How many times a free looks for its pool while installs keep moving the
/// slot (each look is a few loads and, when something is listed, a short
/// scan).
const FREE_LOOKS: usize = 8;

/// Frees `ptr` in a region or a pool or arena that left the hooks; false
/// if none of them holds it.
fn left_pool_free(ptr: usize, size: Option<i64>, device: i32, stream: u64) -> bool {
    // The retired list first: a pool listed there that also serves (a
    // region again) must see its frees there, or the entry would never see
    // its last block and hold the pool for good.
    (RETIRED_COUNT.load(Ordering::Acquire) > 0 && retired_free(ptr, size, device, stream))
        || (REGION_COUNT.load(Ordering::Acquire) > 0 && region_free(ptr, size, device, stream))
        || (RETIRED_WEIGHTS_COUNT.load(Ordering::Acquire) > 0 && retired_weights_free(ptr))
}

/// Frees `ptr` in the installed pool (or records a T1 take's free);
/// `Some(counter)` when neither holds it, the miss to count if nothing
/// else does.
fn free_on(
    inst: Option<&Installed>,
    ptr: usize,
    size: Option<i64>,
    device: i32,
    stream: u64,
) -> Option<C> {
    let Some(inst) = inst else {
        return Some(C::free_not_installed);
    };
    if device != inst.device {
        bump(C::wrong_device);
        return None;
    }
    match inst.pool.try_free(ptr, stream) {
        Ok(freed) => counted_free(freed.requested, size),
        Err(RefusedFree::Foreign) => {
            let stranded = inst.weights.as_ref().and_then(|w| w.ptrs().remove(&ptr));
            match stranded {
                Some(bytes) => {
                    bump(C::stranded_frees);
                    add(C::stranded_bytes, bytes);
                }
                None => return Some(C::foreign_frees),
            }
        }
        Err(RefusedFree::NotLive) => bump(C::double_frees),
        Err(RefusedFree::ReservedStream) => bump(C::bad_stream_frees),
    }
    None
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::activations::{ActivationConfig, NoStreams};
    use crate::fake::{FakeBackend, FakeConfig};
    use crate::tag::Tag;
    use crate::tier::Tier;

    fn count(name: &str) -> u64 {
        stats()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map_or(u64::MAX, |(_, v)| v)
    }

    // The only test touching the process-wide slot in this binary.
    #[test]
    fn misuse_is_counted_and_refused_and_the_weights_route_strands() {
        let fb = FakeBackend::new(FakeConfig::default()).unwrap();
        let pool =
            ActivationPool::new(&fb, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap();
        reset_stats();
        assert_eq!(malloc(64, 0, 0), 0);
        assert_eq!(count("not_installed"), 1);
        install(pool.clone(), 0, None);
        let p = malloc(1000, 0, 0);
        assert_ne!(p, 0);
        assert_eq!(malloc(0, 0, 0), 0);
        assert_eq!(malloc_signed(-5, 0, 0), 0);
        assert_eq!(malloc(u64::MAX, 0, 0), 0);
        assert_eq!(malloc(64, 1, 0), 0);
        assert_eq!(malloc(2 << 20, 0, 0), 0);
        free(p, Some(999), 0, 0);
        free(p, Some(1000), 0, 0);
        free(8, Some(8), 0, 0);
        free(0, None, 0, 0);
        for (name, n) in [
            ("zero_size", 1),
            ("negative_size", 1),
            ("absurd_size", 1),
            ("wrong_device", 1),
            ("ooms", 1),
            ("size_mismatches", 1),
            ("double_frees", 1),
            ("foreign_frees", 1),
            ("null_frees", 1),
            ("free_ok", 1),
            ("malloc_ok", 1),
            ("panics", 0),
        ] {
            assert_eq!(count(name), n, "{name}");
        }
        pool.check_invariants().unwrap();
        assert_eq!(pool.stats().live, 0);

        let arena = SharedArena::new(&fb, Tier::ModelResident, 1 << 20, None).unwrap();
        install(pool.clone(), 0, Some(arena.clone()));
        set_route(Route::Weights);
        let w = malloc(3000, 0, 0);
        assert!(w != 0 && !pool.contains(w));
        assert_eq!(malloc(2 << 20, 0, 0), 0);
        set_route(Route::Activations);
        free(w, Some(3000), 0, 0);
        free(w, Some(3000), 0, 0);
        assert_eq!(
            (count("stranded_frees"), count("stranded_bytes")),
            (1, 3000)
        );
        assert_eq!((count("weights_refused"), count("foreign_frees")), (1, 2));
        assert_eq!(installed_pool_id(), Some(pool.id()));
        assert!(uninstall());
        assert!(!uninstall());

        // Another thread's copy: after an uninstall its next call refuses
        // and lets go of the pool, whose region is then released.
        let fb2 = FakeBackend::new(FakeConfig::default()).unwrap();
        let pool2 = ActivationPool::new(&fb2, &ActivationConfig::new(1 << 20), Arc::new(NoStreams))
            .unwrap();
        install(pool2, 0, None);
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (done, called) = std::sync::mpsc::channel::<usize>();
        let worker = std::thread::spawn(move || {
            let p = malloc(4096, 0, 0);
            free(p, Some(4096), 0, 0);
            done.send(p).unwrap();
            wait.recv().unwrap();
            done.send(malloc(4096, 0, 0)).unwrap();
        });
        assert_ne!(called.recv().unwrap(), 0);
        let region =
            |fb: &FakeBackend| fb.stats().tags.get(&Tag::Activations).map_or(0, |t| t.live);
        assert!(uninstall());
        assert_eq!(region(&fb2), 1 << 20, "the worker still holds the pool");
        go.send(()).unwrap();
        assert_eq!(called.recv().unwrap(), 0, "refused after the uninstall");
        worker.join().unwrap();
        assert_eq!(region(&fb2), 0, "released with the worker's copy");

        // A pool that leaves the hooks with a live block is retired: the
        // block's free still reaches it, whatever is installed then, and
        // the pool goes with that last block.
        let fb3 = FakeBackend::new(FakeConfig::default()).unwrap();
        let open = |fb: &FakeBackend| {
            ActivationPool::new(fb, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap()
        };
        let (a, b) = (open(&fb3), open(&fb3));
        let (a_id, b_id) = (a.id(), b.id());
        install(a, 0, None);
        let kept = malloc(4096, 0, 0);
        let gone = malloc(4096, 0, 0);
        free(gone, Some(4096), 0, 0);
        install(b, 0, None);
        assert_eq!(retired_pool_ids(), vec![a_id], "replaced with a live block");
        assert_eq!(region(&fb3), 2 << 20, "both pools' regions held");
        let on_b = malloc(4096, 0, 0);
        assert!(on_b != 0 && on_b != kept);
        free(kept, Some(4096), 0, 0);
        assert_eq!(count("retired_frees"), 1);
        assert!(retired_pool_ids().is_empty(), "gone with its last block");
        assert_eq!(region(&fb3), 1 << 20, "a's region released");
        free(kept, Some(4096), 0, 0);
        assert_eq!(
            count("retired_frees"),
            1,
            "a second free is not a retired one"
        );
        // Uninstalled with a live block, then installed again: no longer
        // retired, its frees go through the slot.
        assert!(uninstall());
        assert_eq!(retired_pool_ids(), vec![b_id]);
        let b_again = {
            let all = RETIRED.read().unwrap();
            all[0].pool.clone()
        };
        install(b_again, 0, None);
        assert!(retired_pool_ids().is_empty(), "installed again");
        free(on_b, Some(4096), 0, 0);
        assert_eq!(count("retired_frees"), 1);
        // A region removed with a live block.
        let c = open(&fb3);
        let c_id = c.id();
        add_region(c, 0);
        set_region(Some(c_id)).unwrap();
        let in_c = malloc(4096, 0, 0);
        set_region(None).unwrap();
        assert!(remove_region(c_id));
        assert_eq!(retired_pool_ids(), vec![c_id]);
        free(in_c, Some(4096), 0, 0);
        assert_eq!(count("retired_frees"), 2);
        assert!(retired_pool_ids().is_empty());
        assert!(uninstall());
        assert!(
            retired_pool_ids().is_empty(),
            "nothing live: released, not retired"
        );
        assert_eq!(region(&fb3), 0);

        // A block another thread's call was still placing in the pool when
        // it was uninstalled: the pool is retired when that thread lets go
        // of it, not judged at the uninstall.
        let pool5 = open(&fb3);
        let id5 = pool5.id();
        install(pool5.clone(), 0, None);
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (done, called) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            let p = malloc(4096, 0, 0);
            free(p, Some(4096), 0, 0);
            done.send(()).unwrap();
            wait.recv().unwrap();
            assert_eq!(malloc(4096, 0, 0), 0, "refused: uninstalled");
        });
        called.recv().unwrap();
        assert!(uninstall());
        assert_eq!(
            retired_pool_ids(),
            vec![id5],
            "listed while the worker's copy may still place a block"
        );
        // What the worker's call on its copy would have done in between.
        let late = pool5.allocate(4096, 0).unwrap();
        drop(pool5);
        go.send(()).unwrap();
        worker.join().unwrap();
        assert_eq!(
            retired_pool_ids(),
            vec![id5],
            "retired with the worker's copy"
        );
        assert_eq!(region(&fb3), 1 << 20);
        free(late, Some(4096), 0, 0);
        assert!(retired_pool_ids().is_empty());
        assert_eq!(region(&fb3), 0);

        // A T1 arena that leaves the hooks with takes live is kept for them.
        let fb4 = FakeBackend::new(FakeConfig::default()).unwrap();
        let pool4 = open(&fb4);
        let t1 = SharedArena::new(&fb4, Tier::ModelResident, 1 << 20, None).unwrap();
        let t1_live = |fb: &FakeBackend| fb.stats().tags.get(&Tag::Weights).map_or(0, |t| t.live);
        install(pool4.clone(), 0, Some(t1.clone()));
        set_route(Route::Weights);
        let (w1, w2) = (malloc(4096, 0, 0), malloc(4096, 0, 0));
        set_route(Route::Activations);
        // Installed again with the same arena: its takes are still its own.
        install(pool4.clone(), 0, Some(t1.clone()));
        let (stranded, retired) = (count("stranded_frees"), count("retired_frees"));
        free(w1, Some(4096), 0, 0);
        assert_eq!(count("stranded_frees"), stranded + 1);
        assert!(uninstall());
        assert_eq!(retired_arena_count(), 1);
        drop(t1);
        assert_eq!(t1_live(&fb4), 1 << 20, "kept for the live take");
        free(w2, Some(4096), 0, 0);
        assert_eq!(retired_arena_count(), 0);
        assert_eq!(t1_live(&fb4), 0, "released with its last take");
        assert_eq!(
            (count("stranded_frees"), count("retired_frees")),
            (stranded + 2, retired + 1)
        );
        let unknown = count("free_not_installed");
        free(w2, Some(4096), 0, 0);
        assert_eq!(
            count("free_not_installed"),
            unknown + 1,
            "gone: nothing knows it"
        );
        assert_eq!(count("panics"), 0);
    }
}
