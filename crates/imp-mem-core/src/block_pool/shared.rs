//! The shared façade: [`SharedBlockPool`] (`Arc` + mutex, `Send + Sync`),
//! its refs that keep the pool alive ([`SharedBlockRef`], one per block;
//! [`SharedBlockRefs`], a batch under one lock) and the one-client claim
//! ([`PoolClaim`]). What the Python binding uses.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Backend, Region};
use crate::decommit::{DecommitPolicy, FenceLike};
use crate::error::{try_reserve, MemError};
use crate::source::PinnedHostOps;
use crate::source::Placement;
use crate::span::{MintKey, StableSpan};

use super::config::{PoolConfig, PoolStats};
use super::pool::{foreign, slots_have_no_memory, PoolCore};
use super::shrink::PoolFence;
use super::BlockId;

#[derive(Debug)]
pub(super) struct SharedPoolInner {
    pub(super) id: u64,
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
pub(super) struct CoreGuard<'a> {
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
    pub(super) inner: Arc<SharedPoolInner>,
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

    pub(super) fn core(&self) -> CoreGuard<'_> {
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

    /// The pinned host memory of the pool's source
    /// ([`Backend::pinned_host`]), which a copy of its blocks to and from
    /// the host stages through; `None` in slots mode and for a source
    /// without one (the fake).
    pub fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        self.core().region.as_ref()?.backend().pinned_host()
    }

    /// [`SharedBlockRef::read_into`] of every `(block, dst)` of `copies`
    /// (refs of this pool) under one lock and as one batch of the pool's
    /// region: on a GPU the device → host copies are enqueued together and
    /// the host waits once, not once a block. Every copy is checked first
    /// (a ref of this pool, a live block, a buffer of one whole block): a
    /// batch with one bad copy reads nothing, and its error names the
    /// block.
    pub fn read_blocks(&self, copies: &mut [(&SharedBlockRef, &mut [u8])]) -> Result<(), MemError> {
        let mut ids = Vec::new();
        try_reserve(&mut ids, copies.len(), "a batch of block copies")?;
        for (block, dst) in copies.iter_mut() {
            ids.push((self.own_id(block)?, &mut **dst));
        }
        self.core().read_blocks(&mut ids)
    }

    /// [`SharedBlockRef::write_from`] of every `(block, src)` of `copies`
    /// (refs of this pool), in order, under one lock and as one batch of the
    /// region (one wait on a GPU); checked as [`Self::read_blocks`]: a batch
    /// with one bad copy writes nothing.
    pub fn write_blocks(&self, copies: &[(&SharedBlockRef, &[u8])]) -> Result<(), MemError> {
        let mut ids = Vec::new();
        try_reserve(&mut ids, copies.len(), "a batch of block copies")?;
        for &(block, src) in copies {
            ids.push((self.own_id(block)?, src));
        }
        self.core().write_blocks(&ids)
    }

    /// `block`'s id, refused when it is a ref of another pool.
    fn own_id(&self, block: &SharedBlockRef) -> Result<BlockId, MemError> {
        if Arc::ptr_eq(&block.pool.inner, &self.inner) {
            Ok(block.id)
        } else {
            Err(foreign(block.pool.id(), self.id()))
        }
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
    /// ([`DecommitTracker`](crate::decommit::DecommitTracker)): after
    /// `min_idle_steps` steps with more than `keep_chunks` spare chunks
    /// above the highest live block, the free
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

    /// Shrinks to the chunks holding live blocks plus `keep_chunks` now,
    /// bypassing the hysteresis (never below the blocks the pool opened
    /// with); the decommit waits for `fence`. Returns the bytes decommitted
    /// during this call.
    pub fn trim<F: FenceLike + Send + 'static>(
        &self,
        keep_chunks: u32,
        fence: F,
    ) -> Result<u64, MemError> {
        self.core().trim(keep_chunks, PoolFence(Box::new(fence)))
    }

    /// Gives back the free tail above `blocks` now, bypassing the
    /// hysteresis (never below the live blocks or the blocks the pool
    /// opened with); the decommit waits for `fence`. What an operation that
    /// grew the pool and then failed calls with the capacity it found, so
    /// that the failure leaves the pool as it was. Returns the bytes
    /// decommitted during this call.
    pub fn shrink_to<F: FenceLike + Send + 'static>(
        &self,
        blocks: u32,
        fence: F,
    ) -> Result<u64, MemError> {
        self.core().shrink_to(blocks, PoolFence(Box::new(fence)))
    }

    /// Makes at least `n` blocks free now, committing more of a growable
    /// region if it must (through the backend, so on a device ledger only
    /// what it grants): room promised ahead to work already admitted. All
    /// or nothing; a refusal is the growth's error.
    pub fn reserve_free(&self, n: u32) -> Result<(), MemError> {
        self.core().ensure_free_pub(n)
    }

    /// Lowers the most blocks the pool may grow to (`max_blocks`), at least
    /// the blocks committed now; the reservation and every address stay.
    /// A growable pool sized before its plan was final is capped at the
    /// final plan's blocks this way.
    pub fn limit_blocks(&self, max_blocks: u32) -> Result<(), MemError> {
        self.core().limit_blocks(max_blocks)
    }

    /// The backend its region came from (`None` in slots mode).
    pub fn backend(&self) -> Option<crate::backend::Backend> {
        self.core().region.as_ref().map(|r| r.backend().clone())
    }

    /// One past the highest live block id (0 when none is live): the
    /// blocks a shrink must keep.
    pub fn live_top(&self) -> u32 {
        self.core().live_top_block()
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

    pub(super) fn span_of(&self, id: BlockId) -> Result<StableSpan<'_>, MemError> {
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
    pub(super) pool: SharedBlockPool,
    pub(super) id: BlockId,
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

    /// Copies the block's bytes into `dst`, which must be exactly one block
    /// ([`SharedBlockPool::block_bytes`]) long, through the pool's own
    /// region and its source: a memcpy on the fake, a synchronous device →
    /// host copy on a GPU (run after the kernels that wrote the block have
    /// completed). Refused, as an error, in slots mode, on an unbacked fake,
    /// for a source without host copies, and for a buffer of another length.
    /// Holds the pool's lock for the copy: the region cannot shrink or sleep
    /// under it.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), MemError> {
        self.pool.core().read_block(self.id, dst)
    }

    /// Copies `src`, exactly one block long, into the block (as
    /// [`Self::read_into`], the other way). Every ref to the block sees the
    /// new bytes.
    pub fn write_from(&self, src: &[u8]) -> Result<(), MemError> {
        self.pool.core().write_block(self.id, src)
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &SharedBlockPool {
        &self.pool
    }
}

/// The id of a [`SharedBlockRef`] that [`SharedBlockPool::release_all`]
/// already released (never a block id: ids are below [`MAX_BLOCKS`]).
pub(super) const RELEASED: BlockId = u32::MAX;

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
