//! `CudaStreamOrder`: the activation pool's [`StreamOrder`] on CUDA.
//!
//! `wait(stream)` is `cuStreamSynchronize`: the pool calls it before a
//! fallback region goes back to the backend.
//!
//! Algorithm: `order_after(waiter, producer)` records an event on the
//! producer stream (`cuEventRecord`) and makes the waiter wait for it
//! (`cuStreamWaitEvent`). Both only enqueue; neither blocks the host. The
//! wait captures the event's state at the call, so the event can be
//! recorded again by the next call at once: a small pool of events (one per
//! concurrent caller, created on first need with `CU_EVENT_DISABLE_TIMING`)
//! is reused and never grows past the number of threads that ordered at the
//! same time.
//!
//! Context: both streams belong to the device's primary context (torch's and
//! CuPy's do); each call binds it for its duration and restores whatever the
//! calling thread had current.
//!
//! Thread safety: `Send + Sync`; the event pool sits behind one mutex, held
//! only to take or return an event, never across a driver call.

use std::sync::{Arc, Mutex};

use imp_mem_core::activations::StreamOrder;
use imp_mem_core::MemError;

use crate::driver::{check, CuEvent, CuStream, DeviceContext, CU_EVENT_DISABLE_TIMING};

/// Orders CUDA streams of one device with events.
pub struct CudaStreamOrder {
    device: Arc<DeviceContext>,
    events: Mutex<Vec<usize>>,
}

impl std::fmt::Debug for CudaStreamOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStreamOrder")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl CudaStreamOrder {
    /// An orderer for streams of device `device`.
    pub fn new(device: i32) -> Result<Self, MemError> {
        Ok(Self {
            device: DeviceContext::open(device)?,
            events: Mutex::new(Vec::new()),
        })
    }

    fn take_event(&self) -> Result<CuEvent, MemError> {
        let pooled = self.events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        if let Some(ev) = pooled {
            return Ok(ev as CuEvent);
        }
        let mut event: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the caller has bound the context.
        check("cuEventCreate", unsafe {
            (self.device.api().event_create)(&mut event, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(event)
    }

    fn give_event(&self, event: CuEvent) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event as usize);
    }
}

impl StreamOrder for CudaStreamOrder {
    fn order_after(&self, waiter: u64, producer: u64) -> Result<(), MemError> {
        let api = self.device.api();
        let _scope = self.device.bind()?;
        let event = self.take_event()?;
        // SAFETY: the event is live and owned by this call until returned;
        // `producer` is a stream of this context as the caller states (0 is
        // the legacy default stream); recording only enqueues a marker.
        let recorded = check("cuEventRecord", unsafe {
            (api.event_record)(event, producer as usize as CuStream)
        });
        let waited = recorded.and_then(|()| {
            // SAFETY: as above for `waiter`; the wait captures the event's
            // current record, so the event may be recorded again afterwards.
            check("cuStreamWaitEvent", unsafe {
                (api.stream_wait_event)(waiter as usize as CuStream, event, 0)
            })
        });
        self.give_event(event);
        waited.map_err(MemError::from)
    }

    fn wait(&self, stream: u64) -> Result<(), MemError> {
        let _scope = self.device.bind()?;
        // SAFETY: `stream` is a stream of this context as the caller states
        // (0 is the legacy default stream, which waits for every blocking
        // stream); the scope has bound the context.
        unsafe { self.device.synchronize(stream as usize as CuStream) }.map_err(MemError::from)
    }
}

impl Drop for CudaStreamOrder {
    fn drop(&mut self) {
        let events = std::mem::take(self.events.get_mut().unwrap_or_else(|p| p.into_inner()));
        if let Ok(_scope) = self.device.bind() {
            for ev in events {
                // SAFETY: each event was created by `take_event` and is
                // destroyed once; destroying an event with pending work is
                // allowed.
                let _ = unsafe { (self.device.api().event_destroy)(ev as CuEvent) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_it_is_unavailable() {
        if crate::cuda_available() {
            return;
        }
        assert!(matches!(
            CudaStreamOrder::new(0),
            Err(MemError::BackendUnavailable(_))
        ));
    }
}
