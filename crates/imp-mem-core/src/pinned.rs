//! T5b — engine-persistent pinned host memory (seed A2).
//!
//! Two move-only owners, each freeing exactly once when dropped:
//!
//! * [`PinnedBuffer`] owns page-locked host memory the library allocated
//!   (`cuMemHostAlloc`);
//! * [`HostRegistration`] owns the registration of memory the library does
//!   not own (`cuMemHostRegister` / `cuMemHostUnregister`), so an unregister
//!   can be neither forgotten nor doubled.
//!
//! Both are **empty on failure** when made with the `_or_empty` constructors:
//! an engine that stages through pinned memory when it can and through
//! pageable memory when it cannot keeps its degradation path, and the
//! failure is still counted.
//!
//! The physical operations sit behind [`PinnedHostOps`], a four-method
//! trait: the core ships [`FakePinnedHost`] (ordinary host memory, with
//! failure injection and a record of what is live), and `imp-mem-cuda`
//! implements it with the driver. [`PinnedHost`] wraps any implementation
//! with the accounting (live bytes, counts, failures).
//!
//! Thread safety: `PinnedHost` is a clonable `Arc` handle, `Send + Sync`; its
//! counters sit behind a mutex. Buffers and registrations are `Send + Sync`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{MemError, OomReport};
use crate::fake::countdown_fails;
use crate::fake::host_pages::HostPages;
use crate::source::{MemoryKind, Placement, SourceError};
use crate::span::{MintKey, StableSpan};
use crate::tag::Tag;

// The physical side's trait moved to `source`; its old paths stay.
pub use crate::source::{PinnedHostOps, PINNED_ALIGNMENT};

/// Counters of one [`PinnedHost`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// Bytes of live buffers.
    pub live_bytes: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Bytes of live registrations.
    pub registered_bytes: u64,
    /// Live registrations.
    pub registrations: u64,
    /// Allocations and registrations refused (each left an empty owner or an
    /// error behind).
    pub failures: u64,
    /// The largest `live_bytes` has been.
    pub peak_bytes: u64,
}

#[derive(Debug)]
struct PinnedInner {
    ops: Arc<dyn PinnedHostOps>,
    placement: Placement,
    stats: Mutex<PinnedStats>,
}

/// The T5b allocator: pinned-host operations plus their accounting.
#[derive(Debug, Clone)]
pub struct PinnedHost {
    inner: Arc<PinnedInner>,
}

fn check_bytes(bytes: usize) -> Result<(), MemError> {
    if bytes == 0 {
        return Err(MemError::invalid("pinned size must be positive, got 0"));
    }
    Ok(())
}

impl PinnedHost {
    /// Wraps `ops`.
    pub fn new(ops: Arc<dyn PinnedHostOps>) -> Self {
        let placement = ops.placement();
        Self {
            inner: Arc::new(PinnedInner {
                ops,
                placement,
                stats: Mutex::new(PinnedStats::default()),
            }),
        }
    }

    fn stats_mut(&self) -> MutexGuard<'_, PinnedStats> {
        self.inner.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refused(&self, err: SourceError, bytes: usize, what: &str) -> MemError {
        let mut stats = self.stats_mut();
        stats.failures += 1;
        match err {
            SourceError::OutOfMemory => MemError::OutOfMemory(OomReport {
                asked: bytes as u64,
                live: stats.live_bytes,
                budget: 0,
                capacity: 0,
                tag: Tag::PinnedHost,
                device_refused: true,
                ledger_headroom: None,
                ledger_tenant: None,
            }),
            SourceError::Driver(msg) => MemError::Driver(format!("{what}: {msg}")),
            SourceError::Unsupported(msg) => MemError::BackendUnavailable(format!("{what}: {msg}")),
            SourceError::NotGrowable | SourceError::Invariant(_) => {
                MemError::Invariant(format!("{what}: {err:?}"))
            }
        }
    }

    /// A buffer of `bytes` pinned bytes.
    pub fn allocate(&self, bytes: usize) -> Result<PinnedBuffer, MemError> {
        check_bytes(bytes)?;
        let addr = self
            .inner
            .ops
            .allocate(bytes)
            .map_err(|e| self.refused(e, bytes, "pinned allocation"))?;
        let mut stats = self.stats_mut();
        stats.live_bytes += bytes as u64;
        stats.buffers += 1;
        stats.peak_bytes = stats.peak_bytes.max(stats.live_bytes);
        Ok(PinnedBuffer {
            host: Some(self.clone()),
            addr,
            len: bytes,
        })
    }

    /// A buffer of `bytes`, or an empty one if the memory cannot be pinned
    /// (the failure is counted in [`PinnedStats::failures`]).
    pub fn allocate_or_empty(&self, bytes: usize) -> PinnedBuffer {
        self.allocate(bytes)
            .unwrap_or_else(|_| PinnedBuffer::empty())
    }

    /// Registers `[addr, addr + bytes)`, memory this library does not own.
    ///
    /// # Safety
    /// The memory stays allocated for as long as the returned registration
    /// lives (it unregisters when dropped).
    pub unsafe fn register(&self, addr: usize, bytes: usize) -> Result<HostRegistration, MemError> {
        check_bytes(bytes)?;
        self.inner
            .ops
            .register(addr, bytes)
            .map_err(|e| self.refused(e, bytes, "host registration"))?;
        let mut stats = self.stats_mut();
        stats.registered_bytes += bytes as u64;
        stats.registrations += 1;
        Ok(HostRegistration {
            host: Some(self.clone()),
            addr,
            len: bytes,
        })
    }

    /// As [`PinnedHost::register`], or an empty registration on failure.
    ///
    /// # Safety
    /// As for [`PinnedHost::register`].
    pub unsafe fn register_or_empty(&self, addr: usize, bytes: usize) -> HostRegistration {
        // SAFETY: the caller's promise is forwarded unchanged.
        unsafe { self.register(addr, bytes) }.unwrap_or_else(|_| HostRegistration::empty())
    }

    /// The counters.
    pub fn stats(&self) -> PinnedStats {
        *self.stats_mut()
    }

    /// Where its memory is.
    pub fn placement(&self) -> Placement {
        self.inner.placement
    }
}

/// Owns pinned host memory; frees it exactly once, when dropped. May be
/// empty (no memory), which is how an allocation failure can degrade.
#[derive(Debug)]
pub struct PinnedBuffer {
    host: Option<PinnedHost>,
    addr: usize,
    len: usize,
}

impl PinnedBuffer {
    /// A buffer with no memory.
    pub const fn empty() -> Self {
        Self {
            host: None,
            addr: 0,
            len: 0,
        }
    }

    /// True when it holds no memory.
    pub fn is_empty(&self) -> bool {
        self.host.is_none()
    }

    /// Bytes held (0 when empty).
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first address (0 when empty).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// The memory, valid while this buffer lives; `None` when empty.
    pub fn span(&self) -> Option<StableSpan<'_>> {
        self.host
            .as_ref()
            .map(|h| StableSpan::new(MintKey::new(), self.addr, self.len, h.placement()))
    }

    /// The memory as a byte slice (pinned memory is host memory).
    pub fn as_slice(&self) -> &[u8] {
        if self.host.is_none() {
            return &[];
        }
        // SAFETY: `[addr, addr + len)` is a live allocation owned by this buffer
        // (trait promise 1) and freed only in its Drop; `&self` keeps it alive
        // for the slice's lifetime. Host code reads it only through this buffer.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The memory as a mutable byte slice.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.host.is_none() {
            return &mut [];
        }
        // SAFETY: as in `as_slice`, and `&mut self` makes the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Some(host) = self.host.take() {
            // SAFETY: this buffer is the unique owner of a live allocation of
            // exactly these sizes; `take()` above makes this the only free.
            unsafe { host.inner.ops.free(self.addr, self.len) };
            let mut stats = host.stats_mut();
            stats.live_bytes -= self.len as u64;
            stats.buffers -= 1;
        }
    }
}

/// Owns the registration of memory the library does not own; unregisters it
/// exactly once, when dropped. May be empty.
#[derive(Debug)]
pub struct HostRegistration {
    host: Option<PinnedHost>,
    addr: usize,
    len: usize,
}

impl HostRegistration {
    /// A registration of nothing.
    pub const fn empty() -> Self {
        Self {
            host: None,
            addr: 0,
            len: 0,
        }
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.host.is_none()
    }

    /// The registered address (0 when empty).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes registered (0 when empty).
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Some(host) = self.host.take() {
            // SAFETY: this owner holds a live registration of these sizes, and
            // `take()` makes this the only unregister.
            unsafe { host.inner.ops.unregister(self.addr, self.len) };
            let mut stats = host.stats_mut();
            stats.registered_bytes -= self.len as u64;
            stats.registrations -= 1;
        }
    }
}

#[derive(Debug, Default)]
struct FakePinnedState {
    used: u64,
    /// Live allocations by address: their host memory, which is mapped
    /// lazily (`HostPages`), so a buffer costs only the pages written.
    allocations: BTreeMap<usize, HostPages>,
    registrations: BTreeMap<usize, usize>,
    fail_countdown: Option<u64>,
    double_frees: u64,
}

/// Pinned host memory faked with ordinary host memory: for tests and for
/// machines with no GPU. It exports as `kDLCPU`.
#[derive(Debug)]
pub struct FakePinnedHost {
    capacity: u64,
    state: Mutex<FakePinnedState>,
}

impl FakePinnedHost {
    /// A fake with `capacity` bytes of "pinnable" memory.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            state: Mutex::new(FakePinnedState::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, FakePinnedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the `n`-th allocation or registration from now fail (1 = the
    /// next); `None` clears it.
    pub fn fail_nth(&self, n: Option<u64>) {
        self.state().fail_countdown = n.filter(|&n| n > 0);
    }

    /// Live allocations.
    pub fn live_allocations(&self) -> usize {
        self.state().allocations.len()
    }

    /// Live registrations.
    pub fn live_registrations(&self) -> usize {
        self.state().registrations.len()
    }

    /// Frees or unregisters of something not live (always 0 unless a bug).
    pub fn double_frees(&self) -> u64 {
        self.state().double_frees
    }
}

// SAFETY: allocations are `HostPages` mappings aligned to `PINNED_ALIGNMENT`
// and are unmapped only through `free`, once (a second free of an address is
// counted, not performed); registrations are bookkeeping only; nothing panics.
unsafe impl PinnedHostOps for FakePinnedHost {
    fn placement(&self) -> Placement {
        Placement {
            kind: MemoryKind::Host,
            device: 0,
        }
    }

    fn allocate(&self, bytes: usize) -> Result<usize, SourceError> {
        let mut state = self.state();
        if countdown_fails(&mut state.fail_countdown) || state.used + bytes as u64 > self.capacity {
            return Err(SourceError::OutOfMemory);
        }
        let pages = HostPages::new(bytes, PINNED_ALIGNMENT).ok_or(SourceError::OutOfMemory)?;
        let addr = pages.addr();
        state.used += bytes as u64;
        state.allocations.insert(addr, pages);
        Ok(addr)
    }

    unsafe fn free(&self, addr: usize, bytes: usize) {
        let mut state = self.state();
        if state.allocations.get(&addr).map(HostPages::len) != Some(bytes) {
            state.double_frees += 1;
            return;
        }
        state.used -= bytes as u64;
        // Dropping the entry unmaps its memory, once: it has left the map.
        state.allocations.remove(&addr);
    }

    fn register(&self, addr: usize, bytes: usize) -> Result<(), SourceError> {
        let mut state = self.state();
        if countdown_fails(&mut state.fail_countdown) {
            return Err(SourceError::Driver(
                "registration refused on command (FakePinnedHost)".into(),
            ));
        }
        let end = addr
            .checked_add(bytes)
            .ok_or(SourceError::Driver("range overflows".into()))?;
        let overlaps = state
            .registrations
            .range(..end)
            .next_back()
            .is_some_and(|(&a, &n)| a + n > addr);
        if overlaps {
            return Err(SourceError::Driver("memory already registered".into()));
        }
        state.registrations.insert(addr, bytes);
        Ok(())
    }

    unsafe fn unregister(&self, addr: usize, bytes: usize) {
        let mut state = self.state();
        if state.registrations.remove(&addr) != Some(bytes) {
            state.double_frees += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_free_exactly_once_and_count() {
        let fake = Arc::new(FakePinnedHost::new(1 << 20));
        let host = PinnedHost::new(fake.clone());
        let mut buf = host.allocate(10_000).unwrap();
        assert_eq!(buf.addr() % PINNED_ALIGNMENT, 0);
        buf.as_mut_slice()[9_999] = 7;
        assert_eq!(buf.as_slice()[9_999], 7);
        assert_eq!(buf.span().unwrap().len(), 10_000);
        assert_eq!(host.stats().live_bytes, 10_000);
        drop(buf);
        assert_eq!(
            (
                host.stats().live_bytes,
                fake.live_allocations(),
                fake.double_frees()
            ),
            (0, 0, 0)
        );
        assert_eq!(host.stats().peak_bytes, 10_000);
    }

    #[test]
    fn failure_degrades_to_empty_and_is_counted() {
        let fake = Arc::new(FakePinnedHost::new(4096));
        let host = PinnedHost::new(fake.clone());
        let buf = host.allocate_or_empty(8192);
        assert!(buf.is_empty() && buf.span().is_none() && buf.as_slice().is_empty());
        fake.fail_nth(Some(1));
        assert!(matches!(host.allocate(16), Err(MemError::OutOfMemory(_))));
        assert_eq!(host.stats().failures, 2);
        drop(buf);
        assert_eq!(fake.double_frees(), 0);
    }

    #[test]
    fn registrations_unregister_once_and_refuse_overlap() {
        let fake = Arc::new(FakePinnedHost::new(1 << 20));
        let host = PinnedHost::new(fake.clone());
        let memory = vec![0u8; 8192];
        let addr = memory.as_ptr() as usize;
        // SAFETY: `memory` outlives both registrations (dropped at the end).
        let reg = unsafe { host.register(addr, 8192) }.unwrap();
        // SAFETY: as above.
        let again = unsafe { host.register_or_empty(addr + 100, 10) };
        assert!(again.is_empty());
        assert_eq!(
            (host.stats().registrations, fake.live_registrations()),
            (1, 1)
        );
        drop(reg);
        drop(again);
        assert_eq!((fake.live_registrations(), fake.double_frees()), (0, 0));
        drop(memory);
    }
}
