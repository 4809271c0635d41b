//! A sequence and its block table: the slots (own blocks, cache hits,
//! holes), growth by `append`, `free` and `abort`, handing computed
//! blocks to the prefix cache, middle eviction, and the tables and
//! spans the engine reads.

use super::{ceil_div, sat_u32, KVCacheManager, SeqId};
use crate::block_pool::{BlockId, BlockToken};
use crate::error::MemError;
use crate::kv::events::Medium;
use crate::kv::hash::{BlockHash, ExtraKeys};
use crate::kv::prefix::Insert;

/// A block of the SWA pool. The cache takes no `SwaRef` and there is no way
/// to share one, so sharing an SWA block cannot be written (B2's second
/// trap).
#[derive(Debug)]
pub(super) struct SwaRef(pub(super) BlockToken);

/// One position of a sequence's block table.
#[derive(Debug)]
pub(super) enum Slot {
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
    pub(super) fn id(&self) -> Option<BlockId> {
        match self {
            Slot::Hole => None,
            Slot::Own(t) => Some(t.id()),
            Slot::Cached { id, .. } => Some(*id),
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Sequence {
    /// Tokens in the sequence.
    pub(super) len: usize,
    /// The tokens of the partial last block (the full ones live on only as
    /// hashes).
    pub(super) tail: Vec<u32>,
    /// Every token, kept only while KV events are on (`BlockStored`
    /// carries the ids of the blocks it names).
    pub(super) tokens: Vec<u32>,
    pub(super) extras: ExtraKeys,
    pub(super) root: BlockHash,
    /// Chained hashes of the full blocks (empty with prefix caching off).
    pub(super) hashes: Vec<BlockHash>,
    pub(super) blocks: Vec<Slot>,
    /// Blocks below this were prefix hits or offered to the cache by
    /// `cache_computed`.
    pub(super) offered: usize,
    /// Blocks at or after this index were (or will be) computed after a
    /// middle eviction and are never cached.
    pub(super) cacheable: usize,
    pub(super) swa: Vec<Option<SwaRef>>,
    pub(super) table: Vec<i32>,
    swa_table: Vec<i32>,
    pub(super) dirty: bool,
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
pub(super) struct Spare {
    tokens: Vec<BlockToken>,
    pub(super) hits: Vec<u32>,
    // Boxed on purpose: a sequence moves between this list and the map as
    // one pointer, not a few hundred bytes.
    #[allow(clippy::vec_box)]
    pub(super) seqs: Vec<Box<Sequence>>,
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
    pub(super) fn keep(&mut self, mut seq: Box<Sequence>) {
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

impl KVCacheManager {
    pub(super) fn seq(&self, id: SeqId) -> Result<&Sequence, MemError> {
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

    /// Lets go of a sequence's slots: owned blocks are released under one
    /// pool lock, cached ones give back their entry's use.
    pub(super) fn release_slots(&mut self, slots: impl IntoIterator<Item = Slot>) {
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
    pub(super) fn release_swa(&self, tokens: impl IntoIterator<Item = Option<SwaRef>>) {
        if let Some(swa) = &self.swa_pool {
            let _ = swa.release_tokens(tokens.into_iter().flatten().map(|r| r.0));
        }
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
}
