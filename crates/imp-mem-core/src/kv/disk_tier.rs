//! The disk tier behind the host tier: where the host tier's evictions go
//! when a disk budget is given, instead of to nothing.
//!
//! # Algorithm
//!
//! A host block evicted for room is written, synchronously, to
//! `<dir>/<hash>.impkv`: a prefix-cache file of one entry in the persistence
//! format (`kv::persist`; `load_prefix_cache` reads it too), written to a
//! temporary name and renamed: three writes from a block buffer the tier
//! keeps, unsynced (the files are a cache of this process; a crash loses
//! the index that names them); read back into another kept buffer, each
//! byte hashed once for each checksum, no allocation a block. The tier keeps an LRU of its files within
//! `budget` bytes, deleting the oldest for room. A prefix whose hits
//! continue past the host tier into disk blocks reads each back (checked:
//! header, hash, both checksums; a bad or missing file is a miss) and
//! deletes the file before it takes a host slot for it (so the spill that
//! makes room adds a file where one went, and evicts none), then onboards
//! it as a host hit. Each hash
//! is in one tier at a time: a block cached on the device or the host drops
//! its disk copy.
//!
//! The I/O runs under the manager's `&mut self`, inside the admission or
//! eviction that needs it: it is the slow path of a prefix that fell out of
//! both faster tiers. Files of an earlier run are not indexed (their names
//! are reused).
//!
//! Thread safety: part of the manager.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::MemError;
use crate::kv::events::{EventLog, Medium};
use crate::kv::hash::BlockHash;
use crate::kv::persist::BlockFileFormat;
use crate::kv::prefix::FastMap;

/// Counters of the disk tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DiskCounters {
    pub spills: u64,
    pub loads: u64,
    pub evictions: u64,
    pub errors: u64,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct DiskTier {
    dir: PathBuf,
    budget: u64,
    file_bytes: u64,
    format: BlockFileFormat,
    index: FastMap<BlockHash, u64>,
    lru: BTreeMap<u64, BlockHash>,
    next: u64,
    block_bytes: usize,
    /// A spill's block, kept between spills, and a reload's.
    scratch: Vec<u8>,
    reload: Vec<u8>,
    pub counters: DiskCounters,
}

impl DiskTier {
    pub fn new(
        dir: &Path,
        budget: u64,
        block_bytes: usize,
        format: BlockFileFormat,
    ) -> Result<Self, MemError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            MemError::invalid(format!("disk tier directory {}: {e}", dir.display()))
        })?;
        // Magic, version, header length, the header, one entry, trailer.
        let file_bytes = (16 + format.header_len() + 24 + block_bytes + 16) as u64;
        if budget < file_bytes {
            return Err(MemError::invalid(format!(
                "a disk budget of {budget} B holds no block file of {file_bytes} B; give at \
                 least that, or no disk tier"
            )));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            budget,
            file_bytes,
            format,
            index: FastMap::default(),
            lru: BTreeMap::new(),
            next: 0,
            block_bytes,
            scratch: Vec::new(),
            reload: Vec::new(),
            counters: DiskCounters::default(),
        })
    }

    fn path(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{hash:032x}.impkv"))
    }

    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.index.contains_key(hash)
    }

    pub fn len(&self) -> u32 {
        self.index.len() as u32
    }

    /// Bytes of the files held.
    pub fn used(&self) -> u64 {
        self.index.len() as u64 * self.file_bytes
    }

    /// Hashes on disk, least recently written first.
    pub fn in_order(&self) -> Vec<BlockHash> {
        self.lru.values().copied().collect()
    }

    fn forget(&mut self, hash: &BlockHash) -> bool {
        let Some(stamp) = self.index.remove(hash) else {
            return false;
        };
        self.lru.remove(&stamp);
        let _ = std::fs::remove_file(self.path(*hash));
        true
    }

    /// Drops the disk copy of `hash` (it is cached in a faster tier now).
    pub fn discard(&mut self, hash: &BlockHash, events: &mut EventLog) {
        if self.forget(hash) {
            events.removed(*hash, Medium::Disk);
        }
    }

    /// Writes block `hash`; the oldest files make room. A failed write
    /// drops the block (counted), as if there were no disk tier.
    pub fn store(&mut self, hash: BlockHash, bytes: &[u8], events: &mut EventLog) {
        self.discard(&hash, events);
        while self.used() + self.file_bytes > self.budget {
            let Some((_, &oldest)) = self.lru.iter().next() else {
                break;
            };
            self.forget(&oldest);
            self.counters.evictions += 1;
            events.removed(oldest, Medium::Disk);
        }
        if self.format.write(&self.path(hash), hash, bytes).is_err() {
            self.counters.errors += 1;
            return;
        }
        let stamp = self.next;
        self.next += 1;
        self.index.insert(hash, stamp);
        self.lru.insert(stamp, hash);
        self.counters.spills += 1;
        events.stored_alone(hash, Medium::Disk);
    }

    /// The block buffer kept for reloads, a block long, taken (give it
    /// back with [`Self::put_reload_buffer`]).
    pub fn take_reload_buffer(&mut self) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.reload);
        buf.resize(self.block_bytes, 0);
        buf
    }

    /// Gives the reload buffer back.
    pub fn put_reload_buffer(&mut self, buf: Vec<u8>) {
        self.reload = buf;
    }

    /// Writes block `hash` with the bytes `fill` puts in a block-sized
    /// buffer the tier keeps (no allocation a spill); nothing when `fill`
    /// says it could not.
    pub fn spill(
        &mut self,
        hash: BlockHash,
        fill: impl FnOnce(&mut [u8]) -> bool,
        events: &mut EventLog,
    ) {
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(self.block_bytes, 0);
        if fill(&mut buf) {
            self.store(hash, &buf, events);
        }
        self.scratch = buf;
    }

    /// Reads block `hash` back into `dst` (a block long) and deletes its
    /// file (it moves to a faster tier). False when it is not here or its
    /// file is bad (then dropped).
    pub fn take_into(&mut self, hash: &BlockHash, dst: &mut [u8], events: &mut EventLog) -> bool {
        if !self.contains(hash) {
            return false;
        }
        let read = self.format.read_into(&self.path(*hash), *hash, dst).is_ok();
        self.taken(hash, read, events)
    }

    /// What a reader of `hash`'s file (read without the tier, as
    /// [`Self::reader`] lets it) reports: the file goes (its block moves to a
    /// faster tier, or it was bad), counted. Returns `read`.
    pub fn taken(&mut self, hash: &BlockHash, read: bool, events: &mut EventLog) -> bool {
        self.forget(hash);
        events.removed(*hash, Medium::Disk);
        if read {
            self.counters.loads += 1;
        } else {
            self.counters.errors += 1;
        }
        read
    }

    /// The leading `hashes` held here with their files' paths, and the
    /// format that reads them: for reads on other threads, each reported
    /// back through [`Self::taken`].
    pub fn reader(&self, hashes: &[BlockHash]) -> (Vec<(BlockHash, PathBuf)>, BlockFileFormat) {
        let files = hashes
            .iter()
            .take_while(|h| self.contains(h))
            .map(|h| (*h, self.path(*h)))
            .collect();
        (files, self.format.clone())
    }

    /// Deletes every file (a reset).
    pub fn clear(&mut self) {
        for h in self.in_order() {
            self.forget(&h);
        }
    }

    pub fn check(&self) -> Result<(), MemError> {
        if self.lru.len() != self.index.len() || self.used() > self.budget {
            return Err(MemError::Invariant(format!(
                "disk tier: {} files of {} B in a budget of {} B, LRU of {}",
                self.index.len(),
                self.file_bytes,
                self.budget,
                self.lru.len()
            )));
        }
        Ok(())
    }
}
