//! `VmmSource`: growable device regions over the CUDA virtual memory API.
//!
//! Algorithm (seed A3.1, SPEC "Facts measured on an H200"):
//!
//! * **reserve** takes address space for a region's maximum with
//!   `cuMemAddressReserve` — no physical memory (64 GiB in ~31 µs on an
//!   H200). The reservation is rounded up to whole chunks.
//! * **commit** extends the committed prefix by whole *chunks*: for each new
//!   chunk one physical handle (`cuMemCreate`, or a cached one) mapped with
//!   `cuMemMap` at its offset, then **one** `cuMemSetAccess` over the new
//!   chunks only. The chunk is a multiple of the device's allocation
//!   granularity, 64 MiB by default: the driver's cost goes with the number of
//!   handles, not bytes (one `cuMemSetAccess` over 256 × 2 MiB handles took
//!   6.5 ms against 48 µs over one 512 MiB handle), and setting access on the
//!   whole region again would re-pay it for every old chunk.
//! * **decommit** unmaps the committed tail chunk by chunk (`cuMemUnmap` can
//!   only unmap whole mappings, which is why every chunk is its own mapping)
//!   and hands each handle to a small cache of at most `cache_chunks` handles,
//!   releasing (`cuMemRelease`) the rest. A later commit takes cached handles
//!   before creating new ones. If an unmap fails half way, the chunks already
//!   unmapped are mapped back, so a failed decommit changes nothing.
//! * The base never moves: a region's mappings all live inside its
//!   reservation (V9).
//! * **allocate** (a fixed region) is a reservation of the request rounded up
//!   to the device granularity, backed by chunks when it is a whole number of
//!   them (cache-friendly) and by one handle of its exact size otherwise.
//!
//! None of these calls synchronises the device. A commit can overlap queued
//! work; a decommit must not happen while a kernel may still touch the tail:
//! the caller waits for a [`crate::Fence`] first (`imp_mem_core::decommit` has
//! the policy and the deferred queue).
//!
//! Accounting: the backend's ledger sees committed bytes. Cached handles are
//! physical memory that no region holds; the source reports them
//! ([`VmmCore::cached_bytes`]) and, so that the budget stays honest, tells the
//! backend a capacity of *device total − cache limit*: a budget can never
//! admit so much that committed + cached exceeds the device. [`VmmCore::trim_cache`]
//! returns the cache to the device at once.
//!
//! Thread safety: all bookkeeping is behind one mutex, held across the driver
//! calls of one operation (the backend already serialises its source calls,
//! so this lock is uncontended in practice). Each operation makes the
//! device's primary context current on the calling thread for its duration.
//!
//! The driver calls go through the [`VmmDriver`] trait so that the
//! bookkeeping — rollback, the cache, boundaries — is tested on the CPU
//! against a simulated driver that enforces the same rules.
//!
//! One concept a file: the configuration and its size arithmetic
//! (`config.rs`), the driver calls ([`VmmDriver`], [`CudaVmm`]:
//! `driver.rs`), the bookkeeping of reservations, mappings and the handle
//! cache ([`VmmCore`]: `regions.rs`), the source contract over it
//! (`source.rs`) and the backend with the source's extras ([`VmmBackend`]:
//! `backend.rs`).

mod backend;
mod config;
mod driver;
mod regions;
mod source;

#[cfg(test)]
pub(crate) mod sim;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod conformance;

pub use backend::{vmm_backend, VmmBackend};
pub use config::{
    check_sizes, chunk_size, combined_granularity, VmmConfig, DEFAULT_CACHE_CHUNKS,
    DEFAULT_CHUNK_BYTES,
};
pub use driver::{CudaVmm, VmmDriver};
pub use regions::{VmmCore, VmmCounters, VmmSource};
