//! The [`MemorySource`] contract over [`VmmCore`](super::VmmCore): what the
//! backend calls, each a step of the bookkeeping.

use std::sync::Arc;

use imp_mem_core::source::{FromHost, StreamOrder, TierIo, ToHost};
use imp_mem_core::units::round_up;
use imp_mem_core::{
    DeviceReading, MemError, MemoryKind, MemorySource, PinnedHostOps, SourceCharge, SourceError,
    SourceInfo,
};

use super::driver::VmmDriver;
use super::regions::{Mapping, VmmCore};

// SAFETY: (1) every address is inside a reservation from
// `cuMemAddressReserve`, which never overlaps another live one; a reservation
// is freed only by `free`/`unreserve` of its own base. A reservation is
// aligned to `max(align, granularity)`, asked of the driver and checked. (2) commits map only past the committed prefix
// inside the reservation, so the base is fixed; decommit unmaps only the
// named tail. (3) nothing panics: every arithmetic step is checked or bounded
// by sizes the backend validated, and driver failures are returned.
unsafe impl<D: VmmDriver> MemorySource for VmmCore<D> {
    fn info(&self) -> SourceInfo {
        let cache_bytes = (self.cache_limit as u64).saturating_mul(self.chunk as u64);
        SourceInfo {
            name: "vmm".into(),
            kind: MemoryKind::Device,
            device: self.driver.device(),
            capacity: self.driver.total_memory().saturating_sub(cache_bytes),
            granularity: self.chunk,
            growable: true,
        }
    }

    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        self.driver.mem_info()
    }

    fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        self.driver.pinned_host()
    }

    fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        self.driver.stream_order()
    }

    fn host_tier_io(
        self: Arc<Self>,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        self.driver.host_tier_io(block_bytes, slots)
    }

    /// The handle cache (physical memory no region holds) and the mapping
    /// past the ledger: a fixed region is mapped to whole granules while
    /// the ledger counts the bytes asked for.
    fn extra_charges(&self, committed: u64) -> Vec<SourceCharge> {
        let (cached, mapped) = {
            let state = self.state();
            ((state.cache.len() * self.chunk) as u64, state.mapped_bytes)
        };
        vec![
            SourceCharge {
                key: "vmm_handle_cache".into(),
                label: "VMM handle cache (kept for reuse)".into(),
                bytes: cached,
            },
            SourceCharge {
                key: "vmm_rounding".into(),
                label: "VMM mapping past the ledger (chunk rounding)".into(),
                bytes: mapped.saturating_sub(committed),
            },
        ]
    }

    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError> {
        let size = round_up(bytes, self.granule).ok_or(SourceError::OutOfMemory)?;
        let piece = if size % self.chunk == 0 {
            self.chunk
        } else {
            size
        };
        let mut state = self.state();
        let _scope = self.driver.enter()?;
        let base = self.reserve_inner(&mut state, size, align)?;
        match self.map_range(&mut state, base, 0, size, piece) {
            Ok(added) => {
                if let Some(res) = state.reservations.get_mut(&base) {
                    res.mappings = added;
                }
                Ok(base)
            }
            Err(err) => {
                self.free_reservation(&mut state, base);
                Err(err.into())
            }
        }
    }

    unsafe fn free(&self, addr: usize, _bytes: usize, _align: usize) {
        let mut state = self.state();
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        self.free_reservation(&mut state, addr);
    }

    fn reserve(&self, max_bytes: usize, align: usize) -> Result<usize, SourceError> {
        let size = round_up(max_bytes, self.chunk).ok_or(SourceError::OutOfMemory)?;
        let mut state = self.state();
        let _scope = self.driver.enter()?;
        self.reserve_inner(&mut state, size, align)
    }

    fn commit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        let Some(res) = state.reservations.get(&base) else {
            return Err(SourceError::Invariant(format!(
                "commit at {base:#x}, which is not a reservation of this source"
            )));
        };
        let committed = res.committed();
        if from != committed || to > res.size || from >= to || (to - from) % self.chunk != 0 {
            return Err(SourceError::Invariant(format!(
                "commit [{from}, {to}) does not extend the committed {committed} B of a {} B \
                 reservation by whole {} B chunks",
                res.size, self.chunk
            )));
        }
        let _scope = self.driver.enter()?;
        let added = self.map_range(&mut state, base, from, to, self.chunk)?;
        if let Some(res) = state.reservations.get_mut(&base) {
            res.mappings.extend(added);
        }
        Ok(())
    }

    unsafe fn decommit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        let Some(res) = state.reservations.get_mut(&base) else {
            return Err(SourceError::Invariant(format!(
                "decommit at {base:#x}, which is not a reservation of this source"
            )));
        };
        let committed = res.committed();
        if to != committed || from > to {
            return Err(SourceError::Invariant(format!(
                "decommit [{from}, {to}) is not the committed tail of {committed} B"
            )));
        }
        if from == to {
            return Ok(());
        }
        let Some(split) = res.mappings.iter().position(|m| m.offset == from) else {
            return Err(SourceError::Invariant(format!(
                "decommit from {from} B is not a chunk boundary of this region"
            )));
        };
        let tail = res.mappings.split_off(split);
        let _scope = match self.driver.enter() {
            Ok(scope) => scope,
            Err(err) => {
                if let Some(res) = state.reservations.get_mut(&base) {
                    res.mappings.extend(tail);
                }
                return Err(err.into());
            }
        };
        let (still_mapped, unmapped, failure) = self.unmap_all(&mut state, base, tail);
        if let Some(err) = failure {
            // Put the region back as it was: map the unmapped chunks again, in
            // offset order, and give them access again.
            let mut restored = still_mapped;
            let remap: Vec<Mapping> = unmapped.into_iter().rev().collect();
            let remap_start = remap.first().map(|m| m.offset);
            let mut remap_end = None;
            let mut broken = None;
            let mut pending = remap.into_iter();
            for m in pending.by_ref() {
                // SAFETY: `m` was unmapped just above from this very range of
                // the live reservation, and its handle is still owned.
                match unsafe { self.driver.map((base + m.offset) as u64, m.size, m.handle) } {
                    Ok(()) => {
                        state.mapped_bytes += m.size as u64;
                        remap_end = Some(m.offset + m.size);
                        restored.push(m);
                    }
                    Err(e) => {
                        broken = Some(e);
                        self.release_counted(&mut state, m.handle);
                        break;
                    }
                }
            }
            for m in pending {
                self.release_counted(&mut state, m.handle);
            }
            if let (Some(start), Some(end)) = (remap_start, remap_end) {
                let addr = (base + start) as u64;
                // SAFETY: `[start, end)` was just mapped again, completely.
                let access = unsafe { self.driver.set_access(addr, end - start) };
                if let Err(e) = access {
                    broken = broken.or(Some(e));
                }
            }
            if let Some(res) = state.reservations.get_mut(&base) {
                res.mappings.extend(restored);
            }
            return Err(match broken {
                None => err.into(),
                Some(e) => SourceError::Invariant(format!(
                    "decommit failed ({err}) and restoring the region failed too ({e}); the \
                     region's tail is unusable — release it"
                )),
            });
        }
        for m in unmapped {
            self.put_handle(&mut state, m.handle, m.size);
        }
        Ok(())
    }

    unsafe fn unreserve(&self, base: usize, _max_bytes: usize, _committed: usize) {
        let mut state = self.state();
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        self.free_reservation(&mut state, base);
    }

    unsafe fn copy_to_host(&self, src: usize, dst: *mut u8, len: usize) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: the backend passes a committed (mapped, accessible) range of
        // a live region of this source, and a host buffer of `len` bytes.
        unsafe { self.driver.copy_dtoh(dst, src as u64, len) }.map_err(SourceError::from)
    }

    unsafe fn copy_from_host(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: as in `copy_to_host`, in the other direction.
        unsafe { self.driver.copy_htod(dst as u64, src, len) }.map_err(SourceError::from)
    }

    unsafe fn copy_to_host_many(&self, copies: &[ToHost]) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: the backend passes committed (mapped, accessible) ranges of
        // live regions of this source, and disjoint host buffers.
        unsafe { self.driver.copy_dtoh_many(copies) }.map_err(SourceError::from)
    }

    unsafe fn copy_from_host_many(&self, copies: &[FromHost]) -> Result<(), SourceError> {
        let _scope = self.driver.enter()?;
        // SAFETY: as in `copy_to_host_many`, in the other direction.
        unsafe { self.driver.copy_htod_many(copies) }.map_err(SourceError::from)
    }
}
