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
//!
//! One concept a file: the thread's route (`route.rs`), the installed
//! slot and each thread's copy of it (`slot.rs`), the regions (`regions.rs`),
//! the pools and arenas that left the hooks (`retired.rs`) and the
//! per-thread counters (`counters.rs`); this module holds the entry points
//! (malloc, free) that look through them in turn.

mod counters;
mod regions;
mod retired;
mod route;
mod slot;
#[cfg(test)]
mod tests;

pub use counters::{reset_stats, stats};
pub use regions::{add_region, current_region, malloc_in, remove_region, set_region};
pub use retired::{retired_arena_count, retired_pool_ids};
pub use route::{route, set_route, Route};
pub use slot::{install, installed_pool_id, uninstall};

use std::sync::atomic::Ordering;

use super::{ActivationPool, RefusedFree};
use crate::error::MemError;
use counters::{add, bump, C};
use regions::{region_free, region_malloc, REGION_COUNT};
use retired::{retired_free, retired_weights_free, RETIRED_COUNT, RETIRED_WEIGHTS_COUNT};
use slot::{with_installed, Installed, GENERATION};

/// The alignment of a weights-route take (torch's block alignment).
const WEIGHTS_ALIGN: usize = 512;

pub(super) fn allocated(result: Result<usize, MemError>) -> usize {
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

/// Frees `ptr` in `pool` (of device `owner`), counting the outcome; the
/// pool's live blocks after the free, or None if nothing was freed. A
/// `device` of None is the owner's (a caller that knows none: `free_owned`).
pub(super) fn pool_free(
    pool: &ActivationPool,
    owner: i32,
    ptr: usize,
    size: Option<i64>,
    device: Option<i32>,
    stream: u64,
) -> Option<u64> {
    if device.is_some_and(|d| d != owner) {
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
    if let Err(missed) = free_found(ptr, size, Some(device), stream) {
        bump(missed);
    }
}

/// Frees `ptr` if the hooks handed it out — from any pool they know: the
/// installed one, a region, a retired pool, a T1 take — at its own device,
/// from any thread, and returns true; a double free of such a block is
/// refused and counted as [`free`] counts it, and true too (the block is
/// the hooks', no other allocator's). False, and nothing counted, for a
/// pointer the hooks never handed out (null included): the caller gives it
/// to whoever did. For a caller that sees every free of the process and
/// knows neither the size nor the device (the LD_PRELOAD interposer's
/// `cudaFree`, `crates/imp-mem-preload`).
pub fn free_owned(ptr: usize, stream: u64) -> bool {
    if ptr == 0 {
        return false;
    }
    let found = free_found(ptr, None, None, stream).is_ok();
    if found {
        bump(C::frees);
    }
    found
}

/// Looks for the pool that holds `ptr` and frees it there (counting the
/// outcome); `Err(counter)` when none holds it, the miss to count.
fn free_found(ptr: usize, size: Option<i64>, device: Option<i32>, stream: u64) -> Result<(), C> {
    // The block's pool may move while we look: from the slot to the
    // retired list (listed before the slot changes, `depart`: a second look
    // at the lists finds it), or back into the slot (taken off the list as
    // it is installed again: another look at the slot finds it). A miss is
    // counted only when the slot held still across a whole look.
    let mut missed = C::foreign_frees;
    for _ in 0..FREE_LOOKS {
        let generation = GENERATION.load(Ordering::Acquire);
        if left_pool_free(ptr, size, device, stream) {
            return Ok(());
        }
        match with_installed(|inst| free_on(inst, ptr, size, device, stream)) {
            None => return Ok(()),
            Some(miss) => missed = miss,
        }
        if left_pool_free(ptr, size, device, stream) {
            return Ok(());
        }
        if GENERATION.load(Ordering::Acquire) == generation {
            break;
        }
    }
    Err(missed)
}

/// How many times a free looks for its pool while installs keep moving the
/// slot (each look is a few loads and, when something is listed, a short
/// scan).
const FREE_LOOKS: usize = 8;

/// Frees `ptr` in a region or a pool or arena that left the hooks; false
/// if none of them holds it.
fn left_pool_free(ptr: usize, size: Option<i64>, device: Option<i32>, stream: u64) -> bool {
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
    device: Option<i32>,
    stream: u64,
) -> Option<C> {
    let Some(inst) = inst else {
        return Some(C::free_not_installed);
    };
    if device.is_some_and(|d| d != inst.device) {
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
