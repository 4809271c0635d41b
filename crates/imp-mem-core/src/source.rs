//! L1 — the physical side (seed A3.1): the two `unsafe trait`s a driver
//! implements, and the kinds they speak in.
//!
//! * [`MemorySource`] does the physical work for one kind of memory (host
//!   memory for the fake, `cuMemAlloc`, VMM reserve/map, pinned host pages).
//!   It knows nothing about phases, budgets or tags:
//!   [`Backend`](crate::backend::Backend) wraps a source with those rules.
//! * [`PinnedHostOps`] does the physical work of pinned host memory;
//!   [`PinnedHost`](crate::pinned::PinnedHost) wraps it with the accounting.
//!
//! A source also names what goes with its memory, so that no caller picks
//! it by the source's kind or class: its pinned host memory
//! ([`MemorySource::pinned_host`]), the order between its streams that an
//! activation pool keeps ([`StreamOrder`], [`MemorySource::stream_order`])
//! and the copy engine of a KV host tier over its blocks ([`TierIo`],
//! [`MemorySource::host_tier_io`]).
//!
//! Their kinds: where memory lives ([`MemoryKind`], [`Placement`]), what a
//! source is ([`SourceInfo`]), how it fails ([`SourceError`]), what it
//! reads of its device ([`DeviceReading`]) and what it holds beyond its
//! backend's ledger ([`SourceCharge`]).
//!
//! This module is the floor of the crate: it uses only the error type, and
//! the backend, the spans, the tiers and the fake stand on it.
//!
//! Thread safety: `MemorySource`, `PinnedHostOps` and `StreamOrder` are
//! `Send + Sync` and synchronise their own state (every method takes
//! `&self`); a `TierIo` is `Send` and driven under its owner's `&mut`.

use std::sync::Arc;

use crate::error::MemError;

/// Where a source's memory lives, which decides how it is exported (DLPack).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host memory (the fake backend). DLPack `kDLCPU`.
    Host,
    /// Device memory. DLPack `kDLCUDA`.
    Device,
    /// Page-locked host memory. DLPack `kDLCUDAHost`.
    PinnedHost,
}

impl MemoryKind {
    /// The DLPack device type code.
    pub const fn dlpack_device_type(self) -> i32 {
        match self {
            MemoryKind::Host => 1,
            MemoryKind::Device => 2,
            MemoryKind::PinnedHost => 3,
        }
    }
}

/// Where a span's memory lives: what DLPack and `__cuda_array_interface__`
/// need besides the address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    /// Host, device or pinned host.
    pub kind: MemoryKind,
    /// Device ordinal (0 for host memory).
    pub device: i32,
}

impl Placement {
    /// Ordinary host memory on "device" 0.
    pub const HOST: Placement = Placement {
        kind: MemoryKind::Host,
        device: 0,
    };

    /// The DLPack `(device_type, device_id)` pair.
    pub const fn dlpack_device(self) -> (i32, i32) {
        (self.kind.dlpack_device_type(), self.device)
    }
}

/// What a source is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceInfo {
    /// Short name: `fake`, `cuda`, `vmm`, `pinned`.
    pub name: String,
    /// Where its memory lives.
    pub kind: MemoryKind,
    /// Device ordinal (0 for host memory).
    pub device: i32,
    /// Physical bytes the device has.
    pub capacity: u64,
    /// Growable regions commit in multiples of this (1 where not growable).
    pub granularity: usize,
    /// Whether [`MemorySource::reserve`] is supported.
    pub growable: bool,
}

/// A physical failure, before the backend adds its context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceError {
    /// The device has no memory for it.
    OutOfMemory,
    /// The source cannot reserve growable regions.
    NotGrowable,
    /// The driver refused for another reason.
    Driver(String),
    /// A source-level check failed (a base that moved, a range outside a
    /// reservation). Always a bug.
    Invariant(String),
    /// The source cannot do this at all (a copy to the host on a source
    /// without one); the message names the operation.
    Unsupported(String),
}

/// A device reading: how much of the device is free now, and its size
/// (`cuMemGetInfo`). Taken from a source ([`MemorySource::mem_info`]) or
/// passed in by a caller that read the device itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceReading {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// Physical memory a source holds that its backend's ledger does not count
/// (a VMM handle cache, mapping rounded past what was committed), named so
/// that the memory report attributes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceCharge {
    /// Stable key (`vmm_handle_cache`, ...).
    pub key: String,
    /// What the report prints.
    pub label: String,
    /// Bytes held now.
    pub bytes: u64,
}

/// The physical side of a backend: one kind of memory on one device.
///
/// # Safety
///
/// An implementation promises, and [`Backend`](crate::backend::Backend) relies on it:
///
/// 1. `allocate(bytes, align)` returns an address `a` with `a % align == 0`
///    such that `[a, a + bytes)` overlaps no other live allocation or
///    reservation of this source, and stays valid until `free(a, bytes, align)`.
/// 2. `reserve(max, align)` returns a base `b` with `b % align == 0` whose
///    `[b, b + max)` overlaps nothing else live; `commit(b, from, to)` makes
///    `[b + from, b + to)` usable without moving `b`; `decommit(b, from, to)`
///    returns that range's physical memory; `unreserve` frees all of it.
/// 3. No method panics or aborts: failures are returned as [`SourceError`].
///
/// The backend promises in turn that every `free`, `decommit` and `unreserve`
/// names an address and sizes that this source returned and that are live.
pub unsafe trait MemorySource: Send + Sync + 'static {
    /// What this source is.
    fn info(&self) -> SourceInfo;

    /// Acquires `bytes` (> 0) aligned to `align` (a power of two).
    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError>;

    /// Frees what `allocate` returned.
    ///
    /// # Safety
    /// `addr`, `bytes` and `align` are exactly those of a live allocation of
    /// this source, and nothing uses the memory afterwards.
    unsafe fn free(&self, addr: usize, bytes: usize, align: usize);

    /// Reserves `max_bytes` of address space for a growable region, with no
    /// physical memory behind it yet.
    fn reserve(&self, max_bytes: usize, align: usize) -> Result<usize, SourceError> {
        let _ = (max_bytes, align);
        Err(SourceError::NotGrowable)
    }

    /// Commits `[base + from, base + to)` of a reservation (`from < to`,
    /// both multiples of the granularity, `to` within the reservation).
    fn commit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let _ = (base, from, to);
        Err(SourceError::NotGrowable)
    }

    /// Returns the physical memory of `[base + from, base + to)`.
    ///
    /// # Safety
    /// The range is committed, and nothing (no kernel in flight either) uses
    /// it afterwards.
    unsafe fn decommit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        let _ = (base, from, to);
        Err(SourceError::NotGrowable)
    }

    /// Frees a reservation and whatever of it is still committed. Infallible:
    /// it runs when a region is dropped.
    ///
    /// # Safety
    /// `base` is a live reservation of `max_bytes` with `committed` bytes
    /// committed, and nothing uses it afterwards.
    unsafe fn unreserve(&self, base: usize, max_bytes: usize, committed: usize) {
        let _ = (base, max_bytes, committed);
    }

    /// Told when a tier allocator hands `[addr, addr + len)` back inside a
    /// live allocation (a block back on its free list, an arena reset, a
    /// scratch rewind). The memory stays allocated; a debugging source may
    /// overwrite it (the fake poisons it) so that a stale read shows. The
    /// default does nothing.
    ///
    /// # Safety
    /// The range lies inside a live allocation (or the committed part of a
    /// reservation) of this source, and no live handle refers to it.
    unsafe fn scrub(&self, addr: usize, len: usize) {
        let _ = (addr, len);
    }

    /// Whether the addresses it hands out refer to real memory that a
    /// consumer (a DLPack importer) may read. False only for a fake with
    /// synthetic addresses; the default is true.
    fn addressable(&self) -> bool {
        true
    }

    /// The device's free and total bytes now, or `None` for a source with no
    /// device to read (the default: the fake, host memory). A memory report
    /// reads it unless its caller passes a reading.
    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        Ok(None)
    }

    /// What this source holds beyond the `committed` bytes its backend's
    /// ledger counts, as named charges for the memory report (a line of 0 B
    /// is left out there). The default: nothing.
    fn extra_charges(&self, committed: u64) -> Vec<SourceCharge> {
        let _ = committed;
        Vec::new()
    }

    /// The pinned host memory that goes with this source: host memory its
    /// copies ([`MemorySource::copy_to_host`], `copy_from_host`) run at full
    /// DMA speed to and from, which a copy of many small pieces stages
    /// through (the prefix cache's block copies). `None`, the default: the
    /// source has no faster kind of host memory (the fake: a copy is a
    /// memcpy whatever the buffer).
    fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        None
    }

    /// The order between streams that an activation pool over this
    /// source's memory keeps when a block freed on one stream is reused on
    /// another. The default: [`NoStreams`], for memory no stream touches
    /// (host memory); a device source gives its driver's events.
    fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        Ok(Arc::new(NoStreams))
    }

    /// The copy engine of a KV host tier over this source's blocks: `slots`
    /// host blocks of `block_bytes` (> 0) and the asynchronous copies
    /// between them and this source's memory. `Ok(None)`, the default: the
    /// source has no host tier (a KV manager over it refuses `host_blocks`).
    /// Takes the source's `Arc`, which the engine may keep: its copies read
    /// and write this source's memory.
    fn host_tier_io(
        self: Arc<Self>,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        let _ = (block_bytes, slots);
        Ok(None)
    }

    /// Copies `len` bytes at `src`, this source's memory, to host memory at
    /// `dst`, and returns when the bytes are there (sleep level 1 saves T1
    /// this way). The default refuses: a source without a host path.
    ///
    /// # Safety
    /// `[src, src + len)` lies inside a live allocation or the committed
    /// part of a live reservation of this source; `[dst, dst + len)` is host
    /// memory this process may write; nothing else writes either range
    /// during the call.
    unsafe fn copy_to_host(&self, src: usize, dst: *mut u8, len: usize) -> Result<(), SourceError> {
        let _ = (src, dst, len);
        Err(SourceError::Unsupported(format!(
            "the {} source cannot copy its memory to the host",
            self.info().name
        )))
    }

    /// Copies `len` bytes of host memory at `src` into this source's memory
    /// at `dst`, and returns when they are there (wake restores T1 this
    /// way). The default refuses.
    ///
    /// # Safety
    /// `[dst, dst + len)` lies inside a live allocation or the committed
    /// part of a live reservation of this source and nothing else uses it
    /// during the call; `[src, src + len)` is host memory this process may
    /// read.
    unsafe fn copy_from_host(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), SourceError> {
        let _ = (dst, src, len);
        Err(SourceError::Unsupported(format!(
            "the {} source cannot copy host memory into its own",
            self.info().name
        )))
    }

    /// [`Self::copy_to_host`] of every `(src, dst, len)` of `copies`, as if
    /// one after another in order, returning when all are there: a device
    /// source enqueues them all and waits once, instead of once a copy (the
    /// prefix cache saves a chunk of blocks this way). The default is the
    /// single copy in a loop. On an error the copies before the failing one
    /// may have landed, and none is still in flight.
    ///
    /// # Safety
    /// Every copy meets [`Self::copy_to_host`]'s contract, and no two
    /// copies' `dst` ranges overlap.
    unsafe fn copy_to_host_many(&self, copies: &[ToHost]) -> Result<(), SourceError> {
        for &(src, dst, len) in copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_to_host(src, dst, len) }?;
        }
        Ok(())
    }

    /// [`Self::copy_from_host`] of every `(dst, src, len)` of `copies`, as
    /// if one after another in order (a later copy to the same bytes
    /// wins), returning when all are there; the default is the single copy
    /// in a loop. On an error the copies before the failing one may have
    /// landed, and none is still in flight.
    ///
    /// # Safety
    /// Every copy meets [`Self::copy_from_host`]'s contract.
    unsafe fn copy_from_host_many(&self, copies: &[FromHost]) -> Result<(), SourceError> {
        for &(dst, src, len) in copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_from_host(dst, src, len) }?;
        }
        Ok(())
    }
}

/// One copy of a batch out of a source's memory
/// ([`MemorySource::copy_to_host_many`]): `(src, dst, len)`, as the single
/// copy's arguments.
pub type ToHost = (usize, *mut u8, usize);

/// One copy of a batch into a source's memory
/// ([`MemorySource::copy_from_host_many`]): `(dst, src, len)`, as the
/// single copy's arguments.
pub type FromHost = (usize, *const u8, usize);

/// The alignment of pinned allocations (a page).
pub const PINNED_ALIGNMENT: usize = 4096;

/// The physical side of pinned host memory.
///
/// # Safety
///
/// An implementation promises, and [`PinnedHost`](crate::pinned::PinnedHost) relies on it:
///
/// 1. `allocate(bytes)` (`bytes > 0`) returns an address `a`, aligned to
///    [`PINNED_ALIGNMENT`], such that `[a, a + bytes)` is host memory
///    readable and writable by this process, overlapping no other live
///    allocation, valid until `free(a, bytes)`.
/// 2. `register(addr, bytes)` pins memory it does not own and never frees
///    it; after a successful call the range stays registered until
///    `unregister(addr, bytes)`.
/// 3. No method panics or aborts; failures are returned as [`SourceError`].
///
/// The wrapper promises in turn that `free` and `unregister` are called
/// exactly once, with the address and size of a live allocation or
/// registration.
pub unsafe trait PinnedHostOps: Send + Sync + 'static {
    /// Where this memory is, for export: `PinnedHost` on a device (DLPack
    /// `kDLCUDAHost`), `Host` for the fake (`kDLCPU`).
    fn placement(&self) -> Placement;

    /// Allocates `bytes` of pinned host memory.
    fn allocate(&self, bytes: usize) -> Result<usize, SourceError>;

    /// Frees what `allocate` returned.
    ///
    /// # Safety
    /// `addr` and `bytes` are those of a live allocation, and nothing uses the
    /// memory afterwards.
    unsafe fn free(&self, addr: usize, bytes: usize);

    /// Pins `[addr, addr + bytes)`, memory this library does not own.
    fn register(&self, addr: usize, bytes: usize) -> Result<(), SourceError>;

    /// Unpins a registration; never frees the memory.
    ///
    /// # Safety
    /// `addr` and `bytes` are those of a live registration.
    unsafe fn unregister(&self, addr: usize, bytes: usize);
}

impl std::fmt::Debug for dyn PinnedHostOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostOps")
            .field("placement", &self.placement())
            .finish()
    }
}

/// Orders one stream after another: the contract an activation pool keeps
/// (`activations::stream` says when it calls it).
pub trait StreamOrder: Send + Sync {
    /// Makes work queued on `waiter` from now on wait for all work queued on
    /// `producer` up to now. `waiter != producer`.
    fn order_after(&self, waiter: u64, producer: u64) -> Result<(), MemError>;

    /// Blocks the host until the work queued on `stream` up to now has
    /// finished: what an activation pool does before it gives a fallback
    /// region back to its backend, whose release (a VMM unmap) does not
    /// wait for queued kernels the way `cuMemFree` does. The default, for
    /// memory no stream touches, returns at once.
    fn wait(&self, stream: u64) -> Result<(), MemError> {
        let _ = stream;
        Ok(())
    }
}

/// For memory no stream touches (host memory, a single-stream caller):
/// ordering is a no-op.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStreams;

impl StreamOrder for NoStreams {
    fn order_after(&self, _waiter: u64, _producer: u64) -> Result<(), MemError> {
        Ok(())
    }
}

/// Names one enqueued copy; tickets of one [`TierIo`] increase, and the
/// copies complete in ticket order (one copy stream).
pub type CopyTicket = u64;

/// Copies blocks between device blocks and host slots, asynchronously: the
/// copy engine of the KV host tier (`kv::host_tier` says how the tier uses
/// it), which a source gives ([`MemorySource::host_tier_io`]).
pub trait TierIo: Send + std::fmt::Debug {
    /// Bytes per block.
    fn block_bytes(&self) -> usize;
    /// Host slots (blocks) the tier holds.
    fn slots(&self) -> u32;
    /// Enqueues a copy of the device block at `dev_addr` into host `slot`.
    fn offload(&mut self, dev_addr: usize, slot: u32) -> Result<CopyTicket, MemError>;
    /// Enqueues a copy of host `slot` into the device block at `dev_addr`.
    fn onboard(&mut self, slot: u32, dev_addr: usize) -> Result<CopyTicket, MemError>;
    /// Enqueues the copies `(slot, dev_addr)` of one admission, in order;
    /// one ticket each. On an error none of them is in flight (any already
    /// enqueued have completed). An implementation may merge neighbours
    /// (consecutive slots into consecutive blocks) into one copy.
    fn onboard_many(&mut self, copies: &[(u32, usize)]) -> Result<Vec<CopyTicket>, MemError> {
        let mut tickets = Vec::with_capacity(copies.len());
        for &(slot, dev) in copies {
            match self.onboard(slot, dev) {
                Ok(t) => tickets.push(t),
                Err(e) => {
                    if let Some(&last) = tickets.last() {
                        self.wait(last)?;
                    }
                    return Err(e);
                }
            }
        }
        Ok(tickets)
    }
    /// Whether copy `ticket` has completed (does not block).
    fn is_done(&mut self, ticket: CopyTicket) -> Result<bool, MemError>;
    /// Blocks until copy `ticket` has completed.
    fn wait(&mut self, ticket: CopyTicket) -> Result<(), MemError>;
    /// Copies host `slot`'s bytes into `dst` (no copy is in flight on it).
    fn read_slot(&mut self, slot: u32, dst: &mut [u8]) -> Result<(), MemError>;
    /// Copies `src` into host `slot` (no copy is in flight on it).
    fn write_slot(&mut self, slot: u32, src: &[u8]) -> Result<(), MemError>;
    /// Makes work enqueued on `stream` (a `CUstream` as an integer; 0 the
    /// legacy default) after this call wait for copy `ticket`, without
    /// blocking the host where the device can. The default blocks.
    fn stream_wait(&mut self, ticket: CopyTicket, _stream: usize) -> Result<(), MemError> {
        self.wait(ticket)
    }
}
