//! The borrowed façade: [`BlockPool`] and its [`BlockRef<'p>`](BlockRef),
//! which cannot outlive the pool. Single-threaded (a `RefCell` over the
//! core).

use std::cell::RefCell;

use crate::backend::Backend;
use crate::decommit::{DecommitPolicy, FenceLike};
use crate::error::{try_reserve, MemError};
use crate::span::{MintKey, StableSpan};

use super::config::{PoolConfig, PoolStats};
use super::pool::{foreign, PoolCore};
use super::shrink::PoolFence;
use super::BlockId;

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
    ///
    /// [`SharedBlockPool::step`]: super::SharedBlockPool::step
    pub fn step<F: FenceLike + Send + 'static>(&self, fence: F) -> Result<u64, MemError> {
        self.core()?.step(PoolFence(Box::new(fence)))
    }

    /// Shrinks to the need now, bypassing the hysteresis (see
    /// [`SharedBlockPool::shrink_now`]).
    ///
    /// [`SharedBlockPool::shrink_now`]: super::SharedBlockPool::shrink_now
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
