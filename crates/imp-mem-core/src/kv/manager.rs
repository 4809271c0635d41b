//! [`KVCacheManager`]: sequences, admission, eviction, pins and stats. The
//! module docs of [`crate::kv`] state the ownership rules this file follows.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::backend::Backend;
use crate::block_pool::{BlockId, BlockToken, PoolClaim, PoolConfig, SharedBlockPool};
use crate::error::{KvCapacityReport, MemError};
use crate::kv::hash::{BlockHash, BlockHasher, ExtraKeys, DEFAULT_HASH_SEED};
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
        // One branch-free pass (it vectorises); the search runs only when
        // there is an id to name.
        if self == IdSource::U32 || tokens.iter().fold(0, |a, &t| a | t) <= i32::MAX as u32 {
            return Ok(());
        }
        let bad = tokens.iter().find(|&&t| t > i32::MAX as u32);
        Err(MemError::invalid(format!(
            "token id {} is outside 0..=4294967295",
            bad.map_or(-1, |&t| t as i32)
        )))
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
    /// Blocks newly allocated for it.
    pub new_blocks: usize,
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
        let evictable = self.cache.evictable().saturating_sub(taken);
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
        while got < need {
            let Some(token) = self.cache.evict_take() else {
                break;
            };
            out.push(Slot::Own(token));
            got += 1;
            self.stats.evictions += 1;
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
        hits.len()
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
        let swa_fresh = match fresh {
            Ok(v) => v,
            Err(e) => {
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
        }
        let admission = Admission {
            cached_tokens: hit_idx.len() * bs,
            blocks: total,
            new_blocks: need as usize,
        };
        seq.len = tokens.len();
        seq.tail
            .extend_from_slice(&tokens[tokens.len() / bs * bs..]);
        seq.extras = extras;
        seq.root = root;
        seq.offered = hit_idx.len();
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
                    Ok(Insert::Added(_)) => {}
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
                }
                Ok(Insert::Present(back)) => seq.blocks[i] = Slot::Own(back),
                Err((e, back)) => {
                    seq.blocks[i] = Slot::Own(back);
                    return Err(e);
                }
            }
        }
        seq.offered = seq.offered.max(limit);
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
    /// skipped). Returns the blocks freed.
    pub fn evict(&mut self, n: u32) -> u32 {
        let mut evicted = Vec::new();
        while (evicted.len() as u64) < u64::from(n) {
            let Some(token) = self.cache.evict_take() else {
                break;
            };
            evicted.push(token);
        }
        let done = evicted.len() as u32;
        // Every evicted token is this pool's, so the release cannot be refused.
        let _ = self.pool.release_tokens(evicted);
        self.stats.evictions += done as u64;
        done
    }

    pub(crate) fn record_evictions(&mut self, n: u32) {
        self.stats.evictions += n as u64;
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
            active: p.live.saturating_sub(idle),
            cached: self.cache.len(),
            evictable: self.cache.evictable(),
            pinned: self.cache.pinned(),
            pins: self.pins.total,
            sequences: self.seqs.len() as u32,
            swa_free,
            swa_live,
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
        let lent_refs: u64 = lent.values().map(|&n| u64::from(n)).sum();
        if refs != seq_refs + self.cache.len() as u64 + lent_refs {
            return broken(format!(
                "{refs} refs outstanding but sequences hold {seq_refs}, the cache {} and a save \
                 or load in progress {lent_refs}",
                self.cache.len()
            ));
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
