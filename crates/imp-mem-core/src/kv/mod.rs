//! The KV cache manager (seed A5.1, B2–B4): paged KV over [`SharedBlockPool`](crate::SharedBlockPool),
//! with sequence block tables that may hold holes, a content-addressed prefix
//! cache that owns its blocks, pinning as an eviction-policy overlay, a
//! separate sliding-window (SWA) id space, admission control, and prefix-cache
//! persistence.
//!
//! # Who owns a block
//!
//! The pool owns the memory; nobody else does. A ref to a block is a
//! `BlockToken` (crate-private, in `block_pool`): move-only, minted only by
//! the pool, consumed only by the pool's `release_tokens`, which decrements
//! exactly once per token. Unlike a [`SharedBlockRef`](crate::SharedBlockRef)
//! it does not hold its pool (the manager holds the pool handles for as long
//! as it holds any token), so it costs no atomic count (K16); what it gives
//! up is release-on-drop, which the manager replaces by explicit releases on
//! every path — including its own `Drop` — and debug builds check: a token
//! dropped unreleased panics. A block's ref has exactly one holder:
//!
//! * a sequence's positional block table, one `Slot` per block: `Own(token)`
//!   for a block the sequence holds, `Hole` for a StreamingLLM middle
//!   eviction (the table keeps its length and the kernels their positional
//!   alignment), or `Cached { entry, id }` for a block it shares with a
//!   prefix-cache entry. The kernel-facing `i32` table (with `-1` for a
//!   hole) is rebuilt from the slots, lazily after a mutation, so the two
//!   cannot drift;
//! * the prefix cache, one token per entry (`prefix.rs`). A sequence that
//!   shares the entry's block — a prefix hit, or its own block handed to
//!   the cache while it runs (`cache_computed`) — is counted as one of the
//!   entry's users and holds no ref of its own: an entry with users is off
//!   the LRU, so its block cannot be evicted under them.
//!
//! Pins are not holders either: they are per-owner counts that keep an entry
//! off the LRU. Freeing a sequence moves its owned, full, computed blocks
//! into the cache (a move of the token, not an omitted free) and gives back
//! its uses; evicting an entry for an allocation moves the entry's token
//! straight into the new sequence's table. No path frees a block by id:
//! every release consumes a token, and `check_invariants` counts the pool's
//! refs against the tokens the sequences and the cache hold (V5).

//! # The three traps of B2, and one more
//!
//! * Two id spaces: the SWA pool is a second [`SharedBlockPool`](crate::SharedBlockPool); its tokens
//!   are wrapped in a type the cache does not take, and a token carries its
//!   pool's tag, which the cache and the pool check.
//! * SWA blocks are never hashed, shared, pinned or persisted.
//! * The persisted cache is another referent: loading allocates fresh blocks
//!   (refs), copies the bytes in through [`BlockIo`], and only then turns
//!   them into entries — a bad file changes nothing.
//! * A block filled *after* a middle eviction was computed without the
//!   evicted context, so its bytes are not what its token hash names: such
//!   blocks are never cached (`Sequence::cacheable`).
//!
//! # Lookups and the race of vllm#37076
//!
//! [`KVCacheManager::admit`] matches the prefix, becomes a user of the hit
//! entries, evicts and allocates under one `&mut self`: nothing can evict a
//! matched block between the lookup and its use. [`KVCacheManager::probe`]
//! is only a hint for a scheduler (it takes no refs).
//!
//! # SWA and prefix hits
//!
//! SWA blocks are not cached, so a sequence admitted with a prefix hit gets
//! fresh SWA blocks for the trailing window positions, hit region included:
//! the engine recomputes the sliding-window layers for
//! `[cached_tokens - window, cached_tokens)`.

mod disk_tier;
pub mod events;
pub mod hash;
pub mod host_tier;
mod manager;
pub mod persist;
mod prefix;
pub mod tokens;
mod xxh3_block;

pub use events::{KvEvent, Medium};
pub use hash::{BlockHash, BlockHasher, ExtraKeys, MmSpan, DEFAULT_HASH_SEED, HASH_ALGORITHM};
pub use host_tier::{host_tier_io, CopyTicket, FakeTierIo, TierIo};
pub use manager::{Admission, IdSource, KVCacheManager, KvConfig, KvStats, SeqId};
pub use persist::{
    BlockIo, HostBuf, LentRefs, LoadTarget, PendingLoad, PoolBlockIo, PrefixSnapshot, VerifiedFile,
    FILE_MAGIC, FILE_VERSION,
};

#[cfg(test)]
mod tests;
