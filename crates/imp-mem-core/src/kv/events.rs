//! KV events: what entered and left the prefix cache, for a KV-aware router.
//!
//! The meanings follow vLLM's KV events (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`, carried in one batch per engine step), so a consumer
//! written for vLLM's stream reads ours; the Python package encodes them
//! (`imp_mem.events`).
//!
//! # Algorithm
//!
//! The manager appends to an [`EventLog`] as it changes the cache — an
//! entry added when a sequence is freed or commits its blocks, an entry
//! evicted, the cache emptied — and the engine takes the whole buffer once
//! per step ([`KVCacheManager::drain_events`](crate::kv::KVCacheManager::drain_events)).
//! Nothing calls out per block: recording is a push onto a vector, and
//! consecutive blocks of one sequence become one `BlockStored` (the chain's
//! run, with the parent hash of its first block), consecutive evictions one
//! `BlockRemoved`. With events off the log records nothing and the manager
//! keeps no token ids.
//!
//! The buffer is bounded ([`EventLog::DEFAULT_LIMIT`] blocks): an engine that
//! stops draining must not grow it for ever. On overflow the log forgets
//! what it held and the next drain opens with `AllBlocksCleared` followed by
//! one `BlockStored` per block cached then (without token ids or parent:
//! the manager keeps hashes only), so a consumer's index is exact again.
//!
//! Thread safety: the log is part of the manager and shares its `&mut self`.

use crate::kv::hash::BlockHash;

/// Where a block lives, in vLLM's words (`medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The device pool (`"GPU"`).
    Device,
    /// The pinned host tier (`"CPU"`).
    Host,
    /// Disk (`"STORAGE"`).
    Disk,
}

impl Medium {
    /// vLLM's name for the medium.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Device => "GPU",
            Medium::Host => "CPU",
            Medium::Disk => "STORAGE",
        }
    }
}

/// One change of the cached set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks became cached: a chain, `block_hashes[0]`'s parent being
    /// `parent_block_hash` (`None` for a prompt's first block, or unknown).
    BlockStored {
        /// The blocks' chained hashes, in chain order.
        block_hashes: Vec<BlockHash>,
        /// The hash of the block before the first one.
        parent_block_hash: Option<BlockHash>,
        /// The blocks' token ids, `block_size` per block (empty where the
        /// manager no longer has them: a loaded file, a resync).
        token_ids: Vec<u32>,
        /// The LoRA adapter the blocks were computed with.
        lora_id: Option<u64>,
        /// Where the blocks are.
        medium: Medium,
    },
    /// Blocks left the cache of `medium`.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<BlockHash>,
        /// Where they were.
        medium: Medium,
    },
    /// Every block left the cache.
    AllBlocksCleared,
}

impl KvEvent {
    fn blocks(&self) -> usize {
        match self {
            KvEvent::BlockStored { block_hashes, .. }
            | KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
            KvEvent::AllBlocksCleared => 1,
        }
    }
}

/// The manager's event buffer. See the module docs.
#[derive(Debug)]
pub(crate) struct EventLog {
    enabled: bool,
    events: Vec<KvEvent>,
    /// Blocks named by `events` (what the limit bounds).
    blocks: usize,
    limit: usize,
    overflowed: bool,
    /// Times the buffer overflowed.
    pub overflows: u64,
}

impl EventLog {
    /// Blocks the buffer holds at most between drains.
    pub const DEFAULT_LIMIT: usize = 1 << 20;

    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            events: Vec::new(),
            blocks: 0,
            limit: Self::DEFAULT_LIMIT,
            overflowed: false,
            overflows: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    #[cfg(test)]
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Events waiting to be drained.
    pub fn pending(&self) -> usize {
        self.events.len() + usize::from(self.overflowed)
    }

    fn push(&mut self, event: KvEvent) {
        if self.overflowed {
            return;
        }
        self.blocks += event.blocks();
        if self.blocks > self.limit {
            self.events = Vec::new();
            self.blocks = 0;
            self.overflowed = true;
            self.overflows += 1;
            return;
        }
        self.events.push(event);
    }

    /// Blocks `idxs` of a sequence (any order, no duplicates) became cached
    /// in `medium`: one `BlockStored` per run of consecutive indices.
    /// `tokens` are the sequence's token ids (empty: unknown).
    pub fn stored(
        &mut self,
        idxs: &mut [usize],
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
        lora_id: Option<u64>,
        medium: Medium,
    ) {
        if !self.enabled || idxs.is_empty() {
            return;
        }
        idxs.sort_unstable();
        let mut start = 0;
        while start < idxs.len() {
            let mut end = start + 1;
            while end < idxs.len() && idxs[end] == idxs[end - 1] + 1 {
                end += 1;
            }
            let (first, last) = (idxs[start], idxs[end - 1] + 1);
            let token_ids = tokens
                .get(first * block_size..last * block_size)
                .map(<[u32]>::to_vec)
                .unwrap_or_default();
            self.push(KvEvent::BlockStored {
                block_hashes: hashes[first..last].to_vec(),
                parent_block_hash: first.checked_sub(1).map(|p| hashes[p]),
                token_ids,
                lora_id,
                medium,
            });
            start = end;
        }
    }

    /// One block of unknown chain (a loaded one) became cached in `medium`.
    pub fn stored_alone(&mut self, hash: BlockHash, medium: Medium) {
        if self.enabled {
            self.push(KvEvent::BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: None,
                token_ids: Vec::new(),
                lora_id: None,
                medium,
            });
        }
    }

    /// Block `hash` left the cache of `medium`; joins the previous event
    /// when that one is a removal from the same medium.
    pub fn removed(&mut self, hash: BlockHash, medium: Medium) {
        if !self.enabled || self.overflowed {
            return;
        }
        if let Some(KvEvent::BlockRemoved {
            block_hashes,
            medium: m,
        }) = self.events.last_mut()
        {
            if *m == medium && self.blocks < self.limit {
                block_hashes.push(hash);
                self.blocks += 1;
                return;
            }
        }
        self.push(KvEvent::BlockRemoved {
            block_hashes: vec![hash],
            medium,
        });
    }

    /// Everything left the cache: what was buffered no longer matters.
    pub fn cleared(&mut self) {
        if self.enabled {
            self.events.clear();
            self.blocks = 0;
            self.overflowed = false;
            self.push(KvEvent::AllBlocksCleared);
        }
    }

    /// Takes the buffered events. After an overflow, `cached` lists what is
    /// cached now (hash, medium) and the batch is a resync.
    pub fn take(&mut self, cached: impl FnOnce() -> Vec<(BlockHash, Medium)>) -> Vec<KvEvent> {
        self.blocks = 0;
        if !std::mem::take(&mut self.overflowed) {
            return std::mem::take(&mut self.events);
        }
        let mut out = vec![KvEvent::AllBlocksCleared];
        out.extend(
            cached()
                .into_iter()
                .map(|(h, medium)| KvEvent::BlockStored {
                    block_hashes: vec![h],
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    lora_id: None,
                    medium,
                }),
        );
        out
    }
}
