//! What a manager reports: [`KvStats`] (its own and the host tier's
//! counters) and the KV events it queued.

use super::KVCacheManager;
use crate::kv::events::{KvEvent, Medium};
use crate::kv::hash::BlockHash;
use crate::kv::host_tier::HostTier;

/// Counters of a [`KVCacheManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvStats {
    /// Blocks in the main pool now (a growable pool's committed blocks).
    pub capacity: u32,
    /// The most blocks the main pool can grow to (`capacity` for a fixed
    /// pool); admission counts `max_blocks - capacity` as room.
    pub max_blocks: u32,
    /// Main blocks on the free list. V4: `free + live == capacity`.
    pub free: u32,
    /// Main blocks with at least one ref (sequences or cache).
    pub live: u32,
    /// Live blocks held by at least one sequence.
    pub active: u32,
    /// Prefix-cache entries (each holds one block).
    pub cached: u32,
    /// Cached blocks that eviction can free (no sequence, no pin).
    pub evictable: u32,
    /// Cached blocks with at least one pin.
    pub pinned: u32,
    /// Block pins outstanding, over all owners (what the budget counts).
    pub pins: u32,
    /// Sequences admitted and not freed.
    pub sequences: u32,
    /// Blocks in the SWA pool (0 without one).
    pub swa_capacity: u32,
    /// SWA blocks on the free list.
    pub swa_free: u32,
    /// SWA blocks held by sequences.
    pub swa_live: u32,
    /// Prefix lookups made by admissions.
    pub prefix_queries: u64,
    /// Full blocks those lookups asked for.
    pub prefix_query_blocks: u64,
    /// Blocks they found cached.
    pub prefix_hit_blocks: u64,
    /// Prompt tokens those lookups were made for (vLLM's prefix-cache
    /// queries).
    pub prefix_query_tokens: u64,
    /// Tokens they found cached (vLLM's prefix-cache hits), in either tier.
    pub prefix_hit_tokens: u64,
    /// Host slots of the host tier (0 without one).
    pub host_capacity: u32,
    /// Prefix blocks resident in the host tier.
    pub host_cached: u32,
    /// Host slots holding nothing.
    pub host_free: u32,
    /// Device → host copies in flight (their device blocks wait for them).
    pub host_offloading: u32,
    /// Host → device copies in flight (their host slots wait for them).
    pub host_onboarding: u32,
    /// Prefix hits served from the host tier, in blocks.
    pub host_hit_blocks: u64,
    /// Device → host copies completed, in blocks.
    pub offloads: u64,
    /// ... and in bytes.
    pub offload_bytes: u64,
    /// Host → device copies started, in blocks.
    pub onboards: u64,
    /// ... and in bytes.
    pub onboard_bytes: u64,
    /// Host blocks evicted to make room for newer ones (to disk, with a
    /// disk tier).
    pub host_evictions: u64,
    /// Blocks held in the disk tier.
    pub disk_cached: u32,
    /// Bytes of the disk tier's files.
    pub disk_bytes: u64,
    /// Blocks written to the disk tier.
    pub disk_spills: u64,
    /// Blocks read back from it (prefix hits).
    pub disk_loads: u64,
    /// Cache entries evicted.
    pub evictions: u64,
}

impl KVCacheManager {
    /// The counters.
    pub fn stats(&self) -> KvStats {
        let p = self.pool.stats();
        let idle = self.cache.evictable() + self.cache.pinned_idle();
        let (swa_free, swa_live) = match &self.swa_pool {
            Some(s) => {
                let st = s.stats();
                (st.free, st.live)
            }
            None => (0, 0),
        };
        KvStats {
            capacity: p.capacity,
            max_blocks: p.max_blocks,
            free: p.free,
            live: p.live,
            active: p.live.saturating_sub(idle + self.offloading()),
            cached: self.cache.len(),
            evictable: self.cache.evictable(),
            pinned: self.cache.pinned(),
            pins: self.pins.total,
            sequences: self.seqs.len() as u32,
            swa_free,
            swa_live,
            ..self.host_stats()
        }
    }

    /// The counters with the host tier's filled in.
    fn host_stats(&self) -> KvStats {
        let Some(h) = &self.host else {
            return self.stats;
        };
        let c = h.counters;
        KvStats {
            host_capacity: h.capacity(),
            host_cached: h.resident_len(),
            host_free: h.free_len(),
            host_offloading: h.offloading.len() as u32,
            host_onboarding: h.onboarding.len() as u32,
            host_hit_blocks: c.hit_blocks,
            offloads: c.offloads,
            offload_bytes: c.offload_bytes,
            onboards: c.onboards,
            onboard_bytes: c.onboard_bytes,
            host_evictions: c.evictions,
            disk_cached: h.disk.as_ref().map_or(0, |d| d.len()),
            disk_bytes: h.disk.as_ref().map_or(0, |d| d.used()),
            disk_spills: h.disk.as_ref().map_or(0, |d| d.counters.spills),
            disk_loads: h.disk.as_ref().map_or(0, |d| d.counters.loads),
            ..self.stats
        }
    }

    /// Takes the KV events recorded since the last drain, oldest first
    /// (one batch per engine step). Empty with `kv_events` off.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        let cache = &self.cache;
        let host = &self.host;
        self.events.take(|| {
            let mut all: Vec<(BlockHash, Medium)> = host
                .as_ref()
                .and_then(|h| h.disk.as_ref())
                .map_or_else(Vec::new, |d| d.in_order())
                .into_iter()
                .map(|h| (h, Medium::Disk))
                .collect();
            all.extend(
                host.as_ref()
                    .map_or_else(Vec::new, HostTier::resident_in_order)
                    .into_iter()
                    .map(|h| (h, Medium::Host)),
            );
            all.extend(
                cache
                    .entries_in_order()
                    .into_iter()
                    .map(|e| (e.hash, Medium::Device)),
            );
            all
        })
    }

    /// Events waiting for [`Self::drain_events`].
    pub fn pending_events(&self) -> usize {
        self.events.pending()
    }
}
