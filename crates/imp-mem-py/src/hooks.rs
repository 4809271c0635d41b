//! The C entry points a framework loads as its allocator, exported from this
//! same shared library, and their Python controls.
//!
//! * torch's `CUDAPluggableAllocator`:
//!   `void* imp_mem_torch_malloc(ssize_t size, int device, cudaStream_t stream)` and
//!   `void imp_mem_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream)`.
//! * CuPy's `CFunctionAllocator(param, malloc_func, free_func, owner)`:
//!   `void* imp_mem_cupy_malloc(void* param, size_t size, int device)` and
//!   `void imp_mem_cupy_free(void* param, void* ptr, int device)`. CuPy's
//!   interface carries no stream, so `param` is taken as the stream handle
//!   (0, the legacy default stream, unless the caller builds one allocator
//!   per stream).
//!
//! They route to one process-wide installed pool (`ActivationPool.install`),
//! held in an `RwLock<Option<..>>`: a call takes the read lock for its
//! duration (one atomic add and one subtract when uncontended), so
//! `uninstall_hooks` — the write lock — waits for calls in flight and no
//! call can see a pool being dropped. While the route is "weights"
//! (`set_hook_route`), malloc takes from the installed T1 arena instead; a
//! free of such a pointer cannot return bytes to a bump arena and is counted
//! as stranded.
//!
//! Every body runs inside `catch_unwind`: a panic is counted and becomes a
//! null return (malloc) or nothing (free). Misuse — a foreign pointer, a
//! double free, size 0, a negative or absurd size, the wrong device, a free
//! whose size disagrees, nothing installed — is counted in a relaxed atomic
//! and refused; nothing reaches undefined behaviour. The hooks never touch
//! Python or the GIL.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, RwLock};

use imp_mem_core::activations::{ActivationPool, RefusedFree};
use imp_mem_core::{MemError, SharedArena};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::invalid;

/// The symbol names, as the frameworks' loaders want them.
pub const TORCH_MALLOC: &str = "imp_mem_torch_malloc";
/// See [`TORCH_MALLOC`].
pub const TORCH_FREE: &str = "imp_mem_torch_free";
/// See [`TORCH_MALLOC`].
pub const CUPY_MALLOC: &str = "imp_mem_cupy_malloc";
/// See [`TORCH_MALLOC`].
pub const CUPY_FREE: &str = "imp_mem_cupy_free";

/// The alignment of a weights-route take (torch's block alignment).
const WEIGHTS_ALIGN: usize = 512;

const ROUTE_ACTIVATIONS: u8 = 0;
const ROUTE_WEIGHTS: u8 = 1;

struct Installed {
    pool: ActivationPool,
    device: i32,
    /// The device's capacity: a request above it is absurd, whatever the
    /// mode.
    device_capacity: u64,
    weights: Option<SharedArena>,
    /// Pointers handed out by the weights route, with their sizes.
    weight_ptrs: Mutex<HashMap<usize, u64>>,
}

static SLOT: RwLock<Option<Installed>> = RwLock::new(None);
static ROUTE: AtomicU8 = AtomicU8::new(ROUTE_ACTIVATIONS);

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident, )*) => {
        /// The hooks' counters.
        #[allow(non_snake_case)]
        struct Counters { $( $name: AtomicU64, )* }

        static COUNTERS: Counters = Counters { $( $name: AtomicU64::new(0), )* };

        impl Counters {
            fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$( (stringify!($name), self.$name.load(Ordering::Relaxed)), )*]
            }

            fn reset(&self) {
                $( self.$name.store(0, Ordering::Relaxed); )*
            }
        }
    };
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
}

#[inline]
fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn slot() -> std::sync::RwLockReadGuard<'static, Option<Installed>> {
    // A poisoned lock means a panic while installing; the slot still holds
    // a whole value (an Option is replaced in one move).
    SLOT.read().unwrap_or_else(|p| p.into_inner())
}

/// Routes the hooks to `pool` for `device`, replacing what was installed.
pub(crate) fn install(pool: ActivationPool, device: i32, weights: Option<SharedArena>) {
    let device_capacity = pool.backend().info().capacity;
    let new = Installed {
        pool,
        device,
        device_capacity,
        weights,
        weight_ptrs: Mutex::new(HashMap::new()),
    };
    let old = SLOT.write().unwrap_or_else(|p| p.into_inner()).replace(new);
    drop(old);
}

/// Removes the installed pool; returns whether one was installed.
pub(crate) fn uninstall() -> bool {
    let old = SLOT.write().unwrap_or_else(|p| p.into_inner()).take();
    old.is_some()
}

/// The id of the installed pool, if any.
pub(crate) fn installed_pool_id() -> Option<u64> {
    slot().as_ref().map(|i| i.pool.id())
}

/// malloc, once the size is known to be positive.
fn malloc_impl(size: u64, device: c_int, stream: u64) -> *mut c_void {
    bump(&COUNTERS.mallocs);
    let guard = slot();
    let Some(inst) = guard.as_ref() else {
        bump(&COUNTERS.not_installed);
        return std::ptr::null_mut();
    };
    if device != inst.device {
        bump(&COUNTERS.wrong_device);
        return std::ptr::null_mut();
    }
    if size > inst.device_capacity {
        bump(&COUNTERS.absurd_size);
        return std::ptr::null_mut();
    }
    if ROUTE.load(Ordering::Relaxed) == ROUTE_WEIGHTS {
        return weights_take(inst, size);
    }
    match inst.pool.allocate(size, stream) {
        Ok(addr) => {
            bump(&COUNTERS.malloc_ok);
            addr as *mut c_void
        }
        Err(MemError::OutOfMemory(_)) | Err(MemError::PhaseViolation { .. }) => {
            bump(&COUNTERS.ooms);
            std::ptr::null_mut()
        }
        Err(_) => {
            bump(&COUNTERS.malloc_errors);
            std::ptr::null_mut()
        }
    }
}

fn weights_take(inst: &Installed, size: u64) -> *mut c_void {
    let taken = inst.weights.as_ref().and_then(|arena| {
        let len = usize::try_from(size).ok()?;
        let ticket = arena.take(len, WEIGHTS_ALIGN).ok()?;
        arena.span(&ticket).ok().map(|s| s.addr())
    });
    let Some(addr) = taken else {
        bump(&COUNTERS.weights_refused);
        return std::ptr::null_mut();
    };
    inst.weight_ptrs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(addr, size);
    bump(&COUNTERS.weights_takes);
    COUNTERS.weights_bytes.fetch_add(size, Ordering::Relaxed);
    bump(&COUNTERS.malloc_ok);
    addr as *mut c_void
}

/// free; `size` is what the caller says it allocated, if it says.
fn free_impl(ptr: *mut c_void, size: Option<i64>, device: c_int, stream: u64) {
    bump(&COUNTERS.frees);
    if ptr.is_null() {
        bump(&COUNTERS.null_frees);
        return;
    }
    let guard = slot();
    let Some(inst) = guard.as_ref() else {
        bump(&COUNTERS.free_not_installed);
        return;
    };
    if device != inst.device {
        bump(&COUNTERS.wrong_device);
        return;
    }
    let addr = ptr as usize;
    match inst.pool.try_free(addr, stream) {
        Ok(freed) => {
            bump(&COUNTERS.free_ok);
            if let Some(size) = size {
                if u64::try_from(size).ok() != Some(freed.requested) {
                    bump(&COUNTERS.size_mismatches);
                }
            }
        }
        Err(RefusedFree::Foreign) => {
            let stranded = inst
                .weight_ptrs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&addr);
            match stranded {
                Some(bytes) => {
                    bump(&COUNTERS.stranded_frees);
                    COUNTERS.stranded_bytes.fetch_add(bytes, Ordering::Relaxed);
                }
                None => bump(&COUNTERS.foreign_frees),
            }
        }
        Err(RefusedFree::NotLive) => bump(&COUNTERS.double_frees),
        Err(RefusedFree::ReservedStream) => bump(&COUNTERS.bad_stream_frees),
    }
}

/// torch `CUDAPluggableAllocator` malloc.
#[no_mangle]
pub extern "C" fn imp_mem_torch_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| {
        if size <= 0 {
            if size == 0 {
                bump(&COUNTERS.zero_size);
            } else {
                bump(&COUNTERS.negative_size);
            }
            bump(&COUNTERS.mallocs);
            return std::ptr::null_mut();
        }
        malloc_impl(size as u64, device, stream as usize as u64)
    }))
    .unwrap_or_else(|_| {
        bump(&COUNTERS.panics);
        std::ptr::null_mut()
    })
}

/// torch `CUDAPluggableAllocator` free.
#[no_mangle]
pub extern "C" fn imp_mem_torch_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    if catch_unwind(AssertUnwindSafe(|| {
        free_impl(ptr, Some(size as i64), device, stream as usize as u64)
    }))
    .is_err()
    {
        bump(&COUNTERS.panics);
    }
}

/// CuPy `CFunctionAllocator` malloc; `param` is the stream.
#[no_mangle]
pub extern "C" fn imp_mem_cupy_malloc(
    param: *mut c_void,
    size: usize,
    device: c_int,
) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| {
        if size == 0 {
            bump(&COUNTERS.zero_size);
            bump(&COUNTERS.mallocs);
            return std::ptr::null_mut();
        }
        malloc_impl(size as u64, device, param as usize as u64)
    }))
    .unwrap_or_else(|_| {
        bump(&COUNTERS.panics);
        std::ptr::null_mut()
    })
}

/// CuPy `CFunctionAllocator` free; `param` is the stream.
#[no_mangle]
pub extern "C" fn imp_mem_cupy_free(param: *mut c_void, ptr: *mut c_void, device: c_int) {
    if catch_unwind(AssertUnwindSafe(|| {
        free_impl(ptr, None, device, param as usize as u64)
    }))
    .is_err()
    {
        bump(&COUNTERS.panics);
    }
}

/// The hooks' counters.
#[pyfunction]
fn hook_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in COUNTERS.snapshot() {
        d.set_item(name, value)?;
    }
    d.set_item("installed", installed_pool_id().is_some())?;
    d.set_item("route", route_name())?;
    Ok(d)
}

/// Sets every hook counter to zero.
#[pyfunction]
fn reset_hook_stats() {
    COUNTERS.reset();
}

/// Removes the installed pool: the hooks refuse (null) until another is
/// installed. Returns whether one was installed. Waits for calls in flight.
#[pyfunction]
fn uninstall_hooks(py: Python<'_>) -> bool {
    py.allow_threads(uninstall)
}

fn route_name() -> &'static str {
    if ROUTE.load(Ordering::Relaxed) == ROUTE_WEIGHTS {
        "weights"
    } else {
        "activations"
    }
}

/// Where the hooks' mallocs go: "activations" (the installed pool) or
/// "weights" (the installed T1 arena, while loading).
#[pyfunction]
fn set_hook_route(route: &str) -> PyResult<()> {
    let value = match route {
        "activations" => ROUTE_ACTIVATIONS,
        "weights" => ROUTE_WEIGHTS,
        other => {
            return Err(invalid(format!(
                "route {other:?} is not a hook route; use \"activations\" or \"weights\""
            )))
        }
    };
    ROUTE.store(value, Ordering::Relaxed);
    Ok(())
}

/// The route now.
#[pyfunction]
fn hook_route() -> &'static str {
    route_name()
}

/// The path of the shared library that exports the hooks (this module's
/// own file), for `CUDAPluggableAllocator` / `ctypes.CDLL`.
#[pyfunction]
fn hook_library_path(py: Python<'_>) -> PyResult<String> {
    py.import("imp_mem._core")?.getattr("__file__")?.extract()
}

/// The hooks' addresses in this process, by symbol name (CuPy's
/// `CFunctionAllocator` takes function pointers as ints).
#[pyfunction]
fn hook_addresses(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(TORCH_MALLOC, imp_mem_torch_malloc as *const () as usize)?;
    d.set_item(TORCH_FREE, imp_mem_torch_free as *const () as usize)?;
    d.set_item(CUPY_MALLOC, imp_mem_cupy_malloc as *const () as usize)?;
    d.set_item(CUPY_FREE, imp_mem_cupy_free as *const () as usize)?;
    Ok(d)
}

/// Registers the functions and the symbol-name constants.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TORCH_MALLOC_SYMBOL", TORCH_MALLOC)?;
    m.add("TORCH_FREE_SYMBOL", TORCH_FREE)?;
    m.add("CUPY_MALLOC_SYMBOL", CUPY_MALLOC)?;
    m.add("CUPY_FREE_SYMBOL", CUPY_FREE)?;
    m.add_function(wrap_pyfunction!(hook_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_hook_stats, m)?)?;
    m.add_function(wrap_pyfunction!(uninstall_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(set_hook_route, m)?)?;
    m.add_function(wrap_pyfunction!(hook_route, m)?)?;
    m.add_function(wrap_pyfunction!(hook_library_path, m)?)?;
    m.add_function(wrap_pyfunction!(hook_addresses, m)?)?;
    Ok(())
}
