//! The fake's copy engine of the KV host tier: [`FakeTierIo`], what
//! [`FakeSource`]'s [`MemorySource::host_tier_io`] gives.
//!
//! Host slots are a `Vec<u8>`; a copy reads or writes the fake's memory
//! when it runs, in enqueue order (one stream). In manual mode copies run
//! only through [`FakeTierIo::advance`] or a wait, so a test can hold them
//! in flight; in auto mode (the source's) each runs as it is enqueued.
//!
//! Thread safety: clones share one state behind a mutex.
//!
//! [`MemorySource::host_tier_io`]: crate::source::MemorySource::host_tier_io

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{FakeBackend, FakeSource};
use crate::error::{try_reserve, MemError};
use crate::source::{CopyTicket, TierIo};

#[derive(Debug)]
enum FakeCopy {
    Out { dev: usize, slot: u32 },
    In { slot: u32, dev: usize },
}

#[derive(Debug)]
struct FakeTierState {
    fake: Arc<FakeSource>,
    block_bytes: usize,
    slots: u32,
    host: Vec<u8>,
    queue: VecDeque<(CopyTicket, FakeCopy)>,
    next: CopyTicket,
    /// Copies up to (excluding) this ticket have run.
    done_below: CopyTicket,
    auto: bool,
}

impl FakeTierState {
    fn run_one(&mut self) -> Result<bool, MemError> {
        let Some((ticket, copy)) = self.queue.pop_front() else {
            return Ok(false);
        };
        let bb = self.block_bytes;
        match copy {
            FakeCopy::Out { dev, slot } => {
                let bytes = self.fake.read(dev, bb)?;
                let at = slot as usize * bb;
                self.host[at..at + bb].copy_from_slice(&bytes);
            }
            FakeCopy::In { slot, dev } => {
                let at = slot as usize * bb;
                self.fake.write(dev, &self.host[at..at + bb])?;
            }
        }
        self.done_below = ticket + 1;
        Ok(true)
    }

    fn enqueue(&mut self, copy: FakeCopy) -> Result<CopyTicket, MemError> {
        let ticket = self.next;
        self.next += 1;
        self.queue.push_back((ticket, copy));
        if self.auto {
            self.run_one()?;
        }
        Ok(ticket)
    }
}

/// [`TierIo`] over a [`FakeBackend`] pool: host slots are a `Vec<u8>`, a
/// copy reads or writes the fake's memory when it runs. In manual mode
/// copies run only through [`Self::advance`] or a wait, in enqueue order
/// (one stream), so a test can hold them in flight; in auto mode each runs
/// as it is enqueued. Clones share the state.
#[derive(Debug, Clone)]
pub struct FakeTierIo {
    state: Arc<Mutex<FakeTierState>>,
}

impl FakeTierIo {
    /// `slots` host blocks of `block_bytes` over `fake`'s memory. The host
    /// bytes are reserved fallibly (the count is a caller's): refused with
    /// `HostOutOfMemory`, or `InvalidArgument` past the address space.
    pub fn new(
        fake: FakeBackend,
        block_bytes: usize,
        slots: u32,
        auto: bool,
    ) -> Result<Self, MemError> {
        Self::over(fake.source().clone(), block_bytes, slots, auto)
    }

    /// [`FakeTierIo::new`] over the fake's source.
    pub(crate) fn over(
        fake: Arc<FakeSource>,
        block_bytes: usize,
        slots: u32,
        auto: bool,
    ) -> Result<Self, MemError> {
        let bytes = block_bytes.checked_mul(slots as usize).ok_or_else(|| {
            MemError::invalid(format!(
                "a host tier of {slots} blocks of {block_bytes} B is too large"
            ))
        })?;
        let mut host = Vec::new();
        try_reserve(
            &mut host,
            bytes,
            &format!("a host tier of {slots} blocks of {block_bytes} B"),
        )?;
        host.resize(bytes, 0);
        Ok(Self {
            state: Arc::new(Mutex::new(FakeTierState {
                fake,
                block_bytes,
                slots,
                host,
                queue: VecDeque::new(),
                next: 0,
                done_below: 0,
                auto,
            })),
        })
    }

    fn lock(&self) -> MutexGuard<'_, FakeTierState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs up to `n` queued copies; returns how many ran.
    pub fn advance(&self, n: usize) -> Result<usize, MemError> {
        let mut s = self.lock();
        let mut ran = 0;
        while ran < n && s.run_one()? {
            ran += 1;
        }
        Ok(ran)
    }

    /// Copies enqueued and not yet run.
    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    /// Host slot `slot`'s bytes.
    pub fn host_bytes(&self, slot: u32) -> Vec<u8> {
        let s = self.lock();
        let at = slot as usize * s.block_bytes;
        s.host
            .get(at..at + s.block_bytes)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }
}

impl TierIo for FakeTierIo {
    fn block_bytes(&self) -> usize {
        self.lock().block_bytes
    }

    fn slots(&self) -> u32 {
        self.lock().slots
    }

    fn offload(&mut self, dev_addr: usize, slot: u32) -> Result<CopyTicket, MemError> {
        let mut s = self.lock();
        if slot >= s.slots {
            return Err(MemError::invalid(format!(
                "host slot {slot} is out of range"
            )));
        }
        s.enqueue(FakeCopy::Out {
            dev: dev_addr,
            slot,
        })
    }

    fn onboard(&mut self, slot: u32, dev_addr: usize) -> Result<CopyTicket, MemError> {
        let mut s = self.lock();
        if slot >= s.slots {
            return Err(MemError::invalid(format!(
                "host slot {slot} is out of range"
            )));
        }
        s.enqueue(FakeCopy::In {
            slot,
            dev: dev_addr,
        })
    }

    fn onboard_many(&mut self, copies: &[(u32, usize)]) -> Result<Vec<CopyTicket>, MemError> {
        let mut s = self.lock();
        if let Some(&(slot, _)) = copies.iter().find(|c| c.0 >= s.slots) {
            return Err(MemError::invalid(format!(
                "host slot {slot} is out of range"
            )));
        }
        copies
            .iter()
            .map(|&(slot, dev)| s.enqueue(FakeCopy::In { slot, dev }))
            .collect()
    }

    fn is_done(&mut self, ticket: CopyTicket) -> Result<bool, MemError> {
        Ok(ticket < self.lock().done_below)
    }

    fn read_slot(&mut self, slot: u32, dst: &mut [u8]) -> Result<(), MemError> {
        let s = self.lock();
        let at = slot as usize * s.block_bytes;
        let src = s
            .host
            .get(at..at + dst.len())
            .ok_or_else(|| MemError::invalid(format!("host slot {slot} is out of range")))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn write_slot(&mut self, slot: u32, src: &[u8]) -> Result<(), MemError> {
        let mut s = self.lock();
        let at = slot as usize * s.block_bytes;
        let dst = s
            .host
            .get_mut(at..at + src.len())
            .ok_or_else(|| MemError::invalid(format!("host slot {slot} is out of range")))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn wait(&mut self, ticket: CopyTicket) -> Result<(), MemError> {
        let mut s = self.lock();
        while s.done_below <= ticket {
            if !s.run_one()? {
                return Err(MemError::invalid(format!(
                    "copy {ticket} was never enqueued"
                )));
            }
        }
        Ok(())
    }
}
