//! Allocate and free: the stream-ordered search (own lane, fresh memory,
//! another lane after an order, reclaim), the fallback acquisition of
//! production mode, and the refused frees.

use std::sync::atomic::Ordering;

use crate::backend::{DEFAULT_ALIGNMENT, MAX_REQUEST_BYTES};
use crate::error::{MemError, OomReport};
use crate::tag::Tag;

use super::blocks::{Core, Fallback};
use super::config::{Freed, RefusedFree};
use super::pool::{reserve_err, ActivationPool};
use super::FRESH_STREAM;

impl ActivationPool {
    /// Allocates `bytes` (rounded up to the alignment) for work on `stream`
    /// and returns its address. See the module documentation for the order
    /// in which free blocks are tried (after a planned pass's hint,
    /// `plan.rs`).
    pub fn allocate(&self, bytes: u64, stream: u64) -> Result<usize, MemError> {
        let addr = self.allocate_unrecorded(bytes, stream)?;
        if self.inner.recording.load(Ordering::Relaxed) {
            let units = bytes.div_ceil(self.inner.align);
            if let Some(rec) = self.core().recording.as_mut() {
                if !rec.alloc(addr, units) {
                    // Spoilt: the free path need not look any more.
                    self.inner.recording.store(false, Ordering::Relaxed);
                }
            }
        }
        Ok(addr)
    }

    fn allocate_unrecorded(&self, bytes: u64, stream: u64) -> Result<usize, MemError> {
        let inner = &*self.inner;
        if bytes == 0 || bytes > MAX_REQUEST_BYTES {
            return Err(MemError::invalid(format!(
                "allocate of {bytes} B: the size must be between 1 B and 1 PiB"
            )));
        }
        if stream == FRESH_STREAM {
            return Err(MemError::invalid(format!(
                "stream {FRESH_STREAM:#x} is reserved; pass a real stream handle (0 for the legacy \
                 default stream)"
            )));
        }
        let need = bytes.div_ceil(inner.align) << inner.shift;
        let units = need >> inner.shift;
        let shift = inner.shift;
        {
            let mut core = self.core();
            if let Some((level, _)) = core.asleep {
                return Err(MemError::Asleep(format!(
                    "allocate of {bytes} B from the activation pool, which sleeps (level \
                     {level}); call wake() first"
                )));
            }
            if core.live.try_reserve(1).is_err() {
                core.c.ooms += 1;
                return Err(reserve_err("pointer map"));
            }
            if core.plan.is_some() {
                if let Some(addr) = self.place_hinted(&mut core, units, need, stream, bytes) {
                    return Ok(addr);
                }
            }
            let own = Self::find_own(&core, stream, units, need);
            if let Some(idx) = own.filter(|&idx| self.reach(&mut core, idx, need)) {
                core.take(idx);
                core.carve(idx, need, stream, bytes, shift);
                return Ok(inner.base + core.slab[idx as usize].offset as usize);
            }
            if need <= self.capacity() {
                if let Some(addr) = self.take_other_lane(&mut core, stream, units, need, bytes)? {
                    return Ok(addr);
                }
                if let Some(addr) = self.reclaim(&mut core, stream, units, need, bytes) {
                    return Ok(addr);
                }
            }
            if inner.strict {
                core.c.ooms += 1;
                return Err(self.oom(&core, bytes));
            }
        }
        self.fall_back(bytes, need, stream)
    }

    /// A block of `stream`'s own lane that fits.
    #[inline]
    fn find_own(core: &Core, stream: u64, units: u64, need: u64) -> Option<u32> {
        let lane = &core.lanes[core.lane_of(stream)? as usize];
        lane.find(&core.slab, units, need)
            .or_else(|| lane.find_exact(&core.slab, units, need))
    }

    /// Serves the request from another stream's free block, after ordering
    /// `stream` after that one. A failed order is returned, nothing changed.
    fn take_other_lane(
        &self,
        core: &mut Core,
        stream: u64,
        units: u64,
        need: u64,
        bytes: u64,
    ) -> Result<Option<usize>, MemError> {
        // Never-used memory first: it needs no order (and so no driver
        // call, which matters while a stream is being captured).
        let fresh = core.lanes.iter().filter(|l| l.stream == FRESH_STREAM);
        let others = core
            .lanes
            .iter()
            .filter(|l| l.stream != stream && l.stream != FRESH_STREAM);
        let found = fresh.chain(others).filter(|l| l.blocks > 0).find_map(|l| {
            l.find(&core.slab, units, need)
                .or_else(|| l.find_exact(&core.slab, units, need))
                .map(|idx| (idx, l.stream))
        });
        let Some((idx, producer)) = found else {
            return Ok(None);
        };
        if !self.reach(core, idx, need) {
            return Ok(None);
        }
        if producer != FRESH_STREAM {
            self.inner.order.order_after(stream, producer)?;
            core.c.cross_stream_reuses += 1;
        }
        core.take(idx);
        core.carve(idx, need, stream, bytes, self.inner.shift);
        Ok(Some(
            self.inner.base + core.slab[idx as usize].offset as usize,
        ))
    }

    /// Orders `stream` after every other stream holding free blocks, moves
    /// their blocks to `stream`'s lane (merging), and searches once more.
    fn reclaim(
        &self,
        core: &mut Core,
        stream: u64,
        units: u64,
        need: u64,
        bytes: u64,
    ) -> Option<usize> {
        let shift = self.inner.shift;
        if core
            .lanes
            .iter()
            .all(|l| l.stream == stream || l.blocks == 0)
        {
            return None;
        }
        let mut moved = false;
        let mut i = 0;
        while i < core.lanes.len() {
            let (other, blocks) = (core.lanes[i].stream, core.lanes[i].blocks);
            let ordered =
                || other == FRESH_STREAM || self.inner.order.order_after(stream, other).is_ok();
            if other != stream && blocks > 0 && ordered() {
                moved |= core.move_lane(i as u32, stream, shift);
            }
            i += 1;
        }
        if !moved {
            return None;
        }
        core.c.reclaims += 1;
        let idx = Self::find_own(core, stream, units, need)?;
        if !self.reach(core, idx, need) {
            return None;
        }
        core.take(idx);
        core.carve(idx, need, stream, bytes, shift);
        Some(self.inner.base + core.slab[idx as usize].offset as usize)
    }

    /// Whether the first `need` bytes of free block `idx` are committed,
    /// committing whole chunks up to them first while the pool measures
    /// (false when the backend refuses the commit: the request is then
    /// exhausted, as if the block did not fit). Records the extent reached.
    fn reach(&self, core: &mut Core, idx: u32, need: u64) -> bool {
        let end = core.slab[idx as usize].offset + need;
        self.reach_end(core, end)
    }

    /// [`Self::reach`] for a block ending at `end`.
    pub(super) fn reach_end(&self, core: &mut Core, end: u64) -> bool {
        if core.measuring {
            let mut region = self.region();
            if end > region.len() as u64 {
                let chunk = self.inner.chunk;
                let target = end
                    .div_ceil(chunk)
                    .saturating_mul(chunk)
                    .min(self.capacity());
                if region.commit(target).is_err() {
                    return false;
                }
            }
        }
        core.extent_peak = core.extent_peak.max(end);
        true
    }

    fn oom(&self, core: &Core, bytes: u64) -> MemError {
        MemError::OutOfMemory(OomReport {
            asked: bytes,
            live: core.c.allocated,
            budget: self.capacity(),
            capacity: self.capacity(),
            tag: Tag::Activations,
            device_refused: false,
            ledger_headroom: None,
            ledger_tenant: None,
        })
    }

    /// Production mode: a region of its own from the backend.
    fn fall_back(&self, bytes: u64, need: u64, stream: u64) -> Result<usize, MemError> {
        let inner = &*self.inner;
        let region = match inner.backend.acquire(
            need,
            inner.align.max(DEFAULT_ALIGNMENT as u64),
            Tag::Activations,
        ) {
            Ok(r) => r,
            Err(e) => {
                self.core().c.ooms += 1;
                return Err(e);
            }
        };
        let addr = region.base();
        let mut core = self.core();
        if core.fallback.try_reserve(1).is_err() {
            core.c.ooms += 1;
            drop(core);
            drop(region);
            return Err(reserve_err("fallback map"));
        }
        core.fallback.insert(
            addr as u64,
            Fallback {
                region,
                requested: bytes,
                stream,
            },
        );
        inner
            .fallbacks
            .store(core.fallback.len(), Ordering::Release);
        let c = &mut core.c;
        c.fallbacks_total += 1;
        c.fallback_bytes_total += need;
        c.fallback_bytes += need;
        c.reserved_peak = c.reserved_peak.max(self.capacity() + c.fallback_bytes);
        c.in_use_peak = c.in_use_peak.max(c.allocated + c.fallback_bytes);
        c.requested += bytes;
        c.live += 1;
        c.live_peak = c.live_peak.max(c.live);
        c.allocs_total += 1;
        c.allocated_bytes_total += need;
        Ok(addr)
    }

    /// Frees `addr` on `stream`: the block is reusable on `stream` at once,
    /// on another stream after an order. A refused free changes nothing but
    /// the refusal counter.
    pub fn free(&self, addr: usize, stream: u64) -> Result<Freed, MemError> {
        self.try_free(addr, stream).map_err(|r| r.error(addr))
    }

    /// [`ActivationPool::free`], with the reason for a refusal as a value.
    pub fn try_free(&self, addr: usize, stream: u64) -> Result<Freed, RefusedFree> {
        let freed = self.free_unrecorded(addr, stream)?;
        if self.inner.recording.load(Ordering::Relaxed) {
            if let Some(rec) = self.core().recording.as_mut() {
                rec.free(addr);
            }
        }
        Ok(freed)
    }

    fn free_unrecorded(&self, addr: usize, stream: u64) -> Result<Freed, RefusedFree> {
        let inner = &*self.inner;
        let mut core = self.core();
        if stream == FRESH_STREAM {
            core.c.refused_frees += 1;
            return Err(RefusedFree::ReservedStream);
        }
        if self.contains(addr) {
            let offset = (addr - inner.base) as u64;
            let found = if offset & (inner.align - 1) == 0 {
                core.live.remove(&(offset >> inner.shift))
            } else {
                None
            };
            let Some(idx) = found else {
                core.c.refused_frees += 1;
                return Err(RefusedFree::NotLive);
            };
            let b = core.slab[idx as usize];
            // SAFETY: the block is live and was just removed from the map,
            // so no handle to it remains; it lies inside the region.
            unsafe { self.region().scrub(b.offset as usize, b.size as usize) };
            core.put_free(idx, stream, inner.shift);
            let c = &mut core.c;
            c.allocated -= b.size;
            c.requested -= b.requested;
            c.live -= 1;
            c.frees_total += 1;
            c.freed_bytes_total += b.size;
            return Ok(Freed {
                size: b.size,
                requested: b.requested,
                alloc_stream: b.stream,
                fallback: false,
                live_after: c.live,
            });
        }
        let Some(fb) = core.fallback.remove(&(addr as u64)) else {
            core.c.refused_frees += 1;
            return Err(RefusedFree::Foreign);
        };
        inner
            .fallbacks
            .store(core.fallback.len(), Ordering::Release);
        let size = fb.region.len() as u64;
        let c = &mut core.c;
        c.fallback_bytes -= size;
        c.requested -= fb.requested;
        c.live -= 1;
        c.frees_total += 1;
        c.freed_bytes_total += size;
        let live_after = c.live;
        drop(core);
        let freed = Freed {
            size,
            requested: fb.requested,
            alloc_stream: fb.stream,
            fallback: true,
            live_after,
        };
        // The release unmaps at once (a VMM backend's does not wait for the
        // device as cuMemFree does): first wait for the work queued on the
        // streams that used the region. The H200 crashed with an illegal
        // address when a served generate() fell back and freed without it.
        let waited = inner.order.wait(fb.stream).and_then(|()| {
            if stream == fb.stream {
                Ok(())
            } else {
                inner.order.wait(stream)
            }
        });
        match waited {
            Ok(()) => drop(fb),
            Err(_) => self.core().parked.push(fb),
        }
        Ok(freed)
    }
}
