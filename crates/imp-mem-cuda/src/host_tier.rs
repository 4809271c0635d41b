//! The host tier's copies on a GPU: [`CudaTierIo`], the `TierIo` behind a
//! KV manager's pinned host blocks (`imp_mem_core::kv::host_tier`).
//!
//! Algorithm: one pinned host buffer of `slots × block_bytes`
//! (`cuMemHostAlloc`, page-aligned, never write-combined) and one copy
//! stream of its own. An offload is one `cuMemcpyDtoHAsync` from the device
//! block into its slot, followed by an event (timing disabled) that its
//! ticket names. An admission's onboards are one batch: neighbours
//! (consecutive slots into consecutive blocks) merge into one
//! `cuMemcpyHtoDAsync`, and one event after the batch completes all of its
//! tickets, so a long prefix costs a few large copies, not one per block.
//! Copies
//! run in enqueue order, so a ticket's completion implies every earlier
//! one's: [`TierIo::is_done`] queries events from the oldest on and retires
//! them, [`TierIo::wait`] synchronises the ticket's event, and
//! [`TierIo::stream_wait`] makes another stream (the engine's) wait for it on
//! the device (`cuStreamWaitEvent`), so onboarding overlaps the host's work.
//! Retired events are reused.
//!
//! Ordering with the engine's kernels: the copy stream is a *blocking*
//! stream (flags 0), so it is ordered with the legacy default stream, where
//! torch runs unless told otherwise: an offload starts only after the
//! kernels that wrote its block (enqueued before the eviction), and kernels
//! enqueued after an onboard wait for it. An engine on other streams makes
//! them wait with `wait_onboarding(seq, stream)` and must have completed
//! the work that wrote a block before freeing its sequence (as for any host
//! read of the KV, `save_prefix_cache`). The price is overlap: default-stream
//! kernels also wait for copies enqueued before them.
//!
//! Thread safety: the manager owning this value serialises every call
//! (`&mut self`); the handles are driver objects any thread may use.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;

use imp_mem_core::kv::{CopyTicket, TierIo};
use imp_mem_core::MemError;

use crate::driver::{
    check, CuError, CuEvent, CuStream, DeviceContext, CUDA_ERROR_NOT_READY, CUDA_SUCCESS,
    CU_EVENT_DISABLE_TIMING,
};
use crate::pinned::{pinned_alloc, pinned_free};

/// [`TierIo`] over pinned host memory and a copy stream of one device.
pub struct CudaTierIo {
    device: Arc<DeviceContext>,
    block_bytes: usize,
    slots: u32,
    host: *mut c_void,
    stream: CuStream,
    /// Events not yet known complete, oldest first, each with the last
    /// ticket it completes (a batch of onboards shares one event).
    pending: VecDeque<(CopyTicket, CuEvent)>,
    spare: Vec<CuEvent>,
    next: CopyTicket,
    /// Every copy below this ticket has completed.
    done_below: CopyTicket,
}

// SAFETY: the host pointer is pinned memory this value alone owns; the stream
// and events are driver handles usable from any thread; all access goes
// through `&mut self` (the manager's lock).
unsafe impl Send for CudaTierIo {}

impl std::fmt::Debug for CudaTierIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTierIo")
            .field("device", &self.device.ordinal())
            .field("block_bytes", &self.block_bytes)
            .field("slots", &self.slots)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl CudaTierIo {
    /// `slots` pinned host blocks of `block_bytes` for `device`'s KV pool.
    pub fn new(
        device: Arc<DeviceContext>,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Self, MemError> {
        let bytes = block_bytes
            .checked_mul(slots as usize)
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                MemError::invalid(format!(
                    "a host tier of {slots} blocks of {block_bytes} B is empty or too large"
                ))
            })?;
        let host = pinned_alloc(&device, bytes)
            .map_err(|e| MemError::Driver(format!("pinned host tier of {bytes} B: {e:?}")))?;
        let mut stream: CuStream = std::ptr::null_mut();
        let created = {
            let _scope = device.bind()?;
            // SAFETY: writes one stream handle; a context is current. Flags
            // 0: blocking, ordered with the legacy default stream (above).
            check("cuStreamCreate", unsafe {
                (device.api().stream_create)(&mut stream, 0)
            })
        };
        if let Err(e) = created {
            // SAFETY: allocated just above and not shared.
            unsafe { pinned_free(&device, host) };
            return Err(e.into());
        }
        Ok(Self {
            device,
            block_bytes,
            slots,
            host,
            stream,
            pending: VecDeque::new(),
            spare: Vec::new(),
            next: 0,
            done_below: 0,
        })
    }

    fn slot_ptr(&self, slot: u32) -> Result<*mut c_void, MemError> {
        if slot >= self.slots {
            return Err(MemError::invalid(format!(
                "host slot {slot} is out of range (the tier has {})",
                self.slots
            )));
        }
        // The buffer holds `slots * block_bytes` bytes (checked in `new`).
        Ok((self.host as usize + slot as usize * self.block_bytes) as *mut c_void)
    }

    fn event(&mut self) -> Result<CuEvent, MemError> {
        if let Some(e) = self.spare.pop() {
            return Ok(e);
        }
        let mut event: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the caller has bound the context.
        check("cuEventCreate", unsafe {
            (self.device.api().event_create)(&mut event, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(event)
    }

    /// Records the ticket of the copy just enqueued.
    fn record(&mut self) -> Result<CopyTicket, MemError> {
        self.record_batch(1)
    }

    /// Records one event completing the `n` copies just enqueued; returns
    /// the first of their `n` consecutive tickets.
    fn record_batch(&mut self, n: u64) -> Result<CopyTicket, MemError> {
        let event = self.event()?;
        // SAFETY: the event is live and the stream is ours.
        if let Err(e) = check("cuEventRecord", unsafe {
            (self.device.api().event_record)(event, self.stream)
        }) {
            self.spare.push(event);
            return Err(e.into());
        }
        let first = self.next;
        self.next += n;
        self.pending.push_back((self.next - 1, event));
        Ok(first)
    }

    /// Blocks until everything enqueued has completed (after a failed
    /// batch: no copy of it may stay in flight).
    fn drain_stream(&mut self) {
        if let Some(&(_, last)) = self.pending.back() {
            // SAFETY: the event is live (owned by `pending`).
            let _ = unsafe { (self.device.api().event_synchronize)(last) };
        }
        let _ = self.retire();
    }

    /// Retires the completed events from the oldest on.
    fn retire(&mut self) -> Result<(), MemError> {
        while let Some(&(ticket, event)) = self.pending.front() {
            // SAFETY: the event is live (owned by `pending`).
            let rc = unsafe { (self.device.api().event_query)(event) };
            match rc {
                CUDA_SUCCESS => {
                    self.pending.pop_front();
                    self.spare.push(event);
                    self.done_below = ticket + 1;
                }
                CUDA_ERROR_NOT_READY => break,
                code => {
                    return Err(CuError {
                        call: "cuEventQuery",
                        code,
                    }
                    .into())
                }
            }
        }
        Ok(())
    }

    fn pending_event(&self, ticket: CopyTicket) -> Result<Option<CuEvent>, MemError> {
        if ticket < self.done_below {
            return Ok(None);
        }
        // The first event whose batch reaches the ticket completes it.
        match self
            .pending
            .iter()
            .find(|(last, _)| *last >= ticket && ticket < self.next)
        {
            Some(&(_, e)) => Ok(Some(e)),
            None => Err(MemError::invalid(format!(
                "copy {ticket} was never enqueued"
            ))),
        }
    }
}

impl TierIo for CudaTierIo {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn slots(&self) -> u32 {
        self.slots
    }

    fn offload(&mut self, dev_addr: usize, slot: u32) -> Result<CopyTicket, MemError> {
        let dst = self.slot_ptr(slot)?;
        let device = Arc::clone(&self.device);
        let _scope = device.bind()?;
        // SAFETY: `dst` is `block_bytes` of our pinned buffer (slot in range);
        // `dev_addr` is a live block of the manager's pool (it holds the
        // block's ref until this copy's ticket completes).
        check("cuMemcpyDtoHAsync_v2", unsafe {
            (self.device.api().memcpy_dtoh_async)(
                dst,
                dev_addr as u64,
                self.block_bytes,
                self.stream,
            )
        })?;
        self.record()
    }

    fn onboard(&mut self, slot: u32, dev_addr: usize) -> Result<CopyTicket, MemError> {
        let src = self.slot_ptr(slot)?;
        let device = Arc::clone(&self.device);
        let _scope = device.bind()?;
        // SAFETY: `src` is `block_bytes` of our pinned buffer, which the
        // manager does not reuse before this copy's ticket completes;
        // `dev_addr` is a live block it allocated for the copy.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            (self.device.api().memcpy_htod_async)(
                dev_addr as u64,
                src.cast_const(),
                self.block_bytes,
                self.stream,
            )
        })?;
        self.record()
    }

    fn onboard_many(&mut self, copies: &[(u32, usize)]) -> Result<Vec<CopyTicket>, MemError> {
        if copies.is_empty() {
            return Ok(Vec::new());
        }
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for &(slot, dev) in copies {
            let src = self.slot_ptr(slot)? as usize;
            match runs.last_mut() {
                // The next slot into the next block: one longer copy.
                Some((s, d, len)) if *s + *len == src && *d + *len == dev => {
                    *len += self.block_bytes;
                }
                _ => runs.push((src, dev, self.block_bytes)),
            }
        }
        let device = Arc::clone(&self.device);
        let _scope = device.bind()?;
        for &(src, dev, len) in &runs {
            // SAFETY: each run is whole slots of our pinned buffer (checked by
            // `slot_ptr`, merged only when adjacent), which the manager does
            // not reuse before the tickets complete; `dev` starts the
            // consecutive live blocks the manager allocated for the copies.
            let rc = check("cuMemcpyHtoDAsync_v2", unsafe {
                (self.device.api().memcpy_htod_async)(
                    dev as u64,
                    src as *const c_void,
                    len,
                    self.stream,
                )
            });
            if let Err(e) = rc {
                self.drain_stream();
                return Err(e.into());
            }
        }
        match self.record_batch(copies.len() as u64) {
            Ok(first) => Ok((first..first + copies.len() as u64).collect()),
            Err(e) => {
                self.drain_stream();
                Err(e)
            }
        }
    }

    fn is_done(&mut self, ticket: CopyTicket) -> Result<bool, MemError> {
        if ticket < self.done_below {
            return Ok(true);
        }
        let device = Arc::clone(&self.device);
        let _scope = device.bind()?;
        self.retire()?;
        Ok(ticket < self.done_below)
    }

    fn wait(&mut self, ticket: CopyTicket) -> Result<(), MemError> {
        let Some(event) = self.pending_event(ticket)? else {
            return Ok(());
        };
        let device = Arc::clone(&self.device);
        let _scope = device.bind()?;
        // SAFETY: the event is live (owned by `pending`).
        check("cuEventSynchronize", unsafe {
            (self.device.api().event_synchronize)(event)
        })?;
        self.retire()
    }

    fn read_slot(&mut self, slot: u32, dst: &mut [u8]) -> Result<(), MemError> {
        let src = self.slot_ptr(slot)?;
        let n = dst.len().min(self.block_bytes);
        // SAFETY: `src` is `block_bytes` of our pinned buffer and no copy is
        // in flight on the slot (the manager reads only resident slots).
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, n) };
        dst[..n].copy_from_slice(bytes);
        Ok(())
    }

    fn write_slot(&mut self, slot: u32, src: &[u8]) -> Result<(), MemError> {
        let dst = self.slot_ptr(slot)?;
        let n = src.len().min(self.block_bytes);
        // SAFETY: `dst` is `block_bytes` of our pinned buffer, owned here, and
        // no copy is in flight on the slot (the manager writes only a slot it
        // just freed or took from a resident).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.cast::<u8>(), n) };
        Ok(())
    }

    fn stream_wait(&mut self, ticket: CopyTicket, stream: usize) -> Result<(), MemError> {
        let Some(event) = self.pending_event(ticket)? else {
            return Ok(());
        };
        let _scope = self.device.bind()?;
        // SAFETY: the event is live; `stream` is a stream of this context as
        // the caller states (0 is the legacy default stream); waiting only
        // enqueues a dependency.
        check("cuStreamWaitEvent", unsafe {
            (self.device.api().stream_wait_event)(stream as CuStream, event, 0)
        })?;
        Ok(())
    }
}

impl Drop for CudaTierIo {
    fn drop(&mut self) {
        let Ok(_scope) = self.device.bind() else {
            return;
        };
        let api = self.device.api();
        if let Some(&(_, last)) = self.pending.back() {
            // SAFETY: the event is live; the buffer must not be freed under a
            // copy still running (errors at process exit are ignored).
            let _ = unsafe { (api.event_synchronize)(last) };
        }
        for (_, e) in self.pending.drain(..) {
            // SAFETY: live events owned here, destroyed once.
            let _ = unsafe { (api.event_destroy)(e) };
        }
        for e in self.spare.drain(..) {
            // SAFETY: as above.
            let _ = unsafe { (api.event_destroy)(e) };
        }
        // SAFETY: our stream, destroyed once; nothing is queued on it now.
        let _ = unsafe { (api.stream_destroy)(self.stream) };
        // SAFETY: allocated by `pinned_alloc` in `new`, freed once, no copy
        // in flight.
        unsafe { pinned_free(&self.device, self.host) };
    }
}
