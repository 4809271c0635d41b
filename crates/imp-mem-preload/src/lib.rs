//! imp-mem's LD_PRELOAD interposer (`libimp_mem_preload.so`, shipped in the
//! wheel beside `imp_mem/_core.abi3.so`).
//!
//! Loaded first (`LD_PRELOAD`), it defines the two entry points
//! torch_memory_saver's preload library defines, `cudaMalloc` and
//! `cudaFree`, so every library of the process that calls them through the
//! dynamic linker — torch's caching allocator, NCCL, cuBLAS, a training
//! framework — calls these first:
//!
//! * `cudaMalloc` on a thread inside a *routing* scope (a per-thread depth,
//!   [`imp_mem_preload_enter`] / [`imp_mem_preload_exit`], which
//!   `imp_mem._preload.routing()` drives) goes to imp-mem's hook malloc
//!   (`imp_mem_torch_malloc`), which allocates from the thread's hook region
//!   (`imp_mem.torch._hook_region`) on the current device (the real
//!   `cudaGetDevice`). Outside, and for a size of 0, it is the real one.
//! * `cudaFree` of a pointer imp-mem's hooks handed out goes home to them
//!   (`imp_mem_hooks_free_owned`) from any thread, routed or not, after the
//!   device is synchronised (as the real `cudaFree` does); every other
//!   pointer, null included, goes to the real `cudaFree`.
//!
//! imp-mem's hooks live in the Python extension, which Python loads
//! `RTLD_LOCAL`: this library cannot find them itself, so `_preload.py`
//! hands their addresses over once ([`imp_mem_preload_register`]). The real
//! entry points are found with `dlsym(RTLD_NEXT, ..)` at their first use and
//! kept; one that is absent makes the call return
//! `cudaErrorSharedObjectSymbolNotFound` (and says so once on stderr). No
//! panic leaves an exported function: each body runs in `catch_unwind`, and
//! a panic becomes `cudaErrorMemoryAllocation` (malloc) or
//! `cudaErrorUnknown` (free). The rules (who owns a pointer, which region a
//! malloc goes to) live in imp-mem's core (`activations/hooks.rs`); this
//! library only decides, per call, imp-mem or the real runtime.

mod next;
mod route;

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use route::{HookFreeOwned, HookMalloc};

/// `cudaError_t` values this library returns itself.
pub mod code {
    use std::ffi::c_int;
    /// `cudaSuccess`.
    pub const SUCCESS: c_int = 0;
    /// `cudaErrorInvalidValue`: a null `devPtr`.
    pub const INVALID_VALUE: c_int = 1;
    /// `cudaErrorMemoryAllocation`: imp-mem refused the malloc (its region
    /// is full or paused, or none is selected), or a panic was caught.
    pub const MEMORY_ALLOCATION: c_int = 2;
    /// `cudaErrorInitializationError`: a routed malloc before imp-mem's
    /// hooks were registered.
    pub const INITIALIZATION_ERROR: c_int = 3;
    /// `cudaErrorSharedObjectSymbolNotFound`: no real entry point to
    /// forward to (no libcudart loaded globally after this library).
    pub const SYMBOL_NOT_FOUND: c_int = 302;
    /// `cudaErrorUnknown`: a panic caught in `cudaFree`.
    pub const UNKNOWN: c_int = 999;
}

/// The runtime's `cudaMalloc`, interposed.
///
/// # Safety
/// As the real one's: `dev_ptr` is null or valid for one pointer's write.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller's contract is the real cudaMalloc's, which
        // `route::malloc` keeps (it writes `dev_ptr` only when non-null).
        unsafe { route::malloc(&next::Dlsym, &route::registered(), dev_ptr, size) }
    }))
    .unwrap_or(code::MEMORY_ALLOCATION)
}

/// The runtime's `cudaFree`, interposed.
///
/// # Safety
/// As the real one's: `dev_ptr` is null or a pointer a `cudaMalloc` of this
/// process returned and not yet freed.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cudaFree(dev_ptr: *mut c_void) -> c_int {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller's contract is the real cudaFree's, passed on.
        unsafe { route::free(&next::Dlsym, &route::registered(), dev_ptr) }
    }))
    .unwrap_or(code::UNKNOWN)
}

/// Registers imp-mem's hooks (their addresses in `imp_mem._core`):
/// `malloc_fn` is `imp_mem_torch_malloc`, `free_owned_fn`
/// `imp_mem_hooks_free_owned`. Returns 0, or `cudaErrorInvalidValue` (and
/// keeps what was registered) if either is null. Registering again replaces
/// both.
///
/// # Safety
/// Each non-null address is a function of that C signature that lives for
/// the rest of the process (the extension is never unloaded).
#[no_mangle]
pub unsafe extern "C" fn imp_mem_preload_register(
    malloc_fn: *const c_void,
    free_owned_fn: *const c_void,
) -> c_int {
    catch_unwind(|| {
        // SAFETY: the caller vouches for both addresses (this function's
        // contract).
        unsafe { route::register(malloc_fn, free_owned_fn) }
    })
    .unwrap_or(code::UNKNOWN)
}

/// Whether imp-mem's hooks are registered (1) or not (0).
#[no_mangle]
pub extern "C" fn imp_mem_preload_registered() -> c_int {
    c_int::from(route::registered().is_complete())
}

/// Enters a routing scope on the calling thread: its `cudaMalloc`s go to
/// imp-mem until the matching [`imp_mem_preload_exit`]. Returns the new
/// depth (scopes nest), or -1 if the thread's locals are gone.
#[no_mangle]
pub extern "C" fn imp_mem_preload_enter() -> c_int {
    catch_unwind(route::enter).unwrap_or(-1)
}

/// Leaves the innermost routing scope of the calling thread. Returns the
/// new depth, or -1 if the thread was in none (nothing changes then).
#[no_mangle]
pub extern "C" fn imp_mem_preload_exit() -> c_int {
    catch_unwind(route::exit).unwrap_or(-1)
}

/// The calling thread's routing depth (0: not routed).
#[no_mangle]
pub extern "C" fn imp_mem_preload_depth() -> c_int {
    catch_unwind(route::depth).unwrap_or(0)
}
