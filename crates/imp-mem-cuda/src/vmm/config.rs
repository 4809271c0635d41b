//! How a VMM source commits ([`VmmConfig`]) and the pure arithmetic of its
//! sizes: the chunk, the handle cache, the granule.

use imp_mem_core::units::round_up;
use imp_mem_core::MemError;

/// The default chunk: tens of MiB, so that a growth event is one handle.
pub const DEFAULT_CHUNK_BYTES: usize = 64 << 20;
/// The default number of released chunk handles kept for reuse.
pub const DEFAULT_CACHE_CHUNKS: usize = 2;

/// How a VMM source commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmConfig {
    /// Bytes per physical handle; rounded up to the device granularity.
    /// `None`: [`DEFAULT_CHUNK_BYTES`].
    pub chunk_bytes: Option<usize>,
    /// Released chunk handles kept for reuse (0 disables the cache).
    pub cache_chunks: usize,
}

impl Default for VmmConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: None,
            cache_chunks: DEFAULT_CACHE_CHUNKS,
        }
    }
}

/// The chunk size for a request: a positive multiple of `unit`, at least one
/// unit. Pure.
pub fn chunk_size(requested: Option<usize>, unit: usize) -> Result<usize, MemError> {
    let unit = unit.max(1);
    let requested = requested.unwrap_or(DEFAULT_CHUNK_BYTES);
    if requested == 0 {
        return Err(MemError::invalid(
            "chunk_bytes must be positive; the default is 64 MiB",
        ));
    }
    let rounded =
        round_up(requested, unit).ok_or_else(|| MemError::invalid("chunk_bytes overflows"))?;
    Ok(rounded.max(unit))
}

/// Refuses a chunk larger than the device, or a handle cache that could
/// hold half of it (the budget's capacity is the device less the cache).
/// Pure.
pub fn check_sizes(chunk: usize, cache_chunks: usize, total: u64) -> Result<(), MemError> {
    if chunk as u64 > total {
        return Err(MemError::invalid(format!(
            "chunk_bytes {chunk} is larger than the device ({total} B); use tens of MiB"
        )));
    }
    let cache = (cache_chunks as u64).saturating_mul(chunk as u64);
    if cache > total / 2 {
        return Err(MemError::invalid(format!(
            "a cache of {cache_chunks} chunks of {chunk} B would hold over half the device; keep \
             a few chunks (the default is {DEFAULT_CACHE_CHUNKS})"
        )));
    }
    Ok(())
}

/// The granule that satisfies both the minimum and the recommended
/// granularity. Pure.
pub fn combined_granularity(min: usize, recommended: usize) -> usize {
    let (min, rec) = (min.max(1), recommended.max(1));
    if rec % min == 0 {
        rec
    } else if min % rec == 0 {
        min
    } else {
        min.saturating_mul(rec)
    }
}
