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
//!
//! Files: `config.rs` (how a pool is built, what it reports),
//! `free_list.rs` (the entries and the free lists), `pool.rs` (the core:
//! open, grow, allocate, share, release, check), `shrink.rs` (shrink and
//! sleep), `borrowed.rs` and `shared.rs` (the two façades), `tokens.rs` (the
//! KV manager's Arc-free refs), `tests.rs`.
//!
//! [`DecommitTracker`]: crate::decommit::DecommitTracker
//! [`DeferredDecommit`]: crate::decommit::DeferredDecommit

mod borrowed;
mod config;
mod free_list;
mod pool;
mod shared;
mod shrink;
#[cfg(test)]
mod tests;
mod tokens;

pub use borrowed::{BlockPool, BlockRef};
pub use config::{PoolConfig, PoolStats};
pub use pool::PoolCore;
pub use shared::{PoolClaim, SharedBlockPool, SharedBlockRef, SharedBlockRefs};
pub(crate) use tokens::BlockToken;

/// A block's index in its pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;
/// The most blocks one pool can hold (ids are `u32`, one value is the list's
/// end marker).
pub const MAX_BLOCKS: u32 = u32::MAX - 1;
