//! Prefix-cache persistence: the file format, its checks, and the block
//! copies ([`BlockIo`]). The manager's `save_prefix_cache` /
//! `load_prefix_cache` (`kv/manager/persist.rs`) build a header from their
//! configuration and drive the steps below; this module knows no manager,
//! so the disk tier's one-block files ([`BlockFileFormat`]) use it too.
//!
//! # File format (version 2, little-endian)
//!
//! ```text
//! magic        8   b"IMPKVPC\0"
//! version      4   u32 = 2
//! header_len   4   u32
//! header       …   JSON: format, version, model_fingerprint, block_size,
//!                  block_bytes, dtype, layout, hash_algorithm, hash_seed,
//!                  entries, checksum
//! entries      K × (hash u128 ‖ xxh3-64 of the bytes u64 ‖ block_bytes bytes)
//! trailer      16  xxh3-128 of magic ‖ version ‖ header_len ‖ header ‖ each
//!                  entry's 24-byte record (hash ‖ checksum), in file order
//! ```
//!
//! Every block byte is hashed once, by its entry's checksum; the trailer
//! covers the rest of the file and, through the checksums it hashes in
//! order, every block byte too (a changed byte changes its checksum or
//! fails it). Version 1, which the builds before wrote, differs only in its
//! trailer: the xxh3-128 of every byte before it, so the block bytes were
//! hashed twice. This build reads both ([`TrailerOver`]) and writes 2; a
//! build that reads only version 1 refuses a version-2 file by its version.
//!
//! Saving streams `<path>.tmp-<pid>-<n>`, syncs it and renames it over
//! `path`, so a reader sees the old file or the new one, never half of one.
//! The old file is opened before the rename and that handle closed on the
//! process's releaser thread (`release_later`): the close that frees its
//! storage (page by page on a tmpfs, a third of the write's time) runs off
//! the save's time instead of inside the rename.
//! A save first removes the temps of earlier saves to the same path whose
//! process is gone (a killed save; Linux, where `/proc` tells), so they do
//! not pile up.
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
//! most [`PIECE_BYTES`] each hashed (its entry's checksum) right after it
//! arrives, while it is still in the core's cache; each entry's check (its
//! hash and checksum against the index, its bytes against its checksum);
//! and the copies of the new entries into their blocks. One worker's read
//! overlaps the others' hashes and copies, and on a host of many cores
//! three readers outrun the one of a plain file read. The buffers are the
//! `BlockIo`'s, kept between calls ([`BlockIo::keep_buffer`]): pinned
//! memory is page-locked once, not at every save and load.
//!
//! Loading reads the file once. [`LoadTarget::verify`] checks its size,
//! magic, version and header fields against this manager and reads its
//! index (each entry's hash and checksum: 24 bytes of each); the manager
//! notes the new entries, checks capacity and allocates fresh blocks (refs
//! — never raw ids, and not in the cache: nothing sees them);
//! [`PendingLoad::copy_in`] then reads every entry, checking each byte as
//! above while the new blocks are filled. Only when every check and copy
//! has passed are the entries inserted. Any failure — a corrupted file, or
//! one changed or truncated while it is read (its bytes then disagree with
//! the index, a checksum or the trailer) — drops the fresh refs and leaves
//! the manager as it was. Only regular files are read or replaced (a FIFO
//! would block the open forever). A manager with prefix caching off
//! refuses a load (`InvalidArgument`): it would hold the blocks and never
//! hit them.
//!
//! The checksums are XXH3 (64 bits a block, 128 the trailer), as version 1
//! has always written: it hashes at memory speed, and right after the read
//! of the same bytes it reads them from cache.
//!
//! Thread safety: the file I/O runs outside the manager's lock. A save takes
//! a [`PrefixSnapshot`] under it (a ref on each cached block, so none is
//! reused while the file is written) and writes without it; a load verifies
//! the file without it, takes the lock to allocate, copies without it, and
//! takes it again to insert. Refs held outside the lock are registered as
//! lent ([`LentRefs`]), which
//! [`KVCacheManager::check_invariants`](crate::kv::KVCacheManager::check_invariants)
//! counts.
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

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64, Xxh3};

use crate::block_pool::{BlockId, SharedBlockRef};
use crate::error::MemError;
use crate::kv::hash::BlockHash;
use crate::kv::prefix::FastMap;
use crate::pinned::{PinnedBuffer, PinnedHost};

/// The file's first bytes.
pub const FILE_MAGIC: &[u8; 8] = b"IMPKVPC\0";
/// The format version this build writes (it reads version 1 too).
pub const FILE_VERSION: u32 = 2;

/// What a file's trailer hashes after its head (magic, version, header
/// length, header), by the file's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrailerOver {
    /// Version 1: every entry whole (record and block bytes).
    Entries,
    /// Version 2: each entry's 24-byte record (hash and checksum), whose
    /// checksum stands for the block's bytes.
    Records,
}

impl TrailerOver {
    /// The trailer of a file of `version`, or `None` for a version this
    /// build does not read.
    fn of_version(version: u32) -> Option<Self> {
        match version {
            1 => Some(Self::Entries),
            2 => Some(Self::Records),
            _ => None,
        }
    }
}

pub(crate) const FORMAT: &str = "imp-mem prefix cache";

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

/// The file's JSON header: what a file must match to load (every field but
/// `entries` and `checksum`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Header {
    pub format: String,
    pub version: u32,
    pub model_fingerprint: String,
    pub block_size: usize,
    pub block_bytes: usize,
    pub dtype: String,
    pub layout: String,
    pub hash_algorithm: String,
    pub hash_seed: u64,
    pub entries: u64,
    pub checksum: String,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> MemError {
    MemError::invalid(format!("{what} {}: {e}", path.display()))
}

pub(crate) fn refuse(path: &Path, why: impl std::fmt::Display) -> MemError {
    MemError::invalid(format!(
        "refusing prefix cache file {}: {why}; nothing was loaded",
        path.display()
    ))
}

/// The header of a one-block file of the disk tier (`kv::disk_tier`): the
/// manager's own, for one entry, so a spilled block is a prefix-cache file
/// of one entry that `load_prefix_cache` also reads.
#[derive(Debug, Clone)]
pub(crate) struct BlockFileFormat {
    header: Vec<u8>,
    block_bytes: usize,
}

impl BlockFileFormat {
    /// The format of one-block files under `header` (a header of one
    /// entry), for blocks of `block_bytes`.
    pub fn new(header: &Header, block_bytes: usize) -> Result<Self, MemError> {
        let header = serde_json::to_vec(header)
            .map_err(|e| MemError::Invariant(format!("header does not serialise: {e}")))?;
        Ok(Self {
            header,
            block_bytes,
        })
    }

    /// Bytes of the JSON header.
    pub fn header_len(&self) -> usize {
        self.header.len()
    }

    /// The bytes before a block's own: magic, version, header length,
    /// header, and the entry's hash and checksum.
    fn head(&self, hash: BlockHash, sum: u64) -> Vec<u8> {
        let mut head = Vec::with_capacity(16 + self.header.len() + 24);
        head.extend_from_slice(FILE_MAGIC);
        head.extend_from_slice(&FILE_VERSION.to_le_bytes());
        head.extend_from_slice(&(self.header.len() as u32).to_le_bytes());
        head.extend_from_slice(&self.header);
        head.extend_from_slice(&hash.to_le_bytes());
        head.extend_from_slice(&sum.to_le_bytes());
        head
    }

    /// Writes `bytes` as block `hash` to `path`, through a temporary file
    /// renamed over it (a reader sees a whole file or none). Three writes
    /// straight from the caller's bytes (no copy through a buffer), and no
    /// sync: the tier's files are a cache of this process, which a crash
    /// loses with the index that names them.
    pub fn write(&self, path: &Path, hash: BlockHash, bytes: &[u8]) -> Result<(), MemError> {
        if bytes.len() != self.block_bytes {
            return Err(MemError::invalid(format!(
                "{} bytes are not a block of {}",
                bytes.len(),
                self.block_bytes
            )));
        }
        let mut tmp_name = path.as_os_str().to_os_string();
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp_name);
        let failed = |e| io_err("cannot write the block file", path, e);
        let written = (|| -> Result<(), MemError> {
            // The head ends with the entry's record: all the trailer hashes.
            let head = self.head(hash, xxh3_64(bytes));
            let mut out = File::create(&tmp).map_err(failed)?;
            out.write_all(&head).map_err(failed)?;
            out.write_all(bytes).map_err(failed)?;
            out.write_all(&xxh3_128(&head).to_le_bytes())
                .map_err(failed)?;
            drop(out);
            fs::rename(&tmp, path).map_err(failed)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }

    /// Reads block `hash` back from `path` into `dst` (a block long),
    /// refusing a file that is not exactly what [`Self::write`] wrote for it
    /// (header, hash, checksums). The block's bytes are read straight into
    /// `dst`; on a refusal its contents are unspecified. Hands back the file
    /// it opened (when it did), still open: a caller that deletes the file
    /// and closes it later frees its storage at that close, off its own
    /// time (`DiskTier::taken`).
    pub fn read_open(
        &self,
        path: &Path,
        hash: BlockHash,
        dst: &mut [u8],
    ) -> (Result<(), MemError>, Option<File>) {
        let mut opened = None;
        let read = self.read_in(path, hash, dst, &mut opened);
        (read, opened)
    }

    fn read_in(
        &self,
        path: &Path,
        hash: BlockHash,
        dst: &mut [u8],
        opened: &mut Option<File>,
    ) -> Result<(), MemError> {
        let failed = |e| io_err("cannot read the block file", path, e);
        let not_ours = || refuse(path, "it is not this manager's block file");
        if dst.len() != self.block_bytes {
            return Err(MemError::invalid(format!(
                "a buffer of {} bytes holds no block of {}",
                dst.len(),
                self.block_bytes
            )));
        }
        let file = opened.insert(File::open(path).map_err(failed)?);
        let head_len = 16 + self.header.len() + 24;
        let want_len = (head_len + self.block_bytes + 16) as u64;
        if file.metadata().map_err(failed)?.len() != want_len {
            return Err(not_ours());
        }
        let mut head = vec![0u8; head_len];
        let mut trailer = [0u8; 16];
        file.read_exact(&mut head).map_err(|_| not_ours())?;
        file.read_exact(dst).map_err(|_| not_ours())?;
        file.read_exact(&mut trailer).map_err(|_| not_ours())?;
        let entry = &head[head_len - 24..];
        let sum = u64::from_le_bytes(entry[16..].try_into().unwrap_or_default());
        if head[..head_len - 24] != self.head(0, 0)[..head_len - 24] {
            return Err(not_ours());
        }
        if xxh3_128(&head) != u128::from_le_bytes(trailer) {
            return Err(refuse(path, "the file checksum does not match (corrupted)"));
        }
        let stored = u128::from_le_bytes(entry[..16].try_into().unwrap_or_default());
        if stored != hash || xxh3_64(dst) != sum {
            return Err(refuse(path, "it holds another block or a corrupted one"));
        }
        Ok(())
    }
}

/// Refuses a file saved under another configuration, naming every field
/// that differs.
fn check_header(path: &Path, header: &Header, want: &Header) -> Result<(), MemError> {
    let want = want.clone();
    let fields = [
        ("format", header.format.clone(), want.format),
        (
            "model_fingerprint",
            header.model_fingerprint.clone(),
            want.model_fingerprint,
        ),
        (
            "block_size",
            header.block_size.to_string(),
            want.block_size.to_string(),
        ),
        (
            "block_bytes",
            header.block_bytes.to_string(),
            want.block_bytes.to_string(),
        ),
        ("dtype", header.dtype.clone(), want.dtype),
        ("layout", header.layout.clone(), want.layout),
        (
            "hash_algorithm",
            header.hash_algorithm.clone(),
            want.hash_algorithm,
        ),
        (
            "hash_seed",
            header.hash_seed.to_string(),
            want.hash_seed.to_string(),
        ),
    ];
    let mismatches: Vec<String> = fields
        .into_iter()
        .filter(|(_, theirs, ours)| theirs != ours)
        .map(|(name, theirs, ours)| format!("{name} is {theirs:?} in the file but {ours:?} here"))
        .collect();
    if mismatches.is_empty() {
        return Ok(());
    }
    Err(refuse(
        path,
        format!(
            "it was saved for another configuration: {}",
            mismatches.join("; ")
        ),
    ))
}

/// Block refs held outside the manager's lock (a save's snapshot, a load's
/// fresh blocks), registered so that the manager's invariant check counts
/// them. Registration and release happen under the registry's lock, which
/// the check holds while it reads the pool's refcounts.
#[derive(Debug, Default)]
pub(crate) struct Lent {
    ids: Mutex<FastMap<BlockId, u32>>,
}

impl Lent {
    /// The registry, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, FastMap<BlockId, u32>> {
        self.ids.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Refs lent out of a manager; see [`Lent`]. Dropping them releases them.
#[derive(Debug)]
pub struct LentRefs {
    refs: Vec<SharedBlockRef>,
    lent: Arc<Lent>,
}

impl LentRefs {
    pub(crate) fn new(refs: Vec<SharedBlockRef>, lent: &Arc<Lent>) -> Self {
        let mut ids = lent.lock();
        for r in &refs {
            *ids.entry(r.id()).or_default() += 1;
        }
        drop(ids);
        Self {
            refs,
            lent: lent.clone(),
        }
    }

    /// Takes the refs back under the manager's lock (unregistered).
    pub(crate) fn take(&mut self) -> Vec<SharedBlockRef> {
        let mut ids = self.lent.lock();
        for r in &self.refs {
            unregister(&mut ids, r.id());
        }
        std::mem::take(&mut self.refs)
    }
}

fn unregister(ids: &mut FastMap<BlockId, u32>, id: BlockId) {
    if let Some(n) = ids.get_mut(&id) {
        *n -= 1;
        if *n == 0 {
            ids.remove(&id);
        }
    }
}

impl Drop for LentRefs {
    fn drop(&mut self) {
        let mut ids = self.lent.lock();
        for r in self.refs.drain(..) {
            unregister(&mut ids, r.id());
            drop(r);
        }
    }
}

/// What a save writes
/// ([`KVCacheManager::snapshot_prefix_cache`](crate::kv::KVCacheManager::snapshot_prefix_cache)).
#[derive(Debug)]
pub struct PrefixSnapshot {
    pub(crate) io: Arc<dyn BlockIo>,
    pub(crate) header: Vec<u8>,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) refs: LentRefs,
}

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

/// Temps of one save: a counter keeps two saves of one process apart.
static SAVES: AtomicU64 = AtomicU64::new(0);

impl PrefixSnapshot {
    /// Writes the file atomically; returns the entries written.
    ///
    /// Streamed in chunks of whole entries through [`BUFFERS`] host
    /// buffers (pinned where the pool has pinned memory) passed along three
    /// stages at once: this thread copies blocks out of the pool into a
    /// chunk laid out as the file is, a second computes the blocks'
    /// checksums into it and feeds the entries' records to the trailer's
    /// hash, and a third writes it to the file.
    pub fn write(self, path: &Path) -> Result<u64, MemError> {
        refuse_irregular(path, "write the prefix cache to")?;
        let file_name = path
            .file_name()
            .ok_or_else(|| MemError::invalid(format!("{} names no file", path.display())))?;
        remove_dead_temps(path);
        let mut tmp_name = file_name.to_os_string();
        tmp_name.push(format!(
            ".tmp-{}-{}",
            std::process::id(),
            SAVES.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = path.with_file_name(tmp_name);
        let failed = |e| io_err("cannot write the prefix cache to", path, e);
        let written = (|| -> Result<Option<File>, MemError> {
            let file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(failed)?;
            let file = self.stream(file).map_err(|e| match e {
                Streamed::Io(e) => failed(e),
                Streamed::Mem(e) => e,
            })?;
            file.sync_all().map_err(failed)?;
            drop(file);
            let replaced = open_to_release(path);
            fs::rename(&tmp, path).map_err(failed)?;
            Ok(replaced)
        })();
        let replaced = match written {
            Ok(replaced) => replaced,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if let Some(old) = replaced {
            release_later(old);
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Makes the rename durable; best effort where directories cannot
            // be opened.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(self.hashes.len() as u64)
    }

    /// Writes magic, version, header, entries and trailer to `file` (the
    /// three-stage pipeline of [`Self::write`]); returns the file, unsynced.
    fn stream(&self, mut file: File) -> Result<File, Streamed> {
        let io = &*self.io;
        let bb = io.block_bytes();
        let stride = 24 + bb;
        let per = entries_per_chunk(SAVE_CHUNK_BYTES, stride);
        let mut head = Vec::with_capacity(16 + self.header.len());
        head.extend_from_slice(FILE_MAGIC);
        head.extend_from_slice(&FILE_VERSION.to_le_bytes());
        head.extend_from_slice(&(self.header.len() as u32).to_le_bytes());
        head.extend_from_slice(&self.header);
        file.write_all(&head).map_err(Streamed::Io)?;
        let refs = &self.refs.refs;
        let n = refs.len();
        let stop = AtomicBool::new(false);
        let (free_tx, free_rx) = sync_channel::<HostBuf>(BUFFERS);
        for buf in chunk_buffers(io, refs.first(), per.min(n.max(1)) * stride) {
            let _ = free_tx.send(buf);
        }
        let (hash_tx, hash_rx) = sync_channel::<(usize, HostBuf)>(BUFFERS);
        let (write_tx, write_rx) = sync_channel::<(usize, HostBuf)>(BUFFERS);
        std::thread::scope(|s| {
            let stop = &stop;
            let hasher = s.spawn(move || {
                let mut trailer = Xxh3::new();
                trailer.update(&head);
                for (len, mut buf) in hash_rx {
                    let chunk = &mut buf.as_mut_slice()[..len];
                    for entry in chunk.chunks_exact_mut(stride) {
                        let sum = xxh3_64(&entry[24..]);
                        entry[16..24].copy_from_slice(&sum.to_le_bytes());
                        trailer.update(&entry[..24]);
                    }
                    if write_tx.send((len, buf)).is_err() {
                        break;
                    }
                }
                trailer.digest128()
            });
            let writer = s.spawn(move || {
                let mut failed = None;
                for (len, buf) in write_rx {
                    if failed.is_none() {
                        if let Err(e) = file.write_all(&buf.as_slice()[..len]) {
                            failed = Some(e);
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    let _ = free_tx.send(buf);
                }
                failed.map_or(Ok(file), Err)
            });
            // This thread: the blocks out of the pool, chunk by chunk.
            let mut copy_failed = None;
            let mut k = 0;
            while k < n && !stop.load(Ordering::Relaxed) {
                let Ok(mut buf) = free_rx.recv() else {
                    break;
                };
                let count = per.min(n - k);
                let chunk = &mut buf.as_mut_slice()[..count * stride];
                let mut copies = Vec::with_capacity(count);
                for (j, entry) in chunk.chunks_exact_mut(stride).enumerate() {
                    let (head, bytes) = entry.split_at_mut(24);
                    head[..16].copy_from_slice(&self.hashes[k + j].to_le_bytes());
                    copies.push((&refs[k + j], bytes));
                }
                if let Err(e) = io.read_blocks_staged(&mut copies) {
                    copy_failed = Some(e);
                    break;
                }
                drop(copies);
                if hash_tx.send((count * stride, buf)).is_err() {
                    break;
                }
                k += count;
            }
            drop(hash_tx);
            let trailer = joined(hasher);
            let file = joined(writer);
            for buf in free_rx.try_iter() {
                io.keep_buffer(buf);
            }
            if let Some(e) = copy_failed {
                return Err(Streamed::Mem(e));
            }
            let mut file = file.map_err(Streamed::Io)?;
            file.write_all(&trailer.to_le_bytes())
                .map_err(Streamed::Io)?;
            Ok(file)
        })
    }
}

/// The regular file at `path`, opened to be held across the rename that
/// replaces it or the deletion that removes it (then closed by
/// [`release_later`]), or `None` (no file, not a regular one, a symlink,
/// or not readable). Non-blocking, so a FIFO put there meanwhile cannot
/// hang it.
pub(crate) fn open_to_release(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOFOLLOW;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits() as i32)
        .open(path)
        .ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

/// Closes `file`, the last handle of a deleted or replaced file, on a
/// thread of the process's (started at the first call, then waiting for
/// the next): the close frees the file's storage — on a tmpfs every page
/// of it, as long as a third of writing it — which the rename over its
/// last link (a save) or its deletion (the disk tier's) would otherwise do
/// in the caller's time. The storage is freed a moment after the call
/// returns. Closed here instead when the thread's queue is full (at most
/// [`RELEASE_QUEUE`] files wait, so that waiting handles cannot use up the
/// process's descriptors, and a caller faster than the frees takes its
/// share of them), when the thread cannot start, and in a child forked
/// after it started (which has no such thread).
pub(crate) fn release_later(file: File) {
    type Releaser = Option<(u32, std::sync::mpsc::SyncSender<File>)>;
    static RELEASER: std::sync::OnceLock<Releaser> = std::sync::OnceLock::new();
    let releaser = RELEASER.get_or_init(|| {
        let (tx, rx) = sync_channel::<File>(RELEASE_QUEUE);
        std::thread::Builder::new()
            .name("imp-mem-release".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| (std::process::id(), tx))
    });
    match releaser {
        Some((pid, tx)) if *pid == std::process::id() => {
            // Full or gone: the file comes back in the error, closed here.
            drop(tx.try_send(file));
        }
        _ => drop(file),
    }
}

/// Files at most waiting for the releaser thread ([`release_later`]).
pub(crate) const RELEASE_QUEUE: usize = 64;

/// A streamed save's failure: of the file, or of a block's copy.
enum Streamed {
    Io(std::io::Error),
    Mem(MemError),
}

/// Refuses `path` when it exists and is not a regular file: opening a FIFO
/// blocks until a writer comes, and a device or a directory is no cache.
fn refuse_irregular(path: &Path, what: &str) -> Result<(), MemError> {
    match fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(MemError::invalid(format!(
            "cannot {what} {}: it is not a regular file (a directory, FIFO, socket or device); \
             pass the path of a regular file",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// Removes `<path>.tmp-<pid>[-<n>]` files whose process is gone (killed
/// saves). Only where `/proc` lists processes (Linux); best effort.
fn remove_dead_temps(path: &Path) {
    let proc = Path::new("/proc/self");
    let (Some(name), Some(dir)) = (path.file_name(), path.parent()) else {
        return;
    };
    if !proc.exists() {
        return;
    }
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(listing) = fs::read_dir(dir) else {
        return;
    };
    let mut prefix = name.to_os_string();
    prefix.push(".tmp-");
    let prefix = prefix.to_string_lossy().into_owned();
    for entry in listing.flatten() {
        let file = entry.file_name();
        let Some(rest) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        let regular = entry.file_type().is_ok_and(|t| t.is_file());
        if !alive && regular {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// What a file must match to load into a manager
/// ([`KVCacheManager::load_target`](crate::kv::KVCacheManager::load_target)).
#[derive(Debug)]
pub struct LoadTarget {
    pub(crate) want: Header,
    pub(crate) io: Arc<dyn BlockIo>,
}

/// A file whose size, magic, version and header fields were checked, and
/// whose entries were indexed; the checksums are checked as the blocks are
/// read in ([`PendingLoad::copy_in`]).
#[derive(Debug)]
pub struct VerifiedFile {
    pub(crate) path: PathBuf,
    file: File,
    io: Arc<dyn BlockIo>,
    /// Magic, version, header length and header: the trailer's first bytes.
    head: Vec<u8>,
    /// What the trailer hashes after `head` (the file's version).
    trailer_over: TrailerOver,
    stride: u64,
    /// `(hash, index in the file, block checksum)` of every entry, in order.
    pub(crate) entries: Vec<(BlockHash, u64, u64)>,
}

/// Fresh blocks allocated for a load, to be filled and inserted.
#[derive(Debug)]
pub struct PendingLoad {
    pub(crate) refs: LentRefs,
    pub(crate) fresh: Vec<(BlockHash, u64, u64)>,
    pub(crate) file: VerifiedFile,
    /// The main pool's capacity before the reservation grew it: what
    /// [`KVCacheManager::abandon_load`](crate::kv::KVCacheManager::abandon_load)
    /// shrinks back to.
    pub(crate) capacity_before: u32,
}

impl LoadTarget {
    /// Opens `path`, checks its size, magic, version and header against
    /// this manager, and reads the entries' index (each entry's hash and
    /// checksum, 24 bytes of each): what the manager needs to choose the
    /// entries it lacks and allocate their blocks. The block bytes and every
    /// checksum are read and checked once, by [`PendingLoad::copy_in`].
    pub fn verify(self, path: &Path) -> Result<VerifiedFile, MemError> {
        let bb = self.io.block_bytes();
        let read_err = |e| io_err("cannot read the prefix cache", path, e);
        refuse_irregular(path, "read the prefix cache")?;
        let file = File::open(path).map_err(read_err)?;
        let meta = file.metadata().map_err(read_err)?;
        refuse_irregular(path, "read the prefix cache")?;
        let len = meta.len();
        let mut prefix = [0u8; 16];
        if len < 16 + 16
            || file.read_exact_at(&mut prefix, 0).is_err()
            || &prefix[..8] != FILE_MAGIC
        {
            return Err(refuse(
                path,
                "it is not an imp-mem prefix cache (bad magic or too short)",
            ));
        }
        let word = |at: usize| {
            u32::from_le_bytes([prefix[at], prefix[at + 1], prefix[at + 2], prefix[at + 3]])
        };
        let version = word(8);
        let Some(trailer_over) = TrailerOver::of_version(version) else {
            return Err(refuse(
                path,
                format!("format version {version}; this build reads versions 1 to {FILE_VERSION}"),
            ));
        };
        let header_len = word(12) as u64;
        let body = 16 + header_len;
        if body + 16 > len {
            return Err(refuse(path, "truncated inside the header"));
        }
        let mut head = vec![0u8; body as usize];
        file.read_exact_at(&mut head, 0).map_err(read_err)?;
        if head[..16] != prefix {
            return Err(refuse(path, "it changed while it was being loaded"));
        }
        let header: Header = serde_json::from_slice(&head[16..])
            .map_err(|e| refuse(path, format!("unreadable header ({e})")))?;
        check_header(path, &header, &self.want)?;
        let n = header.entries;
        let stride = 24 + bb as u64;
        let expected = n
            .checked_mul(stride)
            .and_then(|e| e.checked_add(body + 16))
            .ok_or_else(|| refuse(path, "absurd entry count"))?;
        if len != expected {
            return Err(refuse(
                path,
                format!(
                    "it is {len} bytes but its header promises {expected} ({n} entries of {bb} \
                     bytes): {}",
                    if len < expected {
                        "truncated"
                    } else {
                        "trailing garbage"
                    }
                ),
            ));
        }
        // The index: each entry's hash and checksum. What they claim is
        // checked against the bytes (and the trailer) by `copy_in`.
        let mut entries = Vec::with_capacity(n as usize);
        let mut at = [0u8; 24];
        for k in 0..n {
            file.read_exact_at(&mut at, body + k * stride)
                .map_err(|_| refuse(path, "it changed while it was being loaded"))?;
            let hash = u128::from_le_bytes(at[..16].try_into().unwrap_or_default());
            let sum = u64::from_le_bytes(at[16..].try_into().unwrap_or_default());
            entries.push((hash, k, sum));
        }
        Ok(VerifiedFile {
            path: path.to_path_buf(),
            file,
            io: self.io,
            head,
            trailer_over,
            stride,
            entries,
        })
    }
}

/// Bytes a load reads at once and hashes right after, on the same core:
/// small enough to be still in its L2 cache for the hash (an entry larger
/// than this is read in equal parts).
const PIECE_BYTES: usize = 512 << 10;

/// Why a chunk of a load failed.
enum ChunkFailed {
    /// An entry disagrees with the index or its checksum.
    Refused(MemError),
    /// The read (short: truncated meanwhile).
    Io(std::io::Error),
    /// A block's copy.
    Copy(MemError),
}

/// What every worker of a load shares ([`PendingLoad::copy_in`]).
struct LoadPass<'a> {
    file: &'a File,
    path: &'a Path,
    io: &'a dyn BlockIo,
    /// The first entry's offset in the file.
    body: u64,
    stride: usize,
    /// Entries a chunk.
    per: usize,
    chunks: usize,
    /// `(hash, index, checksum)` of every entry, from the index.
    entries: &'a [(BlockHash, u64, u64)],
    /// For each entry, its fresh block among `refs` (`None`: not loaded).
    target: &'a [Option<usize>],
    refs: &'a [SharedBlockRef],
    /// The next chunk to claim.
    next: AtomicUsize,
    /// Set by the first failure: the workers stop claiming.
    stop: AtomicBool,
    /// The failure of the earliest chunk, by chunk.
    failed: Mutex<Option<(usize, ChunkFailed)>>,
}

impl LoadPass<'_> {
    /// Claims chunks until none is left or a worker failed: each read into
    /// `buf` (its bytes hashed piece by piece as they arrive), checked and
    /// its new entries copied into their blocks. `trailer`, where given,
    /// takes every chunk whole (version 1; there is one worker then, so in
    /// file order).
    fn work(&self, buf: &mut HostBuf, mut trailer: Option<&mut Xxh3>) {
        while !self.stop.load(Ordering::Relaxed) {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            if c >= self.chunks {
                break;
            }
            let first = c * self.per;
            let count = self.per.min(self.entries.len() - first);
            let chunk = &mut buf.as_mut_slice()[..count * self.stride];
            if let Err(e) = self.chunk(first, chunk) {
                self.stop.store(true, Ordering::Relaxed);
                let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                if failed.as_ref().is_none_or(|(at, _)| c < *at) {
                    *failed = Some((c, e));
                }
                break;
            }
            if let Some(t) = trailer.as_deref_mut() {
                t.update(chunk);
            }
        }
    }

    /// Reads, checks and copies the `chunk.len() / stride` entries from
    /// entry `first`.
    fn chunk(&self, first: usize, chunk: &mut [u8]) -> Result<(), ChunkFailed> {
        let stride = self.stride;
        let parts = stride.div_ceil(PIECE_BYTES);
        let piece = stride.div_ceil(parts);
        for (j, entry) in chunk.chunks_exact_mut(stride).enumerate() {
            let k = first + j;
            let at = self.body + (k * stride) as u64;
            let mut sum = Xxh3::new();
            let mut done = 0;
            while done < stride {
                let end = (done + piece).min(stride);
                self.file
                    .read_exact_at(&mut entry[done..end], at + done as u64)
                    .map_err(ChunkFailed::Io)?;
                sum.update(&entry[done.max(24)..end]);
                done = end;
            }
            let hash = u128::from_le_bytes(entry[..16].try_into().unwrap_or_default());
            let stored = u64::from_le_bytes(entry[16..24].try_into().unwrap_or_default());
            let (want_hash, _, want_sum) = self.entries[k];
            let why = if (hash, stored) != (want_hash, want_sum) {
                format!("block {k} changed while it was being loaded")
            } else if sum.digest() != stored {
                format!(
                    "block {k}'s checksum does not match (corrupted, or changed while it was \
                     being loaded)"
                )
            } else {
                continue;
            };
            return Err(ChunkFailed::Refused(refuse(self.path, why)));
        }
        // The chunk's new entries, as one batch.
        let bb = stride - 24;
        let copies: Vec<_> = chunk
            .chunks_exact(stride)
            .zip(&self.target[first..])
            .filter_map(|(entry, &i)| Some((&self.refs[i?], &entry[24..24 + bb])))
            .collect();
        if copies.is_empty() {
            return Ok(());
        }
        self.io
            .write_blocks_staged(&copies)
            .map_err(ChunkFailed::Copy)
    }
}

impl PendingLoad {
    /// Reads the file's entries once, in chunks of whole entries, and
    /// checks every byte while the new blocks' bytes are copied into their
    /// fresh (not yet visible) blocks: each entry against the index and its
    /// checksum, and the whole file against the trailer. Any mismatch fails
    /// it (the caller then drops the fresh blocks: nothing was loaded).
    ///
    /// [`BUFFERS`] workers (this thread and two more), each with a host
    /// buffer of its own (pinned where the pool has pinned memory), claim
    /// chunks in turn and take each through every step on one core: read
    /// in pieces of at most [`PIECE_BYTES`], each hashed right after its
    /// read (while it is in the core's cache), the entries checked against
    /// the index, the new ones copied into their blocks as one batch. The
    /// reads of one worker overlap the hashes and the copies of the others,
    /// and together they read faster than one reader could. A version-2
    /// trailer is the hash of the index the entries were checked against;
    /// a version-1 file, whose trailer hashes every byte in order, is read
    /// by this thread alone.
    pub fn copy_in(&mut self) -> Result<(), MemError> {
        let f = &self.file;
        let path = f.path.as_path();
        let io = &*f.io;
        let stride = f.stride as usize;
        let n = f.entries.len();
        let per = entries_per_chunk(CHUNK_BYTES, stride);
        let refs = &self.refs.refs;
        let mut target: Vec<Option<usize>> = vec![None; n];
        for (i, &(_, k, _)) in self.fresh.iter().enumerate() {
            if let Some(t) = target.get_mut(k as usize) {
                *t = Some(i);
            }
        }
        let pass = LoadPass {
            file: &f.file,
            path,
            io,
            body: f.head.len() as u64,
            stride,
            per,
            chunks: n.div_ceil(per),
            entries: &f.entries,
            target: &target,
            refs,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        };
        let mut buffers = chunk_buffers(io, refs.first(), per.min(n.max(1)) * stride);
        let mut whole = (f.trailer_over == TrailerOver::Entries).then(|| {
            let mut t = Xxh3::new();
            t.update(&f.head);
            t
        });
        let workers = if whole.is_some() {
            1
        } else {
            pass.chunks.clamp(1, buffers.len())
        };
        std::thread::scope(|s| {
            let (mine, others) = buffers.split_at_mut(1);
            let pass = &pass;
            let helpers: Vec<_> = others[..workers - 1]
                .iter_mut()
                .map(|buf| s.spawn(move || pass.work(buf, None)))
                .collect();
            pass.work(&mut mine[0], whole.as_mut());
            helpers.into_iter().for_each(joined);
        });
        for buf in buffers {
            io.keep_buffer(buf);
        }
        if let Some((_, failed)) = pass.failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(match failed {
                ChunkFailed::Refused(e) | ChunkFailed::Copy(e) => e,
                ChunkFailed::Io(e) => read_failed(path, e),
            });
        }
        let trailer = match whole {
            Some(t) => t.digest128(),
            None => {
                let mut t = Xxh3::new();
                t.update(&f.head);
                for &(hash, _, sum) in &f.entries {
                    t.update(&hash.to_le_bytes());
                    t.update(&sum.to_le_bytes());
                }
                t.digest128()
            }
        };
        let mut stored = [0u8; 16];
        f.file
            .read_exact_at(&mut stored, pass.body + (n * stride) as u64)
            .map_err(|e| read_failed(path, e))?;
        if trailer != u128::from_le_bytes(stored) {
            return Err(refuse(path, "the file checksum does not match (corrupted)"));
        }
        Ok(())
    }
}

/// A load's read error: a short read is the file truncated meanwhile.
fn read_failed(path: &Path, e: std::io::Error) -> MemError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            refuse(path, "it was truncated while it was being loaded")
        }
        _ => io_err("cannot read the prefix cache", path, e),
    }
}
