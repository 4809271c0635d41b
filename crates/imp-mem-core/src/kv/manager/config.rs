//! How a manager is built: [`KvConfig`], the constructors over new or
//! given pools, the block I/O and host / disk tier hooks, and the
//! accessors of what it was built with.

use std::sync::Arc;

use super::pins::Pins;
use super::sequence::Spare;
use super::stats::KvStats;
use super::KVCacheManager;
use crate::backend::Backend;
use crate::block_pool::{PoolConfig, SharedBlockPool};
use crate::error::MemError;
use crate::kv::events::EventLog;
use crate::kv::hash::{BlockHash, BlockHasher, ExtraKeys, DEFAULT_HASH_SEED};
use crate::kv::host_tier::{HostTier, TierIo};
use crate::kv::persist::{BlockIo, PoolBlockIo};
use crate::kv::prefix::{FastMap, PrefixCache};
use crate::tag::Tag;

/// How to build a [`KVCacheManager`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the main pool.
    pub num_blocks: u32,
    /// Bytes per main block when the pool lays out its memory over a backend
    /// region; 0 for an id space only (the engine lays the KV out itself,
    /// seed D10).
    pub block_bytes: usize,
    /// Blocks in the SWA pool (0: no SWA pool).
    pub swa_blocks: u32,
    /// The sliding window, in tokens (0: no SWA pool).
    pub swa_window: usize,
    /// Bytes per SWA block over a backend region; 0 for an id space.
    pub swa_block_bytes: usize,
    /// Cache full blocks and serve prefix hits.
    pub enable_prefix_caching: bool,
    /// Seed of the chained block hash.
    pub hash_seed: u64,
    /// The most cached blocks pinned at once, over all owners.
    pub pin_budget: u32,
    /// Names the model (and its weights) the KV belongs to; persisted files
    /// are refused under another.
    pub model_fingerprint: String,
    /// The KV dtype, recorded in persisted files.
    pub dtype: String,
    /// The KV layout, recorded in persisted files.
    pub layout: String,
    /// Record KV events for [`KVCacheManager::drain_events`] (the manager
    /// then also keeps each sequence's token ids, which `BlockStored`
    /// carries).
    pub kv_events: bool,
}

impl KvConfig {
    /// `num_blocks` blocks of `block_size` tokens, ids only, prefix caching
    /// on, no SWA, a pin budget of a quarter of the pool.
    pub fn new(block_size: usize, num_blocks: u32) -> Self {
        Self {
            block_size,
            num_blocks,
            block_bytes: 0,
            swa_blocks: 0,
            swa_window: 0,
            swa_block_bytes: 0,
            enable_prefix_caching: true,
            hash_seed: DEFAULT_HASH_SEED,
            pin_budget: num_blocks / 4,
            model_fingerprint: String::new(),
            dtype: String::new(),
            layout: String::new(),
            kv_events: false,
        }
    }

    /// The disk tier that a directory and a byte budget ask for, behind a
    /// host tier of `host_blocks` blocks: `None` when neither is given;
    /// refused unless both are, and the host tier is there to stand behind.
    pub fn disk_tier_args<P>(
        dir: Option<P>,
        bytes: u64,
        host_blocks: u32,
    ) -> Result<Option<(P, u64)>, MemError> {
        match (dir, bytes) {
            (None, 0) => Ok(None),
            (Some(dir), bytes) if bytes > 0 && host_blocks > 0 => Ok(Some((dir, bytes))),
            _ => Err(MemError::invalid(
                "disk_dir and disk_bytes: a disk tier needs both, and host_blocks > 0",
            )),
        }
    }

    fn check(&self) -> Result<(), MemError> {
        if self.block_size == 0 {
            return Err(MemError::invalid("block_size must be at least one token"));
        }
        if self.num_blocks == 0 {
            return Err(MemError::invalid("num_blocks must be positive"));
        }
        if (self.swa_blocks == 0) != (self.swa_window == 0) {
            return Err(MemError::invalid(format!(
                "an SWA pool needs both swa_blocks and swa_window (got {} blocks, a window of {} \
                 tokens); set both, or neither",
                self.swa_blocks, self.swa_window
            )));
        }
        if self.pin_budget > self.num_blocks {
            return Err(MemError::invalid(format!(
                "pin_budget={} is above num_blocks={}",
                self.pin_budget, self.num_blocks
            )));
        }
        Ok(())
    }
}

impl KVCacheManager {
    /// A manager whose pools are id spaces only, or lay their memory out over
    /// `backend` when `block_bytes` (and `swa_block_bytes`) are set.
    pub fn new(config: KvConfig, backend: Option<&Backend>) -> Result<Self, MemError> {
        config.check()?;
        let open = |bytes: usize, blocks: u32, tag: Tag| match (bytes, backend) {
            (0, _) => SharedBlockPool::slots(blocks),
            (_, Some(b)) => {
                SharedBlockPool::new(b, &PoolConfig::fixed(bytes, blocks).with_tag(tag))
            }
            (_, None) => Err(MemError::invalid(
                "block_bytes is set but no backend was given to lay the blocks out on",
            )),
        };
        let pool = open(config.block_bytes, config.num_blocks, Tag::KvCache)?;
        let swa_pool = if config.swa_blocks > 0 {
            Some(open(
                config.swa_block_bytes,
                config.swa_blocks,
                Tag::SwaCache,
            )?)
        } else {
            None
        };
        Self::with_pools(config, pool, swa_pool)
    }

    /// A manager over pools opened elsewhere (a [`MemorySystem`]'s KV and
    /// SWA pools). The pools decide the sizes: `num_blocks`, `block_bytes`,
    /// `swa_blocks` and `swa_block_bytes` of `config` are replaced by theirs
    /// (`num_blocks` is the most the main pool can grow to; admission counts
    /// the room a growable pool can still commit). `swa_window` must be set
    /// exactly when an SWA pool is given. The manager accounts every ref of
    /// its pools ([`Self::check_invariants`]), so it must be their only
    /// client: a pool that already has live blocks is refused.
    ///
    /// [`MemorySystem`]: crate::system::MemorySystem
    pub fn with_pools(
        mut config: KvConfig,
        pool: SharedBlockPool,
        swa_pool: Option<SharedBlockPool>,
    ) -> Result<Self, MemError> {
        let main = pool.stats();
        config.num_blocks = main.max_blocks;
        config.block_bytes = pool.block_bytes();
        (config.swa_blocks, config.swa_block_bytes) = match &swa_pool {
            Some(swa) => (swa.stats().max_blocks, swa.block_bytes()),
            None => (0, 0),
        };
        config.check()?;
        for (p, what) in [(Some(&pool), "KV"), (swa_pool.as_ref(), "SWA")] {
            let Some(p) = p else { continue };
            let live = p.stats().live;
            if live > 0 {
                return Err(MemError::invalid(format!(
                    "the {what} pool already has {live} live block(s); a KV manager accounts \
                     every ref of its pools, so build it over pools nobody else allocates from"
                )));
            }
        }
        if swa_pool.as_ref().is_some_and(|s| s.id() == pool.id()) {
            return Err(MemError::invalid(
                "the SWA pool must be a second pool with its own id space, not the KV pool",
            ));
        }
        let claims = (
            pool.claim()?,
            swa_pool.as_ref().map(SharedBlockPool::claim).transpose()?,
        );
        // A pool laid out over a region copies its own blocks; an id space
        // has no bytes to persist.
        let io = (pool.block_bytes() > 0)
            .then(|| Arc::new(PoolBlockIo::new(pool.block_bytes())) as Arc<dyn BlockIo>);
        let stats = KvStats {
            capacity: main.capacity,
            swa_capacity: config.swa_blocks,
            ..KvStats::default()
        };
        Ok(Self {
            host: None,
            events: EventLog::new(config.kv_events),
            hasher: BlockHasher::new(config.block_size, config.hash_seed),
            cache: PrefixCache::new(&pool),
            config,
            pool,
            swa_pool,
            seqs: FastMap::default(),
            pins: Pins::default(),
            io,
            stats,
            spare: Spare::default(),
            _claims: claims,
            lent: Arc::default(),
        })
    }

    /// Replaces how block bytes are copied out and in (persistence). A
    /// manager over a pool with `block_bytes > 0` starts with
    /// [`PoolBlockIo`]; tests install others to inject faults.
    pub fn set_block_io(&mut self, io: Box<dyn BlockIo>) -> Result<(), MemError> {
        self.io = Some(Arc::from(io));
        Ok(())
    }

    /// Puts a host tier behind the prefix cache: evicted blocks are copied
    /// into `io`'s host slots instead of dropped, and prefix hits on them
    /// are copied back (`kv::host_tier`). Needs a pool laid out over
    /// memory (`block_bytes`), prefix caching, and no host tier yet.
    pub fn set_host_tier(&mut self, io: Box<dyn TierIo>) -> Result<(), MemError> {
        let bb = self.pool.block_bytes();
        if bb == 0 {
            return Err(MemError::invalid(
                "a host tier copies block bytes: build the manager over a backend with \
                 block_bytes > 0",
            ));
        }
        if io.block_bytes() != bb {
            return Err(MemError::invalid(format!(
                "the host tier copies blocks of {} bytes but the pool's are {bb}",
                io.block_bytes()
            )));
        }
        if !self.config.enable_prefix_caching {
            return Err(MemError::invalid(
                "a host tier needs prefix caching enabled",
            ));
        }
        if io.slots() == 0 {
            return Err(MemError::invalid(
                "a host tier needs at least one host block",
            ));
        }
        if self.host.is_some() {
            return Err(MemError::invalid("this manager has a host tier already"));
        }
        self.host = Some(HostTier::new(io)?);
        Ok(())
    }

    /// Puts a disk tier behind the host tier: its evictions are written to
    /// `dir` (one prefix-cache file per block) within `budget_bytes`, and
    /// read back on a hit (`kv::disk_tier`). Needs a host tier.
    pub fn set_disk_tier(
        &mut self,
        dir: &std::path::Path,
        budget_bytes: u64,
    ) -> Result<(), MemError> {
        let bb = self.pool.block_bytes();
        let format = self.block_file_format(bb)?;
        let Some(host) = self.host.as_mut() else {
            return Err(MemError::invalid(
                "a disk tier stands behind the host tier: give the manager host blocks first",
            ));
        };
        if host.disk.is_some() {
            return Err(MemError::invalid("this manager has a disk tier already"));
        }
        host.disk = Some(crate::kv::disk_tier::DiskTier::new(
            dir,
            budget_bytes,
            bb,
            format,
        )?);
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    /// The main pool.
    pub fn pool(&self) -> &SharedBlockPool {
        &self.pool
    }

    /// The SWA pool, if there is one.
    pub fn swa_pool(&self) -> Option<&SharedBlockPool> {
        self.swa_pool.as_ref()
    }

    /// The chained hashes of the full blocks of `tokens`.
    pub fn hash_blocks(&self, tokens: &[u32], extras: &ExtraKeys) -> Vec<BlockHash> {
        self.hasher.chain(tokens, extras)
    }

    /// The hasher.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// A disk tier is asked for by a directory and a budget together,
        /// behind a host tier; neither asks for none; anything else is
        /// refused.
        #[test]
        fn the_disk_tier_needs_both_arguments_and_a_host_tier(
            dir in proptest::option::of(0u8..4),
            bytes in prop_oneof![Just(0u64), 1u64..1 << 40, Just(u64::MAX)],
            host_blocks in prop_oneof![Just(0u32), 1u32..1000],
        ) {
            let got = KvConfig::disk_tier_args(dir, bytes, host_blocks);
            match (dir, bytes, host_blocks) {
                (None, 0, _) => prop_assert_eq!(got.unwrap(), None),
                (Some(d), b, h) if b > 0 && h > 0 => prop_assert_eq!(got.unwrap(), Some((d, b))),
                _ => {
                    let e = got.unwrap_err();
                    prop_assert!(matches!(e, MemError::InvalidArgument(_)));
                    prop_assert_eq!(
                        e.to_string(),
                        "disk_dir and disk_bytes: a disk tier needs both, and host_blocks > 0"
                    );
                }
            }
        }
    }
}
