//! The prefix-cache file's format: its layout, its header and the checks
//! a file must pass against the manager that loads it, and the disk tier's
//! one-block files in the same format ([`BlockFileFormat`]).
//!
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
//! The checksums are XXH3 (64 bits a block, 128 the trailer), as version 1
//! has always written: it hashes at memory speed, and right after the read
//! of the same bytes it reads them from cache.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::error::MemError;
use crate::kv::hash::BlockHash;

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
    pub(super) fn of_version(version: u32) -> Option<Self> {
        match version {
            1 => Some(Self::Entries),
            2 => Some(Self::Records),
            _ => None,
        }
    }
}

pub(crate) const FORMAT: &str = "imp-mem prefix cache";

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

pub(super) fn io_err(what: &str, path: &Path, e: std::io::Error) -> MemError {
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
pub(super) fn check_header(path: &Path, header: &Header, want: &Header) -> Result<(), MemError> {
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
