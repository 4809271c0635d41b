//! Per call, imp-mem or the real runtime: the interposer's decisions, over
//! a source of real entry points ([`Next`]) and imp-mem's registered hooks
//! ([`Hooks`]), both passed in so the tests drive them with stand-ins.
//!
//! * The routing depth is a thread local (`Cell<u32>`, const-initialised,
//!   no destructor: readable while the thread is torn down), raised and
//!   lowered by [`enter`] / [`exit`]; a malloc is routed while it is above 0.
//! * The hooks are two addresses in atomics, written by [`register`]
//!   (release) and read by every call (acquire); imp-mem's extension is
//!   never unloaded, so an address once registered stays callable.
//!
//! A free asks imp-mem first whenever the hooks are registered, routed or
//! not: a block imp-mem handed out must go home from whichever thread
//! frees it (torch frees its segments wherever it empties its cache).

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::code;
use crate::next::Next;

/// imp-mem's `void* imp_mem_torch_malloc(ssize_t size, int device, cudaStream_t stream)`.
pub type HookMalloc = unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void;
/// imp-mem's `int imp_mem_hooks_free_owned(void* ptr, cudaStream_t stream)`:
/// 1 taken (the hooks' block), 0 not the hooks', below 0 a failure.
pub type HookFreeOwned = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;

static HOOK_MALLOC: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static HOOK_FREE_OWNED: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// imp-mem's hooks, as registered (None: not yet).
#[derive(Clone, Copy, Default)]
pub struct Hooks {
    /// Where a routed malloc goes.
    pub malloc: Option<HookMalloc>,
    /// Where every non-null free is offered first.
    pub free_owned: Option<HookFreeOwned>,
}

impl Hooks {
    /// Both hooks are there.
    pub fn is_complete(&self) -> bool {
        self.malloc.is_some() && self.free_owned.is_some()
    }
}

/// The hooks registered in this process.
pub fn registered() -> Hooks {
    let malloc = HOOK_MALLOC.load(Ordering::Acquire);
    let free_owned = HOOK_FREE_OWNED.load(Ordering::Acquire);
    // SAFETY: only `register` stores non-null addresses here, each a
    // function of this signature for the process's life (its contract).
    let malloc = (!malloc.is_null())
        .then(|| unsafe { std::mem::transmute::<*mut c_void, HookMalloc>(malloc) });
    // SAFETY: as above, for the free.
    let free_owned = (!free_owned.is_null())
        .then(|| unsafe { std::mem::transmute::<*mut c_void, HookFreeOwned>(free_owned) });
    Hooks { malloc, free_owned }
}

/// Stores the hooks' addresses; `cudaErrorInvalidValue` (nothing stored)
/// if either is null.
///
/// # Safety
/// Each address is a function of its hook's signature ([`HookMalloc`],
/// [`HookFreeOwned`]) that stays loaded for the rest of the process.
pub unsafe fn register(malloc_fn: *const c_void, free_owned_fn: *const c_void) -> c_int {
    if malloc_fn.is_null() || free_owned_fn.is_null() {
        return code::INVALID_VALUE;
    }
    HOOK_MALLOC.store(malloc_fn.cast_mut(), Ordering::Release);
    HOOK_FREE_OWNED.store(free_owned_fn.cast_mut(), Ordering::Release);
    code::SUCCESS
}

/// The calling thread's routing depth.
pub fn depth() -> c_int {
    DEPTH.try_with(Cell::get).map_or(0, as_c_int)
}

/// Raises the calling thread's depth; the new one (-1 without locals).
pub fn enter() -> c_int {
    DEPTH
        .try_with(|d| {
            let up = d.get().saturating_add(1);
            d.set(up);
            as_c_int(up)
        })
        .unwrap_or(-1)
}

/// Lowers the calling thread's depth; the new one, or -1 (unchanged) if it
/// was 0.
pub fn exit() -> c_int {
    DEPTH
        .try_with(|d| match d.get() {
            0 => -1,
            n => {
                d.set(n - 1);
                as_c_int(n - 1)
            }
        })
        .unwrap_or(-1)
}

fn as_c_int(n: u32) -> c_int {
    c_int::try_from(n).unwrap_or(c_int::MAX)
}

/// `cudaMalloc`: routed (depth above 0, size above 0) to `hooks.malloc` on
/// the real current device, else to the real one.
///
/// # Safety
/// `dev_ptr` is null or valid for one pointer's write; `next`'s and
/// `hooks`' functions have their declared C signatures.
pub unsafe fn malloc(
    next: &impl Next,
    hooks: &Hooks,
    dev_ptr: *mut *mut c_void,
    size: usize,
) -> c_int {
    if depth() == 0 || size == 0 {
        let Some(real) = next.malloc() else {
            return code::SYMBOL_NOT_FOUND;
        };
        // SAFETY: the caller's arguments, as the real cudaMalloc takes them.
        return unsafe { real(dev_ptr, size) };
    }
    if dev_ptr.is_null() {
        return code::INVALID_VALUE;
    }
    let Some(hook) = hooks.malloc else {
        return code::INITIALIZATION_ERROR;
    };
    let Some(get_device) = next.get_device() else {
        return code::SYMBOL_NOT_FOUND;
    };
    let mut device: c_int = 0;
    // SAFETY: `device` is a live c_int to write.
    let got = unsafe { get_device(&mut device) };
    if got != code::SUCCESS {
        return got;
    }
    let addr = match isize::try_from(size) {
        // SAFETY: the hook's signature; the null stream is the legacy
        // default one (cudaMalloc names none).
        Ok(size) => unsafe { hook(size, device, std::ptr::null_mut()) },
        Err(_) => std::ptr::null_mut(),
    };
    // SAFETY: `dev_ptr` is non-null and, by the caller's contract, valid
    // for this write.
    unsafe { dev_ptr.write(addr) };
    if addr.is_null() {
        code::MEMORY_ALLOCATION
    } else {
        code::SUCCESS
    }
}

/// `cudaFree`: a non-null pointer is offered to `hooks.free_owned` (when
/// registered) after the device is synchronised, as the real `cudaFree`
/// would; one imp-mem does not own goes to the real `cudaFree`.
///
/// # Safety
/// `next`'s and `hooks`' functions have their declared C signatures;
/// `dev_ptr` is what the caller would give the real `cudaFree`.
pub unsafe fn free(next: &impl Next, hooks: &Hooks, dev_ptr: *mut c_void) -> c_int {
    if let (false, Some(free_owned)) = (dev_ptr.is_null(), hooks.free_owned) {
        let Some(synchronize) = next.synchronize() else {
            return code::SYMBOL_NOT_FOUND;
        };
        // The real cudaFree synchronises the device before the memory can
        // be reused; a block given back to imp-mem is reusable at once.
        // SAFETY: the runtime's cudaDeviceSynchronize, no arguments.
        let synced = unsafe { synchronize() };
        // SAFETY: the hook's signature; the legacy default stream (the
        // device is idle now).
        let taken = unsafe { free_owned(dev_ptr, std::ptr::null_mut()) };
        match taken {
            0 => {}
            1 => return synced,
            _ => return code::UNKNOWN,
        }
    }
    let Some(real) = next.free() else {
        return code::SYMBOL_NOT_FOUND;
    };
    // SAFETY: the caller's pointer, as the real cudaFree takes it.
    unsafe { real(dev_ptr) }
}

#[cfg(test)]
mod tests;
