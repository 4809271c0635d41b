//! T3 — the refcounted block pool (seed A2, A3.3, A3.4, A5.1, D2, D10).
//!
//! Algorithm: a vector of entries, one per block id, each either
//! `Vacant { next }` (a link of the intrusive free list) or
//! `Occupied { refs }`. Allocation pops the free list's head and release
//! pushes onto it: both O(1), no search, no fragmentation (every block is the
//! same size). A block's bytes, when the pool has a region, are at
//! `base + id * stride`, with the stride a run-time value (D2: KV block bytes
//! are computed at init). Without a region the pool is an id space only
//! ("slots mode", D10): a KV cache that lays out its own memory per layer
//! still gets its free list and refcounts from here.
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
//! Two façades over one [`PoolCore`]: [`BlockPool`] (borrowed: a
//! `BlockRef<'p>` cannot outlive its pool; single-threaded) and
//! [`SharedBlockPool`] (`Arc` + mutex, `Send + Sync`, handing out
//! [`SharedBlockRef`]s that keep the pool alive; what the Python binding
//! uses). Pool identity is a process-unique id checked wherever a ref is
//! passed back to a pool.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::arena::placement_of;
use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT};
use crate::error::MemError;
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
    /// Blocks that exist now (grows with the region).
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
}

/// The state and the rules of one pool, shared by both façades.
#[derive(Debug)]
pub struct PoolCore {
    id: u64,
    region: Option<Region>,
    placement: Option<Placement>,
    stride: usize,
    entries: Vec<Entry>,
    head: u32,
    free: u32,
    refs: u64,
    max_blocks: u32,
    grow_blocks: u32,
    high_water: u32,
    growths: u32,
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
        );
        core.extend(blocks);
        Ok(core)
    }

    fn slots(blocks: u32) -> Result<Self, MemError> {
        let config = PoolConfig::fixed(0, blocks);
        config.check(true)?;
        let mut core = Self::empty(&config, None, 0, None);
        core.extend(blocks);
        Ok(core)
    }

    fn empty(
        config: &PoolConfig,
        placement: Option<Placement>,
        stride: usize,
        region: Option<Region>,
    ) -> Self {
        Self {
            id: next_tier_id(),
            region,
            placement,
            stride,
            entries: Vec::new(),
            head: NIL,
            free: 0,
            refs: 0,
            max_blocks: config.max_blocks,
            grow_blocks: config.grow_blocks,
            high_water: 0,
            growths: 0,
        }
    }

    /// Appends ids `[len, new_len)` to the front of the free list, in
    /// ascending order.
    fn extend(&mut self, new_len: u32) {
        let old_len = self.entries.len() as u32;
        if new_len <= old_len {
            return;
        }
        let old_head = self.head;
        self.entries.reserve((new_len - old_len) as usize);
        for id in old_len..new_len {
            let next = if id + 1 == new_len { old_head } else { id + 1 };
            self.entries.push(Entry::Vacant { next });
        }
        self.head = old_len;
        self.free += new_len - old_len;
    }

    fn capacity(&self) -> u32 {
        self.entries.len() as u32
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

    /// Makes at least `need` blocks free, growing if it must. All or nothing.
    fn ensure_free(&mut self, need: u32) -> Result<(), MemError> {
        if need <= self.free {
            return Ok(());
        }
        let short = need - self.free;
        let room = self.max_blocks - self.capacity();
        let growable = self.region.as_ref().is_some_and(Region::is_growable);
        if !growable || short > room {
            return Err(self.exhausted(need));
        }
        let target = self.capacity() + short.max(self.grow_blocks).min(room);
        let stride = self.stride;
        let Some(region) = self.region.as_mut() else {
            return Err(self.exhausted(need));
        };
        region.commit(target as u64 * stride as u64)?;
        let fits = ((region.len() / stride) as u64).min(self.max_blocks as u64) as u32;
        self.extend(fits.max(target));
        self.growths += 1;
        Ok(())
    }

    /// Pops one block; the caller has made sure one is free.
    fn pop(&mut self) -> Result<BlockId, MemError> {
        let id = self.head;
        match self.entries.get(id as usize).copied() {
            Some(Entry::Vacant { next }) => {
                self.entries[id as usize] = Entry::Occupied { refs: 1 };
                self.head = next;
                self.free -= 1;
                self.refs += 1;
                Ok(id)
            }
            _ => Err(MemError::Invariant(format!(
                "pool #{}: free-list head {id} is not vacant",
                self.id
            ))),
        }
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
        for _ in 0..n {
            push(self.pop()?);
        }
        self.note_high_water();
        Ok(())
    }

    fn share(&mut self, id: BlockId) -> Result<(), MemError> {
        match self.entries.get_mut(id as usize) {
            Some(Entry::Occupied { refs }) => {
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
    fn release(&mut self, id: BlockId) -> Result<(), MemError> {
        match self.entries.get_mut(id as usize) {
            Some(Entry::Occupied { refs }) if *refs > 1 => {
                *refs -= 1;
                self.refs -= 1;
                Ok(())
            }
            Some(entry @ Entry::Occupied { .. }) => {
                *entry = Entry::Vacant { next: self.head };
                self.head = id;
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
        }
    }

    /// Walks the whole pool and checks V4 and the refcount sum.
    fn check_invariants(&self) -> Result<(), MemError> {
        let broken = |what: String| Err(MemError::Invariant(format!("pool #{}: {what}", self.id)));
        let mut on_list = 0u32;
        let mut cursor = self.head;
        while cursor != NIL {
            if on_list > self.capacity() {
                return broken("the free list has a cycle".into());
            }
            match self.entries.get(cursor as usize) {
                Some(Entry::Vacant { next }) => cursor = *next,
                _ => return broken(format!("free-list link {cursor} is not a vacant entry")),
            }
            on_list += 1;
        }
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
        if on_list != self.free || vacant != self.free {
            return broken(format!(
                "{on_list} on the free list, {vacant} vacant, counter says {}",
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
        let mut refs = Vec::with_capacity(n as usize);
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
                core: Mutex::new(core),
            }),
        }
    }

    fn core(&self) -> MutexGuard<'_, PoolCore> {
        self.inner.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One block, with one ref.
    pub fn allocate(&self) -> Result<SharedBlockRef, MemError> {
        let id = self.core().allocate()?;
        Ok(SharedBlockRef {
            pool: self.clone(),
            id,
        })
    }

    /// `n` blocks as one batch, or none (the pool is unchanged on failure).
    pub fn allocate_many(&self, n: u32) -> Result<SharedBlockRefs, MemError> {
        let mut ids = Ids::with_capacity(n as usize);
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

impl Drop for SharedBlockRef {
    fn drop(&mut self) {
        let _ = self.pool.core().release(self.id);
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

    fn with_capacity(n: usize) -> Self {
        let heap = if n > Self::INLINE {
            Vec::with_capacity(n)
        } else {
            Vec::new()
        };
        Self {
            len: 0,
            inline: [0; Self::INLINE],
            heap,
        }
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
