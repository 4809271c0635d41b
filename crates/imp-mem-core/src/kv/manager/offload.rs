//! Traffic with the host and disk tiers: offloading an evicted block,
//! onboarding host and disk hits, polling and waiting on the copies, and
//! what each tier holds.

use super::sequence::{Sequence, Slot};
use super::{KVCacheManager, SeqId};
use crate::error::MemError;
use crate::kv::events::Medium;
use crate::kv::hash::BlockHash;
use crate::kv::host_tier::{CopyTicket, HostTier};
use crate::kv::prefix::Insert;

impl KVCacheManager {
    /// Finishes the host tier's completed copies (without waiting, or
    /// waiting for all with `wait`): an offloaded block's device block
    /// returns to the free list and its hash becomes a host hit; an
    /// onboarded block's host slot is free again. Call it once per engine
    /// step. Returns the device blocks freed.
    pub fn poll_copies(&mut self, wait: bool) -> Result<u32, MemError> {
        let Some(host) = self.host.as_mut() else {
            return Ok(0);
        };
        let cache = &self.cache;
        let reaped = host.reap(wait, |h| cache.get(h).is_some(), &mut self.events)?;
        let n = reaped.tokens.len() as u32;
        self.pool.release_tokens(reaped.tokens)?;
        Ok(n)
    }

    /// The host → device copies sequence `id`'s blocks still wait for
    /// (its own onboarding, or another sequence's it hit).
    pub fn onboarding(&self, id: SeqId) -> Result<Vec<CopyTicket>, MemError> {
        let seq = self.seq(id)?;
        let Some(host) = &self.host else {
            return Ok(Vec::new());
        };
        if host.onboarding.is_empty() {
            return Ok(Vec::new());
        }
        Ok(seq
            .blocks
            .iter()
            .filter_map(|s| s.id().and_then(|b| host.pending_onboard(b)))
            .collect())
    }

    /// Waits until sequence `id`'s blocks hold their bytes: on the host, or,
    /// given `stream` (a `CUstream` as an integer), by making the work
    /// enqueued on it next wait on the device. Returns the copies waited on.
    pub fn wait_onboarding(&mut self, id: SeqId, stream: Option<usize>) -> Result<u32, MemError> {
        let tickets = self.onboarding(id)?;
        let Some(host) = self.host.as_mut() else {
            return Ok(0);
        };
        for &t in &tickets {
            match stream {
                Some(s) => host.io.stream_wait(t, s)?,
                None => host.io.wait(t)?,
            }
        }
        Ok(tickets.len() as u32)
    }

    /// True when a disk tier backs the host tier (calls that move blocks
    /// may then read or write its files).
    pub fn has_disk_tier(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.disk.is_some())
    }

    /// Hashes in the disk tier, least recently written first.
    pub fn disk_cached_blocks(&self) -> Vec<BlockHash> {
        self.host
            .as_ref()
            .and_then(|h| h.disk.as_ref())
            .map_or_else(Vec::new, |d| d.in_order())
    }

    /// Hashes resident in the host tier, least recently used first.
    pub fn host_cached_blocks(&self) -> Vec<BlockHash> {
        self.host
            .as_ref()
            .map_or_else(Vec::new, HostTier::resident_in_order)
    }

    /// Device blocks in flight to the host tier: room, once their copies
    /// complete.
    pub(crate) fn offloading(&self) -> u32 {
        self.host.as_ref().map_or(0, |h| h.offloading.len() as u32)
    }

    /// A hash just cached on the device leaves the host tier (one tier at
    /// a time).
    pub(crate) fn drop_host_copy(&mut self, hash: &BlockHash) {
        if let Some(host) = self.host.as_mut() {
            host.discard(hash, &mut self.events);
        }
    }

    /// Takes the host slots of `hashes` (all resident: `match_host` said
    /// so), with their LRU stamps for a rollback.
    pub(super) fn take_host_hits(&mut self, hashes: &[BlockHash]) -> Vec<(u32, u64)> {
        let Some(host) = self.host.as_mut() else {
            return Vec::new();
        };
        hashes
            .iter()
            .map(|h| host.take(h).unwrap_or((u32::MAX, 0)))
            .collect()
    }

    /// Starts copying host `slots` into the fresh blocks of `seq` from
    /// index `first` on (one batch), then turns each into a cache entry the
    /// sequence uses. All or nothing: when the copies cannot start, none is
    /// in flight and the slots are the caller's to restore.
    pub(super) fn onboard(
        &mut self,
        seq: &mut Sequence,
        first: usize,
        slots: &mut [(u32, u64)],
    ) -> Result<(), MemError> {
        let Some(host) = self.host.as_mut() else {
            return Err(MemError::Invariant("onboarding without a host tier".into()));
        };
        let mut copies = Vec::with_capacity(slots.len());
        for (j, &(slot, _)) in slots.iter().enumerate() {
            match &seq.blocks[first + j] {
                Slot::Own(t) if slot != u32::MAX => {
                    copies.push((slot, t.id(), self.pool.token_span(t)?.addr()));
                }
                _ => {
                    return Err(MemError::Invariant(
                        "an onboarding slot is not fresh".into(),
                    ))
                }
            }
        }
        host.begin_onboard(&copies)?;
        for j in 0..slots.len() {
            let i = first + j;
            let hash = seq.hashes[i];
            host.onboarded(&hash);
            self.events.removed(hash, Medium::Host);
            let Slot::Own(token) = std::mem::replace(&mut seq.blocks[i], Slot::Hole) else {
                continue;
            };
            let id = token.id();
            seq.blocks[i] = match self.cache.insert(hash, token, 1) {
                Ok(Insert::Added(entry)) => Slot::Cached { entry, id },
                Ok(Insert::Present(back)) | Err((_, back)) => Slot::Own(back),
            };
        }
        Ok(())
    }

    /// Evicts the LRU cache entry into the host tier (the copy starts; the
    /// block is freed when it completes), or drops it when the host tier
    /// cannot take it. False when nothing is evictable.
    pub(super) fn offload_one(&mut self) -> bool {
        let Some((hash, token)) = self.cache.evict_take_hashed() else {
            return false;
        };
        self.stats.evictions += 1;
        self.events.removed(hash, Medium::Device);
        if let Some(host) = self.host.as_mut() {
            let _ = host.settle_onboard(token.id());
        }
        let addr = self.pool.token_span(&token).map(|s| s.addr());
        let dropped = match (self.host.as_mut(), addr) {
            (Some(host), Ok(addr)) => host
                .begin_offload(hash, token, addr, &mut self.events)
                .err(),
            _ => Some(token),
        };
        if let Some(token) = dropped {
            let _ = self.pool.release_tokens([token]);
        }
        true
    }
}
