//! The manager's side of prefix-cache persistence: `save_prefix_cache` /
//! `load_prefix_cache` and their steps, and the disk tier's block-file
//! format, each built from this manager's configuration. The file format,
//! its checks and the block copies ([`BlockIo`]) are `kv::persist`'s; its
//! opening paragraph tells the algorithm and the locking.

use std::path::Path;
use std::sync::Arc;

use super::KVCacheManager;
use crate::error::{KvCapacityReport, MemError};
use crate::kv::events::Medium;
use crate::kv::hash::{BlockHash, HASH_ALGORITHM};
use crate::kv::persist::{
    refuse, BlockFileFormat, BlockIo, Header, LentRefs, LoadTarget, PendingLoad, PrefixSnapshot,
    VerifiedFile, FILE_VERSION, FORMAT,
};
use crate::kv::prefix::Insert;

impl KVCacheManager {
    /// The format of the disk tier's one-block files, for blocks of
    /// `block_bytes`.
    pub(crate) fn block_file_format(
        &self,
        block_bytes: usize,
    ) -> Result<BlockFileFormat, MemError> {
        BlockFileFormat::new(&self.header(1, block_bytes), block_bytes)
    }
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
            checksum: "xxh3-64 per block; xxh3-128 trailer of the header and the entries' hash and checksum".into(),
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

    /// Writes every cached block (hash and bytes) to `path`, atomically,
    /// streaming: host memory holds one block at a time, not the file.
    /// Returns the entries written. (The binding takes the snapshot under
    /// its lock and writes without it.)
    pub fn save_prefix_cache(&self, path: &Path) -> Result<u64, MemError> {
        self.snapshot_prefix_cache()?.write(path)
    }

    /// What a save writes, taken now: the header and a lent ref to every
    /// cached block with its hash, least recently used first.
    pub fn snapshot_prefix_cache(&self) -> Result<PrefixSnapshot, MemError> {
        let io = self.block_io()?;
        let bb = io.block_bytes();
        let entries = self.cache.entries_in_order();
        let header = serde_json::to_vec(&self.header(entries.len() as u64, bb))
            .map_err(|e| MemError::Invariant(format!("header does not serialise: {e}")))?;
        let mut hashes = Vec::with_capacity(entries.len());
        let mut refs = Vec::with_capacity(entries.len());
        for e in &entries {
            hashes.push(e.hash);
            refs.push(self.pool().ref_of_token(&e.block)?);
        }
        Ok(PrefixSnapshot {
            io: self.block_io_shared()?,
            header,
            hashes,
            refs: LentRefs::new(refs, &self.lent),
        })
    }

    /// Loads the entries of `path` whose hashes are not cached yet, as fresh
    /// blocks owned by the cache (least recently used first, as saved).
    /// Refuses a truncated, corrupted or mismatched file, or one that does
    /// not fit, and then changes nothing. Returns the entries added. (The
    /// binding runs the steps — [`Self::load_target`], [`LoadTarget::verify`],
    /// [`Self::reserve_load`], [`PendingLoad::copy_in`], then
    /// [`Self::finish_load`], or [`Self::abandon_load`] when the copy
    /// fails — taking its lock only for the second and the last.)
    pub fn load_prefix_cache(&mut self, path: &Path) -> Result<u64, MemError> {
        let file = self.load_target()?.verify(path)?;
        let mut pending = self.reserve_load(file)?;
        if let Err(e) = pending.copy_in() {
            self.abandon_load(pending)?;
            return Err(e);
        }
        self.finish_load(pending)
    }

    /// What a file must match to load here. Refused when prefix caching is
    /// off or the manager cannot copy block bytes.
    pub fn load_target(&self) -> Result<LoadTarget, MemError> {
        if !self.config().enable_prefix_caching {
            return Err(MemError::invalid(
                "this manager has prefix caching off (enable_prefix_caching=False): loaded \
                 blocks would be held and never hit, so nothing was loaded; open the manager \
                 with prefix caching on to load a prefix cache",
            ));
        }
        let io = self.block_io_shared()?;
        let bb = io.block_bytes();
        Ok(LoadTarget {
            want: self.header(0, bb),
            io,
        })
    }

    /// Allocates fresh blocks for the verified file's entries that are not
    /// cached yet (evicting what it must), or changes nothing.
    pub fn reserve_load(&mut self, file: VerifiedFile) -> Result<PendingLoad, MemError> {
        let mut seen = std::collections::HashSet::new();
        let fresh: Vec<(BlockHash, u64, u64)> = file
            .entries
            .iter()
            .copied()
            .filter(|(hash, _, _)| self.cache.get(hash).is_none() && seen.insert(*hash))
            .collect();
        let path = &file.path;
        let need = u32::try_from(fresh.len()).map_err(|_| refuse(path, "too many entries"))?;
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
        let stats = self.pool().stats();
        self.make_room(need.saturating_sub(stats.free))?;
        let refs = self.pool().allocate_many_unchecked(need)?.into_refs();
        Ok(PendingLoad {
            refs: LentRefs::new(refs, &self.lent),
            fresh,
            file,
            capacity_before: stats.capacity,
        })
    }

    /// Releases the blocks of a load whose copy failed (the file turned out
    /// corrupted, truncated or unreadable part-way) and gives back the
    /// growth its reservation made, so that a refused load leaves the pool
    /// as it found it (but for the evictions that made room). The copies
    /// are synchronous, so nothing is in flight on the blocks.
    pub fn abandon_load(&mut self, mut pending: PendingLoad) -> Result<(), MemError> {
        let refs = pending.refs.take();
        drop(refs);
        if self.pool().stats().capacity > pending.capacity_before {
            self.pool()
                .shrink_to(pending.capacity_before, crate::decommit::NothingInFlight)?;
        }
        Ok(())
    }

    /// Inserts the copied blocks into the cache; returns the entries added.
    /// An entry another thread cached meanwhile keeps its block, and the
    /// fresh one is released.
    pub fn finish_load(&mut self, mut pending: PendingLoad) -> Result<u64, MemError> {
        let refs = pending.refs.take();
        let mut refused = None;
        let mut leftover = Vec::new();
        let mut added = 0u64;
        for (r, (hash, _, _)) in refs.into_iter().zip(&pending.fresh) {
            let token = self.pool().token_from_ref(r)?;
            match self.cache.insert(*hash, token, 0) {
                Ok(Insert::Added(_)) => {
                    added += 1;
                    self.events.stored_alone(*hash, Medium::Device);
                    self.drop_host_copy(hash);
                }
                Ok(Insert::Present(dup)) => leftover.push(dup),
                Err((e, back)) => {
                    leftover.push(back);
                    refused.get_or_insert(e);
                }
            }
        }
        self.pool().release_tokens(leftover)?;
        refused.map_or(Ok(added), Err)
    }

    fn block_io_shared(&self) -> Result<Arc<dyn BlockIo>, MemError> {
        self.block_io()?;
        self.io
            .clone()
            .ok_or_else(|| MemError::Invariant("block io vanished".into()))
    }
}
