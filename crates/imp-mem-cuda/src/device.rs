//! `CudaSource`: plain device memory through `cuMemAlloc` / `cuMemFree`.
//!
//! Algorithm: one `cuMemAlloc_v2` per acquisition and one `cuMemFree_v2` per
//! release; nothing is pooled, because the tiers above pool (seed A3.1: the
//! backend is acquired from once per tier, at load). `cuMemAlloc` returns
//! addresses aligned to at least 256 bytes; a larger alignment is served by
//! over-allocating `bytes + align - 256` and handing out the first aligned
//! address inside, remembering the raw pointer in a small map to free it.
//! The source is not growable: growable regions are [`crate::VmmSource`]'s.
//! Host copies (`copy_to_host` / `copy_from_host`, which `Region`'s
//! bounds-checked copies call) are synchronous `cuMemcpy`s; a batch of them
//! (`copy_*_host_many`) is enqueued async on the legacy stream and waited
//! for once.
//!
//! Accounting: the backend counts the bytes asked for. The driver rounds
//! each allocation up (to 2 MiB pages for large ones), so device used memory
//! can exceed the backend's `live` by up to a page per allocation; tiers
//! acquire few, large regions, which keeps that slack small.
//!
//! Thread safety: `cuMemAlloc`/`cuMemFree` are thread-safe; each call binds the
//! device's primary context on the calling thread for its duration. The
//! over-aligned map is behind a mutex. `cuMemFree` of memory still used by
//! queued kernels is the caller's problem, as with `cudaFree`; note that the
//! driver synchronises the device in `cuMemFree`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use imp_mem_core::source::{FromHost, StreamOrder, TierIo, ToHost};
use imp_mem_core::{
    Backend, DeviceReading, MemError, MemoryKind, MemorySource, PhaseMode, PinnedHostOps,
    SourceError, SourceInfo,
};

use crate::driver::{check, source_error, CuDevicePtr, DeviceContext};
use crate::host_tier::CudaTierIo;
use crate::pinned::CudaPinnedHost;
use crate::stream_order::CudaStreamOrder;

/// What `cuMemAlloc` guarantees.
pub const CU_MEM_ALLOC_ALIGNMENT: usize = 256;

/// Device memory from `cuMemAlloc`.
pub struct CudaSource {
    device: Arc<DeviceContext>,
    /// Aligned address → raw address, for allocations aligned past 256 B.
    over_aligned: Mutex<HashMap<usize, usize>>,
    /// Bytes asked of `cuMemAlloc` and not yet freed (padding included).
    held: AtomicU64,
}

impl std::fmt::Debug for CudaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaSource")
            .field("device", &self.device.props())
            .finish()
    }
}

impl CudaSource {
    /// A source on device `ordinal`. `BackendUnavailable` where there is no
    /// usable driver or device.
    pub fn new(ordinal: i32) -> Result<Self, MemError> {
        let device = DeviceContext::open(ordinal)?;
        Ok(Self {
            device,
            over_aligned: Mutex::new(HashMap::new()),
            held: AtomicU64::new(0),
        })
    }

    /// Bytes this source holds of its device now: what it asked of
    /// `cuMemAlloc` (an over-aligned allocation's padding included) and has
    /// not freed. The driver rounds each allocation up past this.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// The device context.
    pub fn device(&self) -> &Arc<DeviceContext> {
        &self.device
    }

    fn raw_alloc(&self, bytes: usize) -> Result<usize, SourceError> {
        let _scope = self.device.bind()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: writes one device pointer; the primary context is current.
        check("cuMemAlloc_v2", unsafe {
            (self.device.api().mem_alloc)(&mut ptr, bytes)
        })?;
        usize::try_from(ptr)
            .map_err(|_| SourceError::Invariant(format!("device pointer {ptr:#x} overflows usize")))
    }

    fn raw_free(&self, ptr: usize) {
        let Ok(_scope) = self.device.bind() else {
            return;
        };
        // SAFETY: `ptr` came from `cuMemAlloc_v2` in this context and the
        // backend frees each allocation exactly once. A failure (the driver
        // shutting down at exit) leaves nothing we could do.
        let _ = unsafe { (self.device.api().mem_free)(ptr as CuDevicePtr) };
    }
}

// SAFETY: (1) addresses come from `cuMemAlloc`, which never hands out
// overlapping live ranges; an over-aligned request allocates
// `bytes + align - 256` so that the first `align`-aligned address `a` inside
// satisfies `a + bytes <= raw + bytes + align - 256` (the raw pointer is
// 256-aligned, so `a - raw <= align - 256`). (2) not growable. (3) every
// failure is a returned value; nothing here panics.
unsafe impl MemorySource for CudaSource {
    fn info(&self) -> SourceInfo {
        let props = self.device.props();
        SourceInfo {
            name: "cuda".into(),
            kind: MemoryKind::Device,
            device: props.ordinal,
            capacity: props.total_memory,
            granularity: 1,
            growable: false,
        }
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
        self: Arc<Self>,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        let io = CudaTierIo::new(self.device.clone(), block_bytes, slots)?;
        Ok(Some(Box::new(io)))
    }

    unsafe fn copy_to_host(&self, src: usize, dst: *mut u8, len: usize) -> Result<(), SourceError> {
        let _scope = self.device.bind().map_err(source_error)?;
        // SAFETY: the backend passes a range inside a live allocation of this
        // source (device memory of this context) and a host buffer of `len`
        // writable bytes; the copy is synchronous with the host.
        check("cuMemcpyDtoH_v2", unsafe {
            (self.device.api().memcpy_dtoh)(dst.cast(), src as CuDevicePtr, len)
        })
        .map_err(source_error)
    }

    unsafe fn copy_from_host(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), SourceError> {
        let _scope = self.device.bind().map_err(source_error)?;
        // SAFETY: as in `copy_to_host`, in the other direction: `len` readable
        // host bytes into a live allocation nothing else uses meanwhile;
        // `copy_htod` returns when they are there, from pageable memory too.
        unsafe { self.device.copy_htod(dst as CuDevicePtr, src, len) }.map_err(source_error)
    }

    unsafe fn copy_to_host_many(&self, copies: &[ToHost]) -> Result<(), SourceError> {
        let _scope = self.device.bind().map_err(source_error)?;
        // SAFETY: the backend passes ranges inside live allocations of this
        // source and disjoint host buffers; the call waits for every copy.
        unsafe { self.device.copy_dtoh_many(copies) }.map_err(source_error)
    }

    unsafe fn copy_from_host_many(&self, copies: &[FromHost]) -> Result<(), SourceError> {
        let _scope = self.device.bind().map_err(source_error)?;
        // SAFETY: as in `copy_to_host_many`, in the other direction.
        unsafe { self.device.copy_htod_many(copies) }.map_err(source_error)
    }

    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError> {
        if align <= CU_MEM_ALLOC_ALIGNMENT {
            let addr = self.raw_alloc(bytes)?;
            self.held.fetch_add(bytes as u64, Ordering::Relaxed);
            return Ok(addr);
        }
        let padded = bytes
            .checked_add(align - CU_MEM_ALLOC_ALIGNMENT)
            .ok_or(SourceError::OutOfMemory)?;
        let raw = self.raw_alloc(padded)?;
        let Some(aligned) = imp_mem_core::units::align_up(raw, align) else {
            self.raw_free(raw);
            return Err(SourceError::OutOfMemory);
        };
        self.over_aligned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(aligned, raw);
        self.held.fetch_add(padded as u64, Ordering::Relaxed);
        Ok(aligned)
    }

    unsafe fn free(&self, addr: usize, bytes: usize, align: usize) {
        let (raw, held) = if align <= CU_MEM_ALLOC_ALIGNMENT {
            (Some(addr), bytes)
        } else {
            let raw = self
                .over_aligned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&addr);
            (raw, bytes.saturating_add(align - CU_MEM_ALLOC_ALIGNMENT))
        };
        if let Some(raw) = raw {
            self.raw_free(raw);
            self.held.fetch_sub(held as u64, Ordering::Relaxed);
        }
    }
}

/// A [`Backend`] over `cuMemAlloc` on device `device`, with `mode` and
/// `budget` (default: the device's total memory).
pub fn cuda_backend(
    device: i32,
    mode: PhaseMode,
    budget: Option<u64>,
) -> Result<Backend, MemError> {
    let source = CudaSource::new(device)?;
    Backend::new(Arc::new(source), mode, budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_the_constructor_is_unavailable_not_a_panic() {
        if crate::cuda_available() {
            return;
        }
        match cuda_backend(0, PhaseMode::Strict, None) {
            Err(MemError::BackendUnavailable(msg)) => assert!(!msg.is_empty()),
            other => panic!("expected BackendUnavailable, got {other:?}"),
        }
    }
}
