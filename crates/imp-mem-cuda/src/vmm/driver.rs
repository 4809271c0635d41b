//! [`VmmDriver`]: the driver operations a VMM source needs, and
//! [`CudaVmm`], their implementation over the CUDA driver. The bookkeeping
//! is tested on the CPU against a simulation of this trait (`sim.rs`).

use std::sync::Arc;

use imp_mem_core::source::{FromHost, NoStreams, StreamOrder, TierIo, ToHost};
use imp_mem_core::{DeviceReading, MemError, PinnedHostOps, SourceError};

use crate::driver::{
    check, CtxScope, CuDevicePtr, CuError, CuMemAccessDesc, CuMemAllocationProp, CuMemHandle,
    DeviceContext, CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
};
use crate::host_tier::CudaTierIo;
use crate::pinned::CudaPinnedHost;
use crate::stream_order::CudaStreamOrder;

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
