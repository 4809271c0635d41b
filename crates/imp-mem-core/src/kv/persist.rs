//! Prefix-cache persistence: `save_prefix_cache` / `load_prefix_cache`.
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
//! Saving writes `<path>.tmp-<pid>`, syncs it and renames it over `path`, so
//! a reader sees the old file or the new one, never half of one. Loading
//! reads and verifies the whole file first (size, magic, version, header
//! fields against this manager, trailer checksum, each block's checksum),
//! then checks capacity, allocates fresh blocks (refs — never raw ids),
//! copies the bytes in through [`BlockIo`], and only when every copy has
//! succeeded inserts the entries. Any failure drops the fresh refs and leaves
//! the manager as it was.
//!
//! Block bytes travel through [`BlockIo`] — device → pinned host → file on a
//! GPU; a host read/write on [`FakeBackend`](crate::FakeBackend)
//! ([`FakeBlockIo`]). Pins are run-time policy and are not persisted.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::block_pool::SharedBlockRef;
use crate::error::{KvCapacityReport, MemError};
use crate::fake::FakeBackend;
use crate::kv::hash::{BlockHash, HASH_ALGORITHM};
use crate::kv::manager::KVCacheManager;
use crate::kv::prefix::Insert;

/// The file's first bytes.
pub const FILE_MAGIC: &[u8; 8] = b"IMPKVPC\0";
/// The format version this build writes and reads.
pub const FILE_VERSION: u32 = 1;
const FORMAT: &str = "imp-mem prefix cache";

/// Copies one block's bytes between the pool and host memory. The manager
/// passes a live ref, so the block cannot be released during the copy.
/// `block_bytes` is the block's whole footprint, which for a layer-major KV
/// layout is the concatenation of its pieces in every layer (the
/// implementation decides the order; the file records `layout`).
pub trait BlockIo: Send + std::fmt::Debug {
    /// Bytes per block.
    fn block_bytes(&self) -> usize;
    /// Copies the block's bytes into `dst` (`block_bytes` long).
    fn read_block(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError>;
    /// Copies `src` (`block_bytes` long) into the block.
    fn write_block(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError>;
}

/// [`BlockIo`] for a pool laid out over a [`FakeBackend`] region: a host
/// read or write at the block's span.
#[derive(Debug, Clone)]
pub struct FakeBlockIo {
    fake: FakeBackend,
    block_bytes: usize,
}

impl FakeBlockIo {
    /// Copies blocks of `block_bytes` through `fake`.
    pub fn new(fake: FakeBackend, block_bytes: usize) -> Self {
        Self { fake, block_bytes }
    }
}

impl BlockIo for FakeBlockIo {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn read_block(&self, block: &SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        let span = block.span()?;
        let data = self.fake.read(span.addr(), dst.len().min(span.len()))?;
        dst[..data.len()].copy_from_slice(&data);
        Ok(())
    }

    fn write_block(&self, block: &SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        let span = block.span()?;
        if src.len() > span.len() {
            return Err(MemError::invalid(format!(
                "{} bytes do not fit a block of {}",
                src.len(),
                span.len()
            )));
        }
        self.fake.write(span.addr(), src)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    model_fingerprint: String,
    block_size: usize,
    block_bytes: usize,
    dtype: String,
    layout: String,
    hash_algorithm: String,
    hash_seed: u64,
    entries: u64,
    checksum: String,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> MemError {
    MemError::invalid(format!("{what} {}: {e}", path.display()))
}

fn refuse(path: &Path, why: impl std::fmt::Display) -> MemError {
    MemError::invalid(format!(
        "refusing prefix cache file {}: {why}; nothing was loaded",
        path.display()
    ))
}

impl KVCacheManager {
    fn header(&self, entries: u64, block_bytes: usize) -> Header {
        let c = self.config();
        Header {
            format: FORMAT.into(),
            version: FILE_VERSION,
            model_fingerprint: c.model_fingerprint.clone(),
            block_size: c.block_size,
            block_bytes,
            dtype: c.dtype.clone(),
            layout: c.layout.clone(),
            hash_algorithm: HASH_ALGORITHM.into(),
            hash_seed: c.hash_seed,
            entries,
            checksum: "xxh3-128 trailer; xxh3-64 per block".into(),
        }
    }

    fn block_io(&self) -> Result<&dyn BlockIo, MemError> {
        self.io.as_deref().ok_or_else(|| {
            MemError::invalid(
                "this manager has no BlockIo to copy block bytes out and in; open it over a \
                 backend with block_bytes, or install one with set_block_io",
            )
        })
    }

    /// Writes every cached block (hash and bytes) to `path`, atomically.
    /// Returns the entries written.
    pub fn save_prefix_cache(&self, path: &Path) -> Result<u64, MemError> {
        let io = self.block_io()?;
        let bb = io.block_bytes();
        let entries = self.cache.entries_in_order();
        let header = serde_json::to_vec(&self.header(entries.len() as u64, bb))
            .map_err(|e| MemError::Invariant(format!("header does not serialise: {e}")))?;
        let mut out = Vec::with_capacity(16 + header.len() + entries.len() * (24 + bb) + 16);
        out.extend_from_slice(FILE_MAGIC);
        out.extend_from_slice(&FILE_VERSION.to_le_bytes());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        let mut buf = vec![0u8; bb];
        for e in entries {
            io.read_block(&self.pool().ref_of_token(&e.block)?, &mut buf)?;
            out.extend_from_slice(&e.hash.to_le_bytes());
            out.extend_from_slice(&xxh3_64(&buf).to_le_bytes());
            out.extend_from_slice(&buf);
        }
        let trailer = xxh3_128(&out);
        out.extend_from_slice(&trailer.to_le_bytes());

        let file_name = path
            .file_name()
            .ok_or_else(|| MemError::invalid(format!("{} names no file", path.display())))?;
        let mut tmp_name = file_name.to_os_string();
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let written = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&out)?;
            f.sync_all()?;
            fs::rename(&tmp, path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("cannot write the prefix cache to", path, e));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Makes the rename durable; best effort where directories cannot
            // be opened.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(self.cache.len() as u64)
    }

    /// Loads the entries of `path` whose hashes are not cached yet, as fresh
    /// blocks owned by the cache (least recently used first, as saved).
    /// Refuses a truncated, corrupted or mismatched file, or one that does
    /// not fit, and then changes nothing. Returns the entries added.
    pub fn load_prefix_cache(&mut self, path: &Path) -> Result<u64, MemError> {
        let io = self.block_io()?;
        let bb = io.block_bytes();
        let data = fs::read(path).map_err(|e| io_err("cannot read the prefix cache", path, e))?;
        if data.len() < 16 + 16 || &data[..8] != FILE_MAGIC {
            return Err(refuse(
                path,
                "it is not an imp-mem prefix cache (bad magic or too short)",
            ));
        }
        let word =
            |at: usize| u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
        let version = word(8);
        if version != FILE_VERSION {
            return Err(refuse(
                path,
                format!("format version {version}; this build reads version {FILE_VERSION}"),
            ));
        }
        let header_len = word(12) as usize;
        let body = 16usize
            .checked_add(header_len)
            .filter(|&end| end + 16 <= data.len())
            .ok_or_else(|| refuse(path, "truncated inside the header"))?;
        let header: Header = serde_json::from_slice(&data[16..body])
            .map_err(|e| refuse(path, format!("unreadable header ({e})")))?;
        let want = self.header(header.entries, bb);
        let mut mismatches = Vec::new();
        let mut differ = |name: &str, theirs: String, ours: String| {
            if theirs != ours {
                mismatches.push(format!(
                    "{name} is {theirs:?} in the file but {ours:?} here"
                ));
            }
        };
        differ("format", header.format.clone(), want.format.clone());
        differ(
            "model_fingerprint",
            header.model_fingerprint.clone(),
            want.model_fingerprint,
        );
        differ(
            "block_size",
            header.block_size.to_string(),
            want.block_size.to_string(),
        );
        differ(
            "block_bytes",
            header.block_bytes.to_string(),
            want.block_bytes.to_string(),
        );
        differ("dtype", header.dtype.clone(), want.dtype);
        differ("layout", header.layout.clone(), want.layout);
        differ(
            "hash_algorithm",
            header.hash_algorithm.clone(),
            want.hash_algorithm,
        );
        differ(
            "hash_seed",
            header.hash_seed.to_string(),
            want.hash_seed.to_string(),
        );
        if !mismatches.is_empty() {
            return Err(refuse(
                path,
                format!(
                    "it was saved for another configuration: {}",
                    mismatches.join("; ")
                ),
            ));
        }
        let n = usize::try_from(header.entries).map_err(|_| refuse(path, "absurd entry count"))?;
        let expected = n
            .checked_mul(24 + bb)
            .and_then(|e| e.checked_add(body + 16))
            .ok_or_else(|| refuse(path, "absurd entry count"))?;
        if data.len() != expected {
            return Err(refuse(
                path,
                format!(
                    "it is {} bytes but its header promises {expected} ({n} entries of {bb} bytes): \
                     {}",
                    data.len(),
                    if data.len() < expected { "truncated" } else { "trailing garbage" }
                ),
            ));
        }
        let split = data.len() - 16;
        let mut trailer = [0u8; 16];
        trailer.copy_from_slice(&data[split..]);
        if xxh3_128(&data[..split]) != u128::from_le_bytes(trailer) {
            return Err(refuse(path, "the file checksum does not match (corrupted)"));
        }
        let mut fresh_entries: Vec<(BlockHash, &[u8])> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for k in 0..n {
            let at = body + k * (24 + bb);
            let mut h = [0u8; 16];
            h.copy_from_slice(&data[at..at + 16]);
            let mut c = [0u8; 8];
            c.copy_from_slice(&data[at + 16..at + 24]);
            let bytes = &data[at + 24..at + 24 + bb];
            if xxh3_64(bytes) != u64::from_le_bytes(c) {
                return Err(refuse(
                    path,
                    format!("block {k}'s checksum does not match (corrupted)"),
                ));
            }
            let hash = u128::from_le_bytes(h);
            if self.cache.get(&hash).is_none() && seen.insert(hash) {
                fresh_entries.push((hash, bytes));
            }
        }
        let need =
            u32::try_from(fresh_entries.len()).map_err(|_| refuse(path, "too many entries"))?;
        let (free, growable) = self.main_room();
        let evictable = self.cache.evictable();
        if need as u64 > free as u64 + growable as u64 + evictable as u64 {
            return Err(MemError::KvCapacity(KvCapacityReport {
                what: format!("load {need} cached blocks from {}", path.display()),
                needed: need,
                free,
                growable,
                evictable,
                pinned: self.cache.pinned_idle(),
                pool: "kv",
            }));
        }
        // Evicting to make room is the one change that precedes the copies;
        // it drops only entries eviction could have dropped at any time.
        let free = self.pool().stats().free;
        let mut evicted = Vec::new();
        while free as usize + evicted.len() < need as usize
            && self.cache.evict_into(&mut evicted).is_some()
        {}
        self.record_evictions(evicted.len() as u32);
        self.pool().release_tokens(evicted)?;
        let refs = self.pool().allocate_many(need)?.into_refs();
        let io = self.block_io()?;
        for (r, (_, bytes)) in refs.iter().zip(&fresh_entries) {
            io.write_block(r, bytes)?;
        }
        let mut refused = None;
        let mut leftover = Vec::new();
        for (r, (hash, _)) in refs.into_iter().zip(&fresh_entries) {
            let token = self.pool().token_from_ref(r)?;
            match self.cache.insert(*hash, token, 0) {
                Ok(Insert::Added(_)) => {}
                Ok(Insert::Present(dup)) => leftover.push(dup),
                Err((e, back)) => {
                    leftover.push(back);
                    refused.get_or_insert(e);
                }
            }
        }
        self.pool().release_tokens(leftover)?;
        refused.map_or(Ok(need as u64), Err)
    }
}
