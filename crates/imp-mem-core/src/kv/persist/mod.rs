//! Prefix-cache persistence: the file format, its checks, and the block
//! copies ([`BlockIo`]). The manager's `save_prefix_cache` /
//! `load_prefix_cache` (`kv/manager/persist.rs`) build a header from their
//! configuration and drive the steps below; this module knows no manager,
//! so the disk tier's one-block files ([`BlockFileFormat`]) use it too.
//!
//! One concept a file: the file format and its header checks (`format.rs`),
//! the block copies between the pool and host memory (`block_io.rs`), the
//! refs lent out of the manager while a file is read or written
//! (`lent.rs`), the streamed save (`save.rs`), the streamed load
//! (`load.rs`), and the closing of a replaced file off the caller's time
//! (`release.rs`). This module holds what the save and the load share: the
//! chunks they stream through.
//!
//! Both directions move the entries in chunks of whole entries (a save's
//! of about 8 MiB, a load's of about 1 MiB) through three host buffers —
//! pinned where the pool's source has pinned memory, so a block's device
//! copy is a DMA straight to or from the chunk. A save runs its stages on threads of their own at once:
//! it copies blocks out of the pool into a chunk laid out as the file is
//! (this thread), computes their checksums and feeds the entries' records
//! to the trailer's hash (a second), and writes the chunk (a third). A
//! load has three workers, a buffer each, that claim chunks in turn and
//! take each through every step on one core: the read, in pieces of at
//! most `PIECE_BYTES` (`load.rs`) each hashed (its entry's checksum) right after it
//! arrives, while it is still in the core's cache; each entry's check (its
//! hash and checksum against the index, its bytes against its checksum);
//! and the copies of the new entries into their blocks. One worker's read
//! overlaps the others' hashes and copies, and on a host of many cores
//! three readers outrun the one of a plain file read. The buffers are the
//! `BlockIo`'s, kept between calls ([`BlockIo::keep_buffer`]): pinned
//! memory is page-locked once, not at every save and load.
//!
//! Thread safety: the file I/O runs outside the manager's lock. A save takes
//! a [`PrefixSnapshot`] under it (a ref on each cached block, so none is
//! reused while the file is written) and writes without it; a load verifies
//! the file without it, takes the lock to allocate, copies without it, and
//! takes it again to insert. Refs held outside the lock are registered as
//! lent ([`LentRefs`]), which
//! [`KVCacheManager::check_invariants`](crate::kv::KVCacheManager::check_invariants)
//! counts.

mod block_io;
mod format;
mod lent;
mod load;
mod release;
mod save;

pub use block_io::{BlockIo, HostBuf, PoolBlockIo};
pub(crate) use format::{refuse, BlockFileFormat, Header, FORMAT};
pub use format::{FILE_MAGIC, FILE_VERSION};
pub(crate) use lent::Lent;
pub use lent::LentRefs;
pub use load::{LoadTarget, PendingLoad, VerifiedFile};
#[cfg(test)]
pub(crate) use release::RELEASE_QUEUE;
pub(crate) use release::{open_to_release, release_later};
pub use save::PrefixSnapshot;

use crate::block_pool::SharedBlockRef;

/// Bytes a streamed load moves per chunk (rounded to whole entries, at
/// least one), and the chunks in flight: the load's workers, a buffer
/// each. A worker claims its next chunk only once its last one is copied,
/// so at most [`BUFFERS`] chunks are read and not yet copied, and a file
/// changed after a copy is seen by every chunk claimed after it.
const CHUNK_BYTES: usize = 1 << 20;
/// Bytes a save moves per chunk: larger, as its one writer's rate is the
/// save's (8 MiB writes kept the save of 2 MiB blocks at 0.97x a plain
/// file's on the H200 where 1 MiB gave 0.77-0.82x; the load's workers
/// gain nothing from chunks past 1 MiB).
const SAVE_CHUNK_BYTES: usize = 8 << 20;
pub(crate) const BUFFERS: usize = 3;

/// Entries per chunk of `chunk` bytes for entries of `stride` bytes.
fn entries_per_chunk(chunk: usize, stride: usize) -> usize {
    (chunk / stride.max(1)).max(1)
}

/// The chunk buffers of a streamed save or load: through `io`'s host
/// memory for `block`'s pool where there is a block, else heap memory.
fn chunk_buffers(io: &dyn BlockIo, block: Option<&SharedBlockRef>, len: usize) -> Vec<HostBuf> {
    (0..BUFFERS)
        .map(|_| match block {
            Some(b) => io.host_buffer(b, len),
            None => HostBuf::heap(len),
        })
        .collect()
}

/// A pipeline stage's result; its panic goes on unwinding here.
fn joined<T>(stage: std::thread::ScopedJoinHandle<'_, T>) -> T {
    stage
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
}
