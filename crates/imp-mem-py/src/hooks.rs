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
//! * `void* imp_mem_cupy_region_malloc(void* param, size_t size, int device)`
//!   and `void imp_mem_cupy_region_free(void* param, void* ptr, int device)`:
//!   `param` is the id of a pool added as a hook region, which the block
//!   comes from whatever is installed (`imp_mem.cupy` uses them, so that
//!   CuPy and torch in one process each keep to their own tier); both work
//!   on the legacy default stream (CuPy passes the same `param` to both, so
//!   it cannot be the stream here), and the free finds the region by
//!   address.
//! * `int imp_mem_hooks_free_owned(void* ptr, cudaStream_t stream)`: the
//!   free of the LD_PRELOAD interposer (`crates/imp-mem-preload`), which
//!   sees every `cudaFree` of the process: 1 if the hooks handed `ptr` out
//!   (freed at home, any thread, any device), 0 if not (the interposer
//!   gives it to the real `cudaFree`), -1 if a panic was caught.
//!
//! They route to one process-wide installed pool through
//! `imp_mem_core::activations::hooks` (a generation check per call against
//! the thread's cached copy of the slot; the
//! routing, the weights route and the misuse counters live there, so the
//! criterion bench measures the same path). This file adds only the C ABI:
//! every body runs inside `catch_unwind`, a panic is counted and becomes a
//! null return (malloc) or nothing (free). The hooks never touch Python or
//! the GIL.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use imp_mem_core::activations::hooks::{self as routing, Route};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::activations::PyActivationPool;
use crate::errors::{invalid, IntoPyResult};

/// The symbol names, as the frameworks' loaders want them.
pub const TORCH_MALLOC: &str = "imp_mem_torch_malloc";
/// See [`TORCH_MALLOC`].
pub const TORCH_FREE: &str = "imp_mem_torch_free";
/// See [`TORCH_MALLOC`].
pub const CUPY_MALLOC: &str = "imp_mem_cupy_malloc";
/// See [`TORCH_MALLOC`].
pub const CUPY_FREE: &str = "imp_mem_cupy_free";
/// See [`TORCH_MALLOC`].
pub const CUPY_REGION_MALLOC: &str = "imp_mem_cupy_region_malloc";
/// See [`TORCH_MALLOC`].
pub const CUPY_REGION_FREE: &str = "imp_mem_cupy_region_free";
/// See [`TORCH_MALLOC`].
pub const FREE_OWNED: &str = "imp_mem_hooks_free_owned";

/// Runs `f`, counting a panic and returning `on_panic` instead.
#[inline]
fn guarded<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        routing::count_panic();
        on_panic
    })
}

/// The pool installed for the hooks, replacing any (see `routing::install`).
pub(crate) use routing::{install, installed_pool_id};

/// torch `CUDAPluggableAllocator` malloc.
#[no_mangle]
pub extern "C" fn imp_mem_torch_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let addr = guarded(0, || {
        routing::malloc_signed(size as i64, device, stream as usize as u64)
    });
    addr as *mut c_void
}

/// torch `CUDAPluggableAllocator` free.
#[no_mangle]
pub extern "C" fn imp_mem_torch_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    guarded((), || {
        routing::free(
            ptr as usize,
            Some(size as i64),
            device,
            stream as usize as u64,
        )
    });
}

/// CuPy `CFunctionAllocator` malloc; `param` is the stream.
#[no_mangle]
pub extern "C" fn imp_mem_cupy_malloc(
    param: *mut c_void,
    size: usize,
    device: c_int,
) -> *mut c_void {
    let addr = guarded(0, || {
        routing::malloc(size as u64, device, param as usize as u64)
    });
    addr as *mut c_void
}

/// CuPy `CFunctionAllocator` malloc in a hook region: `param` is the
/// region's pool id (legacy default stream).
#[no_mangle]
pub extern "C" fn imp_mem_cupy_region_malloc(
    param: *mut c_void,
    size: usize,
    device: c_int,
) -> *mut c_void {
    let addr = guarded(0, || {
        routing::malloc_in(param as usize as u64, size as u64, device, 0)
    });
    addr as *mut c_void
}

/// CuPy `CFunctionAllocator` free for `imp_mem_cupy_region_malloc`'s
/// blocks: `param` is the region's pool id, the stream the legacy default
/// one, as at the malloc.
#[no_mangle]
pub extern "C" fn imp_mem_cupy_region_free(_param: *mut c_void, ptr: *mut c_void, device: c_int) {
    guarded((), || routing::free(ptr as usize, None, device, 0));
}

/// CuPy `CFunctionAllocator` free; `param` is the stream.
#[no_mangle]
pub extern "C" fn imp_mem_cupy_free(param: *mut c_void, ptr: *mut c_void, device: c_int) {
    guarded((), || {
        routing::free(ptr as usize, None, device, param as usize as u64)
    });
}

/// The LD_PRELOAD interposer's free: 1 taken (the hooks' block), 0 not
/// the hooks' (nothing counted), -1 a panic (counted).
#[no_mangle]
pub extern "C" fn imp_mem_hooks_free_owned(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guarded(-1, || {
        c_int::from(routing::free_owned(ptr as usize, stream as usize as u64))
    })
}

/// The hooks' counters.
#[pyfunction]
fn hook_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in routing::stats() {
        d.set_item(name, value)?;
    }
    d.set_item("installed", installed_pool_id().is_some())?;
    d.set_item("route", routing::route().name())?;
    d.set_item("retired_pools", routing::retired_pool_ids().len())?;
    d.set_item("retired_arenas", routing::retired_arena_count())?;
    Ok(d)
}

/// Sets every hook counter to zero.
#[pyfunction]
fn reset_hook_stats() {
    routing::reset_stats();
}

/// Removes the installed pool: the hooks refuse (null) until another is
/// installed. Returns whether one was installed. A call already running on
/// another thread finishes on its pool; the pool is released once no
/// thread holds it (another thread lets go at its next call). A pool with
/// live blocks is retired instead: their frees still reach it, and it is
/// released with the last (`hook_stats()["retired_pools"]`).
#[pyfunction]
fn uninstall_hooks(py: Python<'_>) -> bool {
    py.detach(routing::uninstall)
}

/// Where the calling thread's hook mallocs go: "activations" (the installed
/// pool) or "weights" (the installed T1 arena, while loading). Per thread,
/// as torch's MemPool scopes are.
#[pyfunction]
fn set_hook_route(route: &str) -> PyResult<()> {
    let value = match route {
        "activations" => Route::Activations,
        "weights" => Route::Weights,
        other => {
            return Err(invalid(format!(
                "route {other:?} is not a hook route; use \"activations\" or \"weights\""
            )))
        }
    };
    routing::set_route(value);
    Ok(())
}

/// Adds `pool` as a region of the hooks for device `device` (default 0):
/// mallocs of a thread that selects it (`set_hook_region`) go to it, and
/// frees of its addresses come back to it from any thread. The installed
/// pool serves every other thread (`imp_mem.torch.region`).
#[pyfunction]
#[pyo3(signature = (pool, device = None))]
fn add_hook_region(
    py: Python<'_>,
    pool: PyRef<'_, PyActivationPool>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let device = device.map_or(Ok(0), |d| crate::convert::index(d, "device"))?;
    let device = i32::try_from(device)
        .map_err(|_| invalid(format!("device {device} is not a device ordinal")))?;
    let pool = pool.pool.clone();
    // The write lock waits for hook calls, which never need the GIL.
    py.detach(move || routing::add_region(pool, device));
    Ok(())
}

/// Removes `pool`'s region; returns whether it was one.
#[pyfunction]
fn remove_hook_region(py: Python<'_>, pool: PyRef<'_, PyActivationPool>) -> bool {
    let id = pool.pool.id();
    py.detach(move || routing::remove_region(id))
}

/// Routes the calling thread's mallocs to `pool`'s region (`None`: back to
/// the installed pool). A pool that is no region raises InvalidArgument.
#[pyfunction]
#[pyo3(signature = (pool))]
fn set_hook_region(pool: Option<PyRef<'_, PyActivationPool>>) -> PyResult<()> {
    routing::set_region(pool.map(|p| p.pool.id())).py()?;
    Ok(())
}

/// The calling thread's route.
#[pyfunction]
fn hook_route() -> &'static str {
    routing::route().name()
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
    d.set_item(
        CUPY_REGION_MALLOC,
        imp_mem_cupy_region_malloc as *const () as usize,
    )?;
    d.set_item(
        CUPY_REGION_FREE,
        imp_mem_cupy_region_free as *const () as usize,
    )?;
    d.set_item(FREE_OWNED, imp_mem_hooks_free_owned as *const () as usize)?;
    Ok(d)
}

/// Registers the functions and the symbol-name constants.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TORCH_MALLOC_SYMBOL", TORCH_MALLOC)?;
    m.add("TORCH_FREE_SYMBOL", TORCH_FREE)?;
    m.add("CUPY_MALLOC_SYMBOL", CUPY_MALLOC)?;
    m.add("CUPY_FREE_SYMBOL", CUPY_FREE)?;
    m.add("CUPY_REGION_MALLOC_SYMBOL", CUPY_REGION_MALLOC)?;
    m.add("CUPY_REGION_FREE_SYMBOL", CUPY_REGION_FREE)?;
    m.add("FREE_OWNED_SYMBOL", FREE_OWNED)?;
    m.add_function(wrap_pyfunction!(hook_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_hook_stats, m)?)?;
    m.add_function(wrap_pyfunction!(uninstall_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(set_hook_route, m)?)?;
    m.add_function(wrap_pyfunction!(hook_route, m)?)?;
    m.add_function(wrap_pyfunction!(add_hook_region, m)?)?;
    m.add_function(wrap_pyfunction!(remove_hook_region, m)?)?;
    m.add_function(wrap_pyfunction!(set_hook_region, m)?)?;
    m.add_function(wrap_pyfunction!(hook_library_path, m)?)?;
    m.add_function(wrap_pyfunction!(hook_addresses, m)?)?;
    Ok(())
}
