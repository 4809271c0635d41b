//! How an activation pool is built ([`ActivationConfig`]), what it
//! reports ([`ActivationStats`]), and the answers of a free ([`Freed`],
//! [`RefusedFree`]).

use crate::error::MemError;

use super::{DEFAULT_ACTIVATION_ALIGN, FRESH_STREAM};

/// How to build an [`ActivationPool`](super::ActivationPool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivationConfig {
    /// Bytes of the region (rounded down to `align`).
    pub capacity: u64,
    /// Alignment of every block and granule of every size: a power of two.
    pub align: u64,
    /// Strict (refuse on exhaustion) or production (fall back to the
    /// backend); `None` follows the backend's phase mode.
    pub strict: Option<bool>,
    /// Hold the region as a growable one, fully committed, so that it can
    /// sleep ([`ActivationPool::sleep`]); needs a growable backend.
    ///
    /// [`ActivationPool::sleep`]: super::ActivationPool::sleep
    pub growable: bool,
    /// A *measured* pool: reserve `capacity` bytes of address space and
    /// commit them in chunks of this many bytes (rounded up to the
    /// backend's granularity) as requests reach past the committed end,
    /// until [`ActivationPool::freeze`] fixes the pool at its high-water
    /// plus a margin. Needs a growable backend; `None`: committed whole.
    ///
    /// [`ActivationPool::freeze`]: super::ActivationPool::freeze
    pub measure_chunk: Option<u64>,
}

impl ActivationConfig {
    /// `capacity` bytes, aligned to 512, strictness from the backend.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            align: DEFAULT_ACTIVATION_ALIGN,
            strict: None,
            growable: false,
            measure_chunk: None,
        }
    }
}

/// A snapshot of one pool's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActivationStats {
    /// Bytes of the region the blocks tile (a measured pool: its
    /// reservation until the freeze, the frozen size after).
    pub capacity: u64,
    /// A measured pool that has not been frozen yet: it commits as it grows.
    pub measuring: bool,
    /// The highest end offset any block has reached: the bytes a measured
    /// pool needed (before the chunk rounding).
    pub high_water: u64,
    /// What the freeze fixed, once it ran.
    pub frozen: Option<Frozen>,
    /// The alignment and size granule.
    pub align: u64,
    /// Bytes in live blocks of the region (rounded sizes).
    pub allocated: u64,
    /// The most `allocated` has been (since the last `reset_peak`).
    pub allocated_peak: u64,
    /// Bytes handed out now, region and fallback: `allocated +
    /// fallback_bytes`.
    pub in_use: u64,
    /// The most `in_use` has been.
    pub in_use_peak: u64,
    /// Bytes the callers asked for, over live blocks and fallbacks.
    pub requested: u64,
    /// Live allocations, region and fallback.
    pub live: u64,
    /// The most `live` has been.
    pub live_peak: u64,
    /// Allocations served, ever.
    pub allocs_total: u64,
    /// Frees accepted, ever.
    pub frees_total: u64,
    /// Bytes allocated, ever (rounded).
    pub allocated_bytes_total: u64,
    /// Bytes freed, ever (rounded).
    pub freed_bytes_total: u64,
    /// Fallback acquisitions, ever (production mode).
    pub fallbacks_total: u64,
    /// Bytes of fallback acquisitions, ever.
    pub fallback_bytes_total: u64,
    /// Fallback regions live now.
    pub fallback_live: u64,
    /// Their bytes.
    pub fallback_bytes: u64,
    /// The most region + fallback bytes held at once.
    pub reserved_peak: u64,
    /// Requests refused for want of memory (strict mode, or a fallback the
    /// backend refused).
    pub ooms: u64,
    /// Frees refused: not a live block's start.
    pub refused_frees: u64,
    /// Free bytes of the region.
    pub free_bytes: u64,
    /// Free blocks.
    pub free_blocks: u64,
    /// The largest free block.
    pub largest_free: u64,
    /// Requests served from a block freed on another stream.
    pub cross_stream_reuses: u64,
    /// Reclaims: other streams' free blocks moved to the requester's.
    pub reclaims: u64,
    /// Streams that hold free blocks now.
    pub streams: u64,
    /// Free blocks that could be listed nowhere (metadata allocation failed);
    /// their bytes are counted free but never reused.
    pub parked_blocks: u64,
}

/// What [`ActivationPool::freeze`](super::ActivationPool::freeze) fixed: the
/// measured figure a later start plans with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Frozen {
    /// The highest end offset any block reached while measuring.
    pub high_water: u64,
    /// The margin asked for on top of it.
    pub margin: u64,
    /// The pool's size from now on: `high_water + margin` rounded up to
    /// whole chunks, at most the reservation.
    pub size: u64,
    /// Bytes that were committed while measuring.
    pub committed_before: u64,
    /// Bytes decommitted by the freeze (whole chunks past `size`).
    pub decommitted: u64,
}

/// What a free released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// Bytes the block held (rounded).
    pub size: u64,
    /// Bytes asked for when it was allocated.
    pub requested: u64,
    /// The stream it was allocated on.
    pub alloc_stream: u64,
    /// Whether it was a fallback region (now released to the backend).
    pub fallback: bool,
    /// The pool's live blocks after this free (read under the same lock).
    pub live_after: u64,
}

/// Why a free was refused. Nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedFree {
    /// The address is neither in the region nor a live fallback.
    Foreign,
    /// The address is in the region but is not a live block's start: a
    /// double free, or a pointer into a block.
    NotLive,
    /// The stream is [`FRESH_STREAM`], which no caller may name.
    ReservedStream,
}

impl RefusedFree {
    /// The error a refused free of `addr` reports.
    pub fn error(self, addr: usize) -> MemError {
        match self {
            RefusedFree::Foreign => MemError::invalid(format!(
                "free of {addr:#x}: this activation pool did not hand out that address; free \
                 only what allocate() returned, to the pool it came from"
            )),
            RefusedFree::NotLive => MemError::invalid(format!(
                "free of {addr:#x}: not a live allocation of this activation pool (a double free, \
                 or a pointer into a block); free each address allocate() returned exactly once"
            )),
            RefusedFree::ReservedStream => MemError::invalid(format!(
                "free of {addr:#x} on stream {FRESH_STREAM:#x}: that value is reserved; pass the \
                 stream the memory was last used on"
            )),
        }
    }
}
