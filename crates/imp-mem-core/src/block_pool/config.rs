//! How a pool is built ([`PoolConfig`], checked before anything is
//! acquired) and what it reports ([`PoolStats`]).

use crate::error::MemError;
use crate::tag::Tag;

use super::MAX_BLOCKS;

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
    /// Hold a pool that does not grow in a growable region, committed
    /// whole at open, so that it can sleep (give its memory back and take
    /// it again at the same addresses). It never shrinks.
    pub sleepable: bool,
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
            sleepable: false,
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
            sleepable: false,
        }
    }

    /// The same pool, held in a growable region committed whole so that
    /// it can sleep ([`PoolConfig::sleepable`]).
    pub fn sleepable(mut self) -> Self {
        self.sleepable = true;
        self
    }

    /// Charges the region to `tag`.
    pub fn with_tag(mut self, tag: Tag) -> Self {
        self.tag = Some(tag);
        self
    }

    pub(super) fn check(&self, slots: bool) -> Result<(), MemError> {
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
