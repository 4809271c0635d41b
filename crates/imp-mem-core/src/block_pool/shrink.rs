//! How a pool gives memory back: the hysteretic shrink (withdraw the free
//! tail, decommit it behind a fence, cancel on demand) and sleep / wake
//! (the whole region decommitted while idle, its reservation kept). The
//! module's opening paragraph gives the policy.

use crate::backend::Region;
use crate::decommit::{Decision, DecommitPolicy, DecommitTracker, FenceLike};
use crate::error::MemError;

use super::free_list::{Entry, FreeBlocks};
use super::pool::PoolCore;

/// A boxed fence the pool keeps while a decommit waits for it.
pub(super) struct PoolFence(pub(super) Box<dyn FenceLike + Send>);

impl std::fmt::Debug for PoolFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolFence")
    }
}

impl FenceLike for PoolFence {
    fn is_complete(&self) -> Result<bool, MemError> {
        self.0.is_complete()
    }

    fn wait(&self) -> Result<(), MemError> {
        self.0.wait()
    }
}

impl PoolCore {
    // ------------------------------------------------------------ shrinking

    fn shrinkable(&self) -> bool {
        // A pool held in a growable region only to sleep (one free list,
        // never grown) does not shrink.
        self.stride > 0
            && self.sleep.is_none()
            && matches!(self.lists, FreeBlocks::Chunked(_))
            && self.region.as_ref().is_some_and(Region::is_growable)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn asleep_error(&self, level: u8) -> MemError {
        MemError::Asleep(format!(
            "block pool #{} sleeps (level {level}): its memory was given back; call wake() \
             before allocating",
            self.id
        ))
    }

    // ------------------------------------------------------- sleep / wake

    /// Gives the whole region's physical memory back, keeping its
    /// reservation (so every block's address) and its free lists. Only an
    /// idle pool sleeps: a live block's bytes would be lost under its
    /// holder. Returns the bytes decommitted.
    pub(super) fn sleep(&mut self, level: u8) -> Result<u64, MemError> {
        if let Some((level, _)) = self.sleep {
            return Err(MemError::invalid(format!(
                "block pool #{} already sleeps (level {level}); call wake() first",
                self.id
            )));
        }
        if !self.region.as_ref().is_some_and(Region::is_growable) || self.stride == 0 {
            return Err(MemError::BackendUnavailable(format!(
                "block pool #{} cannot sleep: only a pool over a growable (VMM) region can give \
                 its physical memory back and take it again at the same addresses",
                self.id
            )));
        }
        let live = self.capacity() - self.free;
        if live > 0 {
            return Err(MemError::invalid(format!(
                "block pool #{} cannot sleep: {live} block(s) are live (sequences, or prefix-cache \
                 entries that hold them), and a sleep drops the pool's bytes; free or abort the \
                 sequences and evict the cache (or drop the KV manager) first",
                self.id
            )));
        }
        // A withdrawn tail comes back first, so the decommit is one range.
        self.reclaim()?;
        let Some(region) = self.region.as_mut() else {
            return Ok(0);
        };
        let committed = region.len();
        region.decommit(0)?;
        self.sleep = Some((level, committed));
        Ok(committed as u64)
    }

    /// Recommits what the pool had at the same base; on failure it sleeps
    /// on.
    pub(super) fn wake(&mut self) -> Result<(), MemError> {
        let Some((_, committed)) = self.sleep else {
            return Ok(());
        };
        if let Some(region) = self.region.as_mut() {
            region.commit(committed as u64)?;
        }
        self.sleep = None;
        Ok(())
    }

    /// Chunks that must stay: up to the highest live block, and never fewer
    /// than the pool opened with.
    fn needed_chunks(&self) -> usize {
        let used = self
            .lists
            .highest_used(self.capacity(), self.free)
            .map_or(0, |c| c + 1);
        let floor = self.min_blocks.div_ceil(self.lists.chunk_blocks()) as usize;
        used.max(floor)
    }

    fn chunks_in_use(&self) -> usize {
        self.capacity().div_ceil(self.lists.chunk_blocks()) as usize
    }

    /// Decommits a pending tail whose fence has completed; the bytes
    /// returned (0 when nothing happened).
    fn poll(&mut self) -> Result<u64, MemError> {
        let Some(region) = self.region.as_mut() else {
            return Ok(0);
        };
        let done = self.deferred.poll(region)?;
        Ok(self.note_decommit(done))
    }

    fn note_decommit(&mut self, done: Option<u64>) -> u64 {
        match done {
            Some(bytes) if bytes > 0 => {
                self.shrinks += 1;
                self.decommitted_bytes += bytes;
                bytes
            }
            _ => 0,
        }
    }

    /// One past the highest live block (0 when none is live). O(one chunk).
    fn live_top(&self) -> u32 {
        let capacity = self.capacity();
        let Some(c) = self.lists.highest_used(capacity, self.free) else {
            return 0;
        };
        let cb = self.lists.chunk_blocks() as u64;
        let start = (c as u64 * cb) as u32;
        let end = ((c as u64 + 1) * cb).min(capacity as u64) as u32;
        (start..end)
            .rev()
            .find(|&id| matches!(self.entries[id as usize], Entry::Occupied { .. }))
            .map_or(start, |id| id + 1)
    }

    /// Withdraws the free tail above `to_blocks` (never below the floor or
    /// the highest live block; rounded up to the region's granularity) and
    /// schedules its decommit behind `fence`. Returns whether anything was
    /// scheduled. O(withdrawn blocks + one chunk).
    fn withdraw(&mut self, to_blocks: u64, fence: PoolFence) -> Result<bool, MemError> {
        if !self.shrinkable() {
            return Ok(false);
        }
        let capacity = self.capacity();
        let target = to_blocks
            .max(self.live_top() as u64)
            .max(self.min_blocks as u64)
            .min(capacity as u64);
        let Some(region) = self.region.as_ref() else {
            return Ok(false);
        };
        let granule = region.backend().info().granularity.max(1) as u64;
        let new_len = (target * self.stride as u64)
            .div_ceil(granule)
            .saturating_mul(granule)
            .min(region.reserved() as u64);
        let current = self
            .deferred
            .pending_target()
            .unwrap_or(region.len() as u64)
            .min(region.len() as u64);
        if new_len >= current {
            return Ok(false);
        }
        let new_cap = (new_len / self.stride as u64)
            .min(self.max_blocks as u64)
            .min(capacity as u64) as u32;
        let tail = &self.entries[new_cap as usize..];
        if tail.iter().any(|e| !matches!(e, Entry::Vacant { .. })) {
            return Err(MemError::Invariant(format!(
                "pool #{}: a live block sits in the tail [{new_cap}, {capacity}) chosen to \
                 decommit",
                self.id
            )));
        }
        self.lists.cut(&mut self.entries, new_cap, capacity);
        self.entries.truncate(new_cap as usize);
        self.free -= capacity - new_cap;
        self.deferred.schedule(fence, new_len);
        Ok(true)
    }

    /// One engine step: decommits a pending tail whose fence completed,
    /// feeds the hysteresis, and when it decides, withdraws the free tail
    /// and schedules its decommit behind `fence` (recorded after the work
    /// this step enqueued). Returns the bytes decommitted during the call.
    pub(super) fn step(&mut self, fence: PoolFence) -> Result<u64, MemError> {
        if !self.shrinkable() {
            return Ok(0);
        }
        let mut returned = self.poll()?;
        let decision = self
            .tracker
            .observe(self.needed_chunks(), self.chunks_in_use());
        if let Decision::Decommit { to_chunks } = decision {
            // Within the floor's chunks the floor itself is the target.
            let floor = self.min_blocks.div_ceil(self.lists.chunk_blocks()) as usize;
            let to_blocks = if to_chunks <= floor {
                0
            } else {
                to_chunks as u64 * self.lists.chunk_blocks() as u64
            };
            if self.withdraw(to_blocks, fence)? {
                returned += self.poll()?;
            }
        }
        Ok(returned)
    }

    /// Shrinks to the need now, bypassing the hysteresis (no spare chunk
    /// kept); the decommit still waits for `fence`.
    pub(super) fn shrink_now(&mut self, fence: PoolFence) -> Result<u64, MemError> {
        let mut returned = self.poll()?;
        if self.withdraw(0, fence)? {
            returned += self.poll()?;
        }
        Ok(returned)
    }

    /// Shrinks to the chunks holding live blocks plus `keep_chunks`, now
    /// (no hysteresis; never below the floor); the decommit waits for
    /// `fence`. What an idle ledger tenant does so that a burst elsewhere
    /// finds the room.
    pub(super) fn trim(&mut self, keep_chunks: u32, fence: PoolFence) -> Result<u64, MemError> {
        let mut returned = self.poll()?;
        let cb = self.lists.chunk_blocks() as u64;
        let to = (self.live_top() as u64).div_ceil(cb) * cb + keep_chunks as u64 * cb;
        if self.withdraw(to, fence)? {
            returned += self.poll()?;
        }
        Ok(returned)
    }

    /// Gives back the free tail above `blocks` now (never below the floor
    /// or the highest live block; rounded up to the region's granularity),
    /// the decommit waiting for `fence`: how an operation that grew the
    /// pool and then failed returns the growth it made.
    pub(super) fn shrink_to(&mut self, blocks: u32, fence: PoolFence) -> Result<u64, MemError> {
        let mut returned = self.poll()?;
        if self.withdraw(blocks as u64, fence)? {
            returned += self.poll()?;
        }
        Ok(returned)
    }

    /// One past the highest live block (0 when none is live).
    pub(super) fn live_top_block(&self) -> u32 {
        self.live_top()
    }

    /// Waits for a pending decommit's fence and decommits.
    pub(super) fn flush_decommit(&mut self) -> Result<u64, MemError> {
        let Some(region) = self.region.as_mut() else {
            return Ok(0);
        };
        let done = self.deferred.flush(region)?;
        Ok(self.note_decommit(done))
    }

    pub(super) fn set_policy(&mut self, policy: DecommitPolicy) {
        self.tracker = DecommitTracker::new(policy);
    }
}
