//! Regions (issue 24's `imp_mem.torch.region`): further pools, each a scope
//! routes its own thread's mallocs to ([`set_region`]); a free finds its
//! region by address, whichever thread frees it.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use super::counters::{bump, C};
use super::retired::{depart, departed, next_serial, unretire};
use super::{allocated, pool_free};
use crate::activations::ActivationPool;
use crate::error::MemError;

pub(super) struct RegionEntry {
    pub(super) pool: ActivationPool,
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
pub(super) static REGION_COUNT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The pool id this thread's mallocs go to; 0 for the installed pool.
    static CURRENT_REGION: Cell<u64> = const { Cell::new(0) };
}

pub(super) fn regions() -> RwLockReadGuard<'static, Vec<Arc<RegionEntry>>> {
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
pub(super) fn take_where<T>(all: &mut Vec<T>, matches: impl Fn(&T) -> bool) -> Vec<T> {
    let (gone, kept) = std::mem::take(all).into_iter().partition(|t| matches(t));
    *all = kept;
    gone
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

pub(super) fn region_malloc(pool_id: u64, size: u64, device: i32, stream: u64) -> usize {
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

/// Frees `ptr` in the region that holds it (inside its range, or one of
/// its fallback blocks outside it); false if none does.
pub(super) fn region_free(ptr: usize, size: Option<i64>, device: Option<i32>, stream: u64) -> bool {
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
