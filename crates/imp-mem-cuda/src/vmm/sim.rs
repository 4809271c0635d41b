//! A simulated VMM driver for CPU tests. It enforces the rules of the real
//! API that the bookkeeping relies on, as this crate reads them:
//!
//! * sizes and mapped addresses are multiples of the granularity;
//! * a mapping lies inside one reservation and overlaps no other mapping, and
//!   maps the whole of a live (unreleased) handle;
//! * `cuMemUnmap` takes exactly one whole mapping (the real driver cannot
//!   unmap part of one);
//! * `cuMemSetAccess` covers only mapped memory;
//! * `cuMemAddressFree` takes a whole reservation with nothing mapped;
//! * a released handle's memory is freed when its last mapping goes.
//!
//! Physical memory is finite, and any operation can be told to fail.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::driver::{
    CuError, CuMemHandle, CuResult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY,
};
use imp_mem_core::{DeviceReading, SourceError};

use crate::vmm::VmmDriver;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Op {
    Reserve,
    Create,
    Map,
    Unmap,
    SetAccess,
}

#[derive(Debug)]
struct Handle {
    size: usize,
    released: bool,
    mappings: usize,
}

#[derive(Debug)]
struct Mapped {
    size: usize,
    handle: CuMemHandle,
    accessible: bool,
}

#[derive(Debug, Default)]
pub struct SimState {
    pub granule: usize,
    pub capacity: u64,
    next_va: u64,
    next_handle: CuMemHandle,
    reservations: BTreeMap<u64, usize>,
    handles: BTreeMap<CuMemHandle, Handle>,
    mappings: BTreeMap<u64, Mapped>,
    /// (op, countdown, code): the countdown-th call of `op` from now fails.
    failures: Vec<(Op, u32, CuResult)>,
    /// Sizes of every successful set-access call.
    pub set_access_sizes: Vec<usize>,
    pub creates: u64,
}

fn err(call: &'static str, code: CuResult) -> CuError {
    CuError { call, code }
}

impl SimState {
    fn fail(&mut self, op: Op) -> Option<CuResult> {
        let mut hit = None;
        for entry in &mut self.failures {
            if entry.0 == op && entry.1 > 0 {
                entry.1 -= 1;
                if entry.1 == 0 {
                    hit = Some(entry.2);
                }
            }
        }
        self.failures.retain(|e| e.1 > 0);
        hit
    }

    /// Physical bytes held by handles that are live or still mapped.
    pub fn physical(&self) -> u64 {
        self.handles.values().map(|h| h.size as u64).sum()
    }

    pub fn live_handles(&self) -> usize {
        self.handles.len()
    }

    pub fn reservations(&self) -> usize {
        self.reservations.len()
    }

    pub fn mapped_bytes(&self) -> u64 {
        self.mappings.values().map(|m| m.size as u64).sum()
    }

    /// True when every mapping has had its access set.
    pub fn all_accessible(&self) -> bool {
        self.mappings.values().all(|m| m.accessible)
    }

    fn reservation_of(&self, addr: u64, size: usize) -> Option<(u64, usize)> {
        let (&start, &len) = self.reservations.range(..=addr).next_back()?;
        let end = start.checked_add(len as u64)?;
        (addr.checked_add(size as u64)? <= end).then_some((start, len))
    }

    fn overlaps_mapping(&self, addr: u64, size: usize) -> bool {
        let end = addr + size as u64;
        if let Some((&start, m)) = self.mappings.range(..=addr).next_back() {
            if start + m.size as u64 > addr {
                return true;
            }
        }
        self.mappings.range(addr..end).next().is_some()
    }
}

/// The simulated driver; clones share one state.
#[derive(Debug, Clone)]
pub struct SimDriver {
    pub state: Arc<Mutex<SimState>>,
    pub total: u64,
    pub recommended: usize,
}

impl SimDriver {
    pub fn new(granule: usize, capacity: u64) -> Self {
        let state = SimState {
            granule,
            capacity,
            next_va: 0x7f00_0000_0000,
            next_handle: 1,
            ..SimState::default()
        };
        Self {
            state: Arc::new(Mutex::new(state)),
            total: capacity,
            recommended: granule,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The `nth` call of `op` from now (1 = the next) fails with `code`.
    pub fn fail_nth(&self, op: Op, nth: u32, code: CuResult) {
        self.lock().failures.push((op, nth, code));
    }
}

// SAFETY: a simulation; it performs no real driver call.
unsafe impl VmmDriver for SimDriver {
    type Scope<'a> = ();

    fn enter(&self) -> Result<(), CuError> {
        Ok(())
    }

    fn device(&self) -> i32 {
        0
    }

    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        let s = self.lock();
        Ok(Some(DeviceReading {
            free: s.capacity.saturating_sub(s.physical()),
            total: s.capacity,
        }))
    }

    fn total_memory(&self) -> u64 {
        self.total
    }

    fn granularity(&self) -> Result<(usize, usize), CuError> {
        let s = self.lock();
        Ok((s.granule, self.recommended))
    }

    fn address_reserve(&self, size: usize, align: usize) -> Result<u64, CuError> {
        let mut s = self.lock();
        if let Some(code) = s.fail(Op::Reserve) {
            return Err(err("cuMemAddressReserve", code));
        }
        if size == 0 || size % s.granule != 0 || (align != 0 && !align.is_power_of_two()) {
            return Err(err("cuMemAddressReserve", CUDA_ERROR_INVALID_VALUE));
        }
        let align = align.max(s.granule) as u64;
        let base = s.next_va.div_ceil(align) * align;
        // A guard gap between reservations, so an overrun cannot land in the
        // next one.
        s.next_va = base + size as u64 + s.granule as u64;
        s.reservations.insert(base, size);
        Ok(base)
    }

    unsafe fn address_free(&self, addr: u64, size: usize) -> Result<(), CuError> {
        let mut s = self.lock();
        if s.reservations.get(&addr) != Some(&size) {
            return Err(err("cuMemAddressFree", CUDA_ERROR_INVALID_VALUE));
        }
        if s.overlaps_mapping(addr, size) {
            return Err(err("cuMemAddressFree", CUDA_ERROR_INVALID_VALUE));
        }
        s.reservations.remove(&addr);
        Ok(())
    }

    fn create(&self, size: usize) -> Result<CuMemHandle, CuError> {
        let mut s = self.lock();
        if let Some(code) = s.fail(Op::Create) {
            return Err(err("cuMemCreate", code));
        }
        if size == 0 || size % s.granule != 0 {
            return Err(err("cuMemCreate", CUDA_ERROR_INVALID_VALUE));
        }
        if s.physical() + size as u64 > s.capacity {
            return Err(err("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY));
        }
        let id = s.next_handle;
        s.next_handle += 1;
        s.creates += 1;
        s.handles.insert(
            id,
            Handle {
                size,
                released: false,
                mappings: 0,
            },
        );
        Ok(id)
    }

    unsafe fn release(&self, handle: CuMemHandle) -> Result<(), CuError> {
        let mut s = self.lock();
        let Some(h) = s.handles.get_mut(&handle) else {
            return Err(err("cuMemRelease", CUDA_ERROR_INVALID_VALUE));
        };
        if h.released {
            return Err(err("cuMemRelease", CUDA_ERROR_INVALID_VALUE));
        }
        h.released = true;
        if h.mappings == 0 {
            s.handles.remove(&handle);
        }
        Ok(())
    }

    unsafe fn map(&self, addr: u64, size: usize, handle: CuMemHandle) -> Result<(), CuError> {
        let mut s = self.lock();
        if let Some(code) = s.fail(Op::Map) {
            return Err(err("cuMemMap", code));
        }
        let granule = s.granule as u64;
        let ok_handle = matches!(s.handles.get(&handle), Some(h) if !h.released && h.size == size);
        if !ok_handle
            || addr % granule != 0
            || s.reservation_of(addr, size).is_none()
            || s.overlaps_mapping(addr, size)
        {
            return Err(err("cuMemMap", CUDA_ERROR_INVALID_VALUE));
        }
        if let Some(h) = s.handles.get_mut(&handle) {
            h.mappings += 1;
        }
        s.mappings.insert(
            addr,
            Mapped {
                size,
                handle,
                accessible: false,
            },
        );
        Ok(())
    }

    unsafe fn unmap(&self, addr: u64, size: usize) -> Result<(), CuError> {
        let mut s = self.lock();
        if let Some(code) = s.fail(Op::Unmap) {
            return Err(err("cuMemUnmap", code));
        }
        let Some(m) = s.mappings.get(&addr) else {
            return Err(err("cuMemUnmap", CUDA_ERROR_INVALID_VALUE));
        };
        if m.size != size {
            return Err(err("cuMemUnmap", CUDA_ERROR_INVALID_VALUE));
        }
        let handle = m.handle;
        s.mappings.remove(&addr);
        let drop_handle = match s.handles.get_mut(&handle) {
            Some(h) => {
                h.mappings -= 1;
                h.released && h.mappings == 0
            }
            None => false,
        };
        if drop_handle {
            s.handles.remove(&handle);
        }
        Ok(())
    }

    unsafe fn set_access(&self, addr: u64, size: usize) -> Result<(), CuError> {
        let mut s = self.lock();
        if let Some(code) = s.fail(Op::SetAccess) {
            return Err(err("cuMemSetAccess", code));
        }
        // Every byte of the range must be mapped.
        let end = addr + size as u64;
        let mut at = addr;
        let keys: Vec<u64> = s.mappings.range(..end).map(|(&k, _)| k).collect();
        let mut covered = Vec::new();
        for k in keys {
            let len = s.mappings.get(&k).map_or(0, |m| m.size as u64);
            if k + len <= at {
                continue;
            }
            if k > at {
                break;
            }
            covered.push(k);
            at = k + len;
        }
        if at < end {
            return Err(err("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE));
        }
        for k in covered {
            if let Some(m) = s.mappings.get_mut(&k) {
                m.accessible = true;
            }
        }
        s.set_access_sizes.push(size);
        Ok(())
    }
}
