//! [`KVCacheManager`]: sequences, admission, eviction, pins and stats. The
//! module docs of [`crate::kv`] state the ownership rules this file follows.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::backend::Backend;
use crate::block_pool::{BlockId, BlockToken, PoolClaim, PoolConfig, SharedBlockPool};
use crate::error::{KvCapacityReport, MemError};
use crate::kv::events::{EventLog, KvEvent, Medium};
use crate::kv::hash::{BlockHash, BlockHasher, ExtraKeys, DEFAULT_HASH_SEED};
use crate::kv::host_tier::{CopyTicket, HostTier, TierIo};
use crate::kv::persist::{BlockIo, Lent};
use crate::kv::prefix::{Entry, FastMap, Insert, PrefixCache};
use crate::tag::Tag;

/// A sequence's id, chosen by the caller.
pub type SeqId = u64;

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
            IdSource::I32 => super::tokens::check_int32(tokens),
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

/// A block of the SWA pool. The cache takes no `SwaRef` and there is no way
/// to share one, so sharing an SWA block cannot be written (B2's second
/// trap).
#[derive(Debug)]
struct SwaRef(BlockToken);

/// One position of a sequence's block table.
#[derive(Debug)]
enum Slot {
    /// A hole left by a middle eviction.
    Hole,
    /// A block the sequence holds a ref to (its token).
    Own(BlockToken),
    /// A block shared with prefix-cache entry `entry` — a hit at admission,
    /// or a block handed to the cache while running (`cache_computed`).
    /// The entry owns the block's ref; the sequence is one of its users,
    /// which keeps the entry off the LRU, so the block cannot be evicted
    /// while the slot exists (K16).
    Cached { entry: u32, id: BlockId },
}

impl Slot {
    fn id(&self) -> Option<BlockId> {
        match self {
            Slot::Hole => None,
            Slot::Own(t) => Some(t.id()),
            Slot::Cached { id, .. } => Some(*id),
        }
    }
}

#[derive(Debug, Default)]
struct Sequence {
    /// Tokens in the sequence.
    len: usize,
    /// The tokens of the partial last block (the full ones live on only as
    /// hashes).
    tail: Vec<u32>,
    /// Every token, kept only while KV events are on (`BlockStored`
    /// carries the ids of the blocks it names).
    tokens: Vec<u32>,
    extras: ExtraKeys,
    root: BlockHash,
    /// Chained hashes of the full blocks (empty with prefix caching off).
    hashes: Vec<BlockHash>,
    blocks: Vec<Slot>,
    /// Blocks below this were prefix hits or offered to the cache by
    /// `cache_computed`.
    offered: usize,
    /// Blocks at or after this index were (or will be) computed after a
    /// middle eviction and are never cached.
    cacheable: usize,
    swa: Vec<Option<SwaRef>>,
    table: Vec<i32>,
    swa_table: Vec<i32>,
    dirty: bool,
}

impl Sequence {
    fn rebuild(&mut self) {
        if !self.dirty {
            return;
        }
        self.table.clear();
        self.table.extend(
            self.blocks
                .iter()
                .map(|b| b.id().map_or(-1, |id| id as i32)),
        );
        self.swa_table.clear();
        self.swa_table.extend(
            self.swa
                .iter()
                .map(|b| b.as_ref().map_or(-1, |r| r.0.id() as i32)),
        );
        self.dirty = false;
    }
}

/// Buffers kept between calls so that the hot paths (admit, free, eviction)
/// do not allocate: scratch lists (always empty between calls) and the
/// boxes of freed sequences, their vectors emptied but not shrunk.
#[derive(Debug, Default)]
struct Spare {
    tokens: Vec<BlockToken>,
    hits: Vec<u32>,
    // Boxed on purpose: a sequence moves between this list and the map as
    // one pointer, not a few hundred bytes.
    #[allow(clippy::vec_box)]
    seqs: Vec<Box<Sequence>>,
}

impl Spare {
    /// Freed sequences kept at most.
    const KEEP: usize = 16;
    /// A freed sequence longer than this many blocks is not kept, so that a
    /// rare very long one does not pin its vectors' memory for good.
    const KEEP_BLOCKS: usize = 4096;

    /// Keeps a freed sequence's box for the next admission. Its slots must
    /// have been drained (their tokens released or moved); a sequence that
    /// still holds any is dropped instead, which a debug build reports.
    fn keep(&mut self, mut seq: Box<Sequence>) {
        if self.seqs.len() >= Self::KEEP
            || !seq.blocks.is_empty()
            || !seq.swa.is_empty()
            || seq.blocks.capacity().max(seq.hashes.capacity()) > Self::KEEP_BLOCKS
        {
            return;
        }
        seq.tail.clear();
        seq.tokens.clear();
        seq.extras = ExtraKeys::default();
        seq.hashes.clear();
        seq.table.clear();
        seq.swa_table.clear();
        self.seqs.push(seq);
    }
}

/// Pins: owner → the hashes it pinned, oldest owner first for budget
/// eviction. Not an owner of any block.
#[derive(Debug, Default)]
struct Pins {
    owners: FastMap<u64, Vec<BlockHash>>,
    order: VecDeque<u64>,
    total: u32,
}

/// The paged KV cache manager. Single-threaded (`&mut self`); the Python
/// binding puts it behind a mutex.
#[derive(Debug)]
pub struct KVCacheManager {
    config: KvConfig,
    hasher: BlockHasher,
    pool: SharedBlockPool,
    swa_pool: Option<SharedBlockPool>,
    pub(crate) cache: PrefixCache,
    seqs: FastMap<SeqId, Box<Sequence>>,
    pins: Pins,
    pub(crate) io: Option<Arc<dyn BlockIo>>,
    stats: KvStats,
    spare: Spare,
    pub(crate) events: EventLog,
    pub(crate) host: Option<HostTier>,
    /// The manager's claims on its pools: no second manager, and no
    /// allocation through the pools' own API, while it lives.
    _claims: (PoolClaim, Option<PoolClaim>),
    /// Refs a save or a load holds outside the binding's lock.
    pub(crate) lent: Arc<Lent>,
}

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// A block count as `u32`, saturated: a count past `u32::MAX` cannot fit
/// any pool (they hold at most `u32::MAX - 1` blocks), so it is refused as
/// `u32::MAX` would be, never truncated into one that fits.
fn sat_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn to_u32(n: usize, what: &str) -> Result<u32, MemError> {
    u32::try_from(n).map_err(|_| MemError::invalid(format!("{what}: {n} blocks is too many")))
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
            io: None,
            stats,
            spare: Spare::default(),
            _claims: claims,
            lent: Arc::default(),
        })
    }

    /// Installs how block bytes are copied out and in (persistence).
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

    fn seq(&self, id: SeqId) -> Result<&Sequence, MemError> {
        self.seqs
            .get(&id)
            .map(|s| &**s)
            .ok_or_else(|| MemError::invalid(format!("no sequence {id} is admitted")))
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence, MemError> {
        self.seqs
            .get_mut(&id)
            .map(|s| &mut **s)
            .ok_or_else(|| MemError::invalid(format!("no sequence {id} is admitted")))
    }

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

    /// Device blocks in flight to the host tier: room, once their copies
    /// complete.
    pub(crate) fn offloading(&self) -> u32 {
        self.host.as_ref().map_or(0, |h| h.offloading.len() as u32)
    }

    fn pinned_idle(&self) -> u32 {
        self.cache.pinned_idle()
    }

    /// Refuses unless `need` main blocks can be had from the free list plus
    /// evictable entries (less `taken`, evictable entries the operation
    /// itself is about to use). Returns the free blocks it saw.
    fn check_main(
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

    /// The main pool's free blocks, and the blocks a growable pool can still
    /// commit before it reaches its maximum (withdrawn blocks waiting for a
    /// decommit included: an allocation takes them back first).
    pub(crate) fn main_room(&self) -> (u32, u32) {
        self.pool.room()
    }

    fn check_swa(
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
    fn take_main(&mut self, need: u32, free: u32, out: &mut Vec<Slot>) -> Result<(), MemError> {
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

    fn take_swa(&self, need: u32) -> Result<Vec<Option<SwaRef>>, MemError> {
        let mut out = Vec::new();
        if let (Some(swa), 1..) = (&self.swa_pool, need) {
            out.reserve(need as usize);
            swa.allocate_tokens(need, |t| out.push(Some(SwaRef(t))))?;
        }
        Ok(out)
    }

    /// Lets go of a sequence's slots: owned blocks are released under one
    /// pool lock, cached ones give back their entry's use.
    fn release_slots(&mut self, slots: impl IntoIterator<Item = Slot>) {
        let mut owned = std::mem::take(&mut self.spare.tokens);
        for slot in slots {
            match slot {
                Slot::Hole => {}
                Slot::Own(t) => owned.push(t),
                Slot::Cached { entry, .. } => self.cache.release_user(entry),
            }
        }
        // Every token here is this pool's, so the release cannot be refused.
        let _ = self.pool.release_tokens(owned.drain(..));
        self.spare.tokens = owned;
    }

    /// Releases SWA tokens (there are none without an SWA pool: they only
    /// come from it).
    fn release_swa(&self, tokens: impl IntoIterator<Item = Option<SwaRef>>) {
        if let Some(swa) = &self.swa_pool {
            let _ = swa.release_tokens(tokens.into_iter().flatten().map(|r| r.0));
        }
    }

    /// First block index inside the sliding window of a sequence of
    /// `n_tokens` tokens.
    fn swa_first(&self, n_tokens: usize) -> usize {
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

    /// A hash just cached on the device leaves the host tier (one tier at
    /// a time).
    pub(crate) fn drop_host_copy(&mut self, hash: &BlockHash) {
        if let Some(host) = self.host.as_mut() {
            host.discard(hash, &mut self.events);
        }
    }

    /// Takes the host slots of `hashes` (all resident: `match_host` said
    /// so), with their LRU stamps for a rollback.
    fn take_host_hits(&mut self, hashes: &[BlockHash]) -> Vec<(u32, u64)> {
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
    fn onboard(
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
        for (j, &(_, _)) in slots.iter().enumerate() {
            let i = first + j;
            let hash = seq.hashes[i];
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

    /// Blocks (main, SWA) an append of `n` tokens to `id` needs, and the SWA
    /// blocks it would release.
    fn append_needs(&self, seq: &Sequence, n: usize) -> (u32, u32, u32) {
        let bs = self.config.block_size;
        let old_n = seq.len;
        // Saturated: `n` is a caller's count and may be absurd; a
        // saturated need is refused like the true one would be.
        let new_n = old_n.saturating_add(n);
        let old_total = ceil_div(old_n, bs);
        let new_total = ceil_div(new_n, bs);
        let need = sat_u32(new_total - old_total);
        if self.swa_pool.is_none() {
            return (need, 0, 0);
        }
        let old_first = self.swa_first(old_n).min(old_total);
        let new_first = self.swa_first(new_n);
        let released = sat_u32(new_first.min(old_total).saturating_sub(old_first));
        let swa_need = sat_u32(new_total.saturating_sub(old_total.max(new_first)));
        (need, swa_need, released)
    }

    /// True when `n` more tokens fit sequence `id` now.
    pub fn can_append(&self, id: SeqId, n: usize) -> Result<bool, MemError> {
        let seq = self.seq(id)?;
        let (need, swa_need, released) = self.append_needs(seq, n);
        let what = || String::new();
        Ok(self.check_main(what, need, 0).is_ok()
            && self.check_swa(what, swa_need, released).is_ok())
    }

    /// Appends `tokens` to sequence `id`, allocating the blocks they need.
    /// All or nothing: a refusal changes nothing.
    pub fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<(), MemError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let (need, swa_need, released) = self.append_needs(seq, tokens.len());
        let old_n = seq.len;
        let what = || {
            format!(
                "append {} tokens to sequence {id} ({old_n} tokens)",
                tokens.len()
            )
        };
        let free = self.check_main(what, need, 0)?;
        self.check_swa(what, swa_need, released)?;
        let mut fresh = Vec::with_capacity(need as usize);
        self.take_main(need, free, &mut fresh)?;
        let new_first = self.swa_first(old_n + tokens.len());
        let caching = self.config.enable_prefix_caching;
        let has_swa = self.swa_pool.is_some();
        let Some(seq) = self.seqs.get_mut(&id) else {
            self.release_slots(fresh);
            return Err(MemError::Invariant(format!("sequence {id} vanished")));
        };
        // Release the SWA blocks that slide out before allocating, so the
        // window's own turnover can serve the append.
        if has_swa {
            let out: Vec<Option<SwaRef>> = seq
                .swa
                .iter_mut()
                .take(new_first)
                .map(Option::take)
                .collect();
            seq.dirty = true;
            self.release_swa(out);
        }
        let swa_fresh = match self.take_swa(swa_need) {
            Ok(v) => v,
            Err(e) => {
                self.release_slots(fresh);
                return Err(e);
            }
        };
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Err(MemError::Invariant(format!("sequence {id} vanished")));
        };
        let old_full = seq.len / bs;
        if self.events.enabled() {
            seq.tokens.extend_from_slice(tokens);
        }
        seq.tail.extend_from_slice(tokens);
        seq.len += tokens.len();
        let filled = (seq.len / bs - old_full) * bs;
        if caching {
            let parent = seq.hashes.last().copied().unwrap_or(seq.root);
            self.hasher.extend_chain(
                parent,
                &seq.tail[..filled],
                old_full,
                &seq.extras,
                &mut seq.hashes,
            );
        }
        seq.tail.drain(..filled);
        seq.blocks.extend(fresh);
        if has_swa {
            let total = seq.blocks.len();
            let target_first = new_first.min(total);
            while seq.swa.len() < target_first {
                seq.swa.push(None);
            }
            seq.swa.extend(swa_fresh);
        }
        seq.dirty = true;
        Ok(())
    }

    /// Frees sequence `id`: its full, computed blocks move into the prefix
    /// cache (a block already cached under the same hash is dropped instead),
    /// the rest are released. `computed_tokens` (default: all) bounds what
    /// is cached: a block whose KV was not computed must not be.
    pub fn free(&mut self, id: SeqId, computed_tokens: Option<usize>) -> Result<(), MemError> {
        let mut seq = self
            .seqs
            .remove(&id)
            .ok_or_else(|| MemError::invalid(format!("no sequence {id} is admitted")))?;
        let bs = self.config.block_size;
        let computed = computed_tokens.unwrap_or(seq.len).min(seq.len);
        let limit = seq.hashes.len().min(seq.cacheable).min(computed / bs);
        let caching = self.config.enable_prefix_caching;
        let mut refused = None;
        let mut stored = Vec::new();
        // The refs this frees, released under one pool lock at the end.
        let mut dropped = std::mem::take(&mut self.spare.tokens);
        // Last block first: each entry joins the LRU's recent end, so the
        // sequence's first block ends up the most recent and its last block
        // the next to go. Eviction then shortens a cached prefix from its
        // end, and what stays is still reachable (a match stops at the
        // first miss); in block order the head would go first and strand
        // the rest (vLLM frees in reverse for the same reason).
        for (i, slot) in seq.blocks.drain(..).enumerate().rev() {
            let block = match slot {
                Slot::Hole => continue,
                Slot::Cached { entry, .. } => {
                    self.cache.release_user(entry);
                    continue;
                }
                Slot::Own(block) => block,
            };
            if caching && i < limit {
                match self.cache.insert(seq.hashes[i], block, 0) {
                    Ok(Insert::Added(_)) => {
                        if self.events.enabled() {
                            stored.push(i);
                        }
                        self.drop_host_copy(&seq.hashes[i]);
                    }
                    Ok(Insert::Present(dup)) => dropped.push(dup),
                    Err((e, back)) => {
                        dropped.push(back);
                        refused = Some(e);
                    }
                }
            } else {
                dropped.push(block);
            }
        }
        self.events.stored(
            &mut stored,
            &seq.hashes,
            &seq.tokens,
            bs,
            seq.extras.lora_id,
            Medium::Device,
        );
        let released = self.pool.release_tokens(dropped.drain(..));
        self.spare.tokens = dropped;
        self.release_swa(seq.swa.drain(..));
        self.spare.keep(seq);
        released?;
        refused.map_or(Ok(()), Err)
    }

    /// Shares the full blocks of sequence `id` that lie inside its first
    /// `computed_tokens` with the prefix cache now, while it runs, so that
    /// requests admitted meanwhile hit them (a block is cacheable as soon as
    /// it is full and its KV computed). Each such block's token moves into a
    /// new cache entry and the sequence becomes the entry's first user (its
    /// slot turns `Cached`). A block whose hash is already cached stays the
    /// sequence's own. Returns the blocks cached.
    pub fn cache_computed(&mut self, id: SeqId, computed_tokens: usize) -> Result<u32, MemError> {
        let bs = self.config.block_size;
        let caching = self.config.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Err(MemError::invalid(format!("no sequence {id} is admitted")));
        };
        if !caching {
            return Ok(0);
        }
        let limit = seq
            .hashes
            .len()
            .min(seq.cacheable)
            .min(computed_tokens.min(seq.len) / bs);
        let mut added = 0;
        let mut stored = Vec::new();
        for i in seq.offered..limit {
            if !matches!(seq.blocks[i], Slot::Own(_)) || self.cache.get(&seq.hashes[i]).is_some() {
                continue;
            }
            let Slot::Own(block) = std::mem::replace(&mut seq.blocks[i], Slot::Hole) else {
                continue;
            };
            let id = block.id();
            match self.cache.insert(seq.hashes[i], block, 1) {
                Ok(Insert::Added(entry)) => {
                    seq.blocks[i] = Slot::Cached { entry, id };
                    added += 1;
                    stored.push(i);
                    if let Some(host) = self.host.as_mut() {
                        host.discard(&seq.hashes[i], &mut self.events);
                    }
                }
                Ok(Insert::Present(back)) => seq.blocks[i] = Slot::Own(back),
                Err((e, back)) => {
                    seq.blocks[i] = Slot::Own(back);
                    self.events.stored(
                        &mut stored,
                        &seq.hashes,
                        &seq.tokens,
                        bs,
                        seq.extras.lora_id,
                        Medium::Device,
                    );
                    return Err(e);
                }
            }
        }
        seq.offered = seq.offered.max(limit);
        self.events.stored(
            &mut stored,
            &seq.hashes,
            &seq.tokens,
            bs,
            seq.extras.lora_id,
            Medium::Device,
        );
        Ok(added)
    }

    /// Aborts sequence `id`: releases everything, caches nothing new (its
    /// KV may not have been computed).
    pub fn abort(&mut self, id: SeqId) -> Result<(), MemError> {
        self.free(id, Some(0))
    }

    /// StreamingLLM: drops the blocks `[start, end)` of sequence `id`,
    /// leaving holes (the table keeps its length). Only full blocks can be
    /// evicted. Returns the blocks released. Blocks filled from now on are
    /// computed without the evicted context and are never cached.
    pub fn evict_middle(&mut self, id: SeqId, start: usize, end: usize) -> Result<u32, MemError> {
        let bs = self.config.block_size;
        let seq = self.seq(id)?;
        let full = seq.len / bs;
        if start > end || end > full {
            return Err(MemError::invalid(format!(
                "evict_middle of blocks [{start}, {end}) of sequence {id}: only its {full} full \
                 block(s) can be evicted, as a range start <= end <= {full}"
            )));
        }
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Err(MemError::invalid(format!("no sequence {id} is admitted")));
        };
        let holed: Vec<Slot> = seq.blocks[start..end]
            .iter_mut()
            .map(|s| std::mem::replace(s, Slot::Hole))
            .filter(|s| !matches!(s, Slot::Hole))
            .collect();
        if end > start {
            seq.cacheable = seq.cacheable.min(full);
            seq.dirty = true;
        }
        let released = holed.len() as u32;
        self.release_slots(holed);
        Ok(released)
    }

    /// The kernel-facing block table of sequence `id`: block ids, `-1` for a
    /// hole. Rebuilt from the refs when the table changed.
    pub fn block_table(&mut self, id: SeqId) -> Result<&[i32], MemError> {
        let seq = self.seq_mut(id)?;
        seq.rebuild();
        Ok(&seq.table)
    }

    /// The SWA table of sequence `id`: positional like [`Self::block_table`],
    /// `-1` outside the trailing window. Empty without an SWA pool.
    pub fn swa_table(&mut self, id: SeqId) -> Result<&[i32], MemError> {
        let seq = self.seq_mut(id)?;
        seq.rebuild();
        Ok(&seq.swa_table)
    }

    /// One decode step's appends: `tokens[i]` onto sequence `ids[i]`, in
    /// order, each all or nothing ([`Self::append`]). Stops at the first
    /// sequence the pools cannot take (a capacity refusal, which changes
    /// nothing for it) and returns how many were appended, so the caller
    /// can make room (preempt) and go on from there. Any other error is
    /// returned before anything is appended: every id is checked first.
    pub fn append_each(&mut self, ids: &[SeqId], tokens: &[u32]) -> Result<usize, MemError> {
        if ids.len() != tokens.len() {
            return Err(MemError::invalid(format!(
                "{} sequence ids but {} tokens; give one token per sequence",
                ids.len(),
                tokens.len()
            )));
        }
        for &id in ids {
            self.seq(id)?;
        }
        for (i, (&id, tok)) in ids.iter().zip(tokens.chunks_exact(1)).enumerate() {
            match self.append(id, tok) {
                Ok(()) => {}
                Err(MemError::KvCapacity(_)) => return Ok(i),
                Err(e) => return Err(e),
            }
        }
        Ok(ids.len())
    }

    /// The block tables of a whole batch, one row of `width` int32 columns
    /// per id of `ids`, written into `out` (`ids.len() * width` values, row
    /// after row) and padded with `-1`: [`Self::block_table`]'s rows, or
    /// [`Self::swa_table`]'s with `swa`. Returns the columns used, the
    /// longest row. Nothing is written unless every id is admitted and every
    /// row fits, so a refused call leaves `out` as it was.
    pub fn block_tables(
        &mut self,
        ids: &[SeqId],
        out: &mut [i32],
        width: usize,
        swa: bool,
    ) -> Result<usize, MemError> {
        if out.len() != ids.len().saturating_mul(width) {
            return Err(MemError::invalid(format!(
                "out holds {} values; {} rows of {width} need {}",
                out.len(),
                ids.len(),
                ids.len().saturating_mul(width)
            )));
        }
        if swa && self.swa_pool.is_none() {
            return Err(MemError::invalid(
                "pool=\"swa\" asks for SWA tables, but this manager has no SWA pool; use \
                 pool=\"full\"",
            ));
        }
        let mut used = 0;
        for &id in ids {
            let seq = self.seq_mut(id)?;
            seq.rebuild();
            let n = if swa {
                seq.swa_table.len()
            } else {
                seq.table.len()
            };
            if n > width {
                return Err(MemError::invalid(format!(
                    "sequence {id} has {n} blocks; out has {width} columns — give it at least {n}"
                )));
            }
            used = used.max(n);
        }
        if width == 0 {
            return Ok(0);
        }
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(width)) {
            let seq = self.seq(id)?;
            let table = if swa { &seq.swa_table } else { &seq.table };
            row[..table.len()].copy_from_slice(table);
            row[table.len()..].fill(-1);
        }
        Ok(used)
    }

    /// Tokens of sequence `id`.
    pub fn num_tokens(&self, id: SeqId) -> Result<usize, MemError> {
        Ok(self.seq(id)?.len)
    }

    /// The chained hashes of sequence `id`'s full blocks.
    pub fn sequence_hashes(&self, id: SeqId) -> Result<&[BlockHash], MemError> {
        Ok(&self.seq(id)?.hashes)
    }

    /// Blocks of sequence `id` at or past which nothing is cached (after a
    /// middle eviction); `None` when all full blocks are cacheable.
    pub fn cacheable_limit(&self, id: SeqId) -> Result<Option<usize>, MemError> {
        let c = self.seq(id)?.cacheable;
        Ok((c != usize::MAX).then_some(c))
    }

    /// The ids of the admitted sequences.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// `(address, bytes)` of block `index` of sequence `id`; `None` for a
    /// hole. Refused in slots mode.
    pub fn block_span(&self, id: SeqId, index: usize) -> Result<Option<(usize, usize)>, MemError> {
        let seq = self.seq(id)?;
        match seq.blocks.get(index) {
            None => Err(MemError::invalid(format!(
                "sequence {id} has {} blocks; {index} is out of range",
                seq.blocks.len()
            ))),
            Some(Slot::Hole) => Ok(None),
            Some(Slot::Own(r)) => {
                let span = self.pool.token_span(r)?;
                Ok(Some((span.addr(), span.len())))
            }
            Some(Slot::Cached { entry, .. }) => {
                let Some(e) = self.cache.entry(*entry) else {
                    return Err(MemError::Invariant(format!(
                        "sequence {id} block {index} names a vacant cache entry"
                    )));
                };
                let span = self.pool.token_span(&e.block)?;
                Ok(Some((span.addr(), span.len())))
            }
        }
    }

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

    /// Evicts the LRU cache entry into the host tier (the copy starts; the
    /// block is freed when it completes), or drops it when the host tier
    /// cannot take it. False when nothing is evictable.
    fn offload_one(&mut self) -> bool {
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

impl Drop for KVCacheManager {
    /// Releases every token the manager holds (its sequences' blocks and
    /// the cache's), so pools shared with a [`MemorySystem`] get their blocks
    /// back, as dropping refs did.
    ///
    /// [`MemorySystem`]: crate::system::MemorySystem
    fn drop(&mut self) {
        let seqs = std::mem::take(&mut self.seqs);
        let mut main = self.cache.drain();
        if let Some(host) = self.host.as_mut() {
            // No copy may run on memory released here.
            main.extend(host.wait_and_take_all());
        }
        let mut swa = Vec::new();
        for (_, seq) in seqs {
            main.extend(seq.blocks.into_iter().filter_map(|s| match s {
                Slot::Own(t) => Some(t),
                _ => None,
            }));
            swa.extend(seq.swa);
        }
        let _ = self.pool.release_tokens(main);
        self.release_swa(swa);
    }
}
