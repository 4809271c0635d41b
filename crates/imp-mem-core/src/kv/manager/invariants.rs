//! The manager's invariant scanner: every ref of its pools accounted to
//! a sequence, the prefix cache, a pin or a lent save / load (V4, V5).

use super::sequence::Slot;
use super::{ceil_div, KVCacheManager, SeqId};
use crate::block_pool::BlockId;
use crate::error::MemError;
use crate::kv::hash::BlockHash;
use crate::kv::prefix::FastMap;

impl KVCacheManager {
    /// Walks everything and checks the ownership invariants: V4 on both
    /// pools; every ref accounted for (cache entries + owned sequence
    /// slots); an owned block held by one slot only and never also cached;
    /// a block reachable from two sequences only through a cache entry of
    /// the same hash; the cache's LRU and counters; the pins; and that each
    /// kernel-facing table matches its slots.
    pub fn check_invariants(&self) -> Result<(), MemError> {
        let broken = |what: String| Err(MemError::Invariant(format!("kv manager: {what}")));
        // Held throughout: lent refs are not registered or dropped while
        // the refcounts are read.
        let lent = self.lent.lock();
        let lent_to = |id: BlockId| lent.get(&id).copied().unwrap_or(0);
        self.pool.check_invariants()?;
        self.cache
            .check(|id| self.pool.refcount(id).saturating_sub(lent_to(id)))?;
        let mut owned: FastMap<BlockId, (SeqId, usize)> = FastMap::default();
        let mut seq_refs = 0u64;
        let mut users: FastMap<u32, u32> = FastMap::default();
        let mut swa_ids: FastMap<BlockId, SeqId> = FastMap::default();
        let bs = self.config.block_size;
        for (&sid, seq) in &self.seqs {
            if seq.blocks.len() != ceil_div(seq.len, bs) || seq.tail.len() != seq.len % bs {
                return broken(format!(
                    "sequence {sid} has {} blocks for {} tokens",
                    seq.blocks.len(),
                    seq.len
                ));
            }
            if self.config.enable_prefix_caching && seq.hashes.len() != seq.len / bs {
                return broken(format!("sequence {sid} has {} hashes", seq.hashes.len()));
            }
            for (i, slot) in seq.blocks.iter().enumerate() {
                match slot {
                    Slot::Hole => {}
                    Slot::Own(r) => {
                        if r.pool_tag() != self.pool.tag() {
                            return broken(format!(
                                "sequence {sid} block {i} is from a foreign pool"
                            ));
                        }
                        seq_refs += 1;
                        if let Some((other, j)) = owned.insert(r.id(), (sid, i)) {
                            return broken(format!(
                                "block {} is owned by slot {i} of sequence {sid} and slot {j} \
                                 of sequence {other}",
                                r.id()
                            ));
                        }
                    }
                    Slot::Cached { entry, id } => {
                        let Some(e) = self.cache.entry(*entry) else {
                            return broken(format!("sequence {sid} hit {i} names no entry"));
                        };
                        if e.block.id() != *id || seq.hashes.get(i) != Some(&e.hash) {
                            return broken(format!(
                                "sequence {sid} block {i} ({id}) is a hit on entry of block {} \
                                 with another hash — a cross-request KV bleed",
                                e.block.id()
                            ));
                        }
                        *users.entry(*entry).or_default() += 1;
                    }
                }
            }
            if !seq.dirty {
                let want: Vec<i32> = seq
                    .blocks
                    .iter()
                    .map(|b| b.id().map_or(-1, |id| id as i32))
                    .collect();
                if want != seq.table {
                    return broken(format!("sequence {sid}'s table drifted from its refs"));
                }
            }
            if let Some(swa) = &self.swa_pool {
                let first = self.swa_first(seq.len).min(seq.blocks.len());
                if seq.swa.len() != seq.blocks.len() {
                    return broken(format!("sequence {sid}'s SWA table has the wrong length"));
                }
                for (i, slot) in seq.swa.iter().enumerate() {
                    if (i >= first) != slot.is_some() {
                        return broken(format!(
                            "sequence {sid}'s SWA slot {i} is wrong for window start {first}"
                        ));
                    }
                    if let Some(r) = slot {
                        if r.0.pool_tag() != swa.tag() || swa.refcount(r.0.id()) != 1 {
                            return broken(format!(
                                "sequence {sid}'s SWA block {i} is shared or foreign"
                            ));
                        }
                        if swa_ids.insert(r.0.id(), sid).is_some() {
                            return broken(format!("SWA block {} is in two places", r.0.id()));
                        }
                    }
                }
            } else if !seq.swa.is_empty() {
                return broken(format!("sequence {sid} has SWA blocks without an SWA pool"));
            }
        }
        for e in self.cache.entries_in_order() {
            let counted = self
                .cache
                .get(&e.hash)
                .and_then(|i| users.get(&i))
                .copied()
                .unwrap_or(0);
            if counted != e.users {
                return broken(format!(
                    "cache entry of block {} has {} users but {counted} sequences hit it",
                    e.block.id(),
                    e.users
                ));
            }
            if let Some((sid, i)) = owned.get(&e.block.id()) {
                return broken(format!(
                    "block {} is cached and also owned by slot {i} of sequence {sid}",
                    e.block.id()
                ));
            }
        }
        let refs = self.pool.stats().refs;
        let in_flight = self.offloading() as u64;
        let lent_refs: u64 = lent.values().map(|&n| u64::from(n)).sum();
        if refs != seq_refs + self.cache.len() as u64 + in_flight + lent_refs {
            return broken(format!(
                "{refs} refs outstanding but sequences hold {seq_refs}, the cache {}, offloads \
                 in flight {in_flight} and a save or load in progress {lent_refs}",
                self.cache.len()
            ));
        }
        if let Some(host) = &self.host {
            host.check()?;
            for h in host.resident_in_order() {
                if self.cache.get(&h).is_some() {
                    return broken(format!("block hash {h:x} is cached in both tiers"));
                }
            }
            if let Some(disk) = &host.disk {
                disk.check()?;
                for h in disk.in_order() {
                    if self.cache.get(&h).is_some() || host.contains(&h) {
                        return broken(format!("block hash {h:x} is on disk and cached"));
                    }
                }
            }
            for o in &host.offloading {
                if o.token.pool_tag() != self.pool.tag() || owned.contains_key(&o.token.id()) {
                    return broken(format!("offloading block {} is also owned", o.token.id()));
                }
            }
            for o in &host.onboarding {
                let cached = self
                    .cache
                    .entries_in_order()
                    .into_iter()
                    .any(|e| e.block.id() == o.block);
                if !cached {
                    return broken(format!(
                        "block {} is being onboarded but is no cache entry's",
                        o.block
                    ));
                }
            }
        }
        if let Some(swa) = &self.swa_pool {
            swa.check_invariants()?;
            if swa.stats().refs != swa_ids.len() as u64 {
                return broken("SWA refs are not all held by sequences".into());
            }
        }
        let mut pins: FastMap<BlockHash, u32> = FastMap::default();
        let mut total = 0u32;
        for list in self.pins.owners.values() {
            for h in list {
                *pins.entry(*h).or_default() += 1;
                total += 1;
            }
        }
        if total != self.pins.total || total > self.config.pin_budget {
            return broken(format!("{total} pins, counter {}", self.pins.total));
        }
        for e in self.cache.entries_in_order() {
            if pins.get(&e.hash).copied().unwrap_or(0) != e.pins {
                return broken(format!(
                    "entry of block {} has a drifted pin count",
                    e.block.id()
                ));
            }
        }
        if pins.keys().any(|h| self.cache.get(h).is_none()) {
            return broken("a pinned hash is not cached".into());
        }
        Ok(())
    }
}
