//! Pinned host memory: page-locked buffers (`cuMemHostAlloc`) and the
//! registration of a caller's memory (`cuMemHostRegister`), for `PinnedBuffer`
//! and `HostRegistration` (T5b).
//!
//! Algorithm: [`PinnedHostSource`] is a [`MemorySource`] of kind
//! `PinnedHost` — one `cuMemHostAlloc` per acquisition with
//! `CU_MEMHOSTALLOC_PORTABLE` (pinned for every context, so a buffer outlives
//! no particular one) and **never** `WRITECOMBINED`: write-combined pages
//! are uncached for host reads, and staging buffers are read back on the
//! host. With unified addressing (checked when the device opens) the device
//! sees the buffer at its host address. Pinning is slow (0.48 ms for 1 MiB,
//! 21.8 ms for 64 MiB on the H200 host) so it belongs to load time, like every
//! acquisition.
//!
//! [`CudaPinnedHost`] carries the four physical operations the tier layer's
//! `PinnedHostOps` trait names (allocate, free, register, unregister —
//! `cuMemHostRegister_v2` with `PORTABLE | DEVICEMAP`), so that implementing
//! that trait is a one-to-one forwarding; the move-only owners
//! (`PinnedBuffer`, `HostRegistration`) live in the core.
//!
//! Capacity: pinned memory comes out of host RAM; the source reports
//! `MemTotal` from `/proc/meminfo` (or the budget the caller gives where it
//! cannot be read), and the budget is what really bounds it.
//!
//! Thread safety: the driver calls are thread-safe; each binds the device's
//! primary context for its duration. Both types are `Send + Sync`.

use std::ffi::c_void;
use std::sync::Arc;

use imp_mem_core::{
    Backend, MemError, MemoryKind, MemorySource, PhaseMode, SourceError, SourceInfo,
};

use crate::driver::{
    check, DeviceContext, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, CU_MEMHOSTALLOC_PORTABLE,
    CU_MEMHOSTALLOC_WRITECOMBINED, CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE,
};

/// The flags every pinned buffer is allocated with.
pub const PINNED_ALLOC_FLAGS: u32 = CU_MEMHOSTALLOC_PORTABLE;
/// The flags every registration uses.
pub const REGISTER_FLAGS: u32 = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;

// Compile-time proof that the allocation flags never ask for write-combined.
const _: () = assert!(PINNED_ALLOC_FLAGS & CU_MEMHOSTALLOC_WRITECOMBINED == 0);

/// The alignment every pinned buffer gets: a page. `cuMemHostAlloc` itself
/// does not promise it — on the H200 machine (driver 580) a 1 MiB buffer came
/// back at an address ending in `0x800` — so [`pinned_alloc`] over-allocates
/// one page and aligns up.
pub const PINNED_ALIGNMENT: usize = 4096;

/// Bytes of the header below an aligned buffer that keep the driver's own
/// pointer.
const HEADER: usize = std::mem::size_of::<usize>();

/// Host RAM from `/proc/meminfo`'s `MemTotal`, if it can be read. Pure
/// parsing in [`parse_mem_total`].
pub fn host_memory_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_total(&text)
}

/// Parses `MemTotal:  <n> kB` out of `/proc/meminfo` text.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    let unit = parts.next().unwrap_or("kB");
    match unit {
        "kB" => value.checked_mul(1024),
        "B" => Some(value),
        _ => None,
    }
}

/// Page-locked host memory from `cuMemHostAlloc`.
pub struct PinnedHostSource {
    device: Arc<DeviceContext>,
    capacity: u64,
}

impl std::fmt::Debug for PinnedHostSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostSource")
            .field("device", &self.device.ordinal())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl PinnedHostSource {
    /// Pinned memory usable by device `device`; `capacity` defaults to the
    /// host's RAM.
    pub fn new(device: i32, capacity: Option<u64>) -> Result<Self, MemError> {
        let device = DeviceContext::open(device)?;
        let capacity = capacity.or_else(host_memory_total).ok_or_else(|| {
            MemError::invalid("cannot read the host's memory size (/proc/meminfo); pass a capacity")
        })?;
        Ok(Self { device, capacity })
    }

    /// The device context.
    pub fn device(&self) -> &Arc<DeviceContext> {
        &self.device
    }
}

/// Allocates `bytes` of pinned host memory (portable, not write-combined),
/// aligned to [`PINNED_ALIGNMENT`].
///
/// The driver's pointer is kept in the word just below the returned address,
/// inside the same allocation, so [`pinned_free`] can give the driver back
/// exactly what it handed out.
pub fn pinned_alloc(device: &DeviceContext, bytes: usize) -> Result<*mut c_void, SourceError> {
    let total = bytes
        .checked_add(PINNED_ALIGNMENT)
        .ok_or(SourceError::OutOfMemory)?;
    let _scope = device.bind()?;
    let mut raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer; a context is current; the flags are
    // PORTABLE only.
    check("cuMemHostAlloc", unsafe {
        (device.api().mem_host_alloc)(&mut raw, total, PINNED_ALLOC_FLAGS)
    })?;
    if raw.is_null() {
        return Err(SourceError::OutOfMemory);
    }
    let raw_addr = raw as usize;
    if raw_addr % HEADER != 0 {
        // SAFETY: `raw` was just allocated and nothing else has seen it.
        let _ = unsafe { (device.api().mem_free_host)(raw) };
        return Err(SourceError::Invariant(format!(
            "cuMemHostAlloc returned {raw_addr:#x}, not even word-aligned"
        )));
    }
    // `raw` is word-aligned, so the first page boundary at or above
    // `raw + HEADER` is at most `PINNED_ALIGNMENT` past `raw`: the header fits
    // below it and `bytes` fit above it inside `total`.
    let aligned = (raw_addr + HEADER).next_multiple_of(PINNED_ALIGNMENT);
    debug_assert!(aligned - raw_addr <= PINNED_ALIGNMENT);
    // SAFETY: `[aligned - HEADER, aligned)` lies inside the `total` bytes just
    // allocated (see above) and is word-aligned, so one `usize` write is in
    // bounds and aligned.
    unsafe { ((aligned - HEADER) as *mut usize).write(raw_addr) };
    Ok(aligned as *mut c_void)
}

/// Frees what [`pinned_alloc`] returned.
///
/// # Safety
/// `ptr` came from [`pinned_alloc`], is freed once, and nothing (no copy in
/// flight either) uses it afterwards.
pub unsafe fn pinned_free(device: &DeviceContext, ptr: *mut c_void) {
    // SAFETY: `ptr` came from `pinned_alloc`, which wrote the driver's pointer
    // in the aligned word just below it, inside the allocation.
    let raw = unsafe { ((ptr as usize - HEADER) as *const usize).read() };
    let Ok(_scope) = device.bind() else { return };
    // SAFETY: the caller's contract; a failure at process exit is ignored.
    let _ = unsafe { (device.api().mem_free_host)(raw as *mut c_void) };
}

// SAFETY: (1) `pinned_alloc` returns page-aligned, non-overlapping host
// memory valid until `pinned_free`; alignments past a page are refused.
// (2) not growable. (3) failures are returned, nothing panics.
unsafe impl MemorySource for PinnedHostSource {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            name: "pinned".into(),
            kind: MemoryKind::PinnedHost,
            device: self.device.ordinal(),
            capacity: self.capacity,
            granularity: 1,
            growable: false,
        }
    }

    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError> {
        if align > PINNED_ALIGNMENT {
            return Err(SourceError::Driver(format!(
                "pinned host memory is page-aligned ({PINNED_ALIGNMENT} B); alignment {align} is not \
                 available"
            )));
        }
        pinned_alloc(&self.device, bytes).map(|p| p as usize)
    }

    unsafe fn free(&self, addr: usize, _bytes: usize, _align: usize) {
        // SAFETY: the backend frees each allocation of this source once.
        unsafe { pinned_free(&self.device, addr as *mut c_void) };
    }
}

/// A [`Backend`] of pinned host memory for device `device`.
pub fn pinned_backend(
    device: i32,
    mode: PhaseMode,
    budget: Option<u64>,
    capacity: Option<u64>,
) -> Result<Backend, MemError> {
    let source = PinnedHostSource::new(device, capacity)?;
    Backend::new(Arc::new(source), mode, budget)
}

/// The pinned-host operations on one device: what the core's
/// `PinnedHostOps` needs, with the driver behind it.
#[derive(Clone)]
pub struct CudaPinnedHost {
    device: Arc<DeviceContext>,
}

impl std::fmt::Debug for CudaPinnedHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPinnedHost")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl CudaPinnedHost {
    /// Pinned-host operations for device `device`.
    pub fn new(device: i32) -> Result<Self, MemError> {
        Ok(Self {
            device: DeviceContext::open(device)?,
        })
    }

    /// Pinned-host operations for an open device context (a source's own).
    pub fn for_context(device: Arc<DeviceContext>) -> Self {
        Self { device }
    }

    /// The device ordinal (DLPack `kDLCUDAHost` memory names one).
    pub fn device(&self) -> i32 {
        self.device.ordinal()
    }

    /// Where the memory is: pinned host.
    pub fn kind(&self) -> MemoryKind {
        MemoryKind::PinnedHost
    }

    /// `cuMemHostAlloc(bytes, PORTABLE)`.
    pub fn allocate(&self, bytes: usize) -> Result<usize, SourceError> {
        pinned_alloc(&self.device, bytes).map(|p| p as usize)
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `addr` came from [`CudaPinnedHost::allocate`], is freed once, and
    /// nothing uses it afterwards.
    pub unsafe fn free(&self, addr: usize, _bytes: usize) {
        // SAFETY: the caller's contract.
        unsafe { pinned_free(&self.device, addr as *mut c_void) };
    }

    /// `cuMemHostRegister_v2(addr, bytes, PORTABLE | DEVICEMAP)`: pins memory
    /// the caller owns. Already-registered memory is refused.
    pub fn register(&self, addr: usize, bytes: usize) -> Result<(), SourceError> {
        if addr == 0 || bytes == 0 {
            return Err(SourceError::Driver(
                "a host registration needs a non-null address and a positive length".into(),
            ));
        }
        let _scope = self.device.bind()?;
        // SAFETY: the driver only pins the pages of `[addr, addr + bytes)`; it
        // fails (does not fault) on an unmapped range. The caller keeps the
        // memory allocated until `unregister`.
        let rc = unsafe {
            (self.device.api().mem_host_register)(addr as *mut c_void, bytes, REGISTER_FLAGS)
        };
        if rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
            return Err(SourceError::Driver(format!(
                "[{addr:#x}, +{bytes}) is already registered (pinned) with CUDA; register each \
                 range once"
            )));
        }
        check("cuMemHostRegister_v2", rc)?;
        Ok(())
    }

    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `addr` is a live registration made by [`CudaPinnedHost::register`].
    pub unsafe fn unregister(&self, addr: usize, _bytes: usize) {
        if let Ok(_scope) = self.device.bind() {
            // SAFETY: the caller's contract; a failure at exit is ignored.
            let _ = unsafe { (self.device.api().mem_host_unregister)(addr as *mut c_void) };
        }
    }
}

// SAFETY: every method forwards to the driver call whose contract is the
// trait's: `pinned_alloc` returns page-aligned host memory, disjoint from
// every other live allocation and readable by the process, until
// `cuMemFreeHost`; `cuMemHostRegister` pins without owning; failures come back
// as `SourceError` and nothing panics.
unsafe impl imp_mem_core::PinnedHostOps for CudaPinnedHost {
    fn placement(&self) -> imp_mem_core::Placement {
        imp_mem_core::Placement {
            kind: MemoryKind::PinnedHost,
            device: self.device(),
        }
    }

    fn allocate(&self, bytes: usize) -> Result<usize, SourceError> {
        CudaPinnedHost::allocate(self, bytes)
    }

    unsafe fn free(&self, addr: usize, bytes: usize) {
        // SAFETY: the trait's contract is `CudaPinnedHost::free`'s.
        unsafe { CudaPinnedHost::free(self, addr, bytes) }
    }

    fn register(&self, addr: usize, bytes: usize) -> Result<(), SourceError> {
        CudaPinnedHost::register(self, addr, bytes)
    }

    unsafe fn unregister(&self, addr: usize, bytes: usize) {
        // SAFETY: the trait's contract is `CudaPinnedHost::unregister`'s.
        unsafe { CudaPinnedHost::unregister(self, addr, bytes) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parsing() {
        let text = "MemTotal:       263921232 kB\nMemFree:        1000 kB\n";
        assert_eq!(parse_mem_total(text), Some(263_921_232 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: x kB\n"), None);
    }

    #[test]
    fn never_write_combined() {
        assert_eq!(PINNED_ALLOC_FLAGS & CU_MEMHOSTALLOC_WRITECOMBINED, 0);
    }

    #[test]
    fn without_a_driver_everything_is_unavailable() {
        if crate::cuda_available() {
            return;
        }
        assert!(matches!(
            pinned_backend(0, PhaseMode::Strict, None, None),
            Err(MemError::BackendUnavailable(_))
        ));
        assert!(matches!(
            CudaPinnedHost::new(0),
            Err(MemError::BackendUnavailable(_))
        ));
    }
}
