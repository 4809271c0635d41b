//! Pins: an owner's hold on cached prefix blocks, which keeps them off
//! the LRU without owning a ref; released by owner, oldest first when the
//! pin budget is exceeded.

use std::collections::VecDeque;

use super::{to_u32, KVCacheManager};
use crate::error::MemError;
use crate::kv::hash::{BlockHash, ExtraKeys};
use crate::kv::prefix::FastMap;

/// Pins: owner → the hashes it pinned, oldest owner first for budget
/// eviction. Not an owner of any block.
#[derive(Debug, Default)]
pub(super) struct Pins {
    pub(super) owners: FastMap<u64, Vec<BlockHash>>,
    order: VecDeque<u64>,
    pub(super) total: u32,
}

impl KVCacheManager {
    /// Pins the cached leading blocks of `tokens` for `owner`, so eviction
    /// skips them. Pins are counted against the budget over all owners; when
    /// it would overflow, the oldest owners are unpinned first. Returns the
    /// blocks pinned (0 when the prefix is not cached).
    pub fn pin(&mut self, owner: u64, tokens: &[u32], extras: &ExtraKeys) -> Result<u32, MemError> {
        if !self.config.enable_prefix_caching {
            return Err(MemError::invalid("pinning needs prefix caching enabled"));
        }
        let hashes = self.hasher.chain(tokens, extras);
        let mut idxs = Vec::new();
        for h in &hashes {
            match self.cache.get(h) {
                Some(i) => idxs.push(i),
                None => break,
            }
        }
        let n = to_u32(idxs.len(), "pin")?;
        if n == 0 {
            return Ok(0);
        }
        if n > self.config.pin_budget {
            return Err(MemError::Capacity(format!(
                "pinning {n} blocks for owner {owner} exceeds the pin budget of {} blocks; pin a \
                 shorter prefix or raise pin_budget",
                self.config.pin_budget
            )));
        }
        while self.pins.total + n > self.config.pin_budget {
            let Some(front) = self.pins.order.front().copied() else {
                return Err(MemError::Invariant("pin total without owners".into()));
            };
            self.unpin(front);
        }
        let list = self.pins.owners.entry(owner).or_default();
        if list.is_empty() && !self.pins.order.contains(&owner) {
            self.pins.order.push_back(owner);
        }
        for (&idx, &h) in idxs.iter().zip(&hashes) {
            self.cache.pin(idx);
            list.push(h);
        }
        self.pins.total += n;
        Ok(n)
    }

    /// Drops every pin of `owner`; its blocks become evictable again (when no
    /// sequence uses them). Returns the pins dropped.
    pub fn unpin(&mut self, owner: u64) -> u32 {
        let Some(list) = self.pins.owners.remove(&owner) else {
            return 0;
        };
        self.pins.order.retain(|&o| o != owner);
        // Last block first, as `free` does (K20): the prefix's head becomes
        // the most recently used, so eviction shortens it from its end.
        for h in list.iter().rev() {
            if let Some(idx) = self.cache.get(h) {
                self.cache.unpin(idx);
            }
        }
        let n = list.len() as u32;
        self.pins.total -= n;
        n
    }
}
