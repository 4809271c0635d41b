//! The KV cache manager (seed A5.1, B2–B4): paged KV over [`SharedBlockPool`](crate::SharedBlockPool),
//! with sequence block tables that may hold holes, a content-addressed prefix
//! cache that owns its blocks, pinning as an eviction-policy overlay, a
//! separate sliding-window (SWA) id space, admission control, and prefix-cache
//! persistence.
//!
//! # Who owns a block
//!
//! The pool owns the memory; nobody else does. A block has at most two kinds
//! of holder, both through [`SharedBlockRef`](crate::SharedBlockRef)s (move-only; `share()` is the
//! only alias; dropping decrements exactly once):
//!
//! * a sequence's positional block table, `Vec<Option<SharedBlockRef>>`: a
//!   `None` is a hole left by StreamingLLM middle eviction, so the table keeps
//!   its length and the kernels their positional alignment. The kernel-facing
//!   `i32` table (with `-1` for a hole) is rebuilt from the refs, lazily after
//!   a mutation, so the two cannot drift;
//! * the prefix cache, one ref per entry ([`prefix`]).
//!
//! Pins are not holders: they are per-owner counts that keep an entry off the
//! LRU. Freeing a sequence moves its full, computed blocks into the cache (a
//! move of the ref, not an omitted free); a prefix hit is a `share()` of the
//! cache's ref; `cache_computed` lets the cache `share()` a running
//! sequence's computed blocks early. No path frees a block by id: every release is a ref going out
//! of scope, including on every error path, which is what makes V5 (refcounts
//! balance when an error unwinds) hold by construction.
//!
//! # The three traps of B2, and one more
//!
//! * Two id spaces: the SWA pool is a second [`SharedBlockPool`](crate::SharedBlockPool); its refs are
//!   wrapped in a type with no `share()`, and the prefix cache refuses a ref
//!   from any pool but the main one.
//! * SWA blocks are never hashed, shared, pinned or persisted.
//! * The persisted cache is another referent: loading allocates fresh blocks
//!   (refs), copies the bytes in through [`BlockIo`], and only then inserts
//!   the entries — a bad file changes nothing.
//! * A block filled *after* a middle eviction was computed without the
//!   evicted context, so its bytes are not what its token hash names: such
//!   blocks are never cached (`Sequence::cacheable`).
//!
//! # Lookups and the race of vllm#37076
//!
//! [`KVCacheManager::admit`] matches the prefix, takes refs to the hit
//! blocks, evicts and allocates under one `&mut self`: nothing can evict a
//! matched block between the lookup and its use. [`KVCacheManager::probe`]
//! is only a hint for a scheduler (it takes no refs).
//!
//! # SWA and prefix hits
//!
//! SWA blocks are not cached, so a sequence admitted with a prefix hit gets
//! fresh SWA blocks for the trailing window positions, hit region included:
//! the engine recomputes the sliding-window layers for
//! `[cached_tokens - window, cached_tokens)`.

pub mod hash;
mod manager;
pub mod persist;
mod prefix;
mod xxh3_block;

pub use hash::{BlockHash, BlockHasher, ExtraKeys, MmSpan, DEFAULT_HASH_SEED, HASH_ALGORITHM};
pub use manager::{Admission, KVCacheManager, KvConfig, KvStats, SeqId};
pub use persist::{BlockIo, FakeBlockIo, FILE_MAGIC, FILE_VERSION};

#[cfg(test)]
mod tests;
