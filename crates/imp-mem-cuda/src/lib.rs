//! imp-mem CUDA backends. The driver is loaded at run time, so this crate
//! builds and its users import on machines with no CUDA at all; there, every
//! constructor returns [`MemError::BackendUnavailable`] and
//! [`cuda_available`] is false.
//!
//! One module per concept:
//!
//! * [`driver`] — loading the driver, the table of entry points, device
//!   contexts and error mapping. All `unsafe` FFI starts here.
//! * [`device`] — [`CudaSource`]: plain device memory (`cuMemAlloc`).
//! * [`vmm`] — [`VmmSource`]: growable regions over `cuMemAddressReserve` /
//!   `cuMemCreate` / `cuMemMap` / `cuMemSetAccess`, in chunks, with a handle
//!   cache.
//! * [`fence`] — [`Fence`]: a CUDA event a decommit waits for.
//! * [`stream_order`] — [`CudaStreamOrder`]: the activation pool's
//!   cross-stream order (an event recorded on one stream, waited on by
//!   another).
//! * the hysteretic decommit policy and the fenced, deferred decommit are
//!   pure and live in the core (`imp_mem_core::decommit`, re-exported here);
//!   [`Fence`] implements their [`FenceLike`].
//! * [`pinned`] — pinned host buffers and host registration.
//! * [`host_tier`] — [`CudaTierIo`]: the KV host tier's async copies.
#![deny(missing_docs)]

pub mod device;
pub mod driver;
pub mod fence;
pub mod host_tier;
pub mod pinned;
pub mod stream_order;
pub mod vmm;

pub use device::{cuda_backend, CudaSource};
pub use driver::{cuda_available, device_count, DeviceContext, DeviceProps};
pub use fence::Fence;
pub use host_tier::CudaTierIo;
pub use imp_mem_core::decommit::{
    Decision, DecommitPolicy, DecommitTracker, DeferredDecommit, FenceLike,
};
pub use imp_mem_core::MemError;
pub use pinned::{pinned_backend, CudaPinnedHost, PinnedHostSource};
pub use stream_order::CudaStreamOrder;
pub use vmm::{vmm_backend, VmmBackend, VmmConfig, VmmCore, VmmSource};

/// The CUDA driver's version (`13000` for CUDA 13.0), or why there is none.
pub fn driver_version() -> Result<i32, MemError> {
    driver::driver().map(|d| d.version)
}

/// Free and total memory of device `device` (`cuMemGetInfo`).
pub fn mem_get_info(device: i32) -> Result<(u64, u64), MemError> {
    DeviceContext::open(device)?.mem_info()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_here_means_unavailable_everywhere() {
        // This machine has no GPU; on one that has, the GPU suite covers it.
        if cuda_available() {
            return;
        }
        assert!(matches!(
            driver_version(),
            Err(MemError::BackendUnavailable(_))
        ));
        assert!(matches!(
            device_count(),
            Err(MemError::BackendUnavailable(_))
        ));
        assert!(matches!(
            mem_get_info(0),
            Err(MemError::BackendUnavailable(_))
        ));
        let err = vmm_backend(
            0,
            imp_mem_core::PhaseMode::Strict,
            None,
            VmmConfig::default(),
        )
        .unwrap_err();
        assert!(matches!(err, MemError::BackendUnavailable(_)));
        assert!(err.to_string().contains("CUDA"), "{err}");
        // Asking twice gives the same answer (the failure is remembered).
        assert!(!cuda_available());
    }
}
