//! The prefix cache from the manager's side: its listing, LRU eviction,
//! making room for an allocation, and the reset.

use super::KVCacheManager;
use crate::block_pool::{BlockId, BlockToken};
use crate::decommit::FenceLike;
use crate::error::MemError;
use crate::kv::events::Medium;
use crate::kv::hash::BlockHash;

impl KVCacheManager {
    /// `(hash, block id, address)` of every cache entry (address `None` in
    /// slots mode).
    pub fn cached_blocks(&self) -> Vec<(BlockHash, BlockId, Option<usize>)> {
        self.cache
            .entries_in_order()
            .into_iter()
            .map(|e| {
                let addr = self.pool.token_span(&e.block).ok().map(|s| s.addr());
                (e.hash, e.block.id(), addr)
            })
            .collect()
    }

    /// Evicts up to `n` LRU cached blocks (pinned and in-use ones are
    /// skipped). Returns the blocks evicted: freed now, or, with a host
    /// tier, being copied there (freed by a later [`Self::poll_copies`]).
    pub fn evict(&mut self, n: u32) -> u32 {
        if self.host.is_some() {
            // Into the host tier, asynchronously: the blocks return to the
            // free list at a later `poll_copies`.
            let mut done = 0;
            while done < n && self.offload_one() {
                done += 1;
            }
            return done;
        }
        let mut evicted = Vec::new();
        while (evicted.len() as u64) < u64::from(n) {
            let Some(token) = self.evict_one() else {
                break;
            };
            evicted.push(token);
        }
        let done = evicted.len() as u32;
        // Every evicted token is this pool's, so the release cannot be refused.
        let _ = self.pool.release_tokens(evicted);
        done
    }

    /// Evicts the LRU cache entry and hands over its block's token,
    /// counting the eviction and recording its event. (With a host tier,
    /// room is made by [`Self::make_room`] instead; this then only takes
    /// what could not be offloaded.)
    pub(crate) fn evict_one(&mut self) -> Option<BlockToken> {
        let (hash, token) = self.cache.evict_take_hashed()?;
        self.stats.evictions += 1;
        self.events.removed(hash, Medium::Device);
        if let Some(host) = self.host.as_mut() {
            // A block still being onboarded must have its bytes before it
            // is reused.
            let _ = host.settle_onboard(token.id());
        }
        Some(token)
    }

    /// Frees up to `n` device blocks onto the free list by eviction: into
    /// the host tier when there is one (waiting for the copies, and for
    /// offloads already in flight), released otherwise.
    pub(crate) fn make_room(&mut self, n: u32) -> Result<(), MemError> {
        if self.host.is_none() {
            let mut evicted = Vec::new();
            while (evicted.len() as u32) < n {
                let Some(token) = self.evict_one() else { break };
                evicted.push(token);
            }
            return self.pool.release_tokens(evicted);
        }
        let mut started = self.offloading();
        while started < n && self.offload_one() {
            started += 1;
        }
        self.poll_copies(true).map(|_| ())
    }

    /// Gives about `bytes` of the KV pool's memory back (to its backend,
    /// and so to the device ledger): first the free tail above the live
    /// blocks, then, chunk by chunk from the top, the prefix-cache blocks
    /// that are all that keeps a chunk committed — evicted whole chunks at a
    /// time, so the pages really come free. Stops at a chunk a sequence
    /// (or a pinned or in-use cache entry) holds. `keep_blocks` free blocks
    /// above the highest live one stay committed (room the caller promised
    /// its running sequences). The decommits wait for `fence` (blocking).
    /// Returns the bytes decommitted.
    pub fn give_back<F: FenceLike + Send + Sync + 'static>(
        &mut self,
        bytes: u64,
        keep_blocks: u32,
        fence: F,
    ) -> Result<u64, MemError> {
        let fence = std::sync::Arc::new(fence);
        let pool = self.pool.clone();
        // No copy may read a block released here.
        let _ = self.poll_copies(true);
        let chunk = pool.stats().chunk_blocks.max(1);
        let keep_chunks = keep_blocks.div_ceil(chunk);
        let mut returned = pool.trim(keep_chunks, fence.clone())? + pool.flush_decommit()?;
        if keep_blocks > 0 {
            // The promised room sits above the live blocks: nothing under
            // it is evicted for the sake of a chunk.
            return Ok(returned);
        }
        while returned < bytes {
            let top = pool.live_top();
            // Within the blocks the pool opened with nothing is decommitted.
            if top <= pool.stats().min_blocks {
                break;
            }
            let from = (top - 1) / chunk * chunk;
            let evicted = self.cache.evict_from(from);
            if evicted.is_empty() {
                break;
            }
            let mut tokens = Vec::with_capacity(evicted.len());
            for (hash, token) in evicted {
                self.stats.evictions += 1;
                self.events.removed(hash, Medium::Device);
                if let Some(host) = self.host.as_mut() {
                    let _ = host.settle_onboard(token.id());
                }
                tokens.push(token);
            }
            self.pool.release_tokens(tokens)?;
            let freed = pool.shrink_now(fence.clone())? + pool.flush_decommit()?;
            if pool.live_top() >= top {
                break; // something else holds the chunk
            }
            returned += freed;
        }
        Ok(returned)
    }

    /// Makes at least `blocks` KV blocks free now, growing the pool (on a
    /// device ledger, only as far as it grants): the room an engine
    /// promises the sequences it admits, so that none of them is refused a
    /// block mid-generation. Evicts cached blocks first where growth is
    /// refused. All or nothing.
    pub fn reserve_free(&mut self, blocks: u32) -> Result<(), MemError> {
        match self.pool.reserve_free(blocks) {
            Ok(()) => Ok(()),
            Err(e) => {
                // Evict only when eviction plus what can still be granted
                // covers it, so a hopeless request costs the cache nothing.
                let (free, growable) = self.pool.room();
                let bb = self.pool.block_bytes().max(1) as u64;
                let grantable = self
                    .pool
                    .backend()
                    .map_or(0, |b| b.headroom().unwrap_or(0) / bb)
                    .min(growable as u64);
                let evictable = self.cache.evictable();
                let short = blocks.saturating_sub(free);
                if short == 0 || free as u64 + evictable as u64 + grantable < blocks as u64 {
                    return Err(e);
                }
                self.make_room(short.min(evictable))?;
                self.pool.reserve_free(blocks)
            }
        }
    }

    /// The ledger's side of one engine step, for a KV pool whose backend
    /// commits through a device ledger tenant (nothing otherwise): records
    /// the bytes of live blocks, and gives back what the ledger asks
    /// ([`crate::ledger::Tenant::pressure`]) with [`Self::give_back`],
    /// keeping `keep_blocks` free blocks.
    /// Returns the bytes given back.
    pub fn ledger_tick<F: FenceLike + Send + Sync + 'static>(
        &mut self,
        keep_blocks: u32,
        fence: F,
    ) -> Result<u64, MemError> {
        let Some(tenant) = self.pool.backend().and_then(|b| b.tenant()) else {
            return Ok(0);
        };
        let st = self.pool.stats();
        tenant.set_kv_live(st.live as u64 * st.block_bytes as u64)?;
        let asked = tenant.pressure()?;
        if asked == 0 {
            return Ok(0);
        }
        self.give_back(asked, keep_blocks, fence)
    }

    /// Empties the prefix cache, as vLLM's `reset_prefix_cache`: only when
    /// no sequence uses a cached block and none is pinned (returns false
    /// and changes nothing otherwise). Records `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.cache.evictable() != self.cache.len() {
            return false;
        }
        // No copy may still read or write a block released here.
        let _ = self.poll_copies(true);
        let tokens = self.cache.drain();
        self.stats.evictions += tokens.len() as u64;
        let _ = self.pool.release_tokens(tokens);
        if let Some(host) = self.host.as_mut() {
            host.clear_resident();
        }
        self.events.cleared();
        true
    }
}
