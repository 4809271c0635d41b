//! Block copies for prefix-cache persistence on a GPU: device → pinned host
//! → file on save, and back on load (issue 6, seed B2's fourth referent).
//!
//! Algorithm: one pinned staging buffer of one block, allocated on first use
//! and reused; `cuMemcpyDtoH` into it and a host copy out on read, a host copy
//! in and `cuMemcpyHtoD` on write. Both driver copies are synchronous with
//! respect to the host for pinned memory, so the staging buffer is free again
//! when a call returns. They run on the legacy default stream: the caller
//! saves after the kernels that wrote the KV have completed (for torch:
//! `torch.cuda.synchronize()`), as with any host read of device memory.
//!
//! Thread safety: the staging buffer is behind a mutex; the manager that owns
//! this value already serialises calls.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use imp_mem_core::block_pool::SharedBlockRef;
use imp_mem_core::kv::BlockIo;
use imp_mem_core::MemError;

use crate::driver::DeviceContext;
use crate::pinned::{pinned_alloc, pinned_free};

struct Staging {
    ptr: *mut c_void,
}

// SAFETY: the pointer is pinned host memory owned by this value alone and only
// touched under the mutex that holds it.
unsafe impl Send for Staging {}

/// [`BlockIo`] for a block pool in device memory.
pub struct CudaBlockIo {
    device: Arc<DeviceContext>,
    block_bytes: usize,
    staging: Mutex<Option<Staging>>,
}

impl std::fmt::Debug for CudaBlockIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBlockIo")
            .field("device", &self.device.ordinal())
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl CudaBlockIo {
    /// Copies blocks of `block_bytes` on `device`'s memory.
    pub fn new(device: Arc<DeviceContext>, block_bytes: usize) -> Self {
        Self {
            device,
            block_bytes,
            staging: Mutex::new(None),
        }
    }

    /// Runs `f` with the staging buffer (allocated on first use).
    fn with_staging<T>(
        &self,
        f: impl FnOnce(*mut c_void) -> Result<T, MemError>,
    ) -> Result<T, MemError> {
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let ptr = pinned_alloc(&self.device, self.block_bytes).map_err(|e| {
                MemError::Driver(format!(
                    "pinned staging buffer of {} B: {e:?}",
                    self.block_bytes
                ))
            })?;
            *guard = Some(Staging { ptr });
        }
        match guard.as_ref() {
            Some(staging) => f(staging.ptr),
            None => Err(MemError::Invariant("staging buffer vanished".into())),
        }
    }

    fn check(&self, block: &SharedBlockRef, len: usize) -> Result<u64, MemError> {
        let span = block.span()?;
        if len > self.block_bytes || len > span.len() {
            return Err(MemError::invalid(format!(
                "{len} bytes do not fit a block of {} B",
                self.block_bytes.min(span.len())
            )));
        }
        Ok(span.addr() as u64)
    }
}

impl BlockIo for CudaBlockIo {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn read_block(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        let src = self.check(block, dst.len())?;
        self.with_staging(|staging| {
            let _scope = self.device.bind()?;
            // SAFETY: `src` is a live block of `dst.len()` bytes or more (the
            // caller holds its ref; checked above), `staging` holds
            // `block_bytes >= dst.len()` pinned bytes; DtoH returns when done.
            crate::driver::check("cuMemcpyDtoH_v2", unsafe {
                (self.device.api().memcpy_dtoh)(staging, src, dst.len())
            })?;
            // SAFETY: the copy above completed and wrote `dst.len()` bytes of
            // the staging buffer, which nothing else touches under the lock.
            let bytes = unsafe { std::slice::from_raw_parts(staging as *const u8, dst.len()) };
            dst.copy_from_slice(bytes);
            Ok(())
        })
    }

    fn write_block(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        let dst = self.check(block, src.len())?;
        self.with_staging(|staging| {
            // SAFETY: the staging buffer holds `block_bytes >= src.len()`
            // bytes and is used by no one else while the lock is held.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), staging.cast::<u8>(), src.len()) };
            let _scope = self.device.bind()?;
            // SAFETY: `dst` is a live block of at least `src.len()` bytes;
            // from pinned memory HtoD is synchronous with respect to the host.
            crate::driver::check("cuMemcpyHtoD_v2", unsafe {
                (self.device.api().memcpy_htod)(dst, staging.cast_const(), src.len())
            })?;
            Ok(())
        })
    }
}

impl Drop for CudaBlockIo {
    fn drop(&mut self) {
        if let Some(staging) = self
            .staging
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // SAFETY: allocated by `pinned_alloc` in `with_staging`, freed once
            // here; no copy is in flight (every copy is synchronous).
            unsafe { pinned_free(&self.device, staging.ptr) };
        }
    }
}
