//! Host memory for the fakes that costs only what is touched.
//!
//! A fake region stands in for device memory that is reserved as address
//! space and committed on demand (VMM). Its host stand-in must cost the same:
//! on Linux a [`HostPages`] is an anonymous private mapping made with
//! `MAP_NORESERVE`, so reserving 80 GiB takes address space, not RAM or swap
//! accounting; pages become resident when first written and
//! [`HostPages::release`] hands them back (`madvise(MADV_DONTNEED)`), after
//! which they read as zero. Elsewhere it falls back to a `calloc`ed block
//! (lazily zeroed by most systems for large sizes) whose release writes zeros.
//!
//! The contents start as zeros. Thread safety: a `HostPages` is only an
//! address range; its owner serializes access (the fakes hold their lock).

/// The page size assumed for releases: ranges are shrunk inward to multiples
/// of it, so a release never touches a byte outside the range it names.
const PAGE: usize = 4096;

/// One zero-initialized host block of `len` bytes aligned to `align`.
#[derive(Debug)]
pub(crate) struct HostPages {
    addr: usize,
    len: usize,
    map: usize,
    map_len: usize,
}

impl HostPages {
    /// Maps `len` bytes (`len > 0`) aligned to `align` (a power of two), or
    /// `None` when the system refuses.
    pub(crate) fn new(len: usize, align: usize) -> Option<Self> {
        // Over-map by `align` when the mapping's own (page) alignment is not
        // enough, and hand out the aligned address inside it.
        let pad = if align > PAGE { align } else { 0 };
        let map_len = len.checked_add(pad)?;
        let map = sys::map(map_len)?;
        let addr = crate::units::align_up(map, align.max(1))?;
        Some(Self {
            addr,
            len,
            map,
            map_len,
        })
    }

    /// The aligned start.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// The length asked for.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Returns the whole pages inside `[from, to)` (offsets from `addr`) to
    /// the system; they read as zero afterwards and cost nothing until
    /// written again.
    pub(crate) fn release(&self, from: usize, to: usize) {
        let to = to.min(self.len);
        let Some(start) = crate::units::align_up(self.addr + from, PAGE) else {
            return;
        };
        let end = (self.addr + to) & !(PAGE - 1);
        if end > start {
            sys::release(start, end - start);
        }
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        sys::unmap(self.map, self.map_len);
    }
}

#[cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
))]
mod sys {
    use std::ffi::{c_int, c_void};

    // The values of <sys/mman.h> on Linux for x86_64 and aarch64.
    const PROT_READ: c_int = 0x1;
    const PROT_WRITE: c_int = 0x2;
    const MAP_PRIVATE: c_int = 0x02;
    const MAP_ANONYMOUS: c_int = 0x20;
    const MAP_NORESERVE: c_int = 0x4000;
    const MADV_DONTNEED: c_int = 4;

    extern "C" {
        fn mmap(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            offset: i64,
        ) -> *mut c_void;
        fn munmap(addr: *mut c_void, len: usize) -> c_int;
        fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int;
    }

    pub(super) fn map(len: usize) -> Option<usize> {
        // SAFETY: a fresh anonymous private mapping at an address the kernel
        // picks (null hint) aliases nothing; the arguments are the documented
        // constants and `fd = -1, offset = 0` that `MAP_ANONYMOUS` requires.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                -1,
                0,
            )
        };
        // MAP_FAILED is `(void *) -1`.
        if ptr as isize == -1 || ptr.is_null() {
            None
        } else {
            Some(ptr as usize)
        }
    }

    pub(super) fn release(addr: usize, len: usize) {
        // SAFETY: `[addr, addr + len)` is whole pages inside a mapping of
        // ours (`HostPages::release` shrinks the range inward); on a private
        // anonymous mapping MADV_DONTNEED only drops contents, which then read
        // as zero, so no reference into it is invalidated. A failure leaves
        // the pages resident, which is harmless.
        unsafe { madvise(addr as *mut c_void, len, MADV_DONTNEED) };
    }

    pub(super) fn unmap(addr: usize, len: usize) {
        // SAFETY: `addr, len` is exactly one mapping made by `map`, unmapped
        // once, from `HostPages::drop`.
        unsafe { munmap(addr as *mut c_void, len) };
    }
}

#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
mod sys {
    use std::alloc::{alloc_zeroed, dealloc, Layout};

    // Alignment 1 so that the system allocator may use `calloc`, which most
    // systems zero lazily for large blocks; `HostPages` aligns inside it.
    fn layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len, 1).ok()
    }

    pub(super) fn map(len: usize) -> Option<usize> {
        // SAFETY: `len > 0` (the fakes refuse zero sizes), so the layout is
        // not zero-sized.
        let ptr = unsafe { alloc_zeroed(layout(len)?) };
        (!ptr.is_null()).then_some(ptr as usize)
    }

    pub(super) fn release(addr: usize, len: usize) {
        // SAFETY: `[addr, addr + len)` lies inside a block of ours.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len) };
    }

    pub(super) fn unmap(addr: usize, len: usize) {
        if let Some(layout) = layout(len) {
            // SAFETY: `addr` came from `alloc_zeroed` with this layout and is
            // freed once, from `HostPages::drop`.
            unsafe { dealloc(addr as *mut u8, layout) };
        }
    }
}
