//! Admission: matching a prompt's blocks in the prefix cache (and the
//! host and disk tiers), checking and taking the blocks it needs, and
//! [`KVCacheManager::admit_from`], which does both for one sequence.

use super::sequence::{Slot, SwaRef};
use super::{ceil_div, sat_u32, KVCacheManager, SeqId};
use crate::error::{KvCapacityReport, MemError};
use crate::kv::events::Medium;
use crate::kv::hash::{BlockHash, ExtraKeys};
use crate::kv::prefix::Entry;

/// What a caller's token ids were before they became `u32`s, so that an
/// admission refuses ids the caller cannot have meant. The manager checks
/// them after hashing the prompt: one tokenized long before its admission
/// is not in the CPU caches, and a check before the hash would wait for
/// its memory, which the hash instead requests ahead of its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdSource {
    /// Unsigned 32-bit ids: every value is an id.
    U32,
    /// Signed 32-bit ids read as `u32` (an `int32` array read in place): a
    /// negative one, whose top bit is set, is refused.
    I32,
}

impl IdSource {
    /// Refuses `tokens` when an id is out of range, naming the first.
    fn check(self, tokens: &[u32]) -> Result<(), MemError> {
        match self {
            IdSource::U32 => Ok(()),
            IdSource::I32 => crate::kv::tokens::check_int32(tokens),
        }
    }
}

/// What an admission gave a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Leading tokens whose KV is already in cached blocks (a multiple of the
    /// block size; at least one token is always left to compute).
    pub cached_tokens: usize,
    /// Blocks in the sequence's table.
    pub blocks: usize,
    /// Blocks newly allocated for it (onboarded ones included).
    pub new_blocks: usize,
    /// Of the cached blocks, those being copied in from the host tier: the
    /// sequence's first step waits for them ([`KVCacheManager::onboarding`]).
    pub onboarded_blocks: usize,
}

impl KVCacheManager {
    /// Cached prefix blocks of `hashes`, stopping at the first miss and
    /// leaving at least one token of `n_tokens` to compute. Returns how many
    /// of them are evictable now (taking them makes them not).
    fn match_prefix(&self, hashes: &[BlockHash], n_tokens: usize, out: &mut Vec<u32>) -> u32 {
        if !self.config.enable_prefix_caching {
            return 0;
        }
        let bs = self.config.block_size;
        let max = if n_tokens > 0 && n_tokens % bs == 0 {
            hashes.len().saturating_sub(1)
        } else {
            hashes.len()
        };
        let mut evictable = 0;
        for h in &hashes[..max.min(hashes.len())] {
            match self.cache.get(h) {
                Some(idx) => {
                    out.push(idx);
                    evictable += u32::from(self.cache.entry(idx).is_some_and(Entry::evictable));
                }
                None => break,
            }
        }
        evictable
    }

    /// Hits continuing a prefix past its `device` device hits: `(host,
    /// disk)`, the leading blocks of `hashes[device..]` resident in the
    /// host tier, then those on disk (as many as host slots can stage),
    /// under the same limit as [`Self::match_prefix`].
    fn match_host(&self, hashes: &[BlockHash], n_tokens: usize, device: usize) -> (usize, usize) {
        let Some(host) = &self.host else {
            return (0, 0);
        };
        let bs = self.config.block_size;
        let max = if n_tokens > 0 && n_tokens % bs == 0 {
            hashes.len().saturating_sub(1)
        } else {
            hashes.len()
        };
        let rest = hashes.get(device..max).unwrap_or_default();
        let on_host = rest.iter().take_while(|h| host.contains(h)).count();
        let Some(disk) = &host.disk else {
            return (on_host, 0);
        };
        let room = (host.stageable() as usize).saturating_sub(on_host);
        let on_disk = rest[on_host..]
            .iter()
            .take_while(|h| disk.contains(h))
            .take(room)
            .count();
        (on_host, on_disk)
    }

    fn pinned_idle(&self) -> u32 {
        self.cache.pinned_idle()
    }

    /// Refuses unless `need` main blocks can be had from the free list plus
    /// evictable entries (less `taken`, evictable entries the operation
    /// itself is about to use). Returns the free blocks it saw.
    pub(super) fn check_main(
        &self,
        what: impl FnOnce() -> String,
        need: u32,
        taken: u32,
    ) -> Result<u32, MemError> {
        // The manager is its pool's only allocator, so the lock-free figure
        // is exact unless a `step()` is shrinking the pool right now — and
        // then an allocation takes withdrawn blocks back anyway.
        let (free, growable) = self.pool.room_hint();
        let evictable = self.cache.evictable().saturating_sub(taken) + self.offloading();
        let short = (need as u64).saturating_sub(free as u64 + evictable as u64);
        let growable = if short > 0 && growable > 0 {
            self.ledger_growable(growable, short)
        } else {
            growable
        };
        if need as u64 > free as u64 + growable as u64 + evictable as u64 {
            return Err(MemError::KvCapacity(KvCapacityReport {
                what: what(),
                needed: need,
                free,
                growable,
                evictable,
                pinned: self.pinned_idle(),
                pool: "kv",
            }));
        }
        Ok(free)
    }

    /// On a backend that commits through a device ledger, the blocks of
    /// `growable` the ledger would grant now (withdrawn blocks, still
    /// committed, included); where that is short of the `short` blocks an
    /// admission needs, the shortfall is recorded as the tenant's want, so
    /// the other tenants are asked to give memory back. Unchanged off a
    /// ledger.
    fn ledger_growable(&self, growable: u32, short: u64) -> u32 {
        let Some(backend) = self.pool.backend() else {
            return growable;
        };
        let Some(tenant) = backend.tenant() else {
            return growable;
        };
        let st = self.pool.stats();
        let bb = st.block_bytes.max(1) as u64;
        let headroom = backend.headroom().unwrap_or(0);
        let blocks = (headroom / bb + st.pending_blocks as u64).min(growable as u64) as u32;
        if (blocks as u64) < short {
            let _ = tenant.want((short - blocks as u64) * bb);
        }
        blocks
    }

    /// The main pool's free blocks, and the blocks a growable pool can still
    /// commit before it reaches its maximum (withdrawn blocks waiting for a
    /// decommit included: an allocation takes them back first).
    pub(crate) fn main_room(&self) -> (u32, u32) {
        self.pool.room()
    }

    pub(super) fn check_swa(
        &self,
        what: impl FnOnce() -> String,
        need: u32,
        released: u32,
    ) -> Result<(), MemError> {
        let Some(swa) = &self.swa_pool else {
            return Ok(());
        };
        let st = swa.stats();
        let (free, growable) = (st.free, st.max_blocks.saturating_sub(st.capacity));
        if need as u64 > free as u64 + growable as u64 + released as u64 {
            return Err(MemError::KvCapacity(KvCapacityReport {
                what: what(),
                needed: need,
                free,
                growable,
                evictable: released,
                pinned: 0,
                pool: "swa",
            }));
        }
        Ok(())
    }

    /// Allocates `need` main blocks into `out`: from the free list first
    /// (`free` blocks, as [`Self::check_main`] saw them), then from the LRU
    /// cache entries — an evicted entry's block moves to the caller as it
    /// is, its ref neither released nor re-taken (K16) — and only then by
    /// growing the pool (K13).
    pub(super) fn take_main(
        &mut self,
        need: u32,
        free: u32,
        out: &mut Vec<Slot>,
    ) -> Result<(), MemError> {
        let from_free = free.min(need);
        if from_free > 0 {
            self.pool
                .allocate_tokens(from_free, |t| out.push(Slot::Own(t)))?;
        }
        let mut got = from_free;
        if self.host.is_some() && got < need {
            // Evicted blocks go to the host tier first: the copies must
            // complete before the blocks are reused (the fence).
            self.make_room(need - got)?;
            let free = self.pool.stats().free.min(need - got);
            if free > 0 {
                self.pool
                    .allocate_tokens(free, |t| out.push(Slot::Own(t)))?;
                got += free;
            }
        }
        while got < need {
            let Some(token) = self.evict_one() else {
                break;
            };
            out.push(Slot::Own(token));
            got += 1;
        }
        if got < need {
            self.pool
                .allocate_tokens(need - got, |t| out.push(Slot::Own(t)))?;
        }
        Ok(())
    }

    pub(super) fn take_swa(&self, need: u32) -> Result<Vec<Option<SwaRef>>, MemError> {
        let mut out = Vec::new();
        if let (Some(swa), 1..) = (&self.swa_pool, need) {
            out.reserve(need as usize);
            swa.allocate_tokens(need, |t| out.push(Some(SwaRef(t))))?;
        }
        Ok(out)
    }

    /// First block index inside the sliding window of a sequence of
    /// `n_tokens` tokens.
    pub(super) fn swa_first(&self, n_tokens: usize) -> usize {
        n_tokens.saturating_sub(self.config.swa_window) / self.config.block_size
    }

    /// Main and SWA blocks an admission of `n_tokens` with `hits` prefix
    /// hits needs now: `(needed, swa needed)`.
    fn admission_needs(&self, n_tokens: usize, hits: usize) -> (u32, u32) {
        let total = ceil_div(n_tokens, self.config.block_size);
        let need = sat_u32(total - hits);
        let swa = if self.swa_pool.is_some() {
            sat_u32(total - self.swa_first(n_tokens).min(total))
        } else {
            0
        };
        (need, swa)
    }

    /// True when `tokens` could be admitted now (counting prefix hits and
    /// evictable blocks). Changes nothing.
    pub fn can_admit(&self, tokens: &[u32], extras: &ExtraKeys) -> bool {
        self.check_admit(tokens, extras).is_ok()
    }

    /// [`Self::can_admit`], with the refusal's arithmetic.
    pub fn check_admit(&self, tokens: &[u32], extras: &ExtraKeys) -> Result<(), MemError> {
        let hashes = self.chain_if_caching(tokens, extras);
        let mut hits = Vec::new();
        // The evictable hits stop being evictable once taken, so they do
        // not count as room.
        let taken = self.match_prefix(&hashes, tokens.len(), &mut hits);
        let (need, swa) = self.admission_needs(tokens.len(), hits.len());
        let what = || format!("admit {} tokens", tokens.len());
        self.check_main(what, need, taken)?;
        self.check_swa(what, swa, 0)
    }

    fn chain_if_caching(&self, tokens: &[u32], extras: &ExtraKeys) -> Vec<BlockHash> {
        if self.config.enable_prefix_caching {
            self.hasher.chain(tokens, extras)
        } else {
            Vec::new()
        }
    }

    /// Cached leading blocks for `tokens` now: a hint for a scheduler, no
    /// refs taken (admission matches again, atomically).
    pub fn probe(&self, tokens: &[u32], extras: &ExtraKeys) -> usize {
        let hashes = self.chain_if_caching(tokens, extras);
        let mut hits = Vec::new();
        self.match_prefix(&hashes, tokens.len(), &mut hits);
        let (host, disk) = self.match_host(&hashes, tokens.len(), hits.len());
        hits.len() + host + disk
    }

    /// Admits sequence `id` with its prompt: matches the cached prefix, takes
    /// refs to the hit blocks, and allocates the rest (evicting LRU cached
    /// blocks as needed). All or nothing: a refusal is
    /// [`MemError::KvCapacity`] and changes nothing.
    pub fn admit(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        extras: ExtraKeys,
    ) -> Result<Admission, MemError> {
        self.admit_from(id, tokens, IdSource::U32, extras)
    }

    /// [`Self::admit`] of ids that were `source`: one out of its range is
    /// refused ([`MemError::InvalidArgument`], nothing changed), checked
    /// once the hash has brought the prompt into the cache.
    pub fn admit_from(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        source: IdSource,
        extras: ExtraKeys,
    ) -> Result<Admission, MemError> {
        if self.seqs.contains_key(&id) {
            return Err(MemError::invalid(format!(
                "sequence {id} is already admitted; free it first or use another id"
            )));
        }
        let bs = self.config.block_size;
        let root = self.hasher.root(&extras);
        // A freed sequence's box, its vectors emptied but their capacity
        // kept: the hot path neither allocates nor moves a `Sequence`.
        let mut seq = self.spare.seqs.pop().unwrap_or_default();
        if self.config.enable_prefix_caching {
            self.hasher
                .extend_chain(root, tokens, 0, &extras, &mut seq.hashes);
        }
        // After the hash, which brought the prompt into the cache.
        if let Err(e) = source.check(tokens) {
            self.spare.keep(seq);
            return Err(e);
        }
        let mut hit_idx = std::mem::take(&mut self.spare.hits);
        hit_idx.clear();
        let taken = self.match_prefix(&seq.hashes, tokens.len(), &mut hit_idx);
        let (host_hits, disk_hits) = self.match_host(&seq.hashes, tokens.len(), hit_idx.len());
        let (need, swa_need) = self.admission_needs(tokens.len(), hit_idx.len());
        let what = || format!("admit sequence {id} ({} tokens)", tokens.len());
        let checked = self
            .check_main(what, need, taken)
            .and_then(|free| self.check_swa(what, swa_need, 0).map(|()| free));
        let free = match checked {
            Ok(free) => free,
            Err(e) => {
                self.spare.keep(seq);
                self.spare.hits = hit_idx;
                return Err(e);
            }
        };

        // Host hits leave the host tier before anything is evicted into
        // it, so no eviction can take them.
        let dev_hits = hit_idx.len();
        let mut slots = self.take_host_hits(&seq.hashes[dev_hits..dev_hits + host_hits]);
        if disk_hits > 0 {
            if let Some(host) = self.host.as_mut() {
                let on_disk = &seq.hashes[dev_hits + host_hits..dev_hits + host_hits + disk_hits];
                slots.extend(host.stage_from_disk(on_disk, &mut self.events));
            }
        }
        // Disk hits that could not be read back are computed instead.
        let host_hits = slots.len();
        // Use the hits first: once users > 0 they are off the LRU, so the
        // evictions below cannot pick them.
        seq.blocks.reserve(ceil_div(tokens.len(), bs));
        let blocks = &mut seq.blocks;
        let fresh = self
            .cache
            .acquire(&hit_idx, |entry, id| {
                blocks.push(Slot::Cached { entry, id })
            })
            .and_then(|()| self.take_main(need, free, &mut seq.blocks))
            .and_then(|()| self.take_swa(swa_need));
        let fresh = fresh.and_then(|swa| {
            if slots.is_empty() {
                return Ok(swa);
            }
            match self.onboard(&mut seq, dev_hits, &mut slots) {
                Ok(()) => Ok(swa),
                Err(e) => {
                    self.release_swa(swa);
                    Err(e)
                }
            }
        });
        let swa_fresh = match fresh {
            Ok(v) => v,
            Err(e) => {
                if let Some(host) = self.host.as_mut() {
                    for (&h, &(slot, stamp)) in seq.hashes[dev_hits..].iter().zip(&slots) {
                        if slot != u32::MAX {
                            host.restore(h, slot, stamp);
                        }
                    }
                }
                self.release_slots(seq.blocks.drain(..));
                self.spare.keep(seq);
                self.spare.hits = hit_idx;
                return Err(e);
            }
        };
        let total = seq.blocks.len();
        if self.swa_pool.is_some() {
            let first = self.swa_first(tokens.len()).min(total);
            seq.swa.resize_with(first, || None);
            seq.swa.extend(swa_fresh);
        }
        if self.config.enable_prefix_caching {
            self.stats.prefix_queries += 1;
            self.stats.prefix_query_blocks += seq.hashes.len() as u64;
            self.stats.prefix_hit_blocks += hit_idx.len() as u64;
            self.stats.prefix_query_tokens += tokens.len() as u64;
            self.stats.prefix_hit_tokens += ((dev_hits + host_hits) * bs) as u64;
        }
        if let Some(host) = self.host.as_mut() {
            host.counters.hit_blocks += host_hits as u64;
        }
        if self.events.enabled() {
            seq.tokens.extend_from_slice(tokens);
            if host_hits > 0 {
                let mut run: Vec<usize> = (dev_hits..dev_hits + host_hits).collect();
                self.events.stored(
                    &mut run,
                    &seq.hashes,
                    &seq.tokens,
                    bs,
                    extras.lora_id,
                    Medium::Device,
                );
            }
        }
        let admission = Admission {
            cached_tokens: (dev_hits + host_hits) * bs,
            blocks: total,
            new_blocks: need as usize,
            onboarded_blocks: host_hits,
        };
        seq.len = tokens.len();
        seq.tail
            .extend_from_slice(&tokens[tokens.len() / bs * bs..]);
        seq.extras = extras;
        seq.root = root;
        seq.offered = dev_hits + host_hits;
        seq.cacheable = usize::MAX;
        seq.dirty = true;
        self.seqs.insert(id, seq);
        self.spare.hits = hit_idx;
        Ok(admission)
    }
}
