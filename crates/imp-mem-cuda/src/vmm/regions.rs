//! [`VmmCore`]: the bookkeeping of a VMM source — its reservations, the
//! chunk mappings of their committed prefixes, and the cache of released
//! handles — over a [`VmmDriver`](super::VmmDriver).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use imp_mem_core::{MemError, SourceError};

use super::config::{check_sizes, chunk_size, combined_granularity, VmmConfig};
use super::driver::{CudaVmm, VmmDriver};
use crate::driver::{CuError, CuMemHandle};

/// One physical handle mapped at `offset` of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mapping {
    pub(super) offset: usize,
    pub(super) size: usize,
    pub(super) handle: CuMemHandle,
}

#[derive(Debug)]
pub(super) struct Reservation {
    pub(super) size: usize,
    /// The committed prefix, in offset order, contiguous from 0.
    pub(super) mappings: Vec<Mapping>,
}

impl Reservation {
    pub(super) fn committed(&self) -> usize {
        self.mappings.last().map_or(0, |m| m.offset + m.size)
    }
}

/// What a VMM source has done, for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmmCounters {
    /// `cuMemAddressReserve` calls that succeeded.
    pub reservations: u64,
    /// `cuMemCreate` calls that succeeded.
    pub handles_created: u64,
    /// `cuMemRelease` calls.
    pub handles_released: u64,
    /// Commits served by a cached handle instead of `cuMemCreate`.
    pub cache_hits: u64,
    /// `cuMemMap` calls that succeeded.
    pub maps: u64,
    /// `cuMemUnmap` calls that succeeded.
    pub unmaps: u64,
    /// `cuMemSetAccess` calls that succeeded.
    pub set_access_calls: u64,
    /// Driver failures during cleanup that could only be counted (an unmap
    /// or release that failed while freeing a region).
    pub cleanup_failures: u64,
}

#[derive(Debug, Default)]
pub(super) struct VmmState {
    pub(super) reservations: BTreeMap<usize, Reservation>,
    /// Released chunk-sized handles, ready to map again.
    pub(super) cache: Vec<CuMemHandle>,
    /// Bytes mapped in live reservations.
    pub(super) mapped_bytes: u64,
    pub(super) counters: VmmCounters,
}

/// A growable device memory source over a [`VmmDriver`].
pub struct VmmCore<D: VmmDriver> {
    pub(super) driver: D,
    /// The device's minimum granularity (what a fixed region rounds to).
    pub(super) granule: usize,
    /// Bytes per handle for growable regions.
    pub(super) chunk: usize,
    pub(super) cache_limit: usize,
    pub(super) state: Mutex<VmmState>,
}

/// The VMM source on a CUDA device.
pub type VmmSource = VmmCore<CudaVmm>;

impl<D: VmmDriver> std::fmt::Debug for VmmCore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmCore")
            .field("device", &self.driver.device())
            .field("granule", &self.granule)
            .field("chunk", &self.chunk)
            .field("cache_limit", &self.cache_limit)
            .finish()
    }
}

impl<D: VmmDriver> VmmCore<D> {
    /// A source over `driver` with `config`.
    pub fn with_driver(driver: D, config: VmmConfig) -> Result<Self, MemError> {
        let (min, recommended) = {
            let _scope = driver.enter()?;
            driver.granularity()?
        };
        if min == 0 || !min.is_power_of_two() {
            return Err(MemError::Driver(format!(
                "the device reports an allocation granularity of {min} B"
            )));
        }
        let unit = combined_granularity(min, recommended);
        let chunk = chunk_size(config.chunk_bytes, unit)?;
        check_sizes(chunk, config.cache_chunks, driver.total_memory())?;
        Ok(Self {
            driver,
            granule: min,
            chunk,
            cache_limit: config.cache_chunks,
            state: Mutex::new(VmmState::default()),
        })
    }

    pub(super) fn state(&self) -> MutexGuard<'_, VmmState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes per physical handle of a growable region (= the granularity the
    /// backend commits in).
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    /// The device's minimum allocation granularity.
    pub fn device_granularity(&self) -> usize {
        self.granule
    }

    /// Most chunk handles kept for reuse.
    pub fn cache_limit_chunks(&self) -> usize {
        self.cache_limit
    }

    /// Physical bytes held in the cache (no region uses them).
    pub fn cached_bytes(&self) -> u64 {
        (self.state().cache.len() * self.chunk) as u64
    }

    /// Physical bytes mapped in live regions.
    pub fn mapped_bytes(&self) -> u64 {
        self.state().mapped_bytes
    }

    /// What the source has done so far.
    pub fn counters(&self) -> VmmCounters {
        self.state().counters
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// Releases every cached handle now, returning its memory to the device.
    pub fn trim_cache(&self) {
        let mut state = self.state();
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        self.drain_cache(&mut state);
    }

    fn drain_cache(&self, state: &mut VmmState) {
        while let Some(handle) = state.cache.pop() {
            self.release_counted(state, handle);
        }
    }

    pub(super) fn release_counted(&self, state: &mut VmmState, handle: CuMemHandle) {
        // SAFETY: every handle reaching here is owned by the state (cached or
        // just removed from a mapping) and leaves it now: released once.
        match unsafe { self.driver.release(handle) } {
            Ok(()) => state.counters.handles_released += 1,
            Err(_) => state.counters.cleanup_failures += 1,
        }
    }

    /// Takes a handle of `size` bytes: a cached one when `size` is a chunk,
    /// else a new one. Out of memory with a non-empty cache releases the
    /// cache and tries once more.
    fn take_handle(&self, state: &mut VmmState, size: usize) -> Result<CuMemHandle, CuError> {
        if size == self.chunk {
            if let Some(handle) = state.cache.pop() {
                state.counters.cache_hits += 1;
                return Ok(handle);
            }
        }
        match self.driver.create(size) {
            Ok(handle) => {
                state.counters.handles_created += 1;
                Ok(handle)
            }
            Err(err)
                if err.code == crate::driver::CUDA_ERROR_OUT_OF_MEMORY
                    && !state.cache.is_empty() =>
            {
                self.drain_cache(state);
                let handle = self.driver.create(size)?;
                state.counters.handles_created += 1;
                Ok(handle)
            }
            Err(err) => Err(err),
        }
    }

    /// Returns a handle that is no longer mapped: into the cache when it is a
    /// chunk and the cache has room, else to the driver.
    pub(super) fn put_handle(&self, state: &mut VmmState, handle: CuMemHandle, size: usize) {
        if size == self.chunk && state.cache.len() < self.cache_limit {
            state.cache.push(handle);
        } else {
            self.release_counted(state, handle);
        }
    }

    /// Unmaps `mappings` (in reverse) of the reservation at `base`; stops at
    /// the first failure and returns the ones still mapped (a prefix) with
    /// the error. The unmapped ones' handles are returned too, still owned.
    pub(super) fn unmap_all(
        &self,
        state: &mut VmmState,
        base: usize,
        mut mappings: Vec<Mapping>,
    ) -> (Vec<Mapping>, Vec<Mapping>, Option<CuError>) {
        let mut unmapped = Vec::with_capacity(mappings.len());
        while let Some(m) = mappings.pop() {
            // SAFETY: `m` is one whole mapping of this reservation, recorded
            // when it was mapped; the caller guarantees nothing uses it.
            match unsafe { self.driver.unmap((base + m.offset) as u64, m.size) } {
                Ok(()) => {
                    state.counters.unmaps += 1;
                    state.mapped_bytes -= m.size as u64;
                    unmapped.push(m);
                }
                Err(err) => {
                    mappings.push(m);
                    return (mappings, unmapped, Some(err));
                }
            }
        }
        (mappings, unmapped, None)
    }

    /// Maps `[from, to)` of the reservation at `base` with new or cached
    /// handles of `piece` bytes each, and sets access on that range only. On
    /// failure every handle taken here is unmapped and given back; the
    /// reservation is as before.
    pub(super) fn map_range(
        &self,
        state: &mut VmmState,
        base: usize,
        from: usize,
        to: usize,
        piece: usize,
    ) -> Result<Vec<Mapping>, CuError> {
        let mut added: Vec<Mapping> = Vec::new();
        let mut offset = from;
        let mut failure = None;
        while offset < to {
            let handle = match self.take_handle(state, piece) {
                Ok(h) => h,
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            };
            // SAFETY: `[base + offset, + piece)` lies inside the reservation
            // (`to <= size`, checked by the caller) past its committed prefix,
            // so it is unmapped; the handle is `piece` bytes.
            match unsafe { self.driver.map((base + offset) as u64, piece, handle) } {
                Ok(()) => {
                    state.counters.maps += 1;
                    state.mapped_bytes += piece as u64;
                    added.push(Mapping {
                        offset,
                        size: piece,
                        handle,
                    });
                    offset += piece;
                }
                Err(err) => {
                    self.put_handle(state, handle, piece);
                    failure = Some(err);
                    break;
                }
            }
        }
        if failure.is_none() {
            // SAFETY: `[base + from, base + to)` was mapped completely just above.
            match unsafe { self.driver.set_access((base + from) as u64, to - from) } {
                Ok(()) => {
                    state.counters.set_access_calls += 1;
                    return Ok(added);
                }
                Err(err) => failure = Some(err),
            }
        }
        // Roll back: nothing was handed out, so nothing can be using it.
        let (still_mapped, unmapped, _) = self.unmap_all(state, base, added);
        for m in unmapped {
            self.put_handle(state, m.handle, m.size);
        }
        for m in still_mapped {
            // An unmap failed: the handle stays mapped; releasing it frees the
            // memory when the reservation is freed. Never cached.
            state.mapped_bytes -= m.size as u64;
            self.release_counted(state, m.handle);
        }
        Err(failure.unwrap_or(CuError {
            call: "map_range",
            code: crate::driver::CUDA_ERROR_INVALID_VALUE,
        }))
    }

    pub(super) fn reserve_inner(
        &self,
        state: &mut VmmState,
        size: usize,
        align: usize,
    ) -> Result<usize, SourceError> {
        // Always explicit: at least the granularity (cuMemMap needs granule-
        // aligned addresses), never the driver's unspecified default.
        let align = align
            .max(self.granule)
            .checked_next_power_of_two()
            .ok_or(SourceError::OutOfMemory)?;
        let base = self.driver.address_reserve(size, align)?;
        let usable = usize::try_from(base).ok().filter(|b| b % align == 0);
        let Some(base) = usable else {
            // SAFETY: reserved just above with this size, nothing mapped.
            let _ = unsafe { self.driver.address_free(base, size) };
            return Err(SourceError::Invariant(format!(
                "cuMemAddressReserve returned {base:#x}, not aligned to {align}"
            )));
        };
        state.counters.reservations += 1;
        state.reservations.insert(
            base,
            Reservation {
                size,
                mappings: Vec::new(),
            },
        );
        Ok(base)
    }

    pub(super) fn free_reservation(&self, state: &mut VmmState, base: usize) {
        let Some(res) = state.reservations.remove(&base) else {
            return;
        };
        let (still_mapped, unmapped, _) = self.unmap_all(state, base, res.mappings);
        for m in unmapped {
            self.put_handle(state, m.handle, m.size);
        }
        for m in still_mapped {
            state.counters.cleanup_failures += 1;
            state.mapped_bytes -= m.size as u64;
            self.release_counted(state, m.handle);
        }
        // SAFETY: the reservation was live and is now out of the map; every
        // mapping in it was unmapped above (or failed to, which the driver then
        // reports here as an error that is only counted).
        if unsafe { self.driver.address_free(base as u64, res.size) }.is_err() {
            state.counters.cleanup_failures += 1;
        }
    }

    /// The committed bytes of the reservation at `base` (for tests).
    pub fn committed_of(&self, base: usize) -> Option<usize> {
        self.state()
            .reservations
            .get(&base)
            .map(Reservation::committed)
    }

    /// Number of mappings (handles) of the reservation at `base`.
    pub fn mappings_of(&self, base: usize) -> Option<usize> {
        self.state()
            .reservations
            .get(&base)
            .map(|r| r.mappings.len())
    }
}

impl<D: VmmDriver> Drop for VmmCore<D> {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut state = std::mem::take(state);
        let Ok(_scope) = self.driver.enter() else {
            return;
        };
        let bases: Vec<usize> = state.reservations.keys().copied().collect();
        for base in bases {
            self.free_reservation(&mut state, base);
        }
        self.drain_cache(&mut state);
    }
}
