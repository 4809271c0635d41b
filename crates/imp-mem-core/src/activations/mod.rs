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
//! **Measured pools** (`ActivationConfig::measure_chunk`). The pool reserves
//! its capacity as address space and commits it in whole chunks from the
//! low end as blocks reach past the committed end (never-used memory is one
//! block at the top, carved from its head, so the extent grows only as the
//! workload needs it; addresses never move). It records the highest end
//! any block reached (`high_water`). [`ActivationPool::freeze`] fixes the
//! pool at `high_water + margin` rounded up to a chunk: the free top block
//! is cut there, the capacity lowered, the commit made exactly that (whole
//! chunks past it decommitted), and no commit happens after. The figure is
//! what a later start plans a fixed tier with, without measuring.
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

//!
//! Files: `config.rs` (config, stats, the answers of a free), `pool.rs`
//! (the handle, open, sleep, counters), `pause.rs` (a sleep that keeps
//! the live blocks' bytes in pinned host memory), `alloc.rs` (allocate and free),
//! `plan.rs` (a recorded pass laid out offline and replayed by hints),
//! `blocks.rs` (the block and lane bookkeeping), `invariants.rs`, `tlsf.rs`
//! (the index), `stream.rs` (the order contract), `hooks/` (the C hooks).
//!
//! [`Region`]: crate::backend::Region
//! [`MemError::OutOfMemory`]: crate::error::MemError::OutOfMemory
//! [`Backend::acquire`]: crate::backend::Backend::acquire

mod alloc;
mod blocks;
mod config;
pub mod hooks;
mod invariants;
mod pause;
pub mod plan;
mod pool;
pub mod stream;
pub(crate) mod tlsf;
mod torch_stats;

pub use config::{ActivationConfig, ActivationStats, Freed, Frozen, RefusedFree};
pub use plan::{HintStats, PassItem, PassPlan};
pub use pool::ActivationPool;
pub use stream::{FakeStreamOrder, NoStreams, StreamOrder};

/// The default alignment (and size granule): torch's caching allocator's.
pub const DEFAULT_ACTIVATION_ALIGN: u64 = 512;
/// The stream of memory no stream has used yet (the region when it opens):
/// reusing it needs no order. Reserved: refused as a caller's stream.
pub const FRESH_STREAM: u64 = u64::MAX;
/// Block metadata entries preallocated at construction.
const INITIAL_BLOCKS: usize = 1024;
/// Lanes (streams) preallocated at construction.
const INITIAL_LANES: usize = 4;

#[cfg(test)]
mod tests;
