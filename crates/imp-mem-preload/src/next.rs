//! The real runtime entry points, found after this library in the
//! process's global lookup order (`dlsym(RTLD_NEXT, ..)`), as the
//! interposer forwards to them.
//!
//! Each is looked up at its first use and kept in an atomic (a found
//! address never changes: the runtime is not unloaded under its callers).
//! One not found is looked up again at the next call, so a libcudart
//! loaded later is still found; the first miss of each is reported once on
//! stderr. Lock-free; no allocation.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// `cudaError_t cudaMalloc(void** devPtr, size_t size)`.
pub type RealMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
/// `cudaError_t cudaFree(void* devPtr)`.
pub type RealFree = unsafe extern "C" fn(*mut c_void) -> c_int;
/// `cudaError_t cudaGetDevice(int* device)`.
pub type RealGetDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
/// `cudaError_t cudaDeviceSynchronize(void)`.
pub type RealSynchronize = unsafe extern "C" fn() -> c_int;

/// Where the real entry points come from (the dynamic linker; a table of
/// stand-ins in the tests). None: not found.
pub trait Next {
    /// The real `cudaMalloc`.
    fn malloc(&self) -> Option<RealMalloc>;
    /// The real `cudaFree`.
    fn free(&self) -> Option<RealFree>;
    /// The real `cudaGetDevice`.
    fn get_device(&self) -> Option<RealGetDevice>;
    /// The real `cudaDeviceSynchronize`.
    fn synchronize(&self) -> Option<RealSynchronize>;
}

extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn write(fd: c_int, buf: *const c_void, count: usize) -> isize;
}

/// glibc's and musl's `RTLD_NEXT`: `((void *) -1)`.
const RTLD_NEXT: *mut c_void = usize::MAX as *mut c_void;

/// One real entry point: its name, where it was found, and whether its
/// absence has been reported.
struct Symbol {
    name: &'static CStr,
    found: AtomicPtr<c_void>,
    reported: AtomicBool,
}

impl Symbol {
    const fn new(name: &'static CStr) -> Self {
        Symbol {
            name,
            found: AtomicPtr::new(std::ptr::null_mut()),
            reported: AtomicBool::new(false),
        }
    }

    /// The address, looked up now if not yet found; None if absent.
    fn address(&self) -> Option<*mut c_void> {
        let kept = self.found.load(Ordering::Acquire);
        if !kept.is_null() {
            return Some(kept);
        }
        // SAFETY: `name` is a NUL-terminated string that outlives the
        // call; RTLD_NEXT is a handle dlsym defines.
        let found = unsafe { dlsym(RTLD_NEXT, self.name.as_ptr()) };
        if found.is_null() {
            self.report_missing();
            return None;
        }
        // Two threads may both look it up; they store the same address.
        self.found.store(found, Ordering::Release);
        Some(found)
    }

    fn report_missing(&self) {
        if self.reported.swap(true, Ordering::Relaxed) {
            return;
        }
        // One write (lines of two threads do not interleave), from a stack
        // buffer (no allocation inside an allocator).
        let mut line = [0u8; 256];
        let mut len = 0;
        for part in [
            b"imp-mem preload: no real ".as_slice(),
            self.name.to_bytes(),
            b" after libimp_mem_preload.so (dlsym RTLD_NEXT); load libcudart globally \
              (torch does at import); the call returns cudaErrorSharedObjectSymbolNotFound\n"
                .as_slice(),
        ] {
            let n = part.len().min(line.len() - len);
            line[len..len + n].copy_from_slice(&part[..n]);
            len += n;
        }
        // SAFETY: `line` is valid for `len` bytes; fd 2 is stderr (a failed
        // write is ignored: the error code stands).
        let _ = unsafe { write(2, line.as_ptr().cast(), len) };
    }
}

static MALLOC: Symbol = Symbol::new(c"cudaMalloc");
static FREE: Symbol = Symbol::new(c"cudaFree");
static GET_DEVICE: Symbol = Symbol::new(c"cudaGetDevice");
static SYNCHRONIZE: Symbol = Symbol::new(c"cudaDeviceSynchronize");

/// The real entry points, through the dynamic linker.
pub struct Dlsym;

impl Next for Dlsym {
    fn malloc(&self) -> Option<RealMalloc> {
        // SAFETY: the runtime's `cudaMalloc` has this C signature.
        MALLOC
            .address()
            .map(|a| unsafe { std::mem::transmute::<*mut c_void, RealMalloc>(a) })
    }

    fn free(&self) -> Option<RealFree> {
        // SAFETY: the runtime's `cudaFree` has this C signature.
        FREE.address()
            .map(|a| unsafe { std::mem::transmute::<*mut c_void, RealFree>(a) })
    }

    fn get_device(&self) -> Option<RealGetDevice> {
        // SAFETY: the runtime's `cudaGetDevice` has this C signature.
        GET_DEVICE
            .address()
            .map(|a| unsafe { std::mem::transmute::<*mut c_void, RealGetDevice>(a) })
    }

    fn synchronize(&self) -> Option<RealSynchronize> {
        // SAFETY: the runtime's `cudaDeviceSynchronize` has this C
        // signature.
        SYNCHRONIZE
            .address()
            .map(|a| unsafe { std::mem::transmute::<*mut c_void, RealSynchronize>(a) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_runtime_after_this_library_means_none() {
        // The test binary loads no libcudart.
        assert!(Dlsym.malloc().is_none());
        assert!(Dlsym.free().is_none());
        assert!(Dlsym.get_device().is_none());
        assert!(Dlsym.synchronize().is_none());
        assert!(MALLOC.reported.load(Ordering::Relaxed));
    }

    #[test]
    fn a_symbol_that_exists_is_found_and_kept() {
        static STRLEN: Symbol = Symbol::new(c"strlen");
        let first = STRLEN.address();
        assert!(first.is_some(), "libc's strlen follows the test binary");
        assert_eq!(Some(STRLEN.found.load(Ordering::Relaxed)), first);
        assert_eq!(STRLEN.address(), first);
    }
}
