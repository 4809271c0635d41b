//! The installed pool: one `Arc` in an `RwLock<Option<..>>` with a
//! generation number bumped by every install and uninstall, and each
//! thread's copy of it, re-read only when the generation changed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use super::retired::{
    depart, depart_weights, departed, next_serial, retired_weights, unretire, unretire_weights,
    RETIRED_WEIGHTS_COUNT,
};
use crate::activations::ActivationPool;
use crate::arena::SharedArena;

pub(super) struct Installed {
    pub(super) pool: ActivationPool,
    pub(super) device: i32,
    /// This handle's serial (`depart`, `departed`).
    serial: u64,
    /// The device's capacity: a request above it is absurd, whatever the
    /// mode.
    pub(super) device_capacity: u64,
    pub(super) weights: Option<Arc<WeightTakes>>,
}

/// A T1 arena the weights route takes from, and the pointers it handed out
/// (with their sizes). Kept past an uninstall while any is live: torch's
/// tensors over them (the model's weights) need the arena's memory.
pub(super) struct WeightTakes {
    pub(super) arena: SharedArena,
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
    pub(super) fn ptrs(&self) -> std::sync::MutexGuard<'_, HashMap<usize, u64>> {
        self.ptrs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static SLOT: RwLock<Option<Arc<Installed>>> = RwLock::new(None);
/// Bumped, under the slot's write lock, by every install and uninstall.
pub(super) static GENERATION: AtomicU64 = AtomicU64::new(1);

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
pub(super) fn with_installed<R>(f: impl Fn(Option<&Installed>) -> R) -> R {
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
