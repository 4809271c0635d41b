//! Prefix-cache persistence: the file format, its checks, and the block
//! copies ([`BlockIo`]). The manager's `save_prefix_cache` /
//! `load_prefix_cache` (`kv/manager/persist.rs`) build a header from their
//! configuration and drive the steps below; this module knows no manager,
//! so the disk tier's one-block files ([`BlockFileFormat`]) use it too.
//!
//! # File format (version 1, little-endian)
//!
//! ```text
//! magic        8   b"IMPKVPC\0"
//! version      4   u32 = 1
//! header_len   4   u32
//! header       …   JSON: format, version, model_fingerprint, block_size,
//!                  block_bytes, dtype, layout, hash_algorithm, hash_seed,
//!                  entries, checksum
//! entries      K × (hash u128 ‖ xxh3-64 of the bytes u64 ‖ block_bytes bytes)
//! trailer      16  xxh3-128 of everything before it
//! ```
//!
//! Saving streams `<path>.tmp-<pid>-<n>` (one block in host memory at a
//! time), syncs it and renames it over `path`, so a reader sees the old file
//! or the new one, never half of one. A save first removes the temps of
//! earlier saves to the same path whose process is gone (a killed save;
//! Linux, where `/proc` tells), so they do not pile up. Loading streams the
//! file twice with one block in host memory: the first pass verifies
//! everything (size, magic, version, header fields against this manager,
//! each block's checksum, the trailer checksum); then it notes the new
//! entries, checks capacity, allocates fresh blocks (refs — never raw ids),
//! and the second pass copies each new block's bytes in through [`BlockIo`],
//! checking its checksum again (the file may have changed in between). Only
//! when every copy has succeeded are the entries inserted. Any failure drops
//! the fresh refs and leaves the manager as it was. Only regular files are
//! read or replaced (a FIFO would block the open forever). A manager with
//! prefix caching off refuses a load (`InvalidArgument`): it would hold the
//! blocks and never hit them.
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
//! pool's region and source (device → host buffer → file on a GPU, a memcpy
//! on the fake). Tests install others to inject faults. Pins are run-time
//! policy and are not persisted.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::block_pool::{BlockId, SharedBlockRef};
use crate::error::MemError;
use crate::kv::hash::BlockHash;
use crate::kv::prefix::FastMap;
use crate::pinned::{PinnedBuffer, PinnedHost};

/// The file's first bytes.
pub const FILE_MAGIC: &[u8; 8] = b"IMPKVPC\0";
/// The format version this build writes and reads.
pub const FILE_VERSION: u32 = 1;
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
#[derive(Debug)]
pub struct PoolBlockIo {
    block_bytes: usize,
    /// `None` until the first copy; then the buffer, or `Some(None)` where
    /// the source has no pinned memory or pinning failed (copied direct).
    staging: Mutex<Option<Option<PinnedBuffer>>>,
}

impl PoolBlockIo {
    /// Copies blocks of `block_bytes` (the pool's block size; a block of
    /// another size is refused by the copy).
    pub fn new(block_bytes: usize) -> Self {
        Self {
            block_bytes,
            staging: Mutex::new(None),
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

/// A file writer that also feeds everything it writes to the trailer's hash.
struct HashingWriter {
    out: BufWriter<File>,
    hash: Xxh3,
}

impl HashingWriter {
    fn new(file: File) -> Self {
        Self {
            out: BufWriter::with_capacity(1 << 20, file),
            hash: Xxh3::new(),
        }
    }

    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hash.update(bytes);
        self.out.write_all(bytes)
    }

    /// Appends the trailer (the hash of everything before it) and syncs.
    fn finish(mut self) -> std::io::Result<()> {
        let trailer = self.hash.digest128();
        self.out.write_all(&trailer.to_le_bytes())?;
        let file = self.out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()
    }
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

    /// Writes `bytes` as block `hash` to `path`, through a temporary file
    /// renamed over it (a reader sees a whole file or none).
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
            let mut out = HashingWriter::new(File::create(&tmp).map_err(failed)?);
            out.put(FILE_MAGIC).map_err(failed)?;
            out.put(&FILE_VERSION.to_le_bytes()).map_err(failed)?;
            out.put(&(self.header.len() as u32).to_le_bytes())
                .map_err(failed)?;
            out.put(&self.header).map_err(failed)?;
            out.put(&hash.to_le_bytes()).map_err(failed)?;
            out.put(&xxh3_64(bytes).to_le_bytes()).map_err(failed)?;
            out.put(bytes).map_err(failed)?;
            out.finish().map_err(failed)?;
            fs::rename(&tmp, path).map_err(failed)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }

    /// Reads block `hash` back from `path`, refusing a file that is not
    /// exactly what [`Self::write`] wrote for it (header, hash, checksums).
    pub fn read(&self, path: &Path, hash: BlockHash) -> Result<Vec<u8>, MemError> {
        let raw = fs::read(path).map_err(|e| io_err("cannot read the block file", path, e))?;
        let head = 16 + self.header.len();
        let want_len = head + 24 + self.block_bytes + 16;
        if raw.len() != want_len
            || &raw[..8] != FILE_MAGIC
            || raw[8..12] != FILE_VERSION.to_le_bytes()
            || raw[12..16] != (self.header.len() as u32).to_le_bytes()
            || raw[16..head] != self.header[..]
        {
            return Err(refuse(path, "it is not this manager's block file"));
        }
        let (body, trailer) = raw.split_at(want_len - 16);
        let trailer = u128::from_le_bytes(trailer.try_into().unwrap_or_default());
        if xxhash_rust::xxh3::xxh3_128(body) != trailer {
            return Err(refuse(path, "the file checksum does not match (corrupted)"));
        }
        let entry = &body[head..];
        let stored = u128::from_le_bytes(entry[..16].try_into().unwrap_or_default());
        let sum = u64::from_le_bytes(entry[16..24].try_into().unwrap_or_default());
        let bytes = &entry[24..];
        if stored != hash || xxh3_64(bytes) != sum {
            return Err(refuse(path, "it holds another block or a corrupted one"));
        }
        Ok(bytes.to_vec())
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

/// Temps of one save: a counter keeps two saves of one process apart.
static SAVES: AtomicU64 = AtomicU64::new(0);

impl PrefixSnapshot {
    /// Writes the file atomically; returns the entries written.
    pub fn write(self, path: &Path) -> Result<u64, MemError> {
        refuse_irregular(path, "write the prefix cache to")?;
        let bb = self.io.block_bytes();
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
        let written = (|| -> Result<(), MemError> {
            let file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(failed)?;
            let mut out = HashingWriter::new(file);
            out.put(FILE_MAGIC).map_err(failed)?;
            out.put(&FILE_VERSION.to_le_bytes()).map_err(failed)?;
            out.put(&(self.header.len() as u32).to_le_bytes())
                .map_err(failed)?;
            out.put(&self.header).map_err(failed)?;
            let mut buf = vec![0u8; bb];
            for (hash, block) in self.hashes.iter().zip(&self.refs.refs) {
                self.io.read_block(block, &mut buf)?;
                out.put(&hash.to_le_bytes()).map_err(failed)?;
                out.put(&xxh3_64(&buf).to_le_bytes()).map_err(failed)?;
                out.put(&buf).map_err(failed)?;
            }
            out.finish().map_err(failed)?;
            fs::rename(&tmp, path).map_err(failed)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
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

/// A file whose every checksum and header field was verified.
#[derive(Debug)]
pub struct VerifiedFile {
    pub(crate) path: PathBuf,
    file: BufReader<File>,
    io: Arc<dyn BlockIo>,
    body: u64,
    stride: u64,
    /// `(hash, index in the file, block checksum)` of every entry.
    pub(crate) entries: Vec<(BlockHash, u64, u64)>,
}

/// Fresh blocks allocated for a load, to be filled and inserted.
#[derive(Debug)]
pub struct PendingLoad {
    pub(crate) refs: LentRefs,
    pub(crate) fresh: Vec<(BlockHash, u64, u64)>,
    pub(crate) file: VerifiedFile,
}

impl LoadTarget {
    /// Pass 1: opens `path` and verifies everything.
    pub fn verify(self, path: &Path) -> Result<VerifiedFile, MemError> {
        let bb = self.io.block_bytes();
        let read_err = |e| io_err("cannot read the prefix cache", path, e);
        refuse_irregular(path, "read the prefix cache")?;
        let file = File::open(path).map_err(read_err)?;
        let meta = file.metadata().map_err(read_err)?;
        refuse_irregular(path, "read the prefix cache")?;
        let len = meta.len();
        let mut file = BufReader::with_capacity(1 << 20, file);
        let mut prefix = [0u8; 16];
        if len < 16 + 16 || file.read_exact(&mut prefix).is_err() || &prefix[..8] != FILE_MAGIC {
            return Err(refuse(
                path,
                "it is not an imp-mem prefix cache (bad magic or too short)",
            ));
        }
        let word = |at: usize| {
            u32::from_le_bytes([prefix[at], prefix[at + 1], prefix[at + 2], prefix[at + 3]])
        };
        let version = word(8);
        if version != FILE_VERSION {
            return Err(refuse(
                path,
                format!("format version {version}; this build reads version {FILE_VERSION}"),
            ));
        }
        let header_len = word(12) as u64;
        let body = 16 + header_len;
        if body + 16 > len {
            return Err(refuse(path, "truncated inside the header"));
        }
        let mut header_bytes = vec![0u8; header_len as usize];
        file.read_exact(&mut header_bytes).map_err(read_err)?;
        let header: Header = serde_json::from_slice(&header_bytes)
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

        // Every checksum; the entries noted.
        let mut trailer_hash = Xxh3::new();
        trailer_hash.update(&prefix);
        trailer_hash.update(&header_bytes);
        let mut entry = vec![0u8; stride as usize];
        let mut bad_block = None;
        let mut entries = Vec::new();
        for k in 0..n {
            file.read_exact(&mut entry).map_err(read_err)?;
            trailer_hash.update(&entry);
            let (h, rest) = entry.split_at(16);
            let (c, bytes) = rest.split_at(8);
            let sum = u64::from_le_bytes(c.try_into().unwrap_or_default());
            if xxh3_64(bytes) != sum {
                bad_block.get_or_insert(k);
                continue;
            }
            let hash = u128::from_le_bytes(h.try_into().unwrap_or_default());
            entries.push((hash, k, sum));
        }
        let mut trailer = [0u8; 16];
        file.read_exact(&mut trailer).map_err(read_err)?;
        if trailer_hash.digest128() != u128::from_le_bytes(trailer) {
            return Err(refuse(path, "the file checksum does not match (corrupted)"));
        }
        if let Some(k) = bad_block {
            return Err(refuse(
                path,
                format!("block {k}'s checksum does not match (corrupted)"),
            ));
        }
        Ok(VerifiedFile {
            path: path.to_path_buf(),
            file,
            io: self.io,
            body,
            stride,
            entries,
        })
    }
}

impl PendingLoad {
    /// Pass 2: the new blocks' bytes, straight from the file into them, in
    /// file order (skips stay inside the reader's buffer when short).
    pub fn copy_in(&mut self) -> Result<(), MemError> {
        let f = &mut self.file;
        let path = f.path.as_path();
        let read_err = |e| io_err("cannot read the prefix cache", path, e);
        let bb = f.io.block_bytes();
        f.file.seek(SeekFrom::Start(f.body)).map_err(read_err)?;
        let mut pos = f.body;
        let mut block = vec![0u8; bb];
        for (r, &(_, k, sum)) in self.refs.refs.iter().zip(&self.fresh) {
            let want = f.body + k * f.stride + 24;
            let skip = i64::try_from(want - pos).map_err(|_| refuse(path, "absurd offset"))?;
            f.file.seek_relative(skip).map_err(read_err)?;
            f.file.read_exact(&mut block).map_err(read_err)?;
            pos = want + bb as u64;
            if xxh3_64(&block) != sum {
                return Err(refuse(
                    path,
                    format!("block {k} changed while it was being loaded"),
                ));
            }
            f.io.write_block(r, &block)?;
        }
        Ok(())
    }
}
