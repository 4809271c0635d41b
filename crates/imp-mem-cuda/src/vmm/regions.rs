//! `VmmSource`: growable device regions over the CUDA virtual memory API.
//!
//! Algorithm (seed A3.1, SPEC "Facts measured on an H200"):
//!
//! * **reserve** takes address space for a region's maximum with
//!   `cuMemAddressReserve` — no physical memory (64 GiB in ~31 µs on an
//!   H200). The reservation is rounded up to whole chunks.
//! * **commit** extends the committed prefix by whole *chunks*: for each new
//!   chunk one physical handle (`cuMemCreate`, or a cached one) mapped with
//!   `cuMemMap` at its offset, then **one** `cuMemSetAccess` over the new
//!   chunks only. The chunk is a multiple of the device's allocation
//!   granularity, 64 MiB by default: the driver's cost goes with the number of
//!   handles, not bytes (one `cuMemSetAccess` over 256 × 2 MiB handles took
//!   6.5 ms against 48 µs over one 512 MiB handle), and setting access on the
//!   whole region again would re-pay it for every old chunk.
//! * **decommit** unmaps the committed tail chunk by chunk (`cuMemUnmap` can
//!   only unmap whole mappings, which is why every chunk is its own mapping)
//!   and hands each handle to a small cache of at most `cache_chunks` handles,
//!   releasing (`cuMemRelease`) the rest. A later commit takes cached handles
//!   before creating new ones. If an unmap fails half way, the chunks already
//!   unmapped are mapped back, so a failed decommit changes nothing.
//! * The base never moves: a region's mappings all live inside its
//!   reservation (V9).
//! * **allocate** (a fixed region) is a reservation of the request rounded up
//!   to the device granularity, backed by chunks when it is a whole number of
//!   them (cache-friendly) and by one handle of its exact size otherwise.
//!
//! None of these calls synchronises the device. A commit can overlap queued
//! work; a decommit must not happen while a kernel may still touch the tail:
//! the caller waits for a [`crate::Fence`] first (`imp_mem_core::decommit` has
//! the policy and the deferred queue).
//!
//! Accounting: the backend's ledger sees committed bytes. Cached handles are
//! physical memory that no region holds; the source reports them
//! ([`VmmCore::cached_bytes`]) and, so that the budget stays honest, tells the
//! backend a capacity of *device total − cache limit*: a budget can never
//! admit so much that committed + cached exceeds the device. [`VmmCore::trim_cache`]
//! returns the cache to the device at once.
//!
//! Thread safety: all bookkeeping is behind one mutex, held across the driver
//! calls of one operation (the backend already serialises its source calls,
//! so this lock is uncontended in practice). Each operation makes the
//! device's primary context current on the calling thread for its duration.
//!
//! The driver calls go through the [`VmmDriver`] trait so that the
//! bookkeeping — rollback, the cache, boundaries — is tested on the CPU
//! against a simulated driver that enforces the same rules.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use imp_mem_core::source::{FromHost, NoStreams, StreamOrder, TierIo, ToHost};
use imp_mem_core::units::round_up;
use imp_mem_core::{
    Backend, DeviceReading, MemError, MemoryKind, MemorySource, PhaseMode, PinnedHostOps,
    SourceCharge, SourceError, SourceInfo,
};

use crate::driver::{
    check, CtxScope, CuDevicePtr, CuError, CuMemAccessDesc, CuMemAllocationProp, CuMemHandle,
    DeviceContext, CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
};
use crate::host_tier::CudaTierIo;
use crate::pinned::CudaPinnedHost;
use crate::stream_order::CudaStreamOrder;

/// The default chunk: tens of MiB, so that a growth event is one handle.
pub const DEFAULT_CHUNK_BYTES: usize = 64 << 20;
/// The default number of released chunk handles kept for reuse.
pub const DEFAULT_CACHE_CHUNKS: usize = 2;

/// How a VMM source commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmConfig {
    /// Bytes per physical handle; rounded up to the device granularity.
    /// `None`: [`DEFAULT_CHUNK_BYTES`].
    pub chunk_bytes: Option<usize>,
    /// Released chunk handles kept for reuse (0 disables the cache).
    pub cache_chunks: usize,
}

impl Default for VmmConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: None,
            cache_chunks: DEFAULT_CACHE_CHUNKS,
        }
    }
}

/// The driver operations a VMM source needs. Implemented by the CUDA driver
/// ([`CudaVmm`]) and, in tests, by a simulation that enforces the same rules.
///
/// # Safety
///
/// Implementations perform the named driver operation or fail; they keep no
/// bookkeeping of their own that the caller could violate. Callers of the
/// `unsafe` methods uphold the driver's preconditions stated on each.
pub unsafe trait VmmDriver: Send + Sync + 'static {
    /// What keeps the context current; dropped at the end of an operation.
    type Scope<'a>
    where
        Self: 'a;
    /// Makes the device's context current for one operation.
    fn enter(&self) -> Result<Self::Scope<'_>, CuError>;
    /// Device ordinal.
    fn device(&self) -> i32;
    /// Total physical memory.
    fn total_memory(&self) -> u64;
    /// (minimum, recommended) allocation granularity.
    fn granularity(&self) -> Result<(usize, usize), CuError>;
    /// `cuMemAddressReserve(size, align)`.
    fn address_reserve(&self, size: usize, align: usize) -> Result<u64, CuError>;
    /// `cuMemAddressFree`.
    ///
    /// # Safety
    /// `[addr, addr + size)` is exactly one live reservation with nothing
    /// mapped in it.
    unsafe fn address_free(&self, addr: u64, size: usize) -> Result<(), CuError>;
    /// `cuMemCreate` of `size` bytes on the device.
    fn create(&self, size: usize) -> Result<CuMemHandle, CuError>;
    /// `cuMemRelease`.
    ///
    /// # Safety
    /// `handle` is live and released once; its memory is freed when its last
    /// mapping goes.
    unsafe fn release(&self, handle: CuMemHandle) -> Result<(), CuError>;
    /// `cuMemMap` of the whole of `handle` at `addr`.
    ///
    /// # Safety
    /// `[addr, addr + size)` lies in a live reservation and is unmapped;
    /// `size` is the handle's size.
    unsafe fn map(&self, addr: u64, size: usize, handle: CuMemHandle) -> Result<(), CuError>;
    /// `cuMemUnmap`.
    ///
    /// # Safety
    /// `[addr, addr + size)` is exactly one whole mapping, and no work in
    /// flight uses it.
    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<(), CuError>;
    /// `cuMemSetAccess`, read-write for the device.
    ///
    /// # Safety
    /// `[addr, addr + size)` is fully mapped.
    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<(), CuError>;

    /// `cuMemGetInfo`: the device's free and total bytes, or `None` for a
    /// driver with no device to read (the default).
    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        Ok(None)
    }

    /// The pinned host memory of this driver's device, or `None` for a
    /// driver with no device (the default, the simulation).
    fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        None
    }

    /// The stream order of an activation pool on this driver's device
    /// ([`MemorySource::stream_order`]); the default, for a driver with no
    /// streams (the simulation), is none.
    fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        Ok(Arc::new(NoStreams))
    }

    /// The KV host tier's copy engine on this driver's device
    /// ([`MemorySource::host_tier_io`]); `None`, the default, for a driver
    /// with no device (the simulation).
    fn host_tier_io(
        &self,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        let _ = (block_bytes, slots);
        Ok(None)
    }

    /// `cuMemcpyDtoH`: `len` bytes at device address `src` to host `dst`,
    /// returning when they are there. The default (a driver with no memory
    /// behind its addresses, the simulation) refuses.
    ///
    /// # Safety
    /// `[src, src + len)` is mapped with access; `[dst, dst + len)` is host
    /// memory this process may write.
    unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), CuError> {
        let _ = (dst, src, len);
        Err(CuError {
            call: "cuMemcpyDtoH_v2",
            code: crate::driver::CUDA_ERROR_NOT_SUPPORTED,
        })
    }

    /// `cuMemcpyHtoD`: `len` bytes of host `src` to device address `dst`,
    /// returning when they are there (from pageable memory too).
    ///
    /// # Safety
    /// `[dst, dst + len)` is mapped with access and unused meanwhile;
    /// `[src, src + len)` is host memory this process may read.
    unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), CuError> {
        let _ = (dst, src, len);
        Err(CuError {
            call: "cuMemcpyHtoD_v2",
            code: crate::driver::CUDA_ERROR_NOT_SUPPORTED,
        })
    }

    /// [`Self::copy_dtoh`] of every `(src, dst, len)`, returning when all
    /// are there; a device enqueues them and waits once. The default loops
    /// the single copy.
    ///
    /// # Safety
    /// Every copy meets `copy_dtoh`'s contract; no two `dst` ranges overlap.
    unsafe fn copy_dtoh_many(&self, copies: &[ToHost]) -> Result<(), CuError> {
        for &(src, dst, len) in copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_dtoh(dst, src as u64, len) }?;
        }
        Ok(())
    }

    /// [`Self::copy_htod`] of every `(dst, src, len)`, in order, returning
    /// when all are there; the default loops the single copy.
    ///
    /// # Safety
    /// Every copy meets `copy_htod`'s contract.
    unsafe fn copy_htod_many(&self, copies: &[FromHost]) -> Result<(), CuError> {
        for &(dst, src, len) in copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_htod(dst as u64, src, len) }?;
        }
        Ok(())
    }
}

/// The CUDA driver as a [`VmmDriver`].
pub struct CudaVmm {
    device: Arc<DeviceContext>,
    prop: CuMemAllocationProp,
    access: CuMemAccessDesc,
}

// SAFETY: `prop` holds a null Windows pointer and plain integers; the context
// is Send + Sync (see driver.rs). Nothing is mutated after construction.
unsafe impl Send for CudaVmm {}
// SAFETY: as above.
unsafe impl Sync for CudaVmm {}

impl CudaVmm {
    /// The driver for device `ordinal`; `BackendUnavailable` when the device
    /// lacks VMM support.
    pub fn new(ordinal: i32) -> Result<Self, MemError> {
        let device = DeviceContext::open(ordinal)?;
        if !device.props().vmm_supported {
            return Err(MemError::BackendUnavailable(format!(
                "device {ordinal} ({}) does not support CUDA virtual memory management; use \
                 CudaBackend instead of VmmBackend",
                device.props().name
            )));
        }
        Ok(Self {
            prop: CuMemAllocationProp::device(ordinal),
            access: CuMemAccessDesc::read_write(ordinal),
            device,
        })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.device
    }
}

// SAFETY: each method is one driver call with the arguments passed through;
// the `unsafe` methods' preconditions are the driver's own.
unsafe impl VmmDriver for CudaVmm {
    type Scope<'a> = CtxScope<'a>;

    fn enter(&self) -> Result<CtxScope<'_>, CuError> {
        self.device.bind()
    }

    fn device(&self) -> i32 {
        self.device.ordinal()
    }

    fn total_memory(&self) -> u64 {
        self.device.props().total_memory
    }

    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        self.device.reading().map(Some)
    }

    fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        Some(Arc::new(CudaPinnedHost::for_context(self.device.clone())))
    }

    fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        Ok(Arc::new(CudaStreamOrder::new(self.device.ordinal())?))
    }

    fn host_tier_io(
        &self,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        let io = CudaTierIo::new(self.device.clone(), block_bytes, slots)?;
        Ok(Some(Box::new(io)))
    }

    fn granularity(&self) -> Result<(usize, usize), CuError> {
        let api = self.device.api();
        let (mut min, mut rec) = (0usize, 0usize);
        // SAFETY: writes one size_t; `prop` is a valid device allocation
        // description that outlives the call.
        check("cuMemGetAllocationGranularity", unsafe {
            (api.mem_get_allocation_granularity)(
                &mut min,
                &self.prop,
                CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        // SAFETY: as above.
        check("cuMemGetAllocationGranularity", unsafe {
            (api.mem_get_allocation_granularity)(
                &mut rec,
                &self.prop,
                CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        Ok((min, rec))
    }

    fn address_reserve(&self, size: usize, align: usize) -> Result<u64, CuError> {
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: writes one device pointer; no fixed address is requested
        // (addr 0) and the flags are 0, as documented.
        check("cuMemAddressReserve", unsafe {
            (self.device.api().mem_address_reserve)(&mut ptr, size, align, 0, 0)
        })?;
        Ok(ptr)
    }

    unsafe fn address_free(&self, addr: u64, size: usize) -> Result<(), CuError> {
        // SAFETY: the caller passes one whole, unmapped reservation.
        check("cuMemAddressFree", unsafe {
            (self.device.api().mem_address_free)(addr, size)
        })
    }

    fn create(&self, size: usize) -> Result<CuMemHandle, CuError> {
        let mut handle: CuMemHandle = 0;
        // SAFETY: writes one handle; `prop` describes plain device memory on
        // this device and outlives the call; flags must be 0.
        check("cuMemCreate", unsafe {
            (self.device.api().mem_create)(&mut handle, size, &self.prop, 0)
        })?;
        Ok(handle)
    }

    unsafe fn release(&self, handle: CuMemHandle) -> Result<(), CuError> {
        // SAFETY: the caller releases a live handle once.
        check("cuMemRelease", unsafe {
            (self.device.api().mem_release)(handle)
        })
    }

    unsafe fn map(&self, addr: u64, size: usize, handle: CuMemHandle) -> Result<(), CuError> {
        // SAFETY: the caller maps a whole handle (offset 0, flags 0) into an
        // unmapped range of a live reservation.
        check("cuMemMap", unsafe {
            (self.device.api().mem_map)(addr, size, 0, handle, 0)
        })
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<(), CuError> {
        // SAFETY: the caller unmaps one whole mapping that nothing uses.
        check("cuMemUnmap", unsafe {
            (self.device.api().mem_unmap)(addr, size)
        })
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<(), CuError> {
        // SAFETY: the caller passes a fully mapped range; one descriptor.
        check("cuMemSetAccess", unsafe {
            (self.device.api().mem_set_access)(addr, size, &self.access, 1)
        })
    }

    unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), CuError> {
        // SAFETY: the caller vouches for both ranges; from device memory to
        // pinned host memory this is one DMA, synchronous with the host.
        check("cuMemcpyDtoH_v2", unsafe {
            (self.device.api().memcpy_dtoh)(dst.cast(), src, len)
        })
    }

    unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), CuError> {
        // SAFETY: as above, in the other direction; the copy returns when the
        // bytes are there from pageable memory too (`copy_htod`'s sync).
        unsafe { self.device.copy_htod(dst, src, len) }
    }

    unsafe fn copy_dtoh_many(&self, copies: &[ToHost]) -> Result<(), CuError> {
        // SAFETY: the caller vouches for every range; the call waits for all.
        unsafe { self.device.copy_dtoh_many(copies) }
    }

    unsafe fn copy_htod_many(&self, copies: &[FromHost]) -> Result<(), CuError> {
        // SAFETY: as above, in the other direction.
        unsafe { self.device.copy_htod_many(copies) }
    }
}

/// One physical handle mapped at `offset` of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mapping {
    offset: usize,
    size: usize,
    handle: CuMemHandle,
}

#[derive(Debug)]
struct Reservation {
    size: usize,
    /// The committed prefix, in offset order, contiguous from 0.
    mappings: Vec<Mapping>,
}

impl Reservation {
    fn committed(&self) -> usize {
        self.mappings.last().map_or(0, |m| m.offset + m.size)
    }
}

/// What a VMM source has done, for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmmCounters {
    /// `cuMemAddressReserve` calls that succeeded.
    pub reservations: u64,
    /// `cuMemCreate` calls that succeeded.
    pub handles_created: u64,
    /// `cuMemRelease` calls.
    pub handles_released: u64,
    /// Commits served by a cached handle instead of `cuMemCreate`.
    pub cache_hits: u64,
    /// `cuMemMap` calls that succeeded.
    pub maps: u64,
    /// `cuMemUnmap` calls that succeeded.
    pub unmaps: u64,
    /// `cuMemSetAccess` calls that succeeded.
    pub set_access_calls: u64,
    /// Driver failures during cleanup that could only be counted (an unmap
    /// or release that failed while freeing a region).
    pub cleanup_failures: u64,
}

#[derive(Debug, Default)]
struct VmmState {
    reservations: BTreeMap<usize, Reservation>,
    /// Released chunk-sized handles, ready to map again.
    cache: Vec<CuMemHandle>,
    /// Bytes mapped in live reservations.
    mapped_bytes: u64,
    counters: VmmCounters,
}

/// A growable device memory source over a [`VmmDriver`].
pub struct VmmCore<D: VmmDriver> {
    driver: D,
    /// The device's minimum granularity (what a fixed region rounds to).
    granule: usize,
    /// Bytes per handle for growable regions.
    chunk: usize,
    cache_limit: usize,
    state: Mutex<VmmState>,
}

/// The VMM source on a CUDA device.
pub type VmmSource = VmmCore<CudaVmm>;

impl<D: VmmDriver> std::fmt::Debug for VmmCore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmCore")
            .field("device", &self.driver.device())
            .field("granule", &self.granule)
            .field("chunk", &self.chunk)
            .field("cache_limit", &self.cache_limit)
            .finish()
    }
}

/// The chunk size for a request: a positive multiple of `unit`, at least one
/// unit. Pure.
pub fn chunk_size(requested: Option<usize>, unit: usize) -> Result<usize, MemError> {
    let unit = unit.max(1);
    let requested = requested.unwrap_or(DEFAULT_CHUNK_BYTES);
    if requested == 0 {
        return Err(MemError::invalid(
            "chunk_bytes must be positive; the default is 64 MiB",
        ));
    }
    let rounded =
        round_up(requested, unit).ok_or_else(|| MemError::invalid("chunk_bytes overflows"))?;
    Ok(rounded.max(unit))
}

/// Refuses a chunk larger than the device, or a handle cache that could
/// hold half of it (the budget's capacity is the device less the cache).
/// Pure.
pub fn check_sizes(chunk: usize, cache_chunks: usize, total: u64) -> Result<(), MemError> {
    if chunk as u64 > total {
        return Err(MemError::invalid(format!(
            "chunk_bytes {chunk} is larger than the device ({total} B); use tens of MiB"
        )));
    }
    let cache = (cache_chunks as u64).saturating_mul(chunk as u64);
    if cache > total / 2 {
        return Err(MemError::invalid(format!(
            "a cache of {cache_chunks} chunks of {chunk} B would hold over half the device; keep \
             a few chunks (the default is {DEFAULT_CACHE_CHUNKS})"
        )));
    }
    Ok(())
}

/// The granule that satisfies both the minimum and the recommended
/// granularity. Pure.
pub fn combined_granularity(min: usize, recommended: usize) -> usize {
    let (min, rec) = (min.max(1), recommended.max(1));
    if rec % min == 0 {
        rec
    } else if min % rec == 0 {
        min
    } else {
        min.saturating_mul(rec)
    }
}

impl<D: VmmDriver> VmmCore<D> {
    /// A source over `driver` with `config`.
    pub fn with_driver(driver: D, config: VmmConfig) -> Result<Self, MemError> {
        let (min, recommended) = {
            let _scope = driver.enter()?;
            driver.granularity()?
        };
        if min == 0 || !min.is_power_of_two() {
            return Err(MemError::Driver(format!(
                "the device reports an allocation granularity of {min} B"
            )));
        }
        let unit = combined_granularity(min, recommended);
        let chunk = chunk_size(config.chunk_bytes, unit)?;
        check_sizes(chunk, config.cache_chunks, driver.total_memory())?;
        Ok(Self {
            driver,
            granule: min,
            chunk,
            cache_limit: config.cache_chunks,
            state: Mutex::new(VmmState::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, VmmState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes per physical handle of a growable region (= the granularity the
    /// backend commits in).
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    /// The device's minimum allocation granularity.
    pub fn device_granularity(&self) -> usize {
        self.granule
    }

    /// Most chunk handles kept for reuse.
    pub fn cache_limit_chunks(&self) -> usize {
        self.cache_limit
    }

    /// Physical bytes held in the cache (no region uses them).
    pub fn cached_bytes(&self) -> u64 {
        (self.state().cache.len() * self.chunk) as u64
    }

    /// Physical bytes mapped in live regions.
    pub fn mapped_bytes(&self) -> u64 {
        self.state().mapped_bytes
    }

    /// What the source has done so far.
    pub fn counters(&self) -> VmmCounters {
        self.state().counters
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// Releases every cached handle now, returning its memory to the device.
    pub fn trim_cache(&self) {
        let mut state = self.state();
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        self.drain_cache(&mut state);
    }

    fn drain_cache(&self, state: &mut VmmState) {
        while let Some(handle) = state.cache.pop() {
            self.release_counted(state, handle);
        }
    }

    fn release_counted(&self, state: &mut VmmState, handle: CuMemHandle) {
        // SAFETY: every handle reaching here is owned by the state (cached or
        // just removed from a mapping) and leaves it now: released once.
        match unsafe { self.driver.release(handle) } {
            Ok(()) => state.counters.handles_released += 1,
            Err(_) => state.counters.cleanup_failures += 1,
        }
    }

    /// Takes a handle of `size` bytes: a cached one when `size` is a chunk,
    /// else a new one. Out of memory with a non-empty cache releases the
    /// cache and tries once more.
    fn take_handle(&self, state: &mut VmmState, size: usize) -> Result<CuMemHandle, CuError> {
        if size == self.chunk {
            if let Some(handle) = state.cache.pop() {
                state.counters.cache_hits += 1;
                return Ok(handle);
            }
        }
        match self.driver.create(size) {
            Ok(handle) => {
                state.counters.handles_created += 1;
                Ok(handle)
            }
            Err(err)
                if err.code == crate::driver::CUDA_ERROR_OUT_OF_MEMORY
                    && !state.cache.is_empty() =>
            {
                self.drain_cache(state);
                let handle = self.driver.create(size)?;
                state.counters.handles_created += 1;
                Ok(handle)
            }
            Err(err) => Err(err),
        }
    }

    /// Returns a handle that is no longer mapped: into the cache when it is a
    /// chunk and the cache has room, else to the driver.
    fn put_handle(&self, state: &mut VmmState, handle: CuMemHandle, size: usize) {
        if size == self.chunk && state.cache.len() < self.cache_limit {
            state.cache.push(handle);
        } else {
            self.release_counted(state, handle);
        }
    }

    /// Unmaps `mappings` (in reverse) of the reservation at `base`; stops at
    /// the first failure and returns the ones still mapped (a prefix) with
    /// the error. The unmapped ones' handles are returned too, still owned.
    fn unmap_all(
        &self,
        state: &mut VmmState,
        base: usize,
        mut mappings: Vec<Mapping>,
    ) -> (Vec<Mapping>, Vec<Mapping>, Option<CuError>) {
        let mut unmapped = Vec::with_capacity(mappings.len());
        while let Some(m) = mappings.pop() {
            // SAFETY: `m` is one whole mapping of this reservation, recorded
            // when it was mapped; the caller guarantees nothing uses it.
            match unsafe { self.driver.unmap((base + m.offset) as u64, m.size) } {
                Ok(()) => {
                    state.counters.unmaps += 1;
                    state.mapped_bytes -= m.size as u64;
                    unmapped.push(m);
                }
                Err(err) => {
                    mappings.push(m);
                    return (mappings, unmapped, Some(err));
                }
            }
        }
        (mappings, unmapped, None)
    }

    /// Maps `[from, to)` of the reservation at `base` with new or cached
    /// handles of `piece` bytes each, and sets access on that range only. On
    /// failure every handle taken here is unmapped and given back; the
    /// reservation is as before.
    fn map_range(
        &self,
        state: &mut VmmState,
        base: usize,
        from: usize,
        to: usize,
        piece: usize,
    ) -> Result<Vec<Mapping>, CuError> {
        let mut added: Vec<Mapping> = Vec::new();
        let mut offset = from;
        let mut failure = None;
        while offset < to {
            let handle = match self.take_handle(state, piece) {
                Ok(h) => h,
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            };
            // SAFETY: `[base + offset, + piece)` lies inside the reservation
            // (`to <= size`, checked by the caller) past its committed prefix,
            // so it is unmapped; the handle is `piece` bytes.
            match unsafe { self.driver.map((base + offset) as u64, piece, handle) } {
                Ok(()) => {
                    state.counters.maps += 1;
                    state.mapped_bytes += piece as u64;
                    added.push(Mapping {
                        offset,
                        size: piece,
                        handle,
                    });
                    offset += piece;
                }
                Err(err) => {
                    self.put_handle(state, handle, piece);
                    failure = Some(err);
                    break;
                }
            }
        }
        if failure.is_none() {
            // SAFETY: `[base + from, base + to)` was mapped completely just above.
            match unsafe { self.driver.set_access((base + from) as u64, to - from) } {
                Ok(()) => {
                    state.counters.set_access_calls += 1;
                    return Ok(added);
                }
                Err(err) => failure = Some(err),
            }
        }
        // Roll back: nothing was handed out, so nothing can be using it.
        let (still_mapped, unmapped, _) = self.unmap_all(state, base, added);
        for m in unmapped {
            self.put_handle(state, m.handle, m.size);
        }
        for m in still_mapped {
            // An unmap failed: the handle stays mapped; releasing it frees the
            // memory when the reservation is freed. Never cached.
            state.mapped_bytes -= m.size as u64;
            self.release_counted(state, m.handle);
        }
        Err(failure.unwrap_or(CuError {
            call: "map_range",
            code: crate::driver::CUDA_ERROR_INVALID_VALUE,
        }))
    }

    fn reserve_inner(
        &self,
        state: &mut VmmState,
        size: usize,
        align: usize,
    ) -> Result<usize, SourceError> {
        // Always explicit: at least the granularity (cuMemMap needs granule-
        // aligned addresses), never the driver's unspecified default.
        let align = align
            .max(self.granule)
            .checked_next_power_of_two()
            .ok_or(SourceError::OutOfMemory)?;
        let base = self.driver.address_reserve(size, align)?;
        let usable = usize::try_from(base).ok().filter(|b| b % align == 0);
        let Some(base) = usable else {
            // SAFETY: reserved just above with this size, nothing mapped.
            let _ = unsafe { self.driver.address_free(base, size) };
            return Err(SourceError::Invariant(format!(
                "cuMemAddressReserve returned {base:#x}, not aligned to {align}"
            )));
        };
        state.counters.reservations += 1;
        state.reservations.insert(
            base,
            Reservation {
                size,
                mappings: Vec::new(),
            },
        );
        Ok(base)
    }

    fn free_reservation(&self, state: &mut VmmState, base: usize) {
        let Some(res) = state.reservations.remove(&base) else {
            return;
        };
        let (still_mapped, unmapped, _) = self.unmap_all(state, base, res.mappings);
        for m in unmapped {
            self.put_handle(state, m.handle, m.size);
        }
        for m in still_mapped {
            state.counters.cleanup_failures += 1;
            state.mapped_bytes -= m.size as u64;
            self.release_counted(state, m.handle);
        }
        // SAFETY: the reservation was live and is now out of the map; every
        // mapping in it was unmapped above (or failed to, which the driver then
        // reports here as an error that is only counted).
        if unsafe { self.driver.address_free(base as u64, res.size) }.is_err() {
            state.counters.cleanup_failures += 1;
        }
    }

    /// The committed bytes of the reservation at `base` (for tests).
    pub fn committed_of(&self, base: usize) -> Option<usize> {
        self.state()
            .reservations
            .get(&base)
            .map(Reservation::committed)
    }

    /// Number of mappings (handles) of the reservation at `base`.
    pub fn mappings_of(&self, base: usize) -> Option<usize> {
        self.state()
            .reservations
            .get(&base)
            .map(|r| r.mappings.len())
    }
}

impl<D: VmmDriver> Drop for VmmCore<D> {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut state = std::mem::take(state);
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        let bases: Vec<usize> = state.reservations.keys().copied().collect();
        for base in bases {
            self.free_reservation(&mut state, base);
        }
        self.drain_cache(&mut state);
    }
}

// SAFETY: (1) every address is inside a reservation from
// `cuMemAddressReserve`, which never overlaps another live one; a reservation
// is freed only by `free`/`unreserve` of its own base. A reservation is
// aligned to `max(align, granularity)`, asked of the driver and checked. (2) commits map only past the committed prefix
// inside the reservation, so the base is fixed; decommit unmaps only the
// named tail. (3) nothing panics: every arithmetic step is checked or bounded
// by sizes the backend validated, and driver failures are returned.
unsafe impl<D: VmmDriver> MemorySource for VmmCore<D> {
    fn info(&self) -> SourceInfo {
        let cache_bytes = (self.cache_limit as u64).saturating_mul(self.chunk as u64);
        SourceInfo {
            name: "vmm".into(),
            kind: MemoryKind::Device,
            device: self.driver.device(),
            capacity: self.driver.total_memory().saturating_sub(cache_bytes),
            granularity: self.chunk,
            growable: true,
        }
    }

    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        self.driver.mem_info()
    }

    fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        self.driver.pinned_host()
    }

    fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        self.driver.stream_order()
    }

    fn host_tier_io(
        self: Arc<Self>,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        self.driver.host_tier_io(block_bytes, slots)
    }

    /// The handle cache (physical memory no region holds) and the mapping
    /// past the ledger: a fixed region is mapped to whole granules while
    /// the ledger counts the bytes asked for.
    fn extra_charges(&self, committed: u64) -> Vec<SourceCharge> {
        let (cached, mapped) = {
            let state = self.state();
            ((state.cache.len() * self.chunk) as u64, state.mapped_bytes)
        };
        vec![
            SourceCharge {
                key: "vmm_handle_cache".into(),
                label: "VMM handle cache (kept for reuse)".into(),
                bytes: cached,
            },
            SourceCharge {
                key: "vmm_rounding".into(),
                label: "VMM mapping past the ledger (chunk rounding)".into(),
                bytes: mapped.saturating_sub(committed),
            },
        ]
    }

    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError> {
        let size = round_up(bytes, self.granule).ok_or(SourceError::OutOfMemory)?;
        let piece = if size % self.chunk == 0 {
            self.chunk
        } else {
            size
        };
        let mut state = self.state();
        let _scope = self.driver.enter()?;
        let base = self.reserve_inner(&mut state, size, align)?;
        match self.map_range(&mut state, base, 0, size, piece) {
            Ok(added) => {
                if let Some(res) = state.reservations.get_mut(&base) {
                    res.mappings = added;
                }
                Ok(base)
            }
            Err(err) => {
                self.free_reservation(&mut state, base);
                Err(err.into())
            }
        }
    }

    unsafe fn free(&self, addr: usize, _bytes: usize, _align: usize) {
        let mut state = self.state();
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        self.free_reservation(&mut state, addr);
    }

    fn reserve(&self, max_bytes: usize, align: usize) -> Result<usize, SourceError> {
        let size = round_up(max_bytes, self.chunk).ok_or(SourceError::OutOfMemory)?;
        let mut state = self.state();
        let _scope = self.driver.enter()?;
        self.reserve_inner(&mut state, size, align)
    }

    fn commit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        let Some(res) = state.reservations.get(&base) else {
            return Err(SourceError::Invariant(format!(
                "commit at {base:#x}, which is not a reservation of this source"
            )));
        };
        let committed = res.committed();
        if from != committed || to > res.size || from >= to || (to - from) % self.chunk != 0 {
            return Err(SourceError::Invariant(format!(
                "commit [{from}, {to}) does not extend the committed {committed} B of a {} B \
                 reservation by whole {} B chunks",
                res.size, self.chunk
            )));
        }
        let _scope = self.driver.enter()?;
        let added = self.map_range(&mut state, base, from, to, self.chunk)?;
        if let Some(res) = state.reservations.get_mut(&base) {
            res.mappings.extend(added);
        }
        Ok(())
    }

    unsafe fn decommit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        let Some(res) = state.reservations.get_mut(&base) else {
            return Err(SourceError::Invariant(format!(
                "decommit at {base:#x}, which is not a reservation of this source"
            )));
        };
        let committed = res.committed();
        if to != committed || from > to {
            return Err(SourceError::Invariant(format!(
                "decommit [{from}, {to}) is not the committed tail of {committed} B"
            )));
        }
        if from == to {
            return Ok(());
        }
        let Some(split) = res.mappings.iter().position(|m| m.offset == from) else {
            return Err(SourceError::Invariant(format!(
                "decommit from {from} B is not a chunk boundary of this region"
            )));
        };
        let tail = res.mappings.split_off(split);
        let _scope = match self.driver.enter() {
            Ok(scope) => scope,
            Err(err) => {
                if let Some(res) = state.reservations.get_mut(&base) {
                    res.mappings.extend(tail);
                }
                return Err(err.into());
            }
        };
        let (still_mapped, unmapped, failure) = self.unmap_all(&mut state, base, tail);
        if let Some(err) = failure {
            // Put the region back as it was: map the unmapped chunks again, in
            // offset order, and give them access again.
            let mut restored = still_mapped;
            let remap: Vec<Mapping> = unmapped.into_iter().rev().collect();
            let remap_start = remap.first().map(|m| m.offset);
            let mut remap_end = None;
            let mut broken = None;
            let mut pending = remap.into_iter();
            for m in pending.by_ref() {
                // SAFETY: `m` was unmapped just above from this very range of
                // the live reservation, and its handle is still owned.
                match unsafe { self.driver.map((base + m.offset) as u64, m.size, m.handle) } {
                    Ok(()) => {
                        state.mapped_bytes += m.size as u64;
                        remap_end = Some(m.offset + m.size);
                        restored.push(m);
                    }
                    Err(e) => {
                        broken = Some(e);
                        self.release_counted(&mut state, m.handle);
                        break;
                    }
                }
            }
            for m in pending {
                self.release_counted(&mut state, m.handle);
            }
            if let (Some(start), Some(end)) = (remap_start, remap_end) {
                let addr = (base + start) as u64;
                // SAFETY: `[start, end)` was just mapped again, completely.
                let access = unsafe { self.driver.set_access(addr, end - start) };
                if let Err(e) = access {
                    broken = broken.or(Some(e));
                }
            }
            if let Some(res) = state.reservations.get_mut(&base) {
                res.mappings.extend(restored);
            }
            return Err(match broken {
                None => err.into(),
                Some(e) => SourceError::Invariant(format!(
                    "decommit failed ({err}) and restoring the region failed too ({e}); the \
                     region's tail is unusable — release it"
                )),
            });
        }
        for m in unmapped {
            self.put_handle(&mut state, m.handle, m.size);
        }
        Ok(())
    }

    unsafe fn unreserve(&self, base: usize, _max_bytes: usize, _committed: usize) {
        let mut state = self.state();
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        self.free_reservation(&mut state, base);
    }

    unsafe fn copy_to_host(&self, src: usize, dst: *mut u8, len: usize) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: the backend passes a committed (mapped, accessible) range of
        // a live region of this source, and a host buffer of `len` bytes.
        unsafe { self.driver.copy_dtoh(dst, src as u64, len) }.map_err(SourceError::from)
    }

    unsafe fn copy_from_host(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: as in `copy_to_host`, in the other direction.
        unsafe { self.driver.copy_htod(dst as u64, src, len) }.map_err(SourceError::from)
    }

    unsafe fn copy_to_host_many(&self, copies: &[ToHost]) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: the backend passes committed (mapped, accessible) ranges of
        // live regions of this source, and disjoint host buffers.
        unsafe { self.driver.copy_dtoh_many(copies) }.map_err(SourceError::from)
    }

    unsafe fn copy_from_host_many(&self, copies: &[FromHost]) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: as in `copy_to_host_many`, in the other direction.
        unsafe { self.driver.copy_htod_many(copies) }.map_err(SourceError::from)
    }
}

/// A [`Backend`] over a [`VmmSource`], with the source's extras (cache,
/// counters, chunk size). Derefs to the backend.
#[derive(Clone)]
pub struct VmmBackend {
    backend: Backend,
    source: Arc<VmmSource>,
}

impl std::fmt::Debug for VmmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmBackend")
            .field("backend", &self.backend)
            .field("source", &self.source)
            .finish()
    }
}

impl VmmBackend {
    /// A VMM backend on device `device`.
    pub fn new(
        device: i32,
        mode: PhaseMode,
        budget: Option<u64>,
        config: VmmConfig,
    ) -> Result<Self, MemError> {
        let source = Arc::new(VmmCore::with_driver(CudaVmm::new(device)?, config)?);
        let backend = Backend::new(source.clone(), mode, budget)?;
        Ok(Self { backend, source })
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The source.
    pub fn source(&self) -> &Arc<VmmSource> {
        &self.source
    }
}

impl std::ops::Deref for VmmBackend {
    type Target = Backend;

    fn deref(&self) -> &Backend {
        &self.backend
    }
}

/// A VMM [`Backend`] on device `device` (see [`VmmBackend`] for the extras).
pub fn vmm_backend(
    device: i32,
    mode: PhaseMode,
    budget: Option<u64>,
    config: VmmConfig,
) -> Result<VmmBackend, MemError> {
    VmmBackend::new(device, mode, budget, config)
}

#[cfg(test)]
pub(crate) mod sim;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod conformance;
