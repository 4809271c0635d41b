//! `FakeBackend`: a backend over host memory, for tests with no GPU (seed A6).
//!
//! It behaves like a device with a configurable capacity and adds what a test
//! needs to see inside:
//!
//! * the full journal `(seq, phase, tag, bytes, op)`, always on;
//! * poison on release: released bytes read as `0xDE` and the last
//!   [`QUARANTINE_LEN`] released allocations are kept (their addresses are not
//!   reused), so a test can read the poison back instead of committing a
//!   use-after-free (seed D6);
//! * `fail_nth(n)`: the n-th acquisition from now fails as out of memory;
//! * growth simulation: a growable region is one host mapping of its whole
//!   reservation, so its base cannot move; commits and decommits can be told to
//!   fail, and every one checks that the base it is given is the base that was
//!   reserved and that the range lies inside the reservation.
//!
//! Host memory follows what is committed, never what is reserved
//! (`host_pages.rs`): a reservation is address space, a page becomes resident
//! when it is written, and a decommit or a release hands its pages back. What
//! lies past a region's committed part (a decommitted tail, a released
//! allocation) has no memory behind it and reads as the poison, so the fake
//! never holds more host memory than its capacity.
//!
//! With `backed = false` the fake hands out synthetic addresses with no host
//! memory behind them, so capacity-scale scenarios (an 80 GiB budget) run on a
//! laptop; reading such memory is refused.
//!
//! The source's KV host tier copies with [`FakeTierIo`] (`tier_io.rs`):
//! host slots in a `Vec`, copies of the fake's memory that run as they are
//! enqueued, or only when a test says so.
//!
//! Thread safety: all state is behind one mutex; reads and writes of fake
//! memory happen under it, so they cannot race a release.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::Backend;
use crate::error::MemError;
use crate::phase::PhaseMode;
use crate::source::{FromHost, MemoryKind, MemorySource, SourceError, SourceInfo, TierIo, ToHost};

pub(crate) mod host_pages;
mod tier_io;

use host_pages::HostPages;

pub use tier_io::FakeTierIo;

/// The byte written over released memory.
pub const POISON: u8 = 0xDE;
/// How many released allocations stay readable.
pub const QUARANTINE_LEN: usize = 16;
/// Where synthetic (unbacked) addresses start.
const SYNTHETIC_BASE: usize = 0x1000_0000_0000;

/// How to build a fake.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    /// Device capacity in bytes.
    pub capacity: u64,
    /// Budget cap (default: the capacity).
    pub budget: Option<u64>,
    /// Growable regions commit in multiples of this.
    pub granularity: usize,
    /// Back regions with host memory (readable, poisonable) or not.
    pub backed: bool,
    /// What an acquisition while serving does.
    pub mode: PhaseMode,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            capacity: 1 << 30,
            budget: None,
            granularity: 4096,
            backed: true,
            mode: PhaseMode::Strict,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AllocState {
    Live,
    Quarantined,
}

#[derive(Debug)]
struct Alloc {
    len: usize,
    state: AllocState,
    /// For a reservation: bytes committed; for a plain allocation: `len`
    /// while live. Released memory is 0: bytes past it read as the poison.
    committed: usize,
    reservation: bool,
    /// For a reservation: the most it has ever had committed. A recommit
    /// below it shows the poison, as the old contents are gone.
    touched: usize,
    /// The host memory of a backed fake (`None` when unbacked).
    memory: Option<HostPages>,
}

/// Counts one call down a fault-injection countdown (`Some(n)`: the `n`-th
/// call from now fails). True for the call that fails, which clears it.
/// The fakes' `fail_nth` set it (`FakeBackend`, `FakePinnedHost`).
pub(crate) fn countdown_fails(countdown: &mut Option<u64>) -> bool {
    match *countdown {
        Some(1) => {
            *countdown = None;
            true
        }
        Some(n) => {
            *countdown = Some(n - 1);
            false
        }
        None => false,
    }
}

#[derive(Debug, Default)]
struct FakeState {
    /// Physical bytes in use by live allocations and committed ranges.
    used: u64,
    /// Bytes the "device" has lost to something outside this backend.
    external: u64,
    allocs: BTreeMap<usize, Alloc>,
    quarantine: VecDeque<usize>,
    fail_countdown: Option<u64>,
    fail_commits: u32,
    fail_decommits: u32,
    next_synthetic: usize,
    acquisitions: u64,
}

/// The physical side of the fake.
#[derive(Debug)]
pub struct FakeSource {
    capacity: u64,
    granularity: usize,
    backed: bool,
    state: Mutex<FakeState>,
}

impl FakeSource {
    pub(crate) fn new(config: &FakeConfig) -> Self {
        Self {
            capacity: config.capacity,
            granularity: config.granularity.max(1),
            backed: config.backed,
            state: Mutex::new(FakeState {
                next_synthetic: SYNTHETIC_BASE,
                ..FakeState::default()
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the fault-injection decision for one acquisition.
    fn should_fail(state: &mut FakeState) -> bool {
        state.acquisitions += 1;
        countdown_fails(&mut state.fail_countdown)
    }

    fn take_bytes(&self, state: &mut FakeState, bytes: u64) -> Result<(), SourceError> {
        if state.used + state.external + bytes > self.capacity {
            return Err(SourceError::OutOfMemory);
        }
        state.used += bytes;
        Ok(())
    }

    fn new_block(
        &self,
        state: &mut FakeState,
        len: usize,
        align: usize,
    ) -> Result<(usize, Option<HostPages>), SourceError> {
        if self.backed {
            let pages = HostPages::new(len, align).ok_or(SourceError::OutOfMemory)?;
            Ok((pages.addr(), Some(pages)))
        } else {
            let addr = crate::units::align_up(state.next_synthetic, align)
                .ok_or(SourceError::OutOfMemory)?;
            state.next_synthetic = addr.checked_add(len).ok_or(SourceError::OutOfMemory)?;
            Ok((addr, None))
        }
    }

    /// Poisons `[addr + from, addr + to)` of a backed allocation.
    fn poison(&self, addr: usize, from: usize, to: usize) {
        if self.backed && to > from {
            // SAFETY: the caller passes a range inside the committed part of a
            // live backed host allocation of this source (checked against
            // `allocs`), which we own, under the state lock.
            unsafe { std::ptr::write_bytes((addr + from) as *mut u8, POISON, to - from) };
        }
    }

    /// Poisons a released allocation and moves it to the quarantine, freeing
    /// the oldest one past the quarantine's length.
    fn retire(&self, state: &mut FakeState, addr: usize) {
        let Some(a) = state.allocs.get_mut(&addr) else {
            return;
        };
        // The memory goes back now; the quarantine keeps only the address
        // range, which reads as the poison.
        if let Some(memory) = &a.memory {
            memory.release(0, a.committed);
        }
        a.committed = 0;
        a.state = AllocState::Quarantined;
        state.quarantine.push_back(addr);
        while state.quarantine.len() > QUARANTINE_LEN {
            let Some(old) = state.quarantine.pop_front() else {
                break;
            };
            // Dropping the entry unmaps its host memory.
            state.allocs.remove(&old);
        }
    }

    /// Finds the allocation holding `[addr, addr + len)`: its start, its
    /// state and its committed bytes.
    fn locate(
        &self,
        state: &FakeState,
        addr: usize,
        len: usize,
    ) -> Result<(usize, AllocState, usize), MemError> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| MemError::invalid("address range overflows"))?;
        let found = state.allocs.range(..=addr).next_back();
        match found {
            Some((&start, a)) if end <= start + a.len => Ok((start, a.state, a.committed)),
            _ => Err(MemError::invalid(format!(
                "[{addr:#x}, {end:#x}) is not inside any live or quarantined region of this fake \
                 backend; read only what it handed out"
            ))),
        }
    }

    /// Checks that `[addr, addr + len)` is committed memory of a live
    /// allocation (for a reservation: inside its committed prefix), as a
    /// device copy would need.
    fn check_committed(
        &self,
        state: &FakeState,
        addr: usize,
        len: usize,
    ) -> Result<(), SourceError> {
        let found = state.allocs.range(..=addr).next_back();
        match found {
            Some((&start, a))
                if a.state == AllocState::Live
                    && addr
                        .checked_add(len)
                        .is_some_and(|end| end <= start + a.committed) =>
            {
                Ok(())
            }
            _ => Err(SourceError::Invariant(format!(
                "copy of [{addr:#x}, +{len}) outside the committed memory of any live region of \
                 this fake backend"
            ))),
        }
    }

    fn check_backed(&self) -> Result<(), MemError> {
        if self.backed {
            Ok(())
        } else {
            Err(MemError::invalid(
                "this FakeBackend is unbacked (backed=False): its addresses have no memory behind \
                 them; construct it with backed=True to read or write",
            ))
        }
    }

    /// Reads `len` bytes at `addr` from a live or quarantined region; bytes
    /// past its committed part (released, decommitted or never committed)
    /// read as the poison.
    pub(crate) fn read(&self, addr: usize, len: usize) -> Result<Vec<u8>, MemError> {
        self.check_backed()?;
        let state = self.state();
        let (start, _, committed) = self.locate(&state, addr, len)?;
        let mut out = vec![POISON; len];
        let readable = (start + committed).saturating_sub(addr).min(len);
        // SAFETY: `locate` proved `[addr, addr + len)` lies inside a host
        // mapping still in the map (live or quarantined, not unmapped), and
        // the state lock keeps it from being unmapped during the copy;
        // `readable <= len` bytes are copied into `out`, which holds `len`.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), readable) };
        Ok(out)
    }

    /// Writes `data` at `addr` inside a live region.
    pub(crate) fn write(&self, addr: usize, data: &[u8]) -> Result<(), MemError> {
        self.check_backed()?;
        let state = self.state();
        let (start, alloc_state, committed) = self.locate(&state, addr, data.len())?;
        if alloc_state != AllocState::Live {
            return Err(MemError::StaleSpan(format!(
                "write at {addr:#x} into a released region (use after free)"
            )));
        }
        if addr + data.len() > start + committed {
            return Err(MemError::invalid(format!(
                "write of [{addr:#x}, +{}) past the {committed} committed bytes of the region at \
                 {start:#x}: commit the range first",
                data.len()
            )));
        }
        // SAFETY: as in `read`, the range is inside a live host allocation and
        // the lock is held.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }
}

// SAFETY: addresses come from `HostPages` mappings with the requested alignment
// (or a synthetic bump pointer, aligned and never reused), so they are aligned
// and disjoint; a reservation is one mapping, so commits never move its base;
// nothing panics (a refused mapping is `None`, not `handle_alloc_error`).
unsafe impl MemorySource for FakeSource {
    fn info(&self) -> SourceInfo {
        SourceInfo {
            name: "fake".into(),
            kind: MemoryKind::Host,
            device: 0,
            capacity: self.capacity,
            granularity: self.granularity,
            growable: true,
        }
    }

    /// Host memory copies that run as they are enqueued.
    fn host_tier_io(
        self: Arc<Self>,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        Ok(Some(Box::new(FakeTierIo::over(
            self,
            block_bytes,
            slots,
            true,
        )?)))
    }

    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError> {
        let mut state = self.state();
        if Self::should_fail(&mut state) {
            return Err(SourceError::OutOfMemory);
        }
        self.take_bytes(&mut state, bytes as u64)?;
        match self.new_block(&mut state, bytes, align) {
            Ok((addr, memory)) => {
                state.allocs.insert(
                    addr,
                    Alloc {
                        len: bytes,
                        state: AllocState::Live,
                        committed: bytes,
                        reservation: false,
                        touched: bytes,
                        memory,
                    },
                );
                Ok(addr)
            }
            Err(e) => {
                state.used -= bytes as u64;
                Err(e)
            }
        }
    }

    unsafe fn free(&self, addr: usize, bytes: usize, _align: usize) {
        let mut state = self.state();
        state.used -= bytes as u64;
        self.retire(&mut state, addr);
    }

    fn reserve(&self, max_bytes: usize, align: usize) -> Result<usize, SourceError> {
        let mut state = self.state();
        if Self::should_fail(&mut state) {
            return Err(SourceError::OutOfMemory);
        }
        let (addr, memory) = self.new_block(&mut state, max_bytes, align)?;
        state.allocs.insert(
            addr,
            Alloc {
                len: max_bytes,
                state: AllocState::Live,
                committed: 0,
                reservation: true,
                touched: 0,
                memory,
            },
        );
        Ok(addr)
    }

    fn commit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        let granularity = self.granularity;
        let Some(a) = state.allocs.get(&base) else {
            return Err(SourceError::Invariant(format!(
                "commit at base {base:#x}, which is not a reservation: the base moved"
            )));
        };
        if !a.reservation || a.state != AllocState::Live {
            return Err(SourceError::Invariant(format!(
                "commit at {base:#x}, not a live reservation"
            )));
        }
        if from != a.committed || to > a.len || from % granularity != 0 || to % granularity != 0 {
            return Err(SourceError::Invariant(format!(
                "commit [{from}, {to}) does not extend the committed {} of a {}-byte reservation",
                a.committed, a.len
            )));
        }
        if state.fail_commits > 0 {
            state.fail_commits -= 1;
            return Err(SourceError::OutOfMemory);
        }
        self.take_bytes(&mut state, (to - from) as u64)?;
        if let Some(a) = state.allocs.get_mut(&base) {
            a.committed = to;
            let touched = a.touched;
            a.touched = touched.max(to);
            // Memory committed before and decommitted since lost its bytes:
            // it comes back poisoned, never with what it held.
            self.poison(base, from, to.min(touched));
        }
        Ok(())
    }

    unsafe fn decommit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        let Some(a) = state.allocs.get(&base) else {
            return Err(SourceError::Invariant(format!(
                "decommit at base {base:#x}, which is not a reservation: the base moved"
            )));
        };
        if !a.reservation || to != a.committed || from > to {
            return Err(SourceError::Invariant(format!(
                "decommit [{from}, {to}) is not the committed tail {} of the reservation",
                a.committed
            )));
        }
        if state.fail_decommits > 0 {
            state.fail_decommits -= 1;
            return Err(SourceError::Driver(
                "decommit failed on command (FakeBackend)".into(),
            ));
        }
        state.used -= (to - from) as u64;
        if let Some(a) = state.allocs.get_mut(&base) {
            if let Some(memory) = &a.memory {
                memory.release(from, to);
            }
            a.committed = from;
        }
        Ok(())
    }

    unsafe fn unreserve(&self, base: usize, _max_bytes: usize, committed: usize) {
        let mut state = self.state();
        state.used -= committed as u64;
        self.retire(&mut state, base);
    }

    fn addressable(&self) -> bool {
        self.backed
    }

    unsafe fn copy_to_host(&self, src: usize, dst: *mut u8, len: usize) -> Result<(), SourceError> {
        let state = self.state();
        self.check_committed(&state, src, len)?;
        if self.backed {
            // SAFETY: `[src, src + len)` is committed memory of a live host
            // allocation (checked above, under the lock that keeps it alive);
            // the caller promises `dst` is writable host memory of `len` bytes
            // that does not overlap ours.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len) };
        }
        // Unbacked: synthetic memory has no bytes; the copy leaves `dst` as is.
        Ok(())
    }

    unsafe fn copy_from_host(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), SourceError> {
        let state = self.state();
        self.check_committed(&state, dst, len)?;
        if self.backed {
            // SAFETY: as in `copy_to_host`, with the roles swapped.
            unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len) };
        }
        Ok(())
    }

    // A batch checks every range under one lock before it copies any: a
    // batch with one bad range copies nothing.
    unsafe fn copy_to_host_many(&self, copies: &[ToHost]) -> Result<(), SourceError> {
        let state = self.state();
        for &(src, _, len) in copies {
            self.check_committed(&state, src, len)?;
        }
        if self.backed {
            for &(src, dst, len) in copies {
                // SAFETY: as in `copy_to_host`: every source range was
                // checked committed above, under the lock held still; the
                // caller promises each `dst` is `len` writable host bytes.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len) };
            }
        }
        Ok(())
    }

    unsafe fn copy_from_host_many(&self, copies: &[FromHost]) -> Result<(), SourceError> {
        let state = self.state();
        for &(dst, _, len) in copies {
            self.check_committed(&state, dst, len)?;
        }
        if self.backed {
            for &(dst, src, len) in copies {
                // SAFETY: as in `copy_to_host_many`, with the roles swapped.
                unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len) };
            }
        }
        Ok(())
    }

    unsafe fn scrub(&self, addr: usize, len: usize) {
        if !self.backed {
            return;
        }
        let state = self.state();
        if let Ok((start, AllocState::Live, committed)) = self.locate(&state, addr, len) {
            // Past the committed part there is no memory: it reads as poison.
            let to = (addr - start + len).min(committed);
            self.poison(start, addr - start, to);
        }
    }
}

/// A [`Backend`] over [`FakeSource`], with the fake's controls.
#[derive(Clone, Debug)]
pub struct FakeBackend {
    backend: Backend,
    source: Arc<FakeSource>,
}

impl FakeBackend {
    /// A fake with `config`. The journal is on.
    pub fn new(config: FakeConfig) -> Result<Self, MemError> {
        if config.capacity == 0 {
            return Err(MemError::invalid("capacity must be positive"));
        }
        if config.granularity == 0 || !config.granularity.is_power_of_two() {
            return Err(MemError::invalid(format!(
                "granularity must be a power of two, got {}",
                config.granularity
            )));
        }
        let source = Arc::new(FakeSource::new(&config));
        let backend = Backend::new(source.clone(), config.mode, config.budget)?;
        backend.enable_journal();
        Ok(Self { backend, source })
    }

    /// The backend itself.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The source under the backend, for a test that drives the
    /// [`MemorySource`] contract directly (the conformance suite).
    pub fn source(&self) -> &Arc<FakeSource> {
        &self.source
    }

    /// Makes the `n`-th acquisition from now (1 = the next) fail as out of
    /// memory; `None` clears it.
    pub fn fail_nth(&self, n: Option<u64>) -> Result<(), MemError> {
        if n == Some(0) {
            return Err(MemError::invalid(
                "fail_nth counts from 1 (the next acquisition); got 0",
            ));
        }
        self.source.state().fail_countdown = n;
        Ok(())
    }

    /// Makes the next `n` commits fail.
    pub fn fail_commits(&self, n: u32) {
        self.source.state().fail_commits = n;
    }

    /// Makes the next `n` decommits fail.
    pub fn fail_decommits(&self, n: u32) {
        self.source.state().fail_decommits = n;
    }

    /// Simulates memory taken by something outside this backend (another
    /// process, a library), so the device refuses before the budget does.
    pub fn set_external_usage(&self, bytes: u64) {
        self.source.state().external = bytes;
    }

    /// Acquisitions that reached the source (including failed ones).
    pub fn source_acquisitions(&self) -> u64 {
        self.source.state().acquisitions
    }

    /// Reads `len` bytes at `addr` from a live or quarantined region.
    pub fn read(&self, addr: usize, len: usize) -> Result<Vec<u8>, MemError> {
        self.source.read(addr, len)
    }

    /// Writes `data` at `addr` inside a live region.
    pub fn write(&self, addr: usize, data: &[u8]) -> Result<(), MemError> {
        self.source.write(addr, data)
    }

    /// True when every byte of `[addr, addr + len)` holds the poison.
    pub fn is_poisoned(&self, addr: usize, len: usize) -> Result<bool, MemError> {
        Ok(self.read(addr, len)?.iter().all(|&b| b == POISON))
    }

    /// Addresses of the quarantined (released, still readable) allocations,
    /// oldest first.
    pub fn quarantine(&self) -> Vec<usize> {
        self.source.state().quarantine.iter().copied().collect()
    }

    /// Physical bytes the fake device has in use.
    pub fn device_used(&self) -> u64 {
        self.source.state().used
    }
}

impl std::ops::Deref for FakeBackend {
    type Target = Backend;

    fn deref(&self) -> &Backend {
        &self.backend
    }
}
