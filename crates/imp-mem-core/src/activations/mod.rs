//! T4a — the activation pool: a general-purpose, stream-ordered sub-allocator
//! over one planned region, for the allocations a framework makes itself
//! (torch's and CuPy's activations, temporaries, library workspaces).
//!
//! **Algorithm.** One backend [`Region`] (tag `activations`) is cut into
//! blocks by a two-level segregated-fit index ([`tlsf`]): sizes are rounded
//! up to the pool's alignment (512 B by default, torch's own), a request
//! takes the head of the first non-empty size class whose blocks all fit,
//! splits off the tail, and a free merges the block at once with its free
//! physical neighbours. Allocate and free are O(1) (a few bit scans and list
//! links, plus one hash-map operation to find a block by its pointer).
//!
//! **Fragmentation bound.** Internal: at most `align - 1` bytes per block
//! (the rounding), none from the classes, since a block is split to the
//! rounded size. External: free neighbours of one stream (or never used)
//! are always merged, so no two adjacent free blocks of one stream exist; a request of `n`
//! bytes is refused only when no free block of at least `n` bytes exists
//! (the good-fit search is followed by a scan of the one class it skips, and
//! by a reclaim of the other streams' free blocks), i.e. only when the free
//! space is split by live blocks. As in any non-moving allocator that split
//! can be adversarial: a pattern of live blocks can keep the largest free
//! block small while much is free in all.
//!
//! **Stream order** ([`stream`]). A block remembers the stream it was freed
//! on and is listed under that stream's lane (memory never used yet is on
//! the lane of [`FRESH_STREAM`], reusable on any stream with no order). A request on stream S is
//! served from S's lane first, with no synchronisation. Failing that, it
//! takes never-used memory, then a fitting block from another lane T after
//! ordering S after T
//! ([`StreamOrder::order_after`]; counted as a cross-stream reuse). Failing
//! that, it reclaims: it orders S after every other stream that holds free
//! blocks, moves their blocks to S's lane, merging them with S's neighbours,
//! and searches again. Only neighbours of one stream are merged, so a block
//! never holds memory that two streams may still be using.
//!
//! **Exhaustion.** In strict mode a request that cannot be met is a
//! [`MemError::OutOfMemory`] (the C hooks turn it into null, so torch raises
//! its own OOM and nothing is corrupted). In production mode it falls back
//! to a [`Backend::acquire`] with tag `activations`, which the phase guard
//! counts as a steady-state acquisition while SERVING; the region is kept by
//! its address, and freeing that address releases it.
//!
//! **Misuse.** A free of an address that is not a live block's start (a
//! foreign pointer, a double free, an interior pointer) is refused and
//! counted, and changes nothing.
//!
//! **Thread safety.** [`ActivationPool`] is a cheap clonable handle (`Arc`),
//! `Send + Sync`. All state sits behind one mutex, held for the list and map
//! operations only: block metadata and the pointer map are preallocated and
//! grow (fallibly, amortised) only when the pool holds more blocks than ever
//! before, so the same-stream path allocates nothing once warm. The rare
//! cross-stream paths call the [`StreamOrder`] under the lock (on CUDA, an
//! event record and a stream wait), so that no other caller can take a block
//! on the waiter's stream before the order exists. A fallback acquisition
//! and a fallback release run outside the lock.

pub mod hooks;
pub mod stream;
pub(crate) mod tlsf;

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hashbrown::HashMap;

use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_REQUEST_BYTES};
use crate::error::{MemError, OomReport};
use crate::phase::PhaseMode;
use crate::tag::Tag;
use crate::units::human_bytes;

pub use stream::{FakeStreamOrder, NoStreams, StreamOrder};
use tlsf::{Block, BlockState, Lane, NONE};

/// The default alignment (and size granule): torch's caching allocator's.
pub const DEFAULT_ACTIVATION_ALIGN: u64 = 512;
/// The stream of memory no stream has used yet (the region when it opens):
/// reusing it needs no order. Reserved: refused as a caller's stream.
pub const FRESH_STREAM: u64 = u64::MAX;
/// Block metadata entries preallocated at construction.
const INITIAL_BLOCKS: usize = 1024;
/// Lanes (streams) preallocated at construction.
const INITIAL_LANES: usize = 4;

/// How to build an [`ActivationPool`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivationConfig {
    /// Bytes of the region (rounded down to `align`).
    pub capacity: u64,
    /// Alignment of every block and granule of every size: a power of two.
    pub align: u64,
    /// Strict (refuse on exhaustion) or production (fall back to the
    /// backend); `None` follows the backend's phase mode.
    pub strict: Option<bool>,
    /// Hold the region as a growable one, fully committed, so that it can
    /// sleep ([`ActivationPool::sleep`]); needs a growable backend.
    pub growable: bool,
}

impl ActivationConfig {
    /// `capacity` bytes, aligned to 512, strictness from the backend.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            align: DEFAULT_ACTIVATION_ALIGN,
            strict: None,
            growable: false,
        }
    }
}

/// A snapshot of one pool's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActivationStats {
    /// Bytes of the region.
    pub capacity: u64,
    /// The alignment and size granule.
    pub align: u64,
    /// Bytes in live blocks of the region (rounded sizes).
    pub allocated: u64,
    /// The most `allocated` has been (since the last `reset_peak`).
    pub allocated_peak: u64,
    /// Bytes handed out now, region and fallback: `allocated +
    /// fallback_bytes`.
    pub in_use: u64,
    /// The most `in_use` has been.
    pub in_use_peak: u64,
    /// Bytes the callers asked for, over live blocks and fallbacks.
    pub requested: u64,
    /// Live allocations, region and fallback.
    pub live: u64,
    /// The most `live` has been.
    pub live_peak: u64,
    /// Allocations served, ever.
    pub allocs_total: u64,
    /// Frees accepted, ever.
    pub frees_total: u64,
    /// Bytes allocated, ever (rounded).
    pub allocated_bytes_total: u64,
    /// Bytes freed, ever (rounded).
    pub freed_bytes_total: u64,
    /// Fallback acquisitions, ever (production mode).
    pub fallbacks_total: u64,
    /// Bytes of fallback acquisitions, ever.
    pub fallback_bytes_total: u64,
    /// Fallback regions live now.
    pub fallback_live: u64,
    /// Their bytes.
    pub fallback_bytes: u64,
    /// The most region + fallback bytes held at once.
    pub reserved_peak: u64,
    /// Requests refused for want of memory (strict mode, or a fallback the
    /// backend refused).
    pub ooms: u64,
    /// Frees refused: not a live block's start.
    pub refused_frees: u64,
    /// Free bytes of the region.
    pub free_bytes: u64,
    /// Free blocks.
    pub free_blocks: u64,
    /// The largest free block.
    pub largest_free: u64,
    /// Requests served from a block freed on another stream.
    pub cross_stream_reuses: u64,
    /// Reclaims: other streams' free blocks moved to the requester's.
    pub reclaims: u64,
    /// Streams that hold free blocks now.
    pub streams: u64,
    /// Free blocks that could be listed nowhere (metadata allocation failed);
    /// their bytes are counted free but never reused.
    pub parked_blocks: u64,
}

/// What a free released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// Bytes the block held (rounded).
    pub size: u64,
    /// Bytes asked for when it was allocated.
    pub requested: u64,
    /// The stream it was allocated on.
    pub alloc_stream: u64,
    /// Whether it was a fallback region (now released to the backend).
    pub fallback: bool,
}

/// Why a free was refused. Nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedFree {
    /// The address is neither in the region nor a live fallback.
    Foreign,
    /// The address is in the region but is not a live block's start: a
    /// double free, or a pointer into a block.
    NotLive,
    /// The stream is [`FRESH_STREAM`], which no caller may name.
    ReservedStream,
}

impl RefusedFree {
    /// The error a refused free of `addr` reports.
    pub fn error(self, addr: usize) -> MemError {
        match self {
            RefusedFree::Foreign => MemError::invalid(format!(
                "free of {addr:#x}: this activation pool did not hand out that address; free \
                 only what allocate() returned, to the pool it came from"
            )),
            RefusedFree::NotLive => MemError::invalid(format!(
                "free of {addr:#x}: not a live allocation of this activation pool (a double free, \
                 or a pointer into a block); free each address allocate() returned exactly once"
            )),
            RefusedFree::ReservedStream => MemError::invalid(format!(
                "free of {addr:#x} on stream {FRESH_STREAM:#x}: that value is reserved; pass the \
                 stream the memory was last used on"
            )),
        }
    }
}

/// Hashes a block's unit offset: one folded multiply, enough for keys that
/// are distinct small integers.
#[derive(Default)]
struct OffsetHasher(u64);

impl Hasher for OffsetHasher {
    fn finish(&self) -> u64 {
        let m = u128::from(self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (m as u64) ^ ((m >> 64) as u64)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type OffsetMap<V> = HashMap<u64, V, BuildHasherDefault<OffsetHasher>>;

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    allocated: u64,
    allocated_peak: u64,
    in_use_peak: u64,
    requested: u64,
    live: u64,
    live_peak: u64,
    allocs_total: u64,
    frees_total: u64,
    allocated_bytes_total: u64,
    freed_bytes_total: u64,
    fallbacks_total: u64,
    fallback_bytes_total: u64,
    fallback_bytes: u64,
    reserved_peak: u64,
    ooms: u64,
    refused_frees: u64,
    cross_stream_reuses: u64,
    reclaims: u64,
    parked_blocks: u64,
}

struct Fallback {
    region: Region,
    requested: u64,
    stream: u64,
}

struct Core {
    slab: Vec<Block>,
    /// Head of the spare slab entries (linked through `next_free`).
    spare: u32,
    lanes: Vec<Lane>,
    /// Live block by unit offset.
    live: OffsetMap<u32>,
    /// Live fallback regions by address.
    fallback: OffsetMap<Fallback>,
    c: Counters,
    /// While the region sleeps: its level and the committed bytes to
    /// restore.
    asleep: Option<(u8, usize)>,
}

struct Inner {
    id: u64,
    base: usize,
    capacity: u64,
    align: u64,
    shift: u32,
    strict: bool,
    backend: Backend,
    order: Arc<dyn StreamOrder>,
    state: Mutex<Core>,
    /// Declared last: released after the state (and its fallbacks) is gone.
    /// Locked after `state` (a sleep decommits it), never before.
    region: Mutex<Region>,
}

/// The activation pool (see the module documentation). Cloning gives
/// another handle to the same pool.
#[derive(Clone)]
pub struct ActivationPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ActivationPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationPool")
            .field("id", &self.inner.id)
            .field("base", &format_args!("{:#x}", self.inner.base))
            .field("capacity", &self.inner.capacity)
            .field("align", &self.inner.align)
            .field("strict", &self.inner.strict)
            .finish()
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

fn reserve_err(what: &str) -> MemError {
    MemError::Capacity(format!(
        "the activation pool could not allocate host memory for its {what}; the host is out of \
         memory"
    ))
}

impl Core {
    /// A free slab entry, growing the slab (fallibly) when none is spare.
    fn new_slot(&mut self) -> Option<u32> {
        if self.spare != NONE {
            let idx = self.spare;
            self.spare = self.slab[idx as usize].next_free;
            return Some(idx);
        }
        if self.slab.len() >= NONE as usize - 1 {
            return None;
        }
        if self.slab.len() == self.slab.capacity() {
            self.slab.try_reserve(self.slab.len().max(64)).ok()?;
        }
        self.slab.push(Block::spare());
        Some((self.slab.len() - 1) as u32)
    }

    fn drop_slot(&mut self, idx: u32) {
        let b = &mut self.slab[idx as usize];
        *b = Block::spare();
        b.next_free = self.spare;
        self.spare = idx;
    }

    /// The lane of `stream`, if it has one.
    #[inline]
    fn lane_of(&self, stream: u64) -> Option<u32> {
        self.lanes
            .iter()
            .position(|l| l.stream == stream)
            .map(|i| i as u32)
    }

    /// The lane of `stream`, taking an empty one or adding one (fallibly).
    fn lane_for(&mut self, stream: u64) -> Option<u32> {
        if let Some(i) = self.lane_of(stream) {
            return Some(i);
        }
        if let Some(i) = self.lanes.iter().position(|l| l.blocks == 0) {
            self.lanes[i].stream = stream;
            return Some(i as u32);
        }
        if self.lanes.len() == self.lanes.capacity() {
            self.lanes.try_reserve(self.lanes.len().max(4)).ok()?;
        }
        self.lanes.push(Lane::new(stream));
        Some((self.lanes.len() - 1) as u32)
    }

    fn unlist(&mut self, idx: u32, shift: u32) {
        let b = self.slab[idx as usize];
        self.lanes[b.lane as usize].remove(&mut self.slab, idx, b.size >> shift);
    }

    /// Makes `idx` a free block of `stream`, merged with its free physical
    /// neighbours of the same stream or never used, and lists it.
    fn put_free(&mut self, mut idx: u32, stream: u64, shift: u32) {
        self.slab[idx as usize].stream = stream;
        self.slab[idx as usize].requested = 0;
        let Some(lane) = self.lane_for(stream) else {
            let b = &mut self.slab[idx as usize];
            b.state = BlockState::Parked;
            b.lane = NONE;
            self.c.parked_blocks += 1;
            return;
        };
        let prev = self.slab[idx as usize].prev_phys;
        if prev != NONE && self.mergeable(prev, stream) {
            self.unlist(prev, shift);
            self.absorb_next(prev);
            idx = prev;
        }
        let next = self.slab[idx as usize].next_phys;
        if next != NONE && self.mergeable(next, stream) {
            self.unlist(next, shift);
            self.absorb_next(idx);
        }
        // The merged block may be a fresh neighbour's entry: it is now
        // `stream`'s.
        self.slab[idx as usize].stream = stream;
        let units = self.slab[idx as usize].size >> shift;
        self.lanes[lane as usize].insert(&mut self.slab, idx, units, lane);
    }

    /// Whether free-block `idx` may join a block freed on `stream`: it was
    /// freed on that stream too, or it was never used (no work can be
    /// pending on fresh memory, so it may take any stream).
    #[inline]
    fn mergeable(&self, idx: u32, stream: u64) -> bool {
        let b = &self.slab[idx as usize];
        b.state == BlockState::Free && (b.stream == stream || b.stream == FRESH_STREAM)
    }

    /// Merges `idx`'s next physical neighbour (unlisted) into `idx`.
    fn absorb_next(&mut self, idx: u32) {
        let next = self.slab[idx as usize].next_phys;
        let (size, after) = {
            let n = &self.slab[next as usize];
            (n.size, n.next_phys)
        };
        self.slab[idx as usize].size += size;
        self.slab[idx as usize].next_phys = after;
        if after != NONE {
            self.slab[after as usize].prev_phys = idx;
        }
        self.drop_slot(next);
    }

    /// Hands out `idx` (unlisted) as a live block of `need` bytes on
    /// `stream`, splitting its tail back onto the lane it came from. The
    /// map has room for one more entry.
    fn carve(&mut self, idx: u32, need: u64, stream: u64, requested: u64, shift: u32) {
        let b = self.slab[idx as usize];
        let rest = b.size - need;
        if rest > 0 {
            if let Some(tail) = self.new_slot() {
                let after = b.next_phys;
                self.slab[tail as usize] = Block {
                    offset: b.offset + need,
                    size: rest,
                    requested: 0,
                    stream: b.stream,
                    prev_phys: idx,
                    next_phys: after,
                    prev_free: NONE,
                    next_free: NONE,
                    lane: NONE,
                    state: BlockState::Free,
                };
                if after != NONE {
                    self.slab[after as usize].prev_phys = tail;
                }
                self.slab[idx as usize].next_phys = tail;
                self.slab[idx as usize].size = need;
                // The tail's next neighbour cannot be a free block of its
                // stream (it would have been merged), so it is listed as is.
                let lane = b.lane;
                self.lanes[lane as usize].insert(&mut self.slab, tail, rest >> shift, lane);
            }
            // Without a slot the whole block is handed out: internal
            // fragmentation, not an error.
        }
        let size = {
            let blk = &mut self.slab[idx as usize];
            blk.state = BlockState::Live;
            blk.stream = stream;
            blk.requested = requested;
            blk.lane = NONE;
            blk.size
        };
        let offset = self.slab[idx as usize].offset;
        self.live.insert(offset >> shift, idx);
        let c = &mut self.c;
        c.allocated += size;
        c.allocated_peak = c.allocated_peak.max(c.allocated);
        c.in_use_peak = c.in_use_peak.max(c.allocated + c.fallback_bytes);
        c.requested += requested;
        c.live += 1;
        c.live_peak = c.live_peak.max(c.live);
        c.allocs_total += 1;
        c.allocated_bytes_total += size;
    }

    /// Unlists `idx` for a carve (its lane is kept in the block for the
    /// tail).
    fn take(&mut self, idx: u32, shift: u32) {
        let lane = self.slab[idx as usize].lane;
        let units = self.slab[idx as usize].size >> shift;
        self.lanes[lane as usize].remove(&mut self.slab, idx, units);
        self.slab[idx as usize].lane = lane;
    }

    /// Moves every free block of lane `from` to `stream`'s lane, merging.
    /// False (nothing moved) when `stream` can get no lane.
    fn move_lane(&mut self, from: u32, stream: u64, shift: u32) -> bool {
        // The target lane must exist before `from` empties, or `lane_for`
        // would hand `from` itself back as the empty lane to reuse.
        if self.lane_for(stream).is_none() {
            return false;
        }
        while let Some(idx) = self.lanes[from as usize].any() {
            self.unlist(idx, shift);
            self.put_free(idx, stream, shift);
        }
        true
    }
}

impl ActivationPool {
    /// Acquires a region of `config.capacity` bytes (tag `activations`) from
    /// `backend` and opens a pool over it. `order` orders streams for
    /// cross-stream reuse ([`NoStreams`] where there is one stream or none).
    pub fn new(
        backend: &Backend,
        config: &ActivationConfig,
        order: Arc<dyn StreamOrder>,
    ) -> Result<Self, MemError> {
        let align = config.align;
        if align == 0 || !align.is_power_of_two() || align > MAX_ALIGNMENT {
            return Err(MemError::invalid(format!(
                "align must be a power of two up to 1 GiB, got {align}; use e.g. \
                 {DEFAULT_ACTIVATION_ALIGN}"
            )));
        }
        let capacity = config.capacity / align * align;
        if capacity == 0 {
            return Err(MemError::invalid(format!(
                "capacity of {} B holds no block of align {align} B; give the activation pool at \
                 least {align} B",
                config.capacity
            )));
        }
        let strict = config
            .strict
            .unwrap_or_else(|| backend.stats().mode == PhaseMode::Strict);
        let mut slab: Vec<Block> = Vec::new();
        slab.try_reserve(INITIAL_BLOCKS)
            .map_err(|_| reserve_err("block metadata"))?;
        let mut lanes: Vec<Lane> = Vec::new();
        lanes
            .try_reserve(INITIAL_LANES)
            .map_err(|_| reserve_err("stream lanes"))?;
        let mut live: OffsetMap<u32> = OffsetMap::default();
        live.try_reserve(INITIAL_BLOCKS)
            .map_err(|_| reserve_err("pointer map"))?;
        let region = if config.growable {
            backend.acquire_growable(capacity, capacity, Tag::Activations)?
        } else {
            backend.acquire(
                capacity,
                align.max(DEFAULT_ALIGNMENT as u64),
                Tag::Activations,
            )?
        };
        let mut core = Core {
            slab,
            spare: NONE,
            lanes,
            live,
            fallback: OffsetMap::default(),
            c: Counters {
                reserved_peak: capacity,
                ..Counters::default()
            },
            asleep: None,
        };
        core.slab.push(Block {
            offset: 0,
            size: capacity,
            ..Block::spare()
        });
        core.put_free(0, FRESH_STREAM, align.trailing_zeros());
        Ok(Self {
            inner: Arc::new(Inner {
                id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
                base: region.base(),
                capacity,
                align,
                shift: align.trailing_zeros(),
                strict,
                backend: backend.clone(),
                order,
                state: Mutex::new(core),
                region: Mutex::new(region),
            }),
        })
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        // A poisoned lock means a panic elsewhere while it was held; the
        // structure is only ever changed by code that does not panic, so it
        // is still consistent (check_invariants says so if not).
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A process-unique id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The region's first address.
    pub fn base(&self) -> usize {
        self.inner.base
    }

    /// Bytes of the region.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// The alignment and size granule.
    pub fn align(&self) -> u64 {
        self.inner.align
    }

    /// Whether exhaustion is refused (true) or falls back to the backend.
    pub fn is_strict(&self) -> bool {
        self.inner.strict
    }

    /// The backend the region came from.
    pub fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    fn region(&self) -> MutexGuard<'_, Region> {
        self.inner
            .region
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Bytes of the region committed now (0 while it sleeps).
    pub fn committed(&self) -> u64 {
        self.region().len() as u64
    }

    /// The sleep level, `None` when awake.
    pub fn asleep(&self) -> Option<u8> {
        self.core().asleep.map(|(level, _)| level)
    }

    /// What a sleeping pool had committed (0 when awake).
    pub fn sleeping_committed(&self) -> usize {
        self.core().asleep.map_or(0, |(_, committed)| committed)
    }

    /// Gives the region's physical memory back, keeping its addresses and
    /// every block's bookkeeping: the bytes of live blocks are dropped (an
    /// activation or a graph's intermediate is rewritten before it is read;
    /// a tensor that must survive is copied out first), and allocations are
    /// refused with [`MemError::Asleep`] (the C hooks return null) until
    /// [`ActivationPool::wake`]. Fallback regions are not touched. Needs a
    /// growable region ([`MemError::BackendUnavailable`] otherwise).
    /// Returns the bytes decommitted.
    pub fn sleep(&self, level: u8) -> Result<u64, MemError> {
        let mut core = self.core();
        if let Some((level, _)) = core.asleep {
            return Err(MemError::invalid(format!(
                "the activation pool already sleeps (level {level}); call wake() first"
            )));
        }
        let mut region = self.region();
        if !region.is_growable() {
            return Err(MemError::BackendUnavailable(
                "the activation pool cannot sleep: its region is fixed; open the system on a \
                 VMM backend"
                    .into(),
            ));
        }
        let committed = region.len();
        region.decommit(0)?;
        core.asleep = Some((level, committed));
        Ok(committed as u64)
    }

    /// Recommits the region at the same base; a no-op when awake. On
    /// failure it sleeps on.
    pub fn wake(&self) -> Result<(), MemError> {
        let mut core = self.core();
        let Some((_, committed)) = core.asleep else {
            return Ok(());
        };
        self.region().commit(committed as u64)?;
        core.asleep = None;
        Ok(())
    }

    /// Whether `addr` lies inside the region.
    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.inner.base && ((addr - self.inner.base) as u64) < self.inner.capacity
    }

    /// Allocates `bytes` (rounded up to the alignment) for work on `stream`
    /// and returns its address. See the module documentation for the order
    /// in which free blocks are tried.
    pub fn allocate(&self, bytes: u64, stream: u64) -> Result<usize, MemError> {
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
            if let Some(idx) = Self::find_own(&core, stream, units, need) {
                core.take(idx, shift);
                core.carve(idx, need, stream, bytes, shift);
                return Ok(inner.base + core.slab[idx as usize].offset as usize);
            }
            if need <= inner.capacity {
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
        lane.find(units)
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
            l.find(units)
                .or_else(|| l.find_exact(&core.slab, units, need))
                .map(|idx| (idx, l.stream))
        });
        let Some((idx, producer)) = found else {
            return Ok(None);
        };
        if producer != FRESH_STREAM {
            self.inner.order.order_after(stream, producer)?;
            core.c.cross_stream_reuses += 1;
        }
        core.take(idx, self.inner.shift);
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
        core.take(idx, shift);
        core.carve(idx, need, stream, bytes, shift);
        Some(self.inner.base + core.slab[idx as usize].offset as usize)
    }

    fn oom(&self, core: &Core, bytes: u64) -> MemError {
        MemError::OutOfMemory(OomReport {
            asked: bytes,
            live: core.c.allocated,
            budget: self.inner.capacity,
            capacity: self.inner.capacity,
            tag: Tag::Activations,
            device_refused: false,
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
        let c = &mut core.c;
        c.fallbacks_total += 1;
        c.fallback_bytes_total += need;
        c.fallback_bytes += need;
        c.reserved_peak = c.reserved_peak.max(inner.capacity + c.fallback_bytes);
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
            });
        }
        let Some(fb) = core.fallback.remove(&(addr as u64)) else {
            core.c.refused_frees += 1;
            return Err(RefusedFree::Foreign);
        };
        let size = fb.region.len() as u64;
        let c = &mut core.c;
        c.fallback_bytes -= size;
        c.requested -= fb.requested;
        c.live -= 1;
        c.frees_total += 1;
        c.freed_bytes_total += size;
        drop(core);
        let freed = Freed {
            size,
            requested: fb.requested,
            alloc_stream: fb.stream,
            fallback: true,
        };
        drop(fb);
        Ok(freed)
    }

    /// The requested size of the live allocation at `addr`, if it is one.
    pub fn requested_size(&self, addr: usize) -> Option<u64> {
        let inner = &*self.inner;
        let core = self.core();
        if self.contains(addr) {
            let offset = (addr - inner.base) as u64;
            let idx = core.live.get(&(offset >> inner.shift))?;
            let b = &core.slab[*idx as usize];
            (b.offset == offset).then_some(b.requested)
        } else {
            core.fallback.get(&(addr as u64)).map(|f| f.requested)
        }
    }

    /// Resets the peaks to the current values.
    pub fn reset_peak(&self) {
        let cap = self.inner.capacity;
        let mut core = self.core();
        let c = &mut core.c;
        c.allocated_peak = c.allocated;
        c.in_use_peak = c.allocated + c.fallback_bytes;
        c.live_peak = c.live;
        c.reserved_peak = cap + c.fallback_bytes;
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ActivationStats {
        let core = self.core();
        let c = core.c;
        let (mut free_bytes, mut free_blocks, mut largest, mut streams) = (0, 0, 0, 0);
        for lane in &core.lanes {
            free_bytes += lane.bytes;
            free_blocks += u64::from(lane.blocks);
            if lane.blocks > 0 {
                streams += 1;
                largest = largest.max(lane.largest(&core.slab));
            }
        }
        ActivationStats {
            capacity: self.inner.capacity,
            align: self.inner.align,
            allocated: c.allocated,
            allocated_peak: c.allocated_peak,
            in_use: c.allocated + c.fallback_bytes,
            in_use_peak: c.in_use_peak,
            requested: c.requested,
            live: c.live,
            live_peak: c.live_peak,
            allocs_total: c.allocs_total,
            frees_total: c.frees_total,
            allocated_bytes_total: c.allocated_bytes_total,
            freed_bytes_total: c.freed_bytes_total,
            fallbacks_total: c.fallbacks_total,
            fallback_bytes_total: c.fallback_bytes_total,
            fallback_live: core.fallback.len() as u64,
            fallback_bytes: c.fallback_bytes,
            reserved_peak: c.reserved_peak,
            ooms: c.ooms,
            refused_frees: c.refused_frees,
            free_bytes,
            free_blocks,
            largest_free: largest,
            cross_stream_reuses: c.cross_stream_reuses,
            reclaims: c.reclaims,
            streams,
            parked_blocks: c.parked_blocks,
        }
    }

    /// Checks the pool's invariants: the blocks tile the region in address
    /// order with no overlap or gap; free + live == capacity; no two
    /// adjacent free blocks of one stream; every free block is listed once,
    /// in its size's class of its stream's lane; every live block is in the
    /// pointer map and nothing else is; the counters agree.
    pub fn check_invariants(&self) -> Result<(), MemError> {
        let core = self.core();
        let bad = |what: String| Err(MemError::Invariant(format!("activation pool: {what}")));
        let shift = self.inner.shift;
        let (mut at, mut prev, mut offset) = (0u32, NONE, 0u64);
        let (mut live_bytes, mut free_bytes, mut live_n, mut free_n, mut parked) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut steps = 0usize;
        while at != NONE {
            steps += 1;
            if steps > core.slab.len() {
                return bad("the physical list has a cycle".into());
            }
            let b = core.slab[at as usize];
            if b.prev_phys != prev {
                return bad(format!("block {at}: prev link {} != {prev}", b.prev_phys));
            }
            if b.offset != offset {
                return bad(format!(
                    "block {at} starts at {} but the previous ends at {offset}: overlap or gap",
                    b.offset
                ));
            }
            if b.size == 0 || b.size & (self.inner.align - 1) != 0 {
                return bad(format!("block {at} has size {}", b.size));
            }
            match b.state {
                BlockState::Live => {
                    live_bytes += b.size;
                    live_n += 1;
                    if core.live.get(&(b.offset >> shift)) != Some(&at) {
                        return bad(format!("live block {at} is not in the pointer map"));
                    }
                }
                BlockState::Free => {
                    free_bytes += b.size;
                    free_n += 1;
                    let lane = core.lanes.get(b.lane as usize);
                    if lane.map(|l| l.stream) != Some(b.stream) {
                        return bad(format!("free block {at} is on the wrong lane"));
                    }
                    if prev != NONE {
                        let p = core.slab[prev as usize];
                        let joinable = p.stream == b.stream
                            || p.stream == FRESH_STREAM
                            || b.stream == FRESH_STREAM;
                        if p.state == BlockState::Free && joinable {
                            return bad(format!(
                                "blocks {prev} and {at} are adjacent free blocks of one stream"
                            ));
                        }
                    }
                }
                BlockState::Parked => {
                    free_bytes += b.size;
                    parked += 1;
                }
                BlockState::Spare => return bad(format!("spare entry {at} is in the region")),
            }
            offset += b.size;
            prev = at;
            at = b.next_phys;
        }
        if offset != self.inner.capacity {
            return bad(format!(
                "blocks cover {offset} B of a {} B region",
                self.inner.capacity
            ));
        }
        if live_bytes + free_bytes != self.inner.capacity {
            return bad(format!(
                "free {free_bytes} + live {live_bytes} != capacity {}",
                self.inner.capacity
            ));
        }
        if live_n as usize != core.live.len() {
            return bad(format!(
                "{live_n} live blocks but {} map entries",
                core.live.len()
            ));
        }
        if core.c.allocated != live_bytes {
            return bad(format!(
                "allocated counter {} != {live_bytes} live bytes",
                core.c.allocated
            ));
        }
        if core.c.live != live_n + core.fallback.len() as u64 {
            return bad(format!(
                "live counter {} != {live_n} blocks + {} fallbacks",
                core.c.live,
                core.fallback.len()
            ));
        }
        if core.c.parked_blocks != parked {
            return bad("parked counter disagrees".into());
        }
        let fb: u64 = core.fallback.values().map(|f| f.region.len() as u64).sum();
        if fb != core.c.fallback_bytes {
            return bad(format!(
                "fallback bytes {fb} != counter {}",
                core.c.fallback_bytes
            ));
        }
        let mut listed = 0u64;
        let mut listed_bytes = 0u64;
        for (li, lane) in core.lanes.iter().enumerate() {
            if !lane.maps_consistent() {
                return bad(format!("lane {li}: bitmaps disagree with the lists"));
            }
            let mut n = 0u32;
            let mut bytes = 0u64;
            let mut wrong = None;
            lane.listed(&core.slab, |idx, class| {
                let b = &core.slab[idx as usize];
                n += 1;
                bytes += b.size;
                if b.state != BlockState::Free
                    || b.lane as usize != li
                    || tlsf::class_of(b.size >> shift) != class
                {
                    wrong = Some(idx);
                }
            });
            if let Some(idx) = wrong {
                return bad(format!("lane {li}: block {idx} is listed wrongly"));
            }
            if n != lane.blocks || bytes != lane.bytes {
                return bad(format!("lane {li}: counters disagree with its lists"));
            }
            listed += u64::from(n);
            listed_bytes += bytes;
        }
        if listed != free_n || listed_bytes + parked_bytes(&core) != free_bytes {
            return bad(format!(
                "{listed} blocks listed, {free_n} free in the region"
            ));
        }
        Ok(())
    }

    /// Where the memory lives (the backend's kind and device).
    pub fn placement(&self) -> crate::span::Placement {
        crate::arena::placement_of(&self.region())
    }

    /// A short description of the pool's size, for messages.
    pub fn describe(&self) -> String {
        format!(
            "activation pool of {} (align {} B, {})",
            human_bytes(self.inner.capacity),
            self.inner.align,
            if self.inner.strict {
                "strict"
            } else {
                "production"
            }
        )
    }
}

fn parked_bytes(core: &Core) -> u64 {
    core.slab
        .iter()
        .filter(|b| b.state == BlockState::Parked)
        .map(|b| b.size)
        .sum()
}

#[cfg(test)]
mod tests;
