//! `Fence`: a CUDA event recorded on a stream, the proof a decommit waits for.
//!
//! Algorithm: [`Fence::record`] creates an event with
//! `CU_EVENT_DISABLE_TIMING` (the cheap kind) and records it on the stream
//! the caller names — a raw `CUstream` as an integer, e.g. torch's
//! `torch.cuda.current_stream().cuda_stream`, or 0 for the legacy default
//! stream. The fence is complete when all work queued on that stream before
//! the record has finished. [`Fence::is_complete`] asks without blocking
//! (`cuEventQuery`); [`Fence::wait`] blocks the calling thread
//! (`cuEventSynchronize`). The event is destroyed when the fence drops.
//!
//! Why: VMM unmap does not synchronise the device (SPEC, H200 facts), so
//! unmapping a chunk that a queued kernel still reads would fault. A pool
//! records a fence after the last work that may touch a chunk and decommits
//! only once it has completed (`imp_mem_core::decommit::DeferredDecommit`).
//!
//! Thread safety: `Fence` is `Send + Sync`; event query/synchronise are
//! thread-safe driver calls, and each binds the device's primary context for
//! its duration. The stream must belong to the device's primary context (all
//! torch and CuPy streams on that device do).

use std::sync::Arc;

use imp_mem_core::MemError;

use crate::driver::{
    check, CuEvent, CuStream, DeviceContext, CUDA_ERROR_NOT_READY, CUDA_SUCCESS,
    CU_EVENT_DISABLE_TIMING,
};
use imp_mem_core::decommit::FenceLike;

/// A recorded CUDA event.
pub struct Fence {
    device: Arc<DeviceContext>,
    event: CuEvent,
}

// SAFETY: a CUevent is a driver handle usable from any thread; the struct
// never mutates it after recording.
unsafe impl Send for Fence {}
// SAFETY: as above; query and synchronise are thread-safe driver calls.
unsafe impl Sync for Fence {}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("device", &self.device.ordinal())
            .field("event", &self.event)
            .finish()
    }
}

impl Fence {
    /// Records a fence on `stream` (a raw `CUstream`; 0 is the legacy
    /// default stream) of device `device`.
    pub fn record(device: i32, stream: u64) -> Result<Fence, MemError> {
        Self::record_on(DeviceContext::open(device)?, stream)
    }

    /// As [`Fence::record`], on an open device context.
    pub fn record_on(device: Arc<DeviceContext>, stream: u64) -> Result<Fence, MemError> {
        let api = device.api();
        let _scope = device.bind()?;
        let mut event: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one event handle; a context is current.
        check("cuEventCreate", unsafe {
            (api.event_create)(&mut event, CU_EVENT_DISABLE_TIMING)
        })?;
        let fence = Fence {
            device: device.clone(),
            event,
        };
        // SAFETY: the event is live; `stream` is a stream handle of this
        // context as the caller states (0/1/2 are the driver's special
        // handles); recording only enqueues a marker.
        check("cuEventRecord", unsafe {
            (api.event_record)(event, stream as usize as CuStream)
        })?;
        Ok(fence)
    }

    /// True when the work before the record has finished. Never blocks.
    pub fn is_complete(&self) -> Result<bool, MemError> {
        let _scope = self.device.bind()?;
        // SAFETY: the event is live until Drop.
        let rc = unsafe { (self.device.api().event_query)(self.event) };
        match rc {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(crate::driver::CuError {
                call: "cuEventQuery",
                code,
            }
            .into()),
        }
    }

    /// Blocks until the work before the record has finished.
    pub fn wait(&self) -> Result<(), MemError> {
        let _scope = self.device.bind()?;
        // SAFETY: the event is live until Drop.
        check("cuEventSynchronize", unsafe {
            (self.device.api().event_synchronize)(self.event)
        })?;
        Ok(())
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.device.ordinal()
    }
}

impl FenceLike for Fence {
    fn is_complete(&self) -> Result<bool, MemError> {
        Fence::is_complete(self)
    }

    fn wait(&self) -> Result<(), MemError> {
        Fence::wait(self)
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let Ok(_scope) = self.device.bind() {
            // SAFETY: the event was created in `record_on` and is destroyed
            // once; destroying an event with pending work is allowed (the
            // driver frees it when the work completes).
            let _ = unsafe { (self.device.api().event_destroy)(self.event) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_recording_is_unavailable() {
        if crate::cuda_available() {
            return;
        }
        assert!(matches!(
            Fence::record(0, 0),
            Err(MemError::BackendUnavailable(_))
        ));
    }
}
