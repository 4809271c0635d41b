//! T3 — the refcounted block pool (seed A2, A3.3, A3.4, A5.1, D2, D10).
//!
//! Algorithm: a vector of entries, one per block id, each either
//! `Vacant { next }` (a link of an intrusive free list) or
//! `Occupied { refs }`. The ids are cut into chunks of `chunk_blocks`
//! consecutive ids (the growth step of a growable pool, the whole pool for a
//! fixed one), each with its own free list, and a two-level bitmap marks the
//! chunks that have a free block. Allocation pops the head of the lowest such
//! chunk (two `trailing_zeros`); release pushes onto its own chunk's list
//! (the chunk is found by a multiply-shift division): both O(1), no search,
//! no fragmentation (every block is the same size). Preferring the lowest
//! chunk packs the live blocks at the front, so under churn the tail of a
//! grown pool drains and can be given back; a single LIFO list would
//! scatter them over the whole range (measured in
//! `tests::churn_lets_the_tail_drain`: 7.9 of 15 chunks free above the
//! highest live block on average, against 1 for LIFO). A fixed or slots pool
//! never grows nor shrinks and is one chunk, so it keeps a single LIFO list
//! (the same order) without the chunk counters, bitmap and cache
//! (`FreeBlocks::Single`). A block's bytes, when
//! the pool has a region, are at `base + id * stride`, with the stride a
//! run-time value (D2: KV block bytes are computed at init). Without a
//! region the pool is an id space only ("slots mode", D10): a KV cache that
//! lays out its own memory per layer still gets its free list and refcounts
//! from here.
//!
//! Ownership (A5.1): the pool owns the memory; nobody else does. A block is
//! held through [`BlockRef`]s, move-only and not `Clone`; [`BlockRef::share`]
//! is the only way to alias and increments the count; dropping a ref
//! decrements exactly once; the block returns to the free list when, and
//! only when, its last ref is dropped. There is no path that frees a block by
//! id, and a ref can only ever be released into the pool it came from.
//!
//! Growth: over a growable region the pool commits more of it in chunks of
//! `grow_blocks` when the free list runs dry. The base never moves, so the
//! addresses of live blocks are stable across growth (V9).
//!
//! Shrinking (issue 4, seed A3.1: decommit is the expensive direction, so it
//! is hysteretic and fenced): the engine calls `step(fence)` once per step,
//! with a fence recorded after the step's work. The step feeds a
//! [`DecommitTracker`] the chunks needed (up to the highest live block, never
//! fewer than the pool opened with) and the chunks in use; after
//! `min_idle_steps` idle steps it decides a target, and the pool *withdraws*
//! the free tail above it — the tail's blocks leave the free lists (the cut
//! chunk's list is rebuilt: O(one chunk)), so they cannot be handed out —
//! and schedules the decommit behind the fence ([`DeferredDecommit`]). A
//! later step (or [`SharedBlockPool::flush_decommit`]) decommits once the
//! fence has completed. An allocation that needs blocks while a decommit is
//! pending cancels it and takes the withdrawn blocks back with no driver
//! call; a growth after a shrink commits the same range again (same base,
//! same addresses). Only free blocks are ever withdrawn, and a DLPack export
//! holds a ref, so no live or exported block is ever decommitted.
//!
//! Two façades over one [`PoolCore`]: [`BlockPool`] (borrowed: a
//! `BlockRef<'p>` cannot outlive its pool; single-threaded) and
//! [`SharedBlockPool`] (`Arc` + mutex, `Send + Sync`, handing out
//! [`SharedBlockRef`]s that keep the pool alive; what the Python binding
//! uses). Pool identity is a process-unique id checked wherever a ref is
//! passed back to a pool.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::arena::placement_of;
use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT};
use crate::decommit::{Decision, DecommitPolicy, DecommitTracker, DeferredDecommit, FenceLike};
use crate::error::{try_reserve, MemError};
use crate::span::{MintKey, Placement, StableSpan};
use crate::tag::Tag;
use crate::tier::{next_tier_id, Tier};
use crate::units::human_bytes;

/// A block's index in its pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;
/// The most blocks one pool can hold (ids are `u32`, one value is the list's
/// end marker).
pub const MAX_BLOCKS: u32 = u32::MAX - 1;

/// One block's slot: a link of the free list, or a live block's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Vacant { next: u32 },
    Occupied { refs: u32 },
}

/// How to build a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes per block (the stride). Ignored in slots mode.
    pub block_bytes: usize,
    /// Blocks available at once.
    pub blocks: u32,
    /// The most blocks the pool may grow to (`blocks` for a fixed pool).
    /// Above `blocks` the region is acquired growable.
    pub max_blocks: u32,
    /// Blocks added per growth step.
    pub grow_blocks: u32,
    /// What the region is charged to (default: `kv_cache`).
    pub tag: Option<Tag>,
}

impl PoolConfig {
    /// A fixed pool of `blocks` blocks of `block_bytes` each.
    pub fn fixed(block_bytes: usize, blocks: u32) -> Self {
        Self {
            block_bytes,
            blocks,
            max_blocks: blocks,
            grow_blocks: 0,
            tag: None,
        }
    }

    /// A pool that starts with `blocks` and grows by `grow_blocks` up to
    /// `max_blocks`.
    pub fn growable(block_bytes: usize, blocks: u32, max_blocks: u32, grow_blocks: u32) -> Self {
        Self {
            block_bytes,
            blocks,
            max_blocks,
            grow_blocks,
            tag: None,
        }
    }

    /// Charges the region to `tag`.
    pub fn with_tag(mut self, tag: Tag) -> Self {
        self.tag = Some(tag);
        self
    }

    fn check(&self, slots: bool) -> Result<(), MemError> {
        if !slots && self.block_bytes == 0 {
            return Err(MemError::invalid(
                "block_bytes must be positive; use slots mode for an id space",
            ));
        }
        if self.max_blocks == 0 || self.max_blocks > MAX_BLOCKS {
            return Err(MemError::invalid(format!(
                "a pool holds 1 to {MAX_BLOCKS} blocks; got max_blocks={}",
                self.max_blocks
            )));
        }
        if self.blocks > self.max_blocks {
            return Err(MemError::invalid(format!(
                "blocks={} is above max_blocks={}; raise max_blocks or start smaller",
                self.blocks, self.max_blocks
            )));
        }
        if self.blocks < self.max_blocks && self.grow_blocks == 0 {
            return Err(MemError::invalid(
                "a growable pool needs grow_blocks > 0 (blocks added per growth step)",
            ));
        }
        Ok(())
    }
}

/// Counters of one pool. V4: `free + live == capacity`, always.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks that exist now (grows with the region, shrinks with a
    /// decommit; blocks withdrawn for a pending decommit are not counted).
    pub capacity: u32,
    /// The most blocks the pool can grow to.
    pub max_blocks: u32,
    /// Blocks on the free list.
    pub free: u32,
    /// Blocks with at least one ref.
    pub live: u32,
    /// Refs outstanding, summed over live blocks.
    pub refs: u64,
    /// The most blocks ever live at once.
    pub high_water: u32,
    /// Bytes per block (0 in slots mode).
    pub block_bytes: usize,
    /// Growth steps taken.
    pub growths: u32,
    /// Decommits carried out (the region's tail returned to the device).
    pub shrinks: u32,
    /// Bytes returned by those decommits, in total.
    pub decommitted_bytes: u64,
    /// Pending decommits cancelled because the pool needed the blocks again.
    pub cancelled_shrinks: u32,
    /// Blocks withdrawn from the pool, still committed, waiting for their
    /// fence before they are decommitted.
    pub pending_blocks: u32,
    /// Bytes of the region committed now (0 in slots mode).
    pub committed_bytes: u64,
    /// The floor: a pool never shrinks below the blocks it opened with.
    pub min_blocks: u32,
    /// Blocks per chunk: the unit of the shrink policy and of the
    /// lowest-chunk-first free lists.
    pub chunk_blocks: u32,
    /// Consecutive idle steps counted towards the next shrink.
    pub idle_steps: u32,
    /// The sleep level (1 or 2) while the pool sleeps, 0 when awake.
    pub asleep: u8,
}

/// Most chunks a pool is divided into (a two-level bitmap of 64 × 64 bits).
const MAX_CHUNKS: u32 = 64 * 64;

/// The blocks per chunk for `config`: the growth step of a growable pool
/// (coarsened so that there are at most [`MAX_CHUNKS`]), the whole pool for
/// a fixed one. At least 2, which keeps [`FreeLists::chunk_of`] exact.
fn chunk_blocks_for(config: &PoolConfig) -> u32 {
    let step = if config.max_blocks > config.blocks {
        config.grow_blocks
    } else {
        config.max_blocks
    };
    step.max(config.max_blocks.div_ceil(MAX_CHUNKS)).max(2)
}

/// A pool's free blocks: one LIFO list for a pool that never grows (fixed or
/// slots: exactly one chunk, never shrinks), per-chunk lists for a growable
/// one. The single list costs one head read and write per pop or push, what
/// the pool paid before it could shrink; the chunked lists add the chunk's
/// counter, its bitmap bit and the lowest-chunk cache, which only a pool
/// that can shrink needs.
#[derive(Debug)]
enum FreeBlocks {
    /// One intrusive LIFO list over every id.
    Single {
        head: u32,
        /// Reported as the chunk size (the whole pool).
        chunk_blocks: u32,
    },
    /// Lowest-chunk-first lists, for a growable pool.
    Chunked(FreeLists),
}

impl FreeBlocks {
    fn new(config: &PoolConfig) -> Result<Self, MemError> {
        let chunk_blocks = chunk_blocks_for(config);
        Ok(if config.max_blocks > config.blocks {
            Self::Chunked(FreeLists::try_new(chunk_blocks, config.max_blocks)?)
        } else {
            Self::Single {
                head: NIL,
                chunk_blocks: chunk_blocks.max(2),
            }
        })
    }

    fn chunk_blocks(&self) -> u32 {
        match self {
            Self::Single { chunk_blocks, .. } => *chunk_blocks,
            Self::Chunked(lists) => lists.chunk_blocks,
        }
    }

    /// Puts `id` (whose entry is `entry`, owned by the caller) on its list.
    #[inline(always)]
    fn push(&mut self, entry: &mut Entry, id: BlockId) {
        match self {
            Self::Single { head, .. } => {
                *entry = Entry::Vacant { next: *head };
                *head = id;
            }
            Self::Chunked(lists) => lists.push(entry, id),
        }
    }

    /// Takes a free block (the head of the single list, or of the lowest
    /// chunk's); `None` when none is free or the list is corrupt. Leaves
    /// `entries[id]` for the caller.
    #[inline(always)]
    fn pop(&mut self, entries: &[Entry]) -> Option<BlockId> {
        match self {
            Self::Single { head, .. } => {
                let id = *head;
                let Some(Entry::Vacant { next }) = entries.get(id as usize).copied() else {
                    return None;
                };
                *head = next;
                Some(id)
            }
            Self::Chunked(lists) => lists.pop(entries),
        }
    }

    /// The highest chunk of `[0, capacity)` holding a live block (`free`:
    /// the blocks free in `[0, capacity)`).
    fn highest_used(&self, capacity: u32, free: u32) -> Option<usize> {
        match self {
            Self::Single { .. } => (free < capacity).then_some(0),
            Self::Chunked(lists) => lists.highest_used(capacity),
        }
    }

    /// Drops ids `[new_cap, old_cap)` (all free) from the lists.
    fn cut(&mut self, entries: &mut [Entry], new_cap: u32, old_cap: u32) {
        match self {
            Self::Single { head, .. } => {
                if new_cap >= old_cap {
                    return;
                }
                *head = NIL;
                for id in (0..new_cap).rev() {
                    let entry = &mut entries[id as usize];
                    if matches!(entry, Entry::Vacant { .. }) {
                        *entry = Entry::Vacant { next: *head };
                        *head = id;
                    }
                }
            }
            Self::Chunked(lists) => lists.cut(entries, new_cap, old_cap),
        }
    }
}

/// The free list, split by chunk: one intrusive list per chunk of
/// `chunk_blocks` consecutive ids, a two-level bitmap of the chunks that
/// have a free block, and the lowest such chunk cached. Allocation pops from
/// the cached chunk; release pushes onto its own chunk's list and lowers the
/// cache if its chunk is lower; only when the cached chunk runs empty is the
/// next one found in the bitmap (two `trailing_zeros`). All O(1).
/// Preferring low chunks keeps the live blocks packed at the front, so
/// under churn the tail of a grown pool drains and can be decommitted
/// (a single LIFO list scatters live blocks over the whole range).
#[derive(Debug)]
struct FreeLists {
    chunk_blocks: u32,
    /// `⌈2^64 / chunk_blocks⌉`: `id / chunk_blocks` is the high half of
    /// `magic * id` for every `u32` id (Lemire, Kaser & Kurz 2019).
    magic: u64,
    chunks: Vec<ChunkList>,
    /// The lowest chunk with a free block; `NIL` when none has one.
    lowest: u32,
    /// Bit `c`: chunk `c` has a free block.
    words: Vec<u64>,
    /// Bit `w`: `words[w] != 0`.
    summary: u64,
}

/// One chunk's free list.
#[derive(Debug, Clone, Copy)]
struct ChunkList {
    head: u32,
    /// Free blocks on it.
    free: u32,
}

impl FreeLists {
    /// The lists of a pool of at most `max_blocks`, their bookkeeping
    /// reserved fallibly (the count is a caller's).
    fn try_new(chunk_blocks: u32, max_blocks: u32) -> Result<Self, MemError> {
        let chunk_blocks = chunk_blocks.max(2);
        let chunks = max_blocks.div_ceil(chunk_blocks).max(1) as usize;
        let what = format!("a pool of up to {max_blocks} blocks");
        let mut lists = Vec::new();
        try_reserve(&mut lists, chunks, &what)?;
        lists.resize(chunks, ChunkList { head: NIL, free: 0 });
        let mut words = Vec::new();
        try_reserve(&mut words, chunks.div_ceil(64), &what)?;
        words.resize(chunks.div_ceil(64), 0);
        Ok(Self {
            chunk_blocks,
            magic: u64::MAX / chunk_blocks as u64 + 1,
            chunks: lists,
            lowest: NIL,
            words,
            summary: 0,
        })
    }

    #[inline]
    fn chunk_of(&self, id: BlockId) -> usize {
        ((self.magic as u128 * id as u128) >> 64) as usize
    }

    /// `chunk_of`, skipping the multiply for a one-chunk (fixed or slots)
    /// pool.
    #[inline]
    fn chunk_of_fast(&self, id: BlockId) -> usize {
        if self.chunks.len() == 1 {
            0
        } else {
            self.chunk_of(id)
        }
    }

    #[inline]
    fn mark(&mut self, c: usize) {
        self.words[c >> 6] |= 1 << (c & 63);
        self.summary |= 1 << (c >> 6);
        if (c as u32) < self.lowest {
            self.lowest = c as u32;
        }
    }

    fn unmark(&mut self, c: usize) {
        let w = c >> 6;
        self.words[w] &= !(1 << (c & 63));
        if self.words[w] == 0 {
            self.summary &= !(1 << w);
        }
        if self.lowest == c as u32 {
            self.lowest = self.find_lowest();
        }
    }

    /// The lowest chunk with a free block, from the bitmap.
    fn find_lowest(&self) -> u32 {
        if self.summary == 0 {
            return NIL;
        }
        let w = self.summary.trailing_zeros() as usize;
        match self.words.get(w) {
            Some(bits) => (w * 64) as u32 + bits.trailing_zeros(),
            None => NIL,
        }
    }

    /// Puts `id` (whose entry is `entry`, owned by the caller) on its
    /// chunk's list.
    #[inline]
    fn push(&mut self, entry: &mut Entry, id: BlockId) {
        let c = self.chunk_of_fast(id);
        let list = &mut self.chunks[c];
        let head = list.head;
        list.head = id;
        list.free += 1;
        *entry = Entry::Vacant { next: head };
        if head == NIL {
            self.mark(c);
        }
    }

    /// Takes the head of the lowest chunk's list; `None` when no block is
    /// free or the list is corrupt. Leaves `entries[id]` for the caller.
    #[inline]
    fn pop(&mut self, entries: &[Entry]) -> Option<BlockId> {
        let c = self.lowest as usize;
        let list = self.chunks.get_mut(c)?;
        let id = list.head;
        let Some(Entry::Vacant { next }) = entries.get(id as usize).copied() else {
            return None;
        };
        list.head = next;
        list.free -= 1;
        if next == NIL {
            self.unmark(c);
        }
        Some(id)
    }

    /// The highest chunk of `[0, capacity)` holding a live block.
    fn highest_used(&self, capacity: u32) -> Option<usize> {
        if capacity == 0 {
            return None;
        }
        let cb = self.chunk_blocks as u64;
        let top = self.chunk_of(capacity - 1);
        (0..=top).rev().find(|&c| {
            let len = (capacity as u64 - c as u64 * cb).min(cb) as u32;
            self.chunks[c].free < len
        })
    }

    /// Drops ids `[new_cap, old_cap)` (all free) from the lists; the chunk
    /// that `new_cap` cuts is rebuilt from `entries`. O(blocks touched).
    fn cut(&mut self, entries: &mut [Entry], new_cap: u32, old_cap: u32) {
        if new_cap >= old_cap {
            return;
        }
        let first = self.chunk_of(new_cap);
        let last = self.chunk_of(old_cap - 1);
        for c in first..=last {
            self.chunks[c] = ChunkList { head: NIL, free: 0 };
            self.unmark(c);
        }
        let start = (first as u64 * self.chunk_blocks as u64) as u32;
        for id in (start..new_cap).rev() {
            let entry = &mut entries[id as usize];
            if matches!(entry, Entry::Vacant { .. }) {
                self.push(entry, id);
            }
        }
    }
}

/// A boxed fence the pool keeps while a decommit waits for it.
struct PoolFence(Box<dyn FenceLike + Send>);

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

/// The state and the rules of one pool, shared by both façades.
#[derive(Debug)]
pub struct PoolCore {
    id: u64,
    region: Option<Region>,
    placement: Option<Placement>,
    stride: usize,
    entries: Vec<Entry>,
    lists: FreeBlocks,
    free: u32,
    refs: u64,
    max_blocks: u32,
    grow_blocks: u32,
    min_blocks: u32,
    high_water: u32,
    growths: u32,
    tracker: DecommitTracker,
    deferred: DeferredDecommit<PoolFence>,
    shrinks: u32,
    cancelled_shrinks: u32,
    decommitted_bytes: u64,
    /// While the pool sleeps: its level and the committed bytes to restore.
    sleep: Option<(u8, usize)>,
}

impl PoolCore {
    fn open(backend: &Backend, config: &PoolConfig) -> Result<Self, MemError> {
        config.check(false)?;
        let tag = config.tag.unwrap_or(Tier::Pooled.default_tag());
        let bytes = |n: u32| {
            (n as u64)
                .checked_mul(config.block_bytes as u64)
                .ok_or_else(|| {
                    MemError::invalid(format!("{n} blocks of {} B overflow", config.block_bytes))
                })
        };
        let region = if config.max_blocks > config.blocks {
            backend.acquire_growable(bytes(config.max_blocks)?, bytes(config.blocks)?, tag)?
        } else {
            backend.acquire(bytes(config.blocks)?, DEFAULT_ALIGNMENT as u64, tag)?
        };
        // A commit rounded up to the granularity may already hold more blocks.
        let blocks =
            ((region.len() / config.block_bytes) as u64).min(config.max_blocks as u64) as u32;
        let mut core = Self::empty(
            config,
            Some(placement_of(&region)),
            config.block_bytes,
            Some(region),
        )?;
        core.extend(blocks)?;
        core.min_blocks = blocks;
        Ok(core)
    }

    fn slots(blocks: u32) -> Result<Self, MemError> {
        let config = PoolConfig::fixed(0, blocks);
        config.check(true)?;
        let mut core = Self::empty(&config, None, 0, None)?;
        core.extend(blocks)?;
        core.min_blocks = blocks;
        Ok(core)
    }

    fn empty(
        config: &PoolConfig,
        placement: Option<Placement>,
        stride: usize,
        region: Option<Region>,
    ) -> Result<Self, MemError> {
        Ok(Self {
            id: next_tier_id(),
            region,
            placement,
            stride,
            entries: Vec::new(),
            lists: FreeBlocks::new(config)?,
            free: 0,
            refs: 0,
            max_blocks: config.max_blocks,
            grow_blocks: config.grow_blocks,
            min_blocks: 0,
            high_water: 0,
            growths: 0,
            tracker: DecommitTracker::new(DecommitPolicy::default()),
            deferred: DeferredDecommit::new(),
            shrinks: 0,
            cancelled_shrinks: 0,
            decommitted_bytes: 0,
            sleep: None,
        })
    }

    /// Adds ids `[len, new_len)` to the free lists, each chunk's new ids in
    /// ascending order at its front. The entries are reserved fallibly: the
    /// count comes from a caller, and the host refusing it is an error.
    fn extend(&mut self, new_len: u32) -> Result<(), MemError> {
        let old_len = self.entries.len() as u32;
        if new_len <= old_len {
            return Ok(());
        }
        let more = (new_len - old_len) as usize;
        try_reserve(
            &mut self.entries,
            more,
            &format!("a pool of {new_len} blocks"),
        )?;
        // Placeholders, each overwritten by the push below.
        self.entries
            .resize(new_len as usize, Entry::Occupied { refs: 0 });
        for id in (old_len..new_len).rev() {
            self.lists.push(&mut self.entries[id as usize], id);
        }
        self.free += new_len - old_len;
        Ok(())
    }

    fn capacity(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Blocks the committed part of the region holds (the capacity, plus
    /// any withdrawn for a pending decommit).
    fn committed_blocks(&self) -> u32 {
        match &self.region {
            Some(region) if self.stride > 0 => {
                ((region.len() / self.stride) as u64).min(self.max_blocks as u64) as u32
            }
            _ => self.capacity(),
        }
    }

    fn exhausted(&self, asked: u32) -> MemError {
        let what = match self.region {
            Some(_) => format!("of {} each", human_bytes(self.stride as u64)),
            None => "(slots)".to_string(),
        };
        MemError::Capacity(format!(
            "block pool #{} cannot give {asked} block(s) {what}: {} free of {} (at most {}); \
             release blocks, admit fewer sequences, or plan a larger pool",
            self.id,
            self.free,
            self.capacity(),
            self.max_blocks
        ))
    }

    /// Cancels a pending decommit and gives its blocks back to the free
    /// lists: they are still committed, so this costs no driver call.
    fn reclaim(&mut self) -> Result<(), MemError> {
        if self.deferred.pending_target().is_none() {
            return Ok(());
        }
        self.deferred.cancel();
        self.cancelled_shrinks += 1;
        let committed = self.committed_blocks();
        self.extend(committed)
    }

    /// Makes at least `need` blocks free, growing if it must: first by
    /// reclaiming blocks withdrawn for a pending decommit, then by
    /// committing more of the region. All or nothing, except that a
    /// reclaim stays done.
    fn ensure_free(&mut self, need: u32) -> Result<(), MemError> {
        if let Some((level, _)) = self.sleep {
            return Err(self.asleep_error(level));
        }
        if need <= self.free {
            return Ok(());
        }
        let room = self.max_blocks - self.capacity();
        let growable = self.region.as_ref().is_some_and(Region::is_growable);
        if !growable || need - self.free > room {
            return Err(self.exhausted(need));
        }
        self.reclaim()?;
        if need <= self.free {
            return Ok(());
        }
        let short = need - self.free;
        let room = self.max_blocks - self.capacity();
        let target = self.capacity() + short.max(self.grow_blocks).min(room);
        let stride = self.stride;
        let Some(region) = self.region.as_mut() else {
            return Err(self.exhausted(need));
        };
        region.commit(target as u64 * stride as u64)?;
        let fits = ((region.len() / stride) as u64).min(self.max_blocks as u64) as u32;
        self.extend(fits.max(target))?;
        self.growths += 1;
        Ok(())
    }

    /// Pops one block; the caller has made sure one is free. Always
    /// inlined into the allocation loops (the error is built out of line).
    #[inline(always)]
    fn pop(&mut self) -> Result<BlockId, MemError> {
        match self.lists.pop(&self.entries) {
            Some(id) => {
                self.entries[id as usize] = Entry::Occupied { refs: 1 };
                self.free -= 1;
                self.refs += 1;
                Ok(id)
            }
            None => Err(self.no_vacant_head()),
        }
    }

    #[cold]
    #[inline(never)]
    fn no_vacant_head(&self) -> MemError {
        MemError::Invariant(format!(
            "pool #{}: the free lists have no vacant head ({} counted free)",
            self.id, self.free
        ))
    }

    fn note_high_water(&mut self) {
        self.high_water = self.high_water.max(self.capacity() - self.free);
    }

    fn allocate(&mut self) -> Result<BlockId, MemError> {
        self.ensure_free(1)?;
        let id = self.pop()?;
        self.note_high_water();
        Ok(id)
    }

    /// Pops `n` blocks, handing each id to `push`; all or nothing.
    fn allocate_many(&mut self, n: u32, mut push: impl FnMut(BlockId)) -> Result<(), MemError> {
        if n == 0 {
            return Ok(());
        }
        self.ensure_free(n)?;
        if let FreeBlocks::Single { head, .. } = &mut self.lists {
            // The single list's loop, the head in a register.
            let mut id = *head;
            for popped in 0..n {
                let Some(Entry::Vacant { next }) = self.entries.get(id as usize).copied() else {
                    *head = id;
                    self.free -= popped;
                    self.refs += popped as u64;
                    return Err(self.no_vacant_head());
                };
                self.entries[id as usize] = Entry::Occupied { refs: 1 };
                push(id);
                id = next;
            }
            *head = id;
            self.free -= n;
            self.refs += n as u64;
        } else {
            for _ in 0..n {
                push(self.pop()?);
            }
        }
        self.note_high_water();
        Ok(())
    }

    fn share(&mut self, id: BlockId) -> Result<(), MemError> {
        match self.entries.get_mut(id as usize) {
            Some(Entry::Occupied { refs }) if *refs > 0 => {
                *refs = refs.checked_add(1).ok_or_else(|| {
                    MemError::invalid(format!(
                        "block {id} already has {} refs; cannot share it again",
                        u32::MAX
                    ))
                })?;
                self.refs += 1;
                Ok(())
            }
            _ => Err(MemError::Invariant(format!(
                "pool #{}: share of block {id}, which is not live",
                self.id
            ))),
        }
    }

    /// Drops one ref; returns the block to the free list at the last one.
    /// Drops one ref on `id`. The common case — the last ref, a single
    /// free list, no memory to scrub — is inlined; the rest is
    /// [`Self::release_slow`].
    #[inline(always)]
    fn release(&mut self, id: BlockId) -> Result<(), MemError> {
        if let (FreeBlocks::Single { head, .. }, None) = (&mut self.lists, &self.region) {
            if let Some(entry @ Entry::Occupied { refs: 1 }) = self.entries.get_mut(id as usize) {
                *entry = Entry::Vacant { next: *head };
                *head = id;
                self.free += 1;
                self.refs -= 1;
                return Ok(());
            }
        }
        self.release_slow(id)
    }

    #[inline(never)]
    fn release_slow(&mut self, id: BlockId) -> Result<(), MemError> {
        match self.entries.get_mut(id as usize) {
            Some(Entry::Occupied { refs }) if *refs > 1 => {
                *refs -= 1;
                self.refs -= 1;
                Ok(())
            }
            Some(entry @ Entry::Occupied { refs: 1 }) => {
                self.lists.push(entry, id);
                self.free += 1;
                self.refs -= 1;
                if let Some(region) = &self.region {
                    // SAFETY: the last ref to `id` is being dropped, so no live
                    // handle refers to its bytes `[id * stride, (id + 1) * stride)`
                    // (inside the region: id < capacity and capacity * stride is
                    // committed).
                    unsafe { region.scrub(id as usize * self.stride, self.stride) };
                }
                Ok(())
            }
            _ => Err(MemError::Invariant(format!(
                "pool #{}: release of block {id}, which is not live",
                self.id
            ))),
        }
    }

    // ------------------------------------------------------------ shrinking

    fn shrinkable(&self) -> bool {
        self.stride > 0
            && self.sleep.is_none()
            && self.region.as_ref().is_some_and(Region::is_growable)
    }

    #[cold]
    #[inline(never)]
    fn asleep_error(&self, level: u8) -> MemError {
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
    fn sleep(&mut self, level: u8) -> Result<u64, MemError> {
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
    fn wake(&mut self) -> Result<(), MemError> {
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
    fn step(&mut self, fence: PoolFence) -> Result<u64, MemError> {
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
    fn shrink_now(&mut self, fence: PoolFence) -> Result<u64, MemError> {
        let mut returned = self.poll()?;
        if self.withdraw(0, fence)? {
            returned += self.poll()?;
        }
        Ok(returned)
    }

    /// Waits for a pending decommit's fence and decommits.
    fn flush_decommit(&mut self) -> Result<u64, MemError> {
        let Some(region) = self.region.as_mut() else {
            return Ok(0);
        };
        let done = self.deferred.flush(region)?;
        Ok(self.note_decommit(done))
    }

    fn set_policy(&mut self, policy: DecommitPolicy) {
        self.tracker = DecommitTracker::new(policy);
    }

    fn refcount(&self, id: BlockId) -> u32 {
        match self.entries.get(id as usize) {
            Some(Entry::Occupied { refs }) => *refs,
            _ => 0,
        }
    }

    fn span_of(&self, id: BlockId) -> Result<(usize, usize, Placement), MemError> {
        match (&self.region, self.placement) {
            (Some(region), Some(placement)) => Ok((
                region.base() + id as usize * self.stride,
                self.stride,
                placement,
            )),
            _ => Err(slots_have_no_memory()),
        }
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.capacity(),
            max_blocks: self.max_blocks,
            free: self.free,
            live: self.capacity() - self.free,
            refs: self.refs,
            high_water: self.high_water,
            block_bytes: self.stride,
            growths: self.growths,
            shrinks: self.shrinks,
            decommitted_bytes: self.decommitted_bytes,
            cancelled_shrinks: self.cancelled_shrinks,
            pending_blocks: self.committed_blocks().saturating_sub(self.capacity()),
            committed_bytes: self.region.as_ref().map_or(0, |r| r.len() as u64),
            min_blocks: self.min_blocks,
            chunk_blocks: self.lists.chunk_blocks(),
            idle_steps: self.tracker.idle_steps(),
            asleep: self.sleep.map_or(0, |(level, _)| level),
        }
    }

    /// Walks the free lists: the single one, or each chunk's with its
    /// counter and bitmap bit, the bitmap's summary and the cached lowest
    /// chunk. The blocks on them, or what is broken.
    fn walk_lists(&self) -> Result<u32, String> {
        let capacity = self.capacity();
        let lists = match &self.lists {
            FreeBlocks::Single { head, .. } => {
                let mut n = 0u32;
                let mut cursor = *head;
                while cursor != NIL {
                    if n > capacity {
                        return Err("the free list has a cycle".into());
                    }
                    if cursor >= capacity {
                        return Err(format!("block {cursor} is on the free list"));
                    }
                    match self.entries.get(cursor as usize) {
                        Some(Entry::Vacant { next }) => cursor = *next,
                        _ => return Err(format!("free-list link {cursor} is not a vacant entry")),
                    }
                    n += 1;
                }
                return Ok(n);
            }
            FreeBlocks::Chunked(lists) => lists,
        };
        let mut on_lists = 0u32;
        let mut summary = 0u64;
        for c in 0..lists.chunks.len() {
            let mut n = 0u32;
            let mut cursor = lists.chunks[c].head;
            while cursor != NIL {
                if n > capacity {
                    return Err(format!("the free list of chunk {c} has a cycle"));
                }
                if cursor >= capacity || lists.chunk_of(cursor) != c {
                    return Err(format!("block {cursor} is on the list of chunk {c}"));
                }
                match self.entries.get(cursor as usize) {
                    Some(Entry::Vacant { next }) => cursor = *next,
                    _ => return Err(format!("free-list link {cursor} is not a vacant entry")),
                }
                n += 1;
            }
            if n != lists.chunks[c].free {
                return Err(format!(
                    "chunk {c}: {n} on its list, counter says {}",
                    lists.chunks[c].free
                ));
            }
            let marked = lists.words[c >> 6] & (1 << (c & 63)) != 0;
            if marked != (n > 0) {
                return Err(format!("chunk {c}: bitmap bit {marked} with {n} free"));
            }
            on_lists += n;
        }
        for (w, word) in lists.words.iter().enumerate() {
            if *word != 0 {
                summary |= 1 << w;
            }
        }
        if summary != lists.summary {
            return Err("the bitmap summary disagrees with its words".into());
        }
        if lists.lowest != lists.find_lowest() {
            return Err(format!(
                "the cached lowest chunk {} is not the lowest with a free block",
                lists.lowest
            ));
        }
        Ok(on_lists)
    }

    /// Walks the whole pool and checks V4, the refcount sum, every chunk's
    /// list and bitmap bit (or the single list), and that the blocks fit the
    /// committed region.
    fn check_invariants(&self) -> Result<(), MemError> {
        let broken = |what: String| Err(MemError::Invariant(format!("pool #{}: {what}", self.id)));
        let capacity = self.capacity();
        let on_lists = match self.walk_lists() {
            Ok(n) => n,
            Err(what) => return broken(what),
        };
        let vacant = self
            .entries
            .iter()
            .filter(|e| matches!(e, Entry::Vacant { .. }))
            .count() as u32;
        let refs: u64 = self
            .entries
            .iter()
            .map(|e| match e {
                Entry::Occupied { refs } => *refs as u64,
                Entry::Vacant { .. } => 0,
            })
            .sum();
        if on_lists != self.free || vacant != self.free {
            return broken(format!(
                "{on_lists} on the free lists, {vacant} vacant, counter says {}",
                self.free
            ));
        }
        if refs != self.refs {
            return broken(format!(
                "refcounts sum to {refs}, counter says {}",
                self.refs
            ));
        }
        if self
            .entries
            .iter()
            .any(|e| matches!(e, Entry::Occupied { refs: 0 }))
        {
            return broken("a live block has no refs".into());
        }
        if self.sleep.is_some() {
            // Nothing is committed, and nothing may be live.
            if capacity != self.free {
                return broken(format!("{} blocks live while asleep", capacity - self.free));
            }
            return Ok(());
        }
        if capacity > self.committed_blocks() {
            return broken(format!(
                "{capacity} blocks but only {} committed",
                self.committed_blocks()
            ));
        }
        if capacity < self.min_blocks {
            return broken(format!(
                "{capacity} blocks, below the floor of {}",
                self.min_blocks
            ));
        }
        if self.deferred.pending_target().is_none() && capacity != self.committed_blocks() {
            return broken(format!(
                "{} committed blocks withdrawn with no decommit pending",
                self.committed_blocks() - capacity
            ));
        }
        Ok(())
    }
}

/// A block pool with the borrowed API: a [`BlockRef<'p>`](BlockRef) borrows
/// its pool. Single-threaded (`!Sync`).
#[derive(Debug)]
pub struct BlockPool {
    core: RefCell<PoolCore>,
}

fn reentered() -> MemError {
    MemError::Invariant("block pool re-entered while it was updating its state".into())
}

impl BlockPool {
    /// A pool over memory acquired from `backend`.
    pub fn new(backend: &Backend, config: &PoolConfig) -> Result<Self, MemError> {
        Ok(Self {
            core: RefCell::new(PoolCore::open(backend, config)?),
        })
    }

    /// An id space of `blocks` ids with no memory (D10).
    pub fn slots(blocks: u32) -> Result<Self, MemError> {
        Ok(Self {
            core: RefCell::new(PoolCore::slots(blocks)?),
        })
    }

    fn core(&self) -> Result<std::cell::RefMut<'_, PoolCore>, MemError> {
        self.core.try_borrow_mut().map_err(|_| reentered())
    }

    /// One block, with one ref.
    pub fn allocate(&self) -> Result<BlockRef<'_>, MemError> {
        let id = self.core()?.allocate()?;
        Ok(BlockRef { pool: self, id })
    }

    /// `n` blocks, or none (the pool is unchanged on failure).
    pub fn allocate_many(&self, n: u32) -> Result<Vec<BlockRef<'_>>, MemError> {
        let mut refs = Vec::new();
        try_reserve(&mut refs, n as usize, &format!("a batch of {n} block refs"))?;
        self.core()?
            .allocate_many(n, |id| refs.push(BlockRef { pool: self, id }))?;
        Ok(refs)
    }

    /// Drops `block` now. A ref from another pool is refused (and still
    /// dropped, into its own pool).
    pub fn release(&self, block: BlockRef<'_>) -> Result<(), MemError> {
        if !std::ptr::eq(block.pool, self) {
            let (theirs, ours) = (block.pool.id(), self.id());
            drop(block);
            return Err(foreign(theirs, ours));
        }
        drop(block);
        Ok(())
    }

    /// The live refs on block `id` (0 when free).
    pub fn refcount(&self, id: BlockId) -> u32 {
        self.core.borrow().refcount(id)
    }

    /// The counters.
    pub fn stats(&self) -> PoolStats {
        self.core.borrow().stats()
    }

    /// The process-unique id.
    pub fn id(&self) -> u64 {
        self.core.borrow().id
    }

    /// Walks the pool and checks V4 and the refcount sum.
    pub fn check_invariants(&self) -> Result<(), MemError> {
        self.core.borrow().check_invariants()
    }

    /// One engine step of the shrink policy (see [`SharedBlockPool::step`]).
    pub fn step<F: FenceLike + Send + 'static>(&self, fence: F) -> Result<u64, MemError> {
        self.core()?.step(PoolFence(Box::new(fence)))
    }

    /// Shrinks to the need now, bypassing the hysteresis (see
    /// [`SharedBlockPool::shrink_now`]).
    pub fn shrink_now<F: FenceLike + Send + 'static>(&self, fence: F) -> Result<u64, MemError> {
        self.core()?.shrink_now(PoolFence(Box::new(fence)))
    }

    /// Waits for a pending decommit's fence and decommits; the bytes
    /// returned.
    pub fn flush_decommit(&self) -> Result<u64, MemError> {
        self.core()?.flush_decommit()
    }

    /// Replaces the shrink policy (and restarts its idle count).
    pub fn set_decommit_policy(&self, policy: DecommitPolicy) -> Result<(), MemError> {
        self.core()?.set_policy(policy);
        Ok(())
    }

    /// The shrink policy.
    pub fn decommit_policy(&self) -> DecommitPolicy {
        self.core.borrow().tracker.policy()
    }
}

fn slots_have_no_memory() -> MemError {
    MemError::invalid(
        "this pool is an id space only (slots mode); it has no memory to view — lay the memory \
         out yourself, or open the pool with block_bytes",
    )
}

fn foreign(theirs: u64, ours: u64) -> MemError {
    MemError::invalid(format!(
        "this block ref belongs to pool #{theirs}, not #{ours}; a ref is only ever released into \
         the pool it came from"
    ))
}

/// One reference to a live block. Move-only, not `Clone`: [`BlockRef::share`]
/// is the only way to alias. Dropping it decrements the count exactly once.
#[derive(Debug)]
#[must_use = "dropping a BlockRef releases the block"]
pub struct BlockRef<'p> {
    pool: &'p BlockPool,
    id: BlockId,
}

impl<'p> BlockRef<'p> {
    /// The block's id.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// Another ref to the same block (the count goes up by one).
    pub fn share(&self) -> Result<BlockRef<'p>, MemError> {
        self.pool.core()?.share(self.id)?;
        Ok(BlockRef {
            pool: self.pool,
            id: self.id,
        })
    }

    /// The block's bytes, valid while this ref is alive. Refused in slots
    /// mode.
    pub fn span(&self) -> Result<StableSpan<'_>, MemError> {
        let (addr, len, placement) = self.pool.core.borrow().span_of(self.id)?;
        Ok(StableSpan::new(MintKey::new(), addr, len, placement))
    }

    /// The live refs on this block.
    pub fn refcount(&self) -> u32 {
        self.pool.refcount(self.id)
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &'p BlockPool {
        self.pool
    }
}

impl Drop for BlockRef<'_> {
    fn drop(&mut self) {
        // Neither can fail for a ref that exists: the pool is not borrowed
        // across any call that runs user code, and the ref holds a count.
        if let Ok(mut core) = self.pool.core() {
            let _ = core.release(self.id);
        }
    }
}

#[derive(Debug)]
struct SharedPoolInner {
    id: u64,
    placement: Option<Placement>,
    stride: usize,
    base: Option<usize>,
    core: Mutex<PoolCore>,
    /// [`SharedBlockPool::room`] as of the last unlock: `free` in the low
    /// half, the growth room in the high half (see [`CoreGuard`]).
    room: AtomicU64,
    /// Held by the one client that accounts every ref ([`PoolClaim`]).
    claimed: AtomicBool,
}

/// A pool reserved for one client that accounts every ref of it (a KV
/// manager): while it lives, a second [`SharedBlockPool::claim`] and
/// allocations through the pool's own API are refused, so the client's
/// invariant checks and counters see only its own blocks. Dropping it ends
/// the claim.
#[derive(Debug)]
pub struct PoolClaim {
    pool: SharedBlockPool,
}

impl Drop for PoolClaim {
    fn drop(&mut self) {
        self.pool.inner.claimed.store(false, Ordering::Release);
    }
}

fn claimed_pool(id: u64) -> MemError {
    MemError::invalid(format!(
        "block pool #{id} belongs to a KV manager, which accounts every ref of it; allocate \
         through the manager (admit/append), or open a separate pool"
    ))
}

/// The pool's lock, which publishes the room on unlock, so a reader that
/// only needs a recent figure ([`SharedBlockPool::room_hint`]) takes no lock.
struct CoreGuard<'a> {
    core: MutexGuard<'a, PoolCore>,
    room: &'a AtomicU64,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = PoolCore;

    fn deref(&self) -> &PoolCore {
        &self.core
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut PoolCore {
        &mut self.core
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.room.store(pack_room(&self.core), Ordering::Relaxed);
    }
}

/// `(free, growable)`: the free list and the blocks a growable pool can
/// still commit.
fn room_of(core: &PoolCore) -> (u32, u32) {
    (core.free, core.max_blocks.saturating_sub(core.capacity()))
}

fn pack_room(core: &PoolCore) -> u64 {
    let (free, growable) = room_of(core);
    u64::from(free) | (u64::from(growable) << 32)
}

/// A block pool with the run-time-checked API: clonable (`Arc`), `Send +
/// Sync`. Its refs ([`SharedBlockRef`], [`SharedBlockRefs`]) hold the pool
/// alive.
#[derive(Debug, Clone)]
pub struct SharedBlockPool {
    inner: Arc<SharedPoolInner>,
}

impl SharedBlockPool {
    /// A pool over memory acquired from `backend`.
    pub fn new(backend: &Backend, config: &PoolConfig) -> Result<Self, MemError> {
        Ok(Self::wrap(PoolCore::open(backend, config)?))
    }

    /// An id space of `blocks` ids with no memory (D10).
    pub fn slots(blocks: u32) -> Result<Self, MemError> {
        Ok(Self::wrap(PoolCore::slots(blocks)?))
    }

    fn wrap(core: PoolCore) -> Self {
        Self {
            inner: Arc::new(SharedPoolInner {
                id: core.id,
                placement: core.placement,
                stride: core.stride,
                base: core.region.as_ref().map(Region::base),
                room: AtomicU64::new(pack_room(&core)),
                claimed: AtomicBool::new(false),
                core: Mutex::new(core),
            }),
        }
    }

    fn core(&self) -> CoreGuard<'_> {
        CoreGuard {
            core: self.inner.core.lock().unwrap_or_else(|p| p.into_inner()),
            room: &self.inner.room,
        }
    }

    /// Reserves the pool for `self`'s one accounting client (see
    /// [`PoolClaim`]); refused when another claim lives.
    pub fn claim(&self) -> Result<PoolClaim, MemError> {
        if self.inner.claimed.swap(true, Ordering::AcqRel) {
            return Err(MemError::invalid(format!(
                "block pool #{} already serves a KV manager; one manager per pool (its checks \
                 and counters account every ref), so use that manager or open another pool",
                self.id()
            )));
        }
        Ok(PoolClaim { pool: self.clone() })
    }

    /// Whether a [`PoolClaim`] on the pool lives.
    pub fn is_claimed(&self) -> bool {
        self.inner.claimed.load(Ordering::Acquire)
    }

    /// One block, with one ref. Refused while the pool is claimed.
    pub fn allocate(&self) -> Result<SharedBlockRef, MemError> {
        if self.is_claimed() {
            return Err(claimed_pool(self.id()));
        }
        let id = self.core().allocate()?;
        Ok(SharedBlockRef {
            pool: self.clone(),
            id,
        })
    }

    /// `n` blocks as one batch, or none (the pool is unchanged on failure).
    /// Refused while the pool is claimed.
    pub fn allocate_many(&self, n: u32) -> Result<SharedBlockRefs, MemError> {
        if self.is_claimed() {
            return Err(claimed_pool(self.id()));
        }
        self.allocate_many_unchecked(n)
    }

    /// [`Self::allocate_many`] for the claim's holder.
    pub(crate) fn allocate_many_unchecked(&self, n: u32) -> Result<SharedBlockRefs, MemError> {
        let mut ids = Ids::try_with_capacity(n as usize)?;
        self.core().allocate_many(n, |id| ids.push(id))?;
        Ok(SharedBlockRefs {
            pool: self.clone(),
            ids,
        })
    }

    /// Drops `block` now. A ref from another pool is refused (and still
    /// dropped, into its own pool).
    pub fn release(&self, block: SharedBlockRef) -> Result<(), MemError> {
        let theirs = block.pool.id();
        drop(block);
        if theirs != self.id() {
            return Err(foreign(theirs, self.id()));
        }
        Ok(())
    }

    /// Drops every ref in `refs` (leaving the vector empty, its capacity
    /// kept) under one lock instead of one lock each: every ref releases
    /// exactly once, as if dropped one by one. A ref of another pool is
    /// dropped into its own pool and reported, like [`Self::release`].
    pub fn release_all(&self, refs: &mut Vec<SharedBlockRef>) -> Result<(), MemError> {
        let mut theirs = None;
        if !refs.is_empty() {
            let mut core = self.core();
            for r in refs.iter_mut() {
                if Arc::ptr_eq(&r.pool.inner, &self.inner) {
                    let _ = core.release(r.id);
                    // Released: its drop below only lets go of the pool.
                    r.id = RELEASED;
                } else {
                    theirs = Some(r.pool.id());
                }
            }
        }
        refs.clear();
        theirs.map_or(Ok(()), |t| Err(foreign(t, self.id())))
    }

    /// One more ref to each block of `refs` (refs of this pool), under one
    /// lock; all or nothing.
    pub fn share_all(&self, refs: &[&SharedBlockRef]) -> Result<Vec<SharedBlockRef>, MemError> {
        if let Some(r) = refs
            .iter()
            .find(|r| !Arc::ptr_eq(&r.pool.inner, &self.inner))
        {
            return Err(foreign(r.pool.id(), self.id()));
        }
        let mut core = self.core();
        for (done, r) in refs.iter().enumerate() {
            if let Err(e) = core.share(r.id) {
                for undo in &refs[..done] {
                    let _ = core.release(undo.id);
                }
                return Err(e);
            }
        }
        drop(core);
        Ok(refs
            .iter()
            .map(|r| SharedBlockRef {
                pool: self.clone(),
                id: r.id,
            })
            .collect())
    }

    /// Blocks on the free list, and blocks the pool can still grow by
    /// (`max_blocks - capacity`): [`Self::stats`]'s two figures an
    /// admission needs, for one lock and no more.
    pub fn room(&self) -> (u32, u32) {
        room_of(&self.core())
    }

    /// [`Self::room`] as the last holder of the lock left it, without
    /// taking the lock: exact for a caller that is the pool's only
    /// allocator, and otherwise what `room()` would have said just before
    /// another thread's call still in progress.
    pub(crate) fn room_hint(&self) -> (u32, u32) {
        let packed = self.inner.room.load(Ordering::Relaxed);
        (packed as u32, (packed >> 32) as u32)
    }

    /// The pool's whole reservation, `max_blocks * block_bytes` from the
    /// base, block `id` at `id * block_bytes`: what a kernel indexes by
    /// block id. The base never moves (V9), so the span holds across growth
    /// and shrinking; but only committed blocks have memory behind them,
    /// so only blocks the caller holds a ref to (directly, or through the
    /// KV manager that handed out their ids) may be touched. An error in
    /// slots mode, which has no memory.
    pub fn reservation(&self) -> Result<StableSpan<'_>, MemError> {
        let (Some(base), Some(placement)) = (self.inner.base, self.inner.placement) else {
            return Err(slots_have_no_memory());
        };
        let blocks = self.core().max_blocks as usize;
        Ok(StableSpan::new(
            MintKey::new(),
            base,
            blocks * self.inner.stride,
            placement,
        ))
    }

    /// Refuses a ref from another pool.
    pub fn check_owner(&self, block: &SharedBlockRef) -> Result<(), MemError> {
        let theirs = block.pool.id();
        if theirs != self.id() {
            return Err(foreign(theirs, self.id()));
        }
        Ok(())
    }

    /// The live refs on block `id` (0 when free).
    pub fn refcount(&self, id: BlockId) -> u32 {
        self.core().refcount(id)
    }

    /// The counters.
    pub fn stats(&self) -> PoolStats {
        self.core().stats()
    }

    /// The process-unique id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Bytes per block (0 in slots mode).
    pub fn block_bytes(&self) -> usize {
        self.inner.stride
    }

    /// Where the memory lives; `None` in slots mode.
    pub fn placement(&self) -> Option<Placement> {
        self.inner.placement
    }

    /// Walks the pool and checks V4 and the refcount sum.
    pub fn check_invariants(&self) -> Result<(), MemError> {
        self.core().check_invariants()
    }

    /// Puts an idle pool to sleep at `level` (the KV pool's bytes are
    /// dropped at either level): its region is decommitted whole, its
    /// reservation and free lists kept, and every allocation is refused
    /// with [`MemError::Asleep`] until [`SharedBlockPool::wake`]. Refused
    /// while a block is live, and on a fixed region
    /// ([`MemError::BackendUnavailable`]). Returns the bytes given back.
    pub fn sleep(&self, level: u8) -> Result<u64, MemError> {
        self.core().sleep(level)
    }

    /// Recommits the region at the same base; a no-op when awake.
    pub fn wake(&self) -> Result<(), MemError> {
        self.core().wake()
    }

    /// What a sleeping pool had committed (0 when awake).
    pub fn sleeping_committed(&self) -> usize {
        self.core().sleep.map_or(0, |(_, committed)| committed)
    }

    /// Handles to this pool alive now (this one included): the system's,
    /// and any a KV manager or a caller holds.
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// One engine step of the shrink policy; call it once per step with a
    /// fence recorded after the step's work was enqueued
    /// ([`NothingInFlight`](crate::decommit::NothingInFlight) when none can
    /// touch the pool). It decommits a withdrawn tail whose earlier fence
    /// has completed, then feeds the hysteresis
    /// ([`DecommitTracker`]): after `min_idle_steps` steps with more than
    /// `keep_chunks` spare chunks above the highest live block, the free
    /// tail is withdrawn (no longer handed out) and decommitted once
    /// `fence` completes. An allocation that needs the withdrawn blocks
    /// first cancels the decommit and takes them back, with no driver call.
    /// Returns the bytes decommitted during this call. O(1) on most steps;
    /// O(withdrawn blocks + one chunk) on the step that withdraws. A fixed pool or a
    /// slots pool never shrinks (the fence is dropped).
    pub fn step<F: FenceLike + Send + 'static>(&self, fence: F) -> Result<u64, MemError> {
        self.core().step(PoolFence(Box::new(fence)))
    }

    /// Withdraws the whole free tail above the highest live block now
    /// (never below the blocks the pool opened with), bypassing the
    /// hysteresis, and decommits it once `fence` completes (at once when it
    /// already has). Returns the bytes decommitted during this call.
    pub fn shrink_now<F: FenceLike + Send + 'static>(&self, fence: F) -> Result<u64, MemError> {
        self.core().shrink_now(PoolFence(Box::new(fence)))
    }

    /// Waits for a pending decommit's fence (blocking) and decommits; the
    /// bytes returned.
    pub fn flush_decommit(&self) -> Result<u64, MemError> {
        self.core().flush_decommit()
    }

    /// Replaces the shrink policy (and restarts its idle count).
    pub fn set_decommit_policy(&self, policy: DecommitPolicy) {
        self.core().set_policy(policy);
    }

    /// The shrink policy.
    pub fn decommit_policy(&self) -> DecommitPolicy {
        self.core().tracker.policy()
    }

    fn span_of(&self, id: BlockId) -> Result<StableSpan<'_>, MemError> {
        let (Some(base), Some(placement)) = (self.inner.base, self.inner.placement) else {
            return Err(slots_have_no_memory());
        };
        let stride = self.inner.stride;
        Ok(StableSpan::new(
            MintKey::new(),
            base + id as usize * stride,
            stride,
            placement,
        ))
    }
}

/// One reference to a live block of a [`SharedBlockPool`]. Move-only, not
/// `Clone`; holds the pool alive; dropping it decrements exactly once.
#[derive(Debug)]
#[must_use = "dropping a SharedBlockRef releases the block"]
pub struct SharedBlockRef {
    pool: SharedBlockPool,
    id: BlockId,
}

impl SharedBlockRef {
    /// The block's id.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// Another ref to the same block.
    pub fn share(&self) -> Result<SharedBlockRef, MemError> {
        self.pool.core().share(self.id)?;
        Ok(SharedBlockRef {
            pool: self.pool.clone(),
            id: self.id,
        })
    }

    /// The block's bytes, valid while this ref is alive.
    pub fn span(&self) -> Result<StableSpan<'_>, MemError> {
        self.pool.span_of(self.id)
    }

    /// The live refs on this block.
    pub fn refcount(&self) -> u32 {
        self.pool.refcount(self.id)
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &SharedBlockPool {
        &self.pool
    }
}

/// The id of a [`SharedBlockRef`] that [`SharedBlockPool::release_all`]
/// already released (never a block id: ids are below [`MAX_BLOCKS`]).
const RELEASED: BlockId = u32::MAX;

impl Drop for SharedBlockRef {
    fn drop(&mut self) {
        if self.id != RELEASED {
            let _ = self.pool.core().release(self.id);
        }
    }
}

/// A batch of refs, one per block, from [`SharedBlockPool::allocate_many`]:
/// one object and one lock for the whole batch. Dropping it releases every
/// ref exactly once.
#[derive(Debug)]
#[must_use = "dropping a SharedBlockRefs releases its blocks"]
pub struct SharedBlockRefs {
    pool: SharedBlockPool,
    ids: Ids,
}

/// Block ids of a batch, inline up to [`Ids::INLINE`]: the common batch of
/// 16 costs no heap allocation.
#[derive(Debug, Clone, Default)]
struct Ids {
    len: usize,
    inline: [BlockId; Ids::INLINE],
    heap: Vec<BlockId>,
}

impl Ids {
    const INLINE: usize = 16;

    /// Room for `n` ids, reserved fallibly (`n` is a caller's count).
    fn try_with_capacity(n: usize) -> Result<Self, MemError> {
        let mut heap = Vec::new();
        if n > Self::INLINE {
            try_reserve(&mut heap, n, &format!("a batch of {n} block ids"))?;
        }
        Ok(Self {
            len: 0,
            inline: [0; Self::INLINE],
            heap,
        })
    }

    fn push(&mut self, id: BlockId) {
        if self.heap.capacity() == 0 && self.len < Self::INLINE {
            self.inline[self.len] = id;
        } else {
            if self.heap.is_empty() {
                self.heap.extend_from_slice(&self.inline[..self.len]);
            }
            self.heap.push(id);
        }
        self.len += 1;
    }
}

impl std::ops::Deref for Ids {
    type Target = [BlockId];

    fn deref(&self) -> &[BlockId] {
        if self.heap.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.heap
        }
    }
}

impl SharedBlockRefs {
    /// The block ids, in allocation order.
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    /// Blocks in the batch.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Another ref to every block (all or nothing).
    pub fn share(&self) -> Result<SharedBlockRefs, MemError> {
        let mut core = self.pool.core();
        for (done, &id) in self.ids.iter().enumerate() {
            if let Err(e) = core.share(id) {
                for &undo in &self.ids[..done] {
                    let _ = core.release(undo);
                }
                return Err(e);
            }
        }
        Ok(SharedBlockRefs {
            pool: self.pool.clone(),
            ids: self.ids.clone(),
        })
    }

    /// One more ref to the `i`-th block, as a handle of its own.
    pub fn share_at(&self, i: usize) -> Result<SharedBlockRef, MemError> {
        let id = self.id_at(i)?;
        self.pool.core().share(id)?;
        Ok(SharedBlockRef {
            pool: self.pool.clone(),
            id,
        })
    }

    fn id_at(&self, i: usize) -> Result<BlockId, MemError> {
        self.ids.get(i).copied().ok_or_else(|| {
            MemError::invalid(format!(
                "index {i} is outside a batch of {} blocks",
                self.ids.len()
            ))
        })
    }

    /// Splits the batch into one ref per block (no count changes).
    pub fn into_refs(mut self) -> Vec<SharedBlockRef> {
        let ids = std::mem::take(&mut self.ids);
        ids.iter()
            .map(|&id| SharedBlockRef {
                pool: self.pool.clone(),
                id,
            })
            .collect()
    }

    /// The bytes of the `i`-th block, valid while the batch is alive.
    pub fn span(&self, i: usize) -> Result<StableSpan<'_>, MemError> {
        self.pool.span_of(self.id_at(i)?)
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &SharedBlockPool {
        &self.pool
    }
}

impl Drop for SharedBlockRefs {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut core = self.pool.core();
        for &id in self.ids.iter() {
            let _ = core.release(id);
        }
    }
}

/// One reference to a live block of a [`SharedBlockPool`] that does not hold
/// the pool: the KV manager's ref (seed A5.1's `BlockRef`, minus the `Arc`).
///
/// A [`SharedBlockRef`] pays an atomic increment and decrement of its pool's
/// `Arc` per ref, which was half of a KV request's cost (K16). The manager
/// owns its pools' handles for as long as it holds any token, so its tokens
/// need not keep the pool alive. What a token keeps from a ref is the
/// discipline: it is move-only (no `Clone`), minted only by the pool, and
/// consumed only by
/// [`SharedBlockPool::release_tokens`], which decrements exactly once per
/// token. What it gives up is release-on-drop: dropping a token would leak
/// its ref, so in debug builds (every Rust test) a token dropped without
/// being released panics, and the manager's `check_invariants` counts the
/// pool's refs against the tokens it holds in every build.
#[derive(Debug)]
#[must_use = "a BlockToken must be released into its pool, or its block leaks"]
pub(crate) struct BlockToken {
    id: BlockId,
    /// The low bits of the minting pool's id, checked on release.
    pool: u32,
}

impl BlockToken {
    /// The block's id.
    pub(crate) fn id(&self) -> BlockId {
        self.id
    }

    /// The low bits of the minting pool's id.
    pub(crate) fn pool_tag(&self) -> u32 {
        self.pool
    }

    /// Consumes the token without touching the pool (its ref was released
    /// or handed over by the caller).
    fn consume(self) {
        std::mem::forget(self);
    }
}

impl Drop for BlockToken {
    fn drop(&mut self) {
        // Only reached for a token nobody released: a leaked ref.
        if cfg!(debug_assertions) && !std::thread::panicking() {
            panic!(
                "a BlockToken of block {} (pool tag {}) was dropped without being released",
                self.id, self.pool
            );
        }
    }
}

impl SharedBlockPool {
    /// The low bits of the id, which this pool's tokens carry.
    pub(crate) fn tag(&self) -> u32 {
        self.inner.id as u32
    }

    fn token(&self, id: BlockId) -> BlockToken {
        BlockToken {
            id,
            pool: self.tag(),
        }
    }

    fn check_tag(&self, token: &BlockToken) -> Result<(), MemError> {
        if token.pool != self.tag() {
            return Err(MemError::Invariant(format!(
                "a block token of pool tag {} was handed to pool #{}",
                token.pool,
                self.id()
            )));
        }
        Ok(())
    }

    /// `n` blocks, one token each, handed to `push` in allocation order, or
    /// none (the pool is unchanged on failure). One lock.
    pub(crate) fn allocate_tokens(
        &self,
        n: u32,
        mut push: impl FnMut(BlockToken),
    ) -> Result<(), MemError> {
        self.core().allocate_many(n, |id| push(self.token(id)))
    }

    /// Releases every token, exactly once each, under one lock. A token of
    /// another pool is consumed without a release and reported (its ref
    /// leaks: the manager never mixes its pools, so this is a bug report).
    pub(crate) fn release_tokens(
        &self,
        tokens: impl IntoIterator<Item = BlockToken>,
    ) -> Result<(), MemError> {
        let mut tokens = tokens.into_iter().peekable();
        if tokens.peek().is_none() {
            return Ok(());
        }
        let mut core = self.core();
        let mut first_err = None;
        for t in tokens {
            let outcome = self.check_tag(&t).and_then(|()| core.release(t.id));
            t.consume();
            if let Err(e) = outcome {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Turns a ref of this pool into a token, keeping its count.
    pub(crate) fn token_from_ref(&self, mut block: SharedBlockRef) -> Result<BlockToken, MemError> {
        self.check_owner(&block)?;
        let id = block.id;
        // Handed over: its drop only lets go of the pool.
        block.id = RELEASED;
        Ok(self.token(id))
    }

    /// A ref (with its own count) to the block of `token`, for code that
    /// takes refs ([`BlockIo`](crate::kv::BlockIo)); off the hot paths.
    pub(crate) fn ref_of_token(&self, token: &BlockToken) -> Result<SharedBlockRef, MemError> {
        self.check_tag(token)?;
        self.core().share(token.id)?;
        Ok(SharedBlockRef {
            pool: self.clone(),
            id: token.id,
        })
    }

    /// The bytes of the block of `token`.
    pub(crate) fn token_span(&self, token: &BlockToken) -> Result<StableSpan<'_>, MemError> {
        self.check_tag(token)?;
        self.span_of(token.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeBackend, FakeConfig};

    fn fake() -> FakeBackend {
        FakeBackend::new(FakeConfig::default()).unwrap()
    }

    #[test]
    fn allocate_share_release_balance() {
        let fb = fake();
        let pool = BlockPool::new(&fb, &PoolConfig::fixed(256, 4)).unwrap();
        let a = pool.allocate().unwrap();
        let b = a.share().unwrap();
        assert_eq!((a.id(), a.refcount()), (0, 2));
        let s = pool.stats();
        assert_eq!((s.free, s.live, s.refs), (3, 1, 2));
        drop(a);
        assert_eq!(pool.refcount(0), 1);
        drop(b);
        assert_eq!(pool.refcount(0), 0);
        assert_eq!(pool.stats().free, 4);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn blocks_sit_at_base_plus_id_times_stride_and_are_poisoned_on_release() {
        let fb = fake();
        let pool = BlockPool::new(&fb, &PoolConfig::fixed(96, 8)).unwrap();
        let refs = pool.allocate_many(3).unwrap();
        let base = refs[0].span().unwrap().addr();
        for r in &refs {
            let span = r.span().unwrap();
            assert_eq!(span.addr(), base + r.id() as usize * 96);
            assert_eq!(span.len(), 96);
        }
        let addr = refs[1].span().unwrap().addr();
        fb.write(addr, &[1u8; 96]).unwrap();
        drop(refs);
        assert!(fb.is_poisoned(addr, 96).unwrap());
    }

    #[test]
    fn allocate_many_is_all_or_nothing() {
        let pool = BlockPool::slots(5).unwrap();
        let held = pool.allocate_many(3).unwrap();
        let err = pool.allocate_many(3).unwrap_err();
        assert!(matches!(err, MemError::Capacity(_)), "{err}");
        assert_eq!(pool.stats().free, 2);
        drop(held);
        assert_eq!(pool.allocate_many(5).unwrap().len(), 5);
    }

    #[test]
    fn slots_mode_has_ids_but_no_memory() {
        let pool = BlockPool::slots(2).unwrap();
        let r = pool.allocate().unwrap();
        assert!(matches!(r.span(), Err(MemError::InvalidArgument(_))));
    }

    #[test]
    fn a_ref_is_refused_by_another_pool_and_still_released_once() {
        let one = BlockPool::slots(2).unwrap();
        let two = BlockPool::slots(2).unwrap();
        let r = one.allocate().unwrap();
        assert!(matches!(two.release(r), Err(MemError::InvalidArgument(_))));
        assert_eq!(one.stats().free, 2);
        assert_eq!(two.stats().free, 2);

        let one = SharedBlockPool::slots(2).unwrap();
        let two = SharedBlockPool::slots(2).unwrap();
        let r = one.allocate().unwrap();
        assert!(two.check_owner(&r).is_err());
        assert!(matches!(two.release(r), Err(MemError::InvalidArgument(_))));
        assert_eq!((one.stats().free, two.stats().free), (2, 2));
    }

    #[test]
    fn batched_release_and_share_keep_the_counts_of_one_by_one() {
        let pool = SharedBlockPool::slots(8).unwrap();
        let mut refs = pool.allocate_many(4).unwrap().into_refs();
        let borrowed: Vec<&SharedBlockRef> = refs.iter().take(3).collect();
        let mut shared = pool.share_all(&borrowed).unwrap();
        assert_eq!(shared.len(), 3);
        assert_eq!(pool.stats().refs, 7);
        assert_eq!(refs[0].refcount(), 2);
        // Each ref releases exactly once: the shares first, then the rest.
        pool.release_all(&mut shared).unwrap();
        assert!(shared.is_empty());
        let s = pool.stats();
        assert_eq!((s.refs, s.live, s.free), (4, 4, 4));
        pool.release_all(&mut refs).unwrap();
        let s = pool.stats();
        assert_eq!((s.refs, s.live, s.free), (0, 0, 8));
        pool.check_invariants().unwrap();
        assert_eq!(pool.room(), (8, 0));

        // A foreign ref is refused by both, and still released into its own
        // pool exactly once.
        let other = SharedBlockPool::slots(2).unwrap();
        let theirs = other.allocate().unwrap();
        assert!(pool.share_all(&[&theirs]).is_err());
        assert_eq!(theirs.refcount(), 1);
        let ours = pool.allocate().unwrap();
        let mut mixed = vec![ours, theirs];
        assert!(matches!(
            pool.release_all(&mut mixed),
            Err(MemError::InvalidArgument(_))
        ));
        assert_eq!((pool.stats().live, other.stats().live), (0, 0));
        pool.check_invariants().unwrap();
        other.check_invariants().unwrap();
    }

    #[test]
    fn a_failed_batched_share_shares_nothing() {
        let pool = SharedBlockPool::slots(4).unwrap();
        let a = pool.allocate().unwrap();
        // The last share of a full count fails; the earlier ones are undone.
        let b = pool.allocate().unwrap();
        {
            let mut core = pool.core();
            if let Some(Entry::Occupied { refs }) = core.entries.get_mut(b.id() as usize) {
                *refs = u32::MAX;
            }
        }
        assert!(pool.share_all(&[&a, &b]).is_err());
        assert_eq!(a.refcount(), 1);
        {
            let mut core = pool.core();
            if let Some(Entry::Occupied { refs }) = core.entries.get_mut(b.id() as usize) {
                *refs = 1;
            }
        }
        drop((a, b));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn growable_pool_grows_in_chunks_without_moving() {
        let fb = FakeBackend::new(FakeConfig {
            granularity: 1024,
            ..FakeConfig::default()
        })
        .unwrap();
        let pool = BlockPool::new(&fb, &PoolConfig::growable(512, 2, 64, 8)).unwrap();
        let first = pool.allocate().unwrap();
        let addr = first.span().unwrap().addr();
        let more = pool.allocate_many(20).unwrap();
        assert_eq!(first.span().unwrap().addr(), addr);
        let s = pool.stats();
        assert!(s.capacity >= 21 && s.capacity <= 64, "{s:?}");
        assert!(s.growths >= 1);
        assert_eq!(s.free + s.live, s.capacity);
        assert!(pool.allocate_many(64).is_err());
        drop(more);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn failed_growth_leaves_the_pool_unchanged() {
        let fb = fake();
        let pool = BlockPool::new(&fb, &PoolConfig::growable(4096, 1, 16, 4)).unwrap();
        let held = pool.allocate().unwrap();
        fb.fail_commits(1);
        let before = pool.stats();
        assert!(matches!(pool.allocate(), Err(MemError::OutOfMemory(_))));
        assert_eq!(pool.stats(), before);
        assert!(pool.allocate().is_ok());
        drop(held);
    }

    #[test]
    fn shared_batches_release_once_and_split() {
        let pool = SharedBlockPool::slots(16).unwrap();
        let batch = pool.allocate_many(4).unwrap();
        let shared = batch.share().unwrap();
        assert_eq!(pool.stats().refs, 8);
        drop(batch);
        assert_eq!(pool.stats().live, 4);
        let refs = shared.into_refs();
        assert_eq!(refs.len(), 4);
        assert_eq!(pool.stats().refs, 4);
        drop(refs);
        assert_eq!(pool.stats().free, 16);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn batches_past_the_inline_size_keep_every_id() {
        let pool = SharedBlockPool::slots(64).unwrap();
        for n in [0u32, 1, 16, 17, 40] {
            let batch = pool.allocate_many(n).unwrap();
            let mut sorted = batch.ids().to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            let twin = batch.share().unwrap();
            assert_eq!(twin.ids(), batch.ids());
            let refs = batch.into_refs();
            assert_eq!(
                refs.iter().map(SharedBlockRef::id).collect::<Vec<_>>(),
                twin.ids()
            );
            assert_eq!(pool.stats().refs, 2 * n as u64);
            drop((refs, twin));
            assert_eq!(pool.stats().free, 64);
        }
    }

    // ------------------------------------------------------------ shrink

    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::decommit::NothingInFlight;

    /// A stand-in fence: complete when its flag is set.
    #[derive(Clone)]
    struct Flag(Arc<AtomicBool>);

    impl Flag {
        fn new() -> Self {
            Self(Arc::new(AtomicBool::new(false)))
        }
        fn complete(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl FenceLike for Flag {
        fn is_complete(&self) -> Result<bool, MemError> {
            Ok(self.0.load(Ordering::SeqCst))
        }
        fn wait(&self) -> Result<(), MemError> {
            self.complete();
            Ok(())
        }
    }

    /// 256-byte blocks over 1 KiB granules: 4 blocks a granule, chunks of
    /// 8 blocks (the growth step), 8 blocks to start, 64 at most.
    fn growable(fb: &FakeBackend, idle: u32, keep: usize) -> SharedBlockPool {
        let pool = SharedBlockPool::new(fb, &PoolConfig::growable(256, 8, 64, 8)).unwrap();
        pool.set_decommit_policy(DecommitPolicy {
            min_idle_steps: idle,
            keep_chunks: keep,
        });
        pool
    }

    fn granular() -> FakeBackend {
        FakeBackend::new(FakeConfig {
            granularity: 1024,
            ..FakeConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn fastdiv_matches_division() {
        for cb in [2u32, 3, 7, 8, 48, 100, 1000, 65_537, u32::MAX / 3] {
            let lists = FreeLists::try_new(cb, cb).unwrap();
            for id in [
                0u32,
                1,
                cb - 1,
                cb,
                cb + 1,
                12_345_678,
                MAX_BLOCKS - 1,
                u32::MAX,
            ] {
                assert_eq!(lists.chunk_of(id), (id / cb) as usize, "{id} / {cb}");
            }
        }
    }

    #[test]
    fn allocation_prefers_the_lowest_chunk() {
        let fb = granular();
        let pool = growable(&fb, 1, 0);
        let all = pool.allocate_many(32).unwrap();
        assert_eq!(pool.stats().capacity, 32);
        let mut refs = all.into_refs();
        // Free one block in each of chunks 3, 1 and 2, in that order.
        for id in [25u32, 9, 17] {
            let at = refs.iter().position(|r| r.id() == id).unwrap();
            drop(refs.swap_remove(at));
        }
        // LIFO would give 17 first; the lowest chunk wins.
        let order: Vec<u32> = (0..3)
            .map(|_| pool.allocate().unwrap())
            .map(|r| {
                let id = r.id();
                refs.push(r);
                id
            })
            .collect();
        assert_eq!(order, vec![9, 17, 25]);
        drop(refs);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn no_shrink_before_the_idle_window_then_down_to_the_floor() {
        let fb = granular();
        let pool = growable(&fb, 5, 0);
        let burst = pool.allocate_many(40).unwrap();
        let s = pool.stats();
        assert_eq!((s.capacity, s.min_blocks, s.chunk_blocks), (40, 8, 8));
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
        drop(burst);
        for i in 0..4 {
            assert_eq!(pool.step(NothingInFlight).unwrap(), 0, "idle step {i}");
            assert_eq!(pool.stats().capacity, 40);
        }
        assert_eq!(pool.step(NothingInFlight).unwrap(), 32 * 256);
        let s = pool.stats();
        assert_eq!((s.capacity, s.free, s.shrinks), (8, 8, 1));
        assert_eq!(
            (s.decommitted_bytes, s.committed_bytes),
            (32 * 256, 8 * 256)
        );
        assert_eq!(fb.stats().total.committed, 8 * 256);
        // Never below the floor, however long it idles.
        for _ in 0..20 {
            assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
        }
        assert_eq!(pool.stats().capacity, 8);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn shrinks_to_the_peak_of_the_window_plus_the_spare_chunks() {
        let fb = granular();
        let pool = growable(&fb, 4, 1);
        let mut held = pool.allocate_many(48).unwrap().into_refs();
        pool.step(NothingInFlight).unwrap();
        // Keep blocks 0..20 live: chunks 0, 1, 2 (needs 3 chunks).
        held.retain(|r| r.id() < 20);
        for _ in 0..3 {
            assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
        }
        // 3 needed + 1 spare = 4 chunks = 32 blocks.
        assert_eq!(pool.step(NothingInFlight).unwrap(), 16 * 256);
        assert_eq!(pool.stats().capacity, 32);
        drop(held);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn flapping_load_does_not_thrash() {
        let fb = granular();
        let pool = growable(&fb, 16, 1);
        let mut decommitted = 0;
        for round in 0..50 {
            let burst = pool.allocate_many(48).unwrap();
            for _ in 0..3 {
                decommitted += pool.step(NothingInFlight).unwrap();
            }
            drop(burst);
            // Quiet for fewer steps than the window: never enough to shrink.
            for _ in 0..(round % 15) {
                decommitted += pool.step(NothingInFlight).unwrap();
            }
        }
        let s = pool.stats();
        assert_eq!((decommitted, s.shrinks), (0, 0));
        assert_eq!(s.growths, 1, "grew once and kept it: {s:?}");
        pool.check_invariants().unwrap();
    }

    #[test]
    fn the_decommit_waits_for_the_fence_and_its_blocks_are_withheld() {
        let fb = granular();
        let pool = growable(&fb, 1, 0);
        drop(pool.allocate_many(40).unwrap());
        pool.step(NothingInFlight).unwrap();
        let fence = Flag::new();
        assert_eq!(pool.step(fence.clone()).unwrap(), 0);
        let s = pool.stats();
        assert_eq!((s.capacity, s.pending_blocks, s.free), (8, 32, 8));
        assert_eq!(
            s.committed_bytes,
            40 * 256,
            "nothing decommitted before the fence"
        );
        // While pending, the withdrawn blocks are not handed out.
        let low = pool.allocate_many(8).unwrap();
        assert!(low.ids().iter().all(|&id| id < 8));
        drop(low);
        for _ in 0..5 {
            assert_eq!(pool.step(NothingInFlight).unwrap(), 0, "fence still open");
        }
        assert_eq!(pool.stats().committed_bytes, 40 * 256);
        fence.complete();
        assert_eq!(pool.step(NothingInFlight).unwrap(), 32 * 256);
        let s = pool.stats();
        assert_eq!((s.capacity, s.pending_blocks, s.shrinks), (8, 0, 1));
        assert_eq!(s.committed_bytes, 8 * 256);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn demand_while_pending_cancels_and_reuses_the_withdrawn_blocks() {
        let fb = granular();
        let pool = growable(&fb, 1, 0);
        let base = {
            let r = pool.allocate().unwrap();
            r.span().unwrap().addr()
        };
        drop(pool.allocate_many(40).unwrap());
        let fence = Flag::new();
        pool.shrink_now(fence.clone()).unwrap();
        assert_eq!(pool.stats().pending_blocks, 32);
        let commits = fb.stats().total.committed;
        let big = pool.allocate_many(20).unwrap();
        let s = pool.stats();
        assert_eq!((s.capacity, s.cancelled_shrinks, s.growths), (40, 1, 1));
        assert_eq!(
            fb.stats().total.committed,
            commits,
            "no driver call to take them back"
        );
        fence.complete();
        assert_eq!(
            pool.step(NothingInFlight).unwrap(),
            0,
            "the decommit was cancelled"
        );
        assert_eq!(pool.stats().committed_bytes, 40 * 256);
        // Same base, same addresses after grow -> shrink -> grow.
        let refs = big.into_refs();
        for r in &refs {
            assert_eq!(r.span().unwrap().addr(), base + r.id() as usize * 256);
        }
        drop(refs);
        assert_eq!(pool.shrink_now(NothingInFlight).unwrap(), 32 * 256);
        let again = pool.allocate_many(30).unwrap();
        assert_eq!(pool.stats().growths, 2);
        for i in 0..again.len() {
            let span = again.span(i).unwrap();
            assert_eq!(span.addr(), base + again.ids()[i] as usize * 256);
        }
        drop(again);
        // The reservation's span starts at the base and spans max_blocks,
        // across grow -> shrink -> grow.
        let whole = pool.reservation().unwrap();
        assert_eq!(whole.addr(), base);
        assert_eq!(whole.len(), pool.stats().max_blocks as usize * 256);
        assert!(SharedBlockPool::slots(4).unwrap().reservation().is_err());
        pool.check_invariants().unwrap();
    }

    #[test]
    fn a_live_block_in_the_tail_pins_it_and_its_bytes_survive() {
        let fb = granular();
        let pool = growable(&fb, 1, 0);
        let mut refs = pool.allocate_many(40).unwrap().into_refs();
        // Keep block 30 (chunk 3) live, and a share of 5 (as a DLPack export
        // would hold).
        refs.retain(|r| r.id() == 30 || r.id() == 5);
        let export = refs[0].share().unwrap();
        for r in &refs {
            fb.write(r.span().unwrap().addr(), &[0x5A; 256]).unwrap();
        }
        assert_eq!(
            pool.shrink_now(NothingInFlight).unwrap(),
            8 * 256,
            "only chunk 4 goes"
        );
        assert_eq!(pool.stats().capacity, 32);
        for r in &refs {
            assert_eq!(
                fb.read(r.span().unwrap().addr(), 256).unwrap(),
                vec![0x5A; 256]
            );
        }
        drop(refs);
        assert_eq!(pool.shrink_now(NothingInFlight).unwrap(), 24 * 256);
        assert_eq!(export.refcount(), 1);
        assert_eq!(
            fb.read(export.span().unwrap().addr(), 256).unwrap(),
            vec![0x5A; 256]
        );
        drop(export);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn flush_waits_for_the_fence_and_a_failed_decommit_retries() {
        let fb = granular();
        let pool = growable(&fb, 1, 0);
        drop(pool.allocate_many(40).unwrap());
        let fence = Flag::new();
        pool.shrink_now(fence.clone()).unwrap();
        fb.fail_decommits(1);
        assert!(pool.flush_decommit().is_err());
        assert_eq!(
            pool.stats().pending_blocks,
            32,
            "still pending after the failure"
        );
        pool.check_invariants().unwrap();
        assert_eq!(pool.step(NothingInFlight).unwrap(), 32 * 256);
        assert_eq!(pool.flush_decommit().unwrap(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn fixed_and_slots_pools_never_shrink() {
        let fb = granular();
        let fixed = SharedBlockPool::new(&fb, &PoolConfig::fixed(256, 16)).unwrap();
        let slots = SharedBlockPool::slots(16).unwrap();
        for pool in [&fixed, &slots] {
            pool.set_decommit_policy(DecommitPolicy {
                min_idle_steps: 1,
                keep_chunks: 0,
            });
            for _ in 0..4 {
                assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
            }
            assert_eq!(pool.shrink_now(NothingInFlight).unwrap(), 0);
            assert_eq!(pool.stats().capacity, 16);
        }
    }

    #[test]
    fn the_borrowed_pool_shrinks_too() {
        let fb = granular();
        let pool = BlockPool::new(&fb, &PoolConfig::growable(256, 8, 64, 8)).unwrap();
        pool.set_decommit_policy(DecommitPolicy {
            min_idle_steps: 2,
            keep_chunks: 0,
        })
        .unwrap();
        drop(pool.allocate_many(40).unwrap());
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
        assert_eq!(pool.step(NothingInFlight).unwrap(), 0);
        let fence = Flag::new();
        assert_eq!(pool.step(fence.clone()).unwrap(), 0);
        assert_eq!(pool.stats().pending_blocks, 32);
        assert_eq!(pool.flush_decommit().unwrap(), 32 * 256);
        assert_eq!(pool.decommit_policy().min_idle_steps, 2);
        pool.check_invariants().unwrap();
    }

    /// The measurement behind lowest-chunk-first: a churn workload (ramp to
    /// 900 live blocks, then 3000 steps of random frees and allocations
    /// around a load that wanders between 100 and 500) on the real pool, and
    /// the same decisions on a plain LIFO free list. Counted per step: the
    /// chunks above the highest live block (what a shrink could return).
    /// `cargo test -p imp-mem-core churn -- --nocapture` prints the figures.
    #[test]
    fn churn_lets_the_tail_drain() {
        struct Rng(u64);
        impl Rng {
            fn next(&mut self) -> u64 {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                self.0
            }
            fn below(&mut self, n: usize) -> usize {
                (self.next() % n.max(1) as u64) as usize
            }
        }
        const CB: u32 = 64;
        let fb = FakeBackend::new(FakeConfig {
            granularity: 64 * 256,
            ..FakeConfig::default()
        })
        .unwrap();
        let pool = SharedBlockPool::new(&fb, &PoolConfig::growable(256, 64, 1024, CB)).unwrap();
        let mut lifo: Vec<u32> = Vec::new();
        let mut lifo_cap = 0u32;
        let (mut live, mut live_lifo): (Vec<SharedBlockRef>, Vec<u32>) = (Vec::new(), Vec::new());
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut ours, mut theirs, mut ours_steps, mut theirs_steps) = (0u64, 0u64, 0u64, 0u64);
        let mut load = 900usize;
        for step in 0..3300 {
            if step >= 300 && step % 50 == 0 {
                load = 100 + rng.below(400);
            }
            // Free about 5 % of the live blocks (the same indices on both).
            for _ in 0..live.len() / 20 {
                let i = rng.below(live.len());
                drop(live.swap_remove(i));
                lifo.push(live_lifo.swap_remove(i));
            }
            while live.len() > load {
                let i = rng.below(live.len());
                drop(live.swap_remove(i));
                lifo.push(live_lifo.swap_remove(i));
            }
            while live.len() < load {
                live.push(pool.allocate().unwrap());
                if lifo.is_empty() {
                    lifo.extend((lifo_cap..lifo_cap + CB).rev());
                    lifo_cap += CB;
                }
                live_lifo.push(lifo.pop().unwrap());
            }
            if step >= 300 {
                let top = |ids: &mut dyn Iterator<Item = u32>| ids.max().map_or(0, |m| m / CB + 1);
                // Both grew to the ramp's 900 blocks: 15 chunks.
                let committed = pool.stats().capacity.div_ceil(CB);
                assert_eq!((committed, lifo_cap / CB), (15, 15));
                let a = committed - top(&mut live.iter().map(SharedBlockRef::id));
                let b = committed - top(&mut live_lifo.iter().copied());
                ours += a as u64;
                theirs += b as u64;
                ours_steps += (a > 0) as u64;
                theirs_steps += (b > 0) as u64;
            }
        }
        let steps = 3000.0;
        eprintln!(
            "churn: lowest-chunk-first frees {:.2} chunks/step on average ({:.0} % of steps \
             have a free tail chunk); LIFO {:.2} ({:.0} %)",
            ours as f64 / steps,
            100.0 * ours_steps as f64 / steps,
            theirs as f64 / steps,
            100.0 * theirs_steps as f64 / steps,
        );
        assert!(ours > 4 * theirs.max(1), "{ours} vs {theirs}");
        drop(live);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn bad_configs_say_what_to_change() {
        let fb = fake();
        for config in [
            PoolConfig::fixed(0, 4),
            PoolConfig::fixed(64, 0),
            PoolConfig::growable(64, 8, 4, 1),
            PoolConfig::growable(64, 2, 8, 0),
        ] {
            assert!(
                matches!(
                    BlockPool::new(&fb, &config),
                    Err(MemError::InvalidArgument(_))
                ),
                "{config:?}"
            );
        }
    }
}
