//! Pools and T1 arenas that left the hooks while blocks of them were live:
//! the retired lists, which frees look at first, and the handle serials
//! that say when a departed pool may leave them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use super::counters::{add, bump, C};
use super::pool_free;
use super::regions::{regions, take_where};
use super::slot::{installed_pool_id, WeightTakes};
use crate::activations::ActivationPool;

/// A pool that left the hooks (or is leaving them), and its device.
pub(super) struct Retiree {
    pub(super) pool: ActivationPool,
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

pub(super) fn next_serial() -> u64 {
    SERIALS.fetch_add(1, Ordering::Relaxed)
}

/// The retired pools.
pub(super) static RETIRED: RwLock<Vec<Arc<Retiree>>> = RwLock::new(Vec::new());
/// `RETIRED.len()`, read without the lock by every free.
pub(super) static RETIRED_COUNT: AtomicUsize = AtomicUsize::new(0);

fn retired() -> RwLockReadGuard<'static, Vec<Arc<Retiree>>> {
    RETIRED.read().unwrap_or_else(|p| p.into_inner())
}

/// Lists `pool` as leaving the hooks through handle `serial`, before the
/// slot or the regions let go of it (called under their write lock): from
/// here a free of its address finds it on the retired list, whatever any
/// thread's copy of the slot says.
pub(super) fn depart(pool: &ActivationPool, device: i32, serial: u64) {
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
pub(super) fn departed(pool: &ActivationPool, device: i32, serial: u64) {
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
pub(super) fn depart_weights(w: &Arc<WeightTakes>) {
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
pub(super) fn unretire(pool_id: u64) -> Vec<Arc<Retiree>> {
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
pub(super) static RETIRED_WEIGHTS_COUNT: AtomicUsize = AtomicUsize::new(0);

pub(super) fn retired_weights() -> std::sync::MutexGuard<'static, Vec<Arc<WeightTakes>>> {
    RETIRED_WEIGHTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes the retired record of arena `arena_id` back, if there is one.
pub(super) fn unretire_weights(arena_id: u64) -> Option<Arc<WeightTakes>> {
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
pub(super) fn retired_weights_free(ptr: usize) -> bool {
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
pub(super) fn retired_free(
    ptr: usize,
    size: Option<i64>,
    device: Option<i32>,
    stream: u64,
) -> bool {
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
