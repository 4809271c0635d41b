//! [`PoolCore`]: the state and the rules of one pool, which both façades
//! borrow or lock: opening over a region or as slots, growth, allocation,
//! share and release, and the counters. Shrinking and sleep are in
//! `shrink.rs`; the walk of the free lists that the invariant check makes is in
//! `free_list.rs`.

use crate::arena::placement_of;
use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT};
use crate::decommit::{DecommitPolicy, DecommitTracker, DeferredDecommit};
use crate::error::{try_reserve, MemError};
use crate::source::Placement;
use crate::tier::{next_tier_id, Tier};
use crate::units::human_bytes;

use super::config::{PoolConfig, PoolStats};
use super::free_list::{Entry, FreeBlocks};
use super::shrink::PoolFence;
use super::BlockId;

/// The state and the rules of one pool, shared by both façades.
#[derive(Debug)]
pub struct PoolCore {
    pub(super) id: u64,
    pub(super) region: Option<Region>,
    pub(super) placement: Option<Placement>,
    pub(super) stride: usize,
    pub(super) entries: Vec<Entry>,
    pub(super) lists: FreeBlocks,
    pub(super) free: u32,
    refs: u64,
    pub(super) max_blocks: u32,
    grow_blocks: u32,
    pub(super) min_blocks: u32,
    high_water: u32,
    growths: u32,
    pub(super) tracker: DecommitTracker,
    pub(super) deferred: DeferredDecommit<PoolFence>,
    pub(super) shrinks: u32,
    cancelled_shrinks: u32,
    pub(super) decommitted_bytes: u64,
    /// While the pool sleeps: its level and the committed bytes to restore.
    pub(super) sleep: Option<(u8, usize)>,
}

impl PoolCore {
    pub(super) fn open(backend: &Backend, config: &PoolConfig) -> Result<Self, MemError> {
        config.check(false)?;
        let tag = config.tag.unwrap_or(Tier::Pooled.default_tag());
        let bytes = |n: u32| {
            (n as u64)
                .checked_mul(config.block_bytes as u64)
                .ok_or_else(|| {
                    MemError::invalid(format!("{n} blocks of {} B overflow", config.block_bytes))
                })
        };
        let region = if config.max_blocks > config.blocks || config.sleepable {
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

    pub(super) fn slots(blocks: u32) -> Result<Self, MemError> {
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

    pub(super) fn capacity(&self) -> u32 {
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
    pub(super) fn reclaim(&mut self) -> Result<(), MemError> {
        if self.deferred.pending_target().is_none() {
            return Ok(());
        }
        self.deferred.cancel();
        self.cancelled_shrinks += 1;
        let committed = self.committed_blocks();
        self.extend(committed)
    }

    /// Lowers the most blocks a growable pool may grow to: its reservation
    /// stays, and the blocks past the new maximum are never committed
    /// (admission no longer counts them as room). Refused while the pool
    /// sleeps, below the blocks committed now (withdrawn ones included) or
    /// above the current maximum.
    pub(super) fn limit_blocks(&mut self, max_blocks: u32) -> Result<(), MemError> {
        if let Some((level, _)) = self.sleep {
            return Err(self.asleep_error(level));
        }
        let committed = self.committed_blocks().max(self.capacity());
        if max_blocks < committed || max_blocks > self.max_blocks {
            return Err(MemError::invalid(format!(
                "block pool #{}: max_blocks={max_blocks} must lie between the {committed} blocks \
                 committed now and the pool's maximum of {}; decommit first or pass a value in \
                 that range",
                self.id, self.max_blocks
            )));
        }
        self.max_blocks = max_blocks;
        Ok(())
    }

    /// [`Self::ensure_free`], for `SharedBlockPool::reserve_free`.
    pub(super) fn ensure_free_pub(&mut self, need: u32) -> Result<(), MemError> {
        let r = self.ensure_free(need);
        self.note_high_water();
        r
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

    pub(super) fn allocate(&mut self) -> Result<BlockId, MemError> {
        self.ensure_free(1)?;
        let id = self.pop()?;
        self.note_high_water();
        Ok(id)
    }

    /// Pops `n` blocks, handing each id to `push`; all or nothing.
    pub(super) fn allocate_many(
        &mut self,
        n: u32,
        mut push: impl FnMut(BlockId),
    ) -> Result<(), MemError> {
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

    pub(super) fn share(&mut self, id: BlockId) -> Result<(), MemError> {
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
    pub(super) fn release(&mut self, id: BlockId) -> Result<(), MemError> {
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

    pub(super) fn refcount(&self, id: BlockId) -> u32 {
        match self.entries.get(id as usize) {
            Some(Entry::Occupied { refs }) => *refs,
            _ => 0,
        }
    }

    pub(super) fn span_of(&self, id: BlockId) -> Result<(usize, usize, Placement), MemError> {
        match (&self.region, self.placement) {
            (Some(region), Some(placement)) => Ok((
                region.base() + id as usize * self.stride,
                self.stride,
                placement,
            )),
            _ => Err(slots_have_no_memory()),
        }
    }

    /// Copies live block `id`'s bytes, all of them, into `dst` through the
    /// pool's region (its source's host copy: a memcpy on the fake, a
    /// synchronous device copy on a GPU).
    pub(super) fn read_block(&self, id: BlockId, dst: &mut [u8]) -> Result<(), MemError> {
        let (region, offset) = self.block_copy(id, dst.len(), "read")?;
        region.copy_to_host(offset, dst)
    }

    /// Copies `src`, one whole block, into live block `id` through the
    /// pool's region.
    pub(super) fn write_block(&mut self, id: BlockId, src: &[u8]) -> Result<(), MemError> {
        let (_, offset) = self.block_copy(id, src.len(), "write")?;
        match self.region.as_mut() {
            Some(region) => region.copy_from_host(offset, src),
            None => Err(slots_have_no_memory()),
        }
    }

    /// [`Self::read_block`] of every `(id, dst)` of `copies` as one batch
    /// of the region ([`Region::copy_to_host_many`]: one wait on a device).
    /// Every copy is checked (a live block, a buffer of one whole block)
    /// before any starts: a batch with one bad copy reads nothing.
    pub(super) fn read_blocks(&self, copies: &mut [(BlockId, &mut [u8])]) -> Result<(), MemError> {
        let mut batch = Vec::new();
        try_reserve(&mut batch, copies.len(), "a batch of block copies")?;
        for (id, dst) in copies.iter_mut() {
            let (_, offset) = self.block_copy(*id, dst.len(), "read")?;
            batch.push((offset, &mut **dst));
        }
        match &self.region {
            Some(region) => region.copy_to_host_many(&mut batch),
            None => Err(slots_have_no_memory()),
        }
    }

    /// [`Self::write_block`] of every `(id, src)` of `copies`, in order, as
    /// one batch of the region; checked as [`Self::read_blocks`]: a batch
    /// with one bad copy writes nothing.
    pub(super) fn write_blocks(&mut self, copies: &[(BlockId, &[u8])]) -> Result<(), MemError> {
        let mut batch = Vec::new();
        try_reserve(&mut batch, copies.len(), "a batch of block copies")?;
        for &(id, src) in copies {
            let (_, offset) = self.block_copy(id, src.len(), "write")?;
            batch.push((offset, src));
        }
        match self.region.as_mut() {
            Some(region) => region.copy_from_host_many(&batch),
            None => Err(slots_have_no_memory()),
        }
    }

    /// The rules of a host copy of one block: the pool has memory with
    /// bytes behind it, the block is live, and the buffer is exactly one
    /// block. Returns the region and the block's offset in it (the region
    /// checks that the range is committed).
    fn block_copy(
        &self,
        id: BlockId,
        len: usize,
        what: &str,
    ) -> Result<(&Region, usize), MemError> {
        let Some(region) = &self.region else {
            return Err(MemError::invalid(format!(
                "block pool #{} is an id space only (slots mode): its blocks have no bytes to \
                 {what}; open the pool with block_bytes over a backend",
                self.id
            )));
        };
        if !region.backend().addressable() {
            return Err(MemError::BackendUnavailable(format!(
                "block pool #{} lies on an unbacked FakeBackend (backed=False), whose addresses \
                 have no bytes behind them, so there is nothing to {what}; use backed=True",
                self.id
            )));
        }
        if self.refcount(id) == 0 {
            return Err(MemError::Invariant(format!(
                "pool #{}: {what} of block {id}, which is not live",
                self.id
            )));
        }
        if len != self.stride {
            return Err(MemError::invalid(format!(
                "a {what} of block {id} of pool #{} moves the whole block: pass a buffer of its \
                 {} B, not {len} B",
                self.id, self.stride
            )));
        }
        let offset = (id as usize).checked_mul(self.stride).ok_or_else(|| {
            MemError::Invariant(format!("pool #{}: block {id}'s offset overflows", self.id))
        })?;
        Ok((region, offset))
    }

    pub(super) fn stats(&self) -> PoolStats {
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

    /// Walks the whole pool and checks V4, the refcount sum, every chunk's
    /// list and bitmap bit (or the single list), and that the blocks fit the
    /// committed region.
    pub(super) fn check_invariants(&self) -> Result<(), MemError> {
        let broken = |what: String| Err(MemError::Invariant(format!("pool #{}: {what}", self.id)));
        let capacity = self.capacity();
        let on_lists = match self.lists.walk(&self.entries, capacity) {
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

pub(super) fn slots_have_no_memory() -> MemError {
    MemError::invalid(
        "this pool is an id space only (slots mode); it has no memory to view — lay the memory \
         out yourself, or open the pool with block_bytes",
    )
}

pub(super) fn foreign(theirs: u64, ours: u64) -> MemError {
    MemError::invalid(format!(
        "this block ref belongs to pool #{theirs}, not #{ours}; a ref is only ever released into \
         the pool it came from"
    ))
}
