//! [`BlockIo`]: how block bytes travel between the pool and host memory
//! during a save or a load, and the host buffers they travel through.
//!
//! Block bytes travel through [`BlockIo`]; a manager over a pool laid out on
//! a backend uses [`PoolBlockIo`], which copies each block through its
//! pool's region and source (device ↔ pinned chunk on a GPU, a memcpy on
//! the fake). The streamed save and load hand it a chunk's blocks at once
//! ([`BlockIo::read_blocks_staged`] / [`BlockIo::write_blocks_staged`]),
//! which it copies as one batch of the pool
//! ([`SharedBlockPool::read_blocks`](crate::block_pool::SharedBlockPool::read_blocks)):
//! one lock, and on a GPU every copy enqueued and one wait, where a copy a
//! block paid a synchronisation each. Tests install others to inject
//! faults. Pins are run-time policy and are not persisted.

use std::sync::Mutex;

use super::BUFFERS;
use crate::block_pool::SharedBlockRef;
use crate::error::MemError;
use crate::pinned::{PinnedBuffer, PinnedHost};

/// Copies one block's bytes between the pool and host memory. The manager
/// passes a live ref, so the block cannot be released during the copy.
/// `block_bytes` is the block's whole footprint, which for a layer-major KV
/// layout is the concatenation of its pieces in every layer (the
/// implementation decides the order; the file records `layout`).
pub trait BlockIo: Send + Sync + std::fmt::Debug {
    /// Bytes per block.
    fn block_bytes(&self) -> usize;
    /// Copies the block's bytes into `dst` (`block_bytes` long).
    fn read_block(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError>;
    /// Copies `src` (`block_bytes` long) into the block.
    fn write_block(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError>;

    /// A host buffer of `len` bytes for the streamed save and load, whose
    /// parts [`Self::read_block_staged`] and [`Self::write_block_staged`]
    /// copy through: pinned where `block`'s pool has pinned host memory (a
    /// device copy from it is a direct DMA), else heap memory (the default).
    fn host_buffer(&self, block: &SharedBlockRef, len: usize) -> HostBuf {
        let _ = block;
        HostBuf::heap(len)
    }

    /// Takes back a [`Self::host_buffer`] a save or load is done with, to
    /// hand out again from `host_buffer` (the default drops it).
    fn keep_buffer(&self, buf: HostBuf) {
        drop(buf);
    }

    /// [`Self::read_block`] into a part of a [`Self::host_buffer`]; the
    /// default is `read_block` itself.
    fn read_block_staged(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        self.read_block(block, dst)
    }

    /// [`Self::write_block`] from a part of a [`Self::host_buffer`]; the
    /// default is `write_block` itself.
    fn write_block_staged(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        self.write_block(block, src)
    }

    /// [`Self::read_block_staged`] of every `(block, dst)` of `copies`, the
    /// parts of one chunk: where the copies can go as one batch (one wait
    /// on a device, [`PoolBlockIo`]) they do. The default is the single
    /// copy in a loop, stopping at the first error.
    fn read_blocks_staged(
        &self,
        copies: &mut [(&SharedBlockRef, &mut [u8])],
    ) -> Result<(), MemError> {
        for (block, dst) in copies.iter_mut() {
            self.read_block_staged(block, dst)?;
        }
        Ok(())
    }

    /// [`Self::write_block_staged`] of every `(block, src)` of `copies`, in
    /// order, as [`Self::read_blocks_staged`].
    fn write_blocks_staged(&self, copies: &[(&SharedBlockRef, &[u8])]) -> Result<(), MemError> {
        for &(block, src) in copies {
            self.write_block_staged(block, src)?;
        }
        Ok(())
    }
}

/// Host memory for the streamed save and load ([`BlockIo::host_buffer`]).
#[derive(Debug)]
pub enum HostBuf {
    /// Pinned memory of the pool's source.
    Pinned(PinnedBuffer),
    /// Heap memory.
    Heap(Vec<u8>),
}

impl HostBuf {
    /// `len` zeroed bytes on the heap.
    pub fn heap(len: usize) -> Self {
        Self::Heap(vec![0; len])
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Pinned(b) => b.as_slice(),
            Self::Heap(v) => v,
        }
    }

    /// The bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Pinned(b) => b.as_mut_slice(),
            Self::Heap(v) => v,
        }
    }
}

/// [`BlockIo`] for a pool laid out over a backend: each block through its
/// pool's region and source ([`SharedBlockRef::read_into`] / `write_from`),
/// the fake and a GPU alike. Where the source has pinned host memory
/// ([`SharedBlockPool::pinned_host`](crate::block_pool::SharedBlockPool::pinned_host):
/// a GPU), the copies stage through one pinned buffer of a block, made at
/// the first copy and kept: a device copy to or from pageable memory goes
/// through the driver's own staging at a fraction of the DMA's speed (the
/// prefix cache's save took 1.2-1.4x the time without it on the H200). A
/// manager over such a pool installs it itself.
///
/// The chunk buffers of a streamed save or load ([`BlockIo::host_buffer`])
/// are kept between calls (`BUFFERS` of them at most): a pinned
/// allocation costs the driver a page-locking of every page, and a fresh
/// heap one a page fault a page, each call.
#[derive(Debug)]
pub struct PoolBlockIo {
    block_bytes: usize,
    /// `None` until the first copy; then the buffer, or `Some(None)` where
    /// the source has no pinned memory or pinning failed (copied direct).
    staging: Mutex<Option<Option<PinnedBuffer>>>,
    /// Chunk buffers back from earlier saves and loads.
    spare: Mutex<Vec<HostBuf>>,
}

impl PoolBlockIo {
    /// Copies blocks of `block_bytes` (the pool's block size; a block of
    /// another size is refused by the copy).
    pub fn new(block_bytes: usize) -> Self {
        Self {
            block_bytes,
            staging: Mutex::new(None),
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` with the staging buffer for `block`'s pool, made on first
    /// use, or with `None` when the copies go direct.
    fn with_staging<T>(
        &self,
        block: &SharedBlockRef,
        f: impl FnOnce(Option<&mut PinnedBuffer>) -> Result<T, MemError>,
    ) -> Result<T, MemError> {
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let staging = guard.get_or_insert_with(|| {
            let host = block.pool().pinned_host()?;
            let buffer = PinnedHost::new(host).allocate_or_empty(self.block_bytes);
            (buffer.len() == self.block_bytes).then_some(buffer)
        });
        f(staging.as_mut())
    }
}

impl BlockIo for PoolBlockIo {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn read_block(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        self.with_staging(block, |staging| match staging {
            Some(buffer) if buffer.len() == dst.len() => {
                block.read_into(buffer.as_mut_slice())?;
                dst.copy_from_slice(buffer.as_slice());
                Ok(())
            }
            _ => block.read_into(dst),
        })
    }

    fn write_block(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        self.with_staging(block, |staging| match staging {
            Some(buffer) if buffer.len() == src.len() => {
                buffer.as_mut_slice().copy_from_slice(src);
                block.write_from(buffer.as_slice())
            }
            _ => block.write_from(src),
        })
    }

    fn host_buffer(&self, block: &SharedBlockRef, len: usize) -> HostBuf {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = spare.iter().position(|b| b.as_slice().len() == len) {
            return spare.swap_remove(at);
        }
        drop(spare);
        if let Some(host) = block.pool().pinned_host() {
            let buffer = PinnedHost::new(host).allocate_or_empty(len);
            if buffer.len() == len {
                return HostBuf::Pinned(buffer);
            }
        }
        HostBuf::heap(len)
    }

    fn keep_buffer(&self, buf: HostBuf) {
        // A save's buffers and a load's differ in size: both sets kept.
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < 2 * BUFFERS {
            spare.push(buf);
        }
    }

    // The staged copies go straight between the block and the (pinned)
    // buffer: no second host copy.
    fn read_block_staged(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        block.read_into(dst)
    }

    fn write_block_staged(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        block.write_from(src)
    }

    // A chunk's blocks go as one batch of their pool (a run of one pool
    // at a time): one lock and, on a GPU, one wait for all of them.
    fn read_blocks_staged(
        &self,
        copies: &mut [(&SharedBlockRef, &mut [u8])],
    ) -> Result<(), MemError> {
        let mut rest = copies;
        while let Some(((first, _), _)) = rest.split_first() {
            let pool = first.pool().clone();
            let (now, later) = rest.split_at_mut(same_pool_run(rest));
            pool.read_blocks(now)?;
            rest = later;
        }
        Ok(())
    }

    fn write_blocks_staged(&self, copies: &[(&SharedBlockRef, &[u8])]) -> Result<(), MemError> {
        let mut rest = copies;
        while let Some(((first, _), _)) = rest.split_first() {
            let pool = first.pool();
            let (now, later) = rest.split_at(same_pool_run(rest));
            pool.write_blocks(now)?;
            rest = later;
        }
        Ok(())
    }
}

/// How many of `copies`, from the first, are blocks of the first's pool.
fn same_pool_run<T>(copies: &[(&SharedBlockRef, T)]) -> usize {
    let Some((first, _)) = copies.first() else {
        return 0;
    };
    let pool = first.pool().id();
    copies
        .iter()
        .position(|(b, _)| b.pool().id() != pool)
        .unwrap_or(copies.len())
}
