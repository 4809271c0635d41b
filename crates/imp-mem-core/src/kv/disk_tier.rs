//! The disk tier behind the host tier: where the host tier's evictions go
//! when a disk budget is given, instead of to nothing.
//!
//! # Algorithm
//!
//! A host block evicted for room is spilled to `<dir>/<hash>.impkv`: a
//! prefix-cache file of one entry in the persistence format
//! (`kv::persist`; `load_prefix_cache` reads it too), written to a
//! temporary name and renamed, unsynced (the files are a cache of this
//! process; a crash loses the index that names them). The block's bytes go
//! into a spare buffer and the file is written by one of up to four writer
//! threads of the tier while the eviction goes on, at most eight writes in
//! flight; the block is indexed at once. Whatever reads or deletes a file
//! waits for its write first (a reload, a discard, an eviction for room),
//! and `poll_copies` waits for all of them, so after a poll every indexed
//! block has its file. A write that fails takes its block out of the index
//! (counted as an error, reported as removed from the disk). The tier keeps
//! an LRU of its files within `budget` bytes, deleting the oldest for room.
//!
//! A prefix whose hits continue past the host tier into disk blocks reads
//! them back on up to four threads (checked: header, hash, both checksums;
//! a bad or missing file is a miss and ends the prefix there), and the
//! caller deletes each file before it takes a host slot for its block (so
//! the spill that makes room adds a file where one went, and evicts none),
//! then onboards it as a host hit. Each hash is in one tier at a time: a
//! block cached on the device or the host drops its disk copy.
//!
//! A deletion (a reload's, a discard's, an eviction's for room) unlinks
//! the file while a handle holds it open — the reader's, or one opened for
//! the purpose — and the process's releaser thread closes that handle
//! (`persist::release_later`): the close frees the file's storage, page by
//! page on a tmpfs, which costs as much as a third of writing it and would
//! otherwise run on the thread that reloads or evicts, under the manager's
//! lock. The storage is free a moment after the index drops the file.
//!
//! The tier's bookkeeping runs under the manager's `&mut self`, inside the
//! admission or eviction that needs it: it is the slow path of a prefix
//! that fell out of both faster tiers. Files of an earlier run are not
//! indexed (their names are reused).
//!
//! Thread safety: part of the manager.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};

use crate::error::MemError;
use crate::kv::events::{EventLog, Medium};
use crate::kv::hash::BlockHash;
use crate::kv::persist::{open_to_release, release_later, BlockFileFormat};
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
    /// Block buffers kept between spills and reloads (at most
    /// [`IN_FLIGHT`]): no allocation, and no page faults, a block.
    spare: Vec<Vec<u8>>,
    /// The threads that write spills, started at the first.
    writers: Option<Writers>,
    /// Spills whose write failed, to be reported as removed.
    failed: Vec<BlockHash>,
    pub counters: DiskCounters,
}

/// Threads of the tier that write its spills' files; see the module docs.
#[derive(Debug)]
struct Writers {
    jobs: Option<mpsc::Sender<(BlockHash, PathBuf, Vec<u8>)>>,
    done: mpsc::Receiver<(BlockHash, Vec<u8>, bool)>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Hashes whose file is being written, with their count.
    pending: FastMap<BlockHash, u32>,
    in_flight: usize,
}

/// Spill writes at once at most, and threads that write them.
const IN_FLIGHT: usize = 8;
const WRITERS: usize = 4;

impl Writers {
    fn start(format: &BlockFileFormat) -> Self {
        let (jobs, queue) = mpsc::channel::<(BlockHash, PathBuf, Vec<u8>)>();
        let (done_tx, done) = mpsc::channel();
        let queue = Arc::new(Mutex::new(queue));
        let n = WRITERS.min(std::thread::available_parallelism().map_or(1, |n| n.get()));
        let threads = (0..n)
            .map(|_| {
                let (queue, done_tx, format) = (queue.clone(), done_tx.clone(), format.clone());
                std::thread::spawn(move || loop {
                    let job = queue.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok((hash, path, buf)) = job else {
                        break;
                    };
                    let written = format.write(&path, hash, &buf).is_ok();
                    if done_tx.send((hash, buf, written)).is_err() {
                        break;
                    }
                })
            })
            .collect();
        Self {
            jobs: Some(jobs),
            done,
            threads,
            pending: FastMap::default(),
            in_flight: 0,
        }
    }
}

impl Drop for Writers {
    fn drop(&mut self) {
        // The queue closes; each thread finishes its write and ends.
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
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
            spare: Vec::new(),
            writers: None,
            failed: Vec::new(),
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

    /// Takes one finished write back (waiting for it when `block`); false
    /// when none was in flight (or none finished, not blocking).
    fn reap_write(&mut self, block: bool) -> bool {
        let Some(w) = self.writers.as_mut() else {
            return false;
        };
        if w.in_flight == 0 {
            return false;
        }
        let got = if block {
            w.done.recv().ok()
        } else {
            w.done.try_recv().ok()
        };
        let Some((hash, buf, written)) = got else {
            return false;
        };
        w.in_flight -= 1;
        if let Some(n) = w.pending.get_mut(&hash) {
            *n -= 1;
            if *n == 0 {
                w.pending.remove(&hash);
            }
        }
        if self.spare.len() < IN_FLIGHT {
            self.spare.push(buf);
        }
        if !written {
            // As if it had never been spilled: out of the index (and its
            // temporary, which the write removed), counted, and reported
            // removed at the next call that records events.
            if let Some(stamp) = self.index.remove(&hash) {
                self.lru.remove(&stamp);
                self.failed.push(hash);
            }
            self.counters.errors += 1;
            self.counters.spills = self.counters.spills.saturating_sub(1);
        }
        true
    }

    /// Waits for every spill's write, and reports the failed ones.
    pub fn flush(&mut self, events: &mut EventLog) {
        while self.reap_write(true) {}
        for hash in self.failed.drain(..) {
            events.removed(hash, Medium::Disk);
        }
    }

    /// Waits for the writes of `hash`'s file, if any.
    fn settle(&mut self, hash: &BlockHash) {
        while self
            .writers
            .as_ref()
            .is_some_and(|w| w.pending.contains_key(hash))
        {
            if !self.reap_write(true) {
                break;
            }
        }
    }

    fn forget(&mut self, hash: &BlockHash) -> bool {
        self.forget_held(hash, None)
    }

    /// [`Self::forget`] with the file's handle where a reader holds one
    /// (else one is opened here): the deletion only unlinks it, and the
    /// handle's close on the releaser thread frees the storage
    /// (`persist::release_later`), which the unlink of the last handle
    /// would do on this thread, under the manager's lock.
    fn forget_held(&mut self, hash: &BlockHash, held: Option<File>) -> bool {
        self.settle(hash);
        let Some(stamp) = self.index.remove(hash) else {
            return false;
        };
        self.lru.remove(&stamp);
        let path = self.path(*hash);
        let held = held.or_else(|| open_to_release(&path));
        let _ = std::fs::remove_file(&path);
        if let Some(file) = held {
            release_later(file);
        }
        true
    }

    /// Drops the disk copy of `hash` (it is cached in a faster tier now).
    pub fn discard(&mut self, hash: &BlockHash, events: &mut EventLog) {
        if self.forget(hash) {
            events.removed(*hash, Medium::Disk);
        }
    }

    /// A block buffer, a block long: a kept one where there is one (give
    /// it back with [`Self::put_buffer`]).
    pub fn take_buffer(&mut self) -> Vec<u8> {
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.resize(self.block_bytes, 0);
        buf
    }

    /// Keeps a block buffer for the next spill or reload.
    pub fn put_buffer(&mut self, buf: Vec<u8>) {
        if self.spare.len() < IN_FLIGHT && buf.len() == self.block_bytes {
            self.spare.push(buf);
        }
    }

    /// Spills block `hash`: `fill` puts its bytes in a block buffer (a
    /// spare one: no allocation a spill once the writers have handed
    /// theirs back), the oldest files make room, and a writer thread
    /// writes the file while the caller goes on; the block is indexed at
    /// once. Nothing when `fill` says it could not. A write that fails
    /// drops the block (counted), as if there were no disk tier.
    pub fn spill(
        &mut self,
        hash: BlockHash,
        fill: impl FnOnce(&mut [u8]) -> bool,
        events: &mut EventLog,
    ) {
        while self.reap_write(false) {}
        for h in std::mem::take(&mut self.failed) {
            events.removed(h, Medium::Disk);
        }
        if self.writers.is_none() {
            self.writers = Some(Writers::start(&self.format));
        }
        let mut buf = self.take_buffer();
        if !fill(&mut buf) {
            self.put_buffer(buf);
            return;
        }
        self.discard(&hash, events);
        while self.used() + self.file_bytes > self.budget {
            let Some((_, &oldest)) = self.lru.iter().next() else {
                break;
            };
            self.forget(&oldest);
            self.counters.evictions += 1;
            events.removed(oldest, Medium::Disk);
        }
        while self
            .writers
            .as_ref()
            .is_some_and(|w| w.in_flight >= IN_FLIGHT)
        {
            self.reap_write(true);
        }
        let path = self.path(hash);
        let Some(w) = self.writers.as_mut() else {
            return;
        };
        let sent = w
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send((hash, path, buf)).is_ok());
        if !sent {
            self.counters.errors += 1;
            return;
        }
        w.in_flight += 1;
        *w.pending.entry(hash).or_default() += 1;
        let stamp = self.next;
        self.next += 1;
        self.index.insert(hash, stamp);
        self.lru.insert(stamp, hash);
        self.counters.spills += 1;
        events.stored_alone(hash, Medium::Disk);
    }

    /// Reads block `hash` back into `dst` (a block long) and deletes its
    /// file (it moves to a faster tier). False when it is not here or its
    /// file is bad (then dropped).
    pub fn take_into(&mut self, hash: &BlockHash, dst: &mut [u8], events: &mut EventLog) -> bool {
        self.settle(hash);
        if !self.contains(hash) {
            return false;
        }
        let (read, file) = self.format.read_open(&self.path(*hash), *hash, dst);
        self.taken(hash, read.is_ok(), file, events)
    }

    /// What a reader of `hash`'s file (read without the tier, as
    /// [`Self::reader`] lets it) reports: the file goes (its block moves to a
    /// faster tier, or it was bad), counted, with `file`, the reader's
    /// handle of it, if it kept one ([`Self::forget_held`]). Returns `read`.
    pub fn taken(
        &mut self,
        hash: &BlockHash,
        read: bool,
        file: Option<File>,
        events: &mut EventLog,
    ) -> bool {
        self.forget_held(hash, file);
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
        while self.reap_write(true) {}
        self.failed.clear();
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
