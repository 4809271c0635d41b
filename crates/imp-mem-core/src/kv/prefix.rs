//! The prefix cache: content hash → one block ref it owns, with an O(1) LRU
//! of the entries that can be evicted.
//!
//! Each entry holds its own block token (a ref; A5.1: the cache is an owner,
//! not a convention). An entry is in one of three states, derived from two
//! counters the manager keeps:
//!
//! * in use — `users > 0`: sequences use its block (a prefix hit, or a block
//!   handed over by `cache_computed`) without a ref of their own (K16); not
//!   evictable, since the entry's ref is what keeps the block theirs;
//! * pinned — `users == 0, pins > 0`: the pin overlay keeps it off the LRU;
//! * evictable — `users == 0, pins == 0`: on the intrusive LRU list, whose
//!   head is evicted first.
//!
//! Every entry's ref is its block's only one. Evicting hands that ref over
//! (to be released, or moved straight into the allocation that needed the
//! room), so each eviction yields exactly one block; the manager's capacity
//! arithmetic relies on it and `check_invariants` verifies it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashTable;

use crate::block_pool::{BlockId, BlockToken, SharedBlockPool};
use crate::error::MemError;
use crate::kv::hash::BlockHash;

const NIL: u32 = u32::MAX;

/// The keys are already uniform 128-bit hashes: fold them, do not rehash.
#[derive(Default)]
pub(crate) struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 ^= fold(v);
    }

    fn write_u64(&mut self, v: u64) {
        // Sequence ids are small and sequential: spread them over the top
        // bits too, which hashbrown uses as its tag.
        self.0 ^= v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
}

pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

/// The table hash of a block hash: the keys are already uniform 128-bit
/// hashes, so fold them rather than rehash.
fn fold(h: BlockHash) -> u64 {
    (h as u64) ^ ((h >> 64) as u64).rotate_left(32)
}

/// The hash of slab entry `i`, if it is occupied.
fn hash_at(slab: &[Option<Entry>], i: u32) -> Option<BlockHash> {
    slab.get(i as usize)
        .and_then(Option::as_ref)
        .map(|e| e.hash)
}

/// What [`PrefixCache::insert`] did with a block.
#[derive(Debug)]
pub(crate) enum Insert {
    /// A new entry at this slab index owns the block.
    Added(u32),
    /// The hash was cached already: the block is handed back.
    Present(BlockToken),
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub hash: BlockHash,
    pub block: BlockToken,
    pub users: u32,
    pub pins: u32,
    prev: u32,
    next: u32,
    on_lru: bool,
}

impl Entry {
    pub fn evictable(&self) -> bool {
        self.users == 0 && self.pins == 0
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct PrefixCache {
    pool_tag: u32,
    /// Hash → slab index, holding only the 4-byte index: the table stays
    /// small enough to live in the CPU caches (10 000 entries: ~80 KiB
    /// against ~530 KiB keyed by the 16-byte hash), and an eviction finds
    /// its bucket by comparing indices, without touching another entry.
    index: HashTable<u32>,
    slab: Vec<Option<Entry>>,
    vacant: Vec<u32>,
    head: u32,
    tail: u32,
    lru_len: u32,
    pinned: u32,
    pinned_idle: u32,
}

impl PrefixCache {
    /// An empty cache of blocks of `pool`.
    pub fn new(pool: &SharedBlockPool) -> Self {
        Self {
            pool_tag: pool.tag(),
            head: NIL,
            tail: NIL,
            ..Default::default()
        }
    }

    pub fn len(&self) -> u32 {
        self.index.len() as u32
    }

    /// Entries on the LRU (each frees one block when evicted).
    pub fn evictable(&self) -> u32 {
        self.lru_len
    }

    /// Entries with at least one pin.
    pub fn pinned(&self) -> u32 {
        self.pinned
    }

    /// Pinned entries no sequence uses (held only by the cache, not evictable).
    pub fn pinned_idle(&self) -> u32 {
        self.pinned_idle
    }

    pub fn get(&self, hash: &BlockHash) -> Option<u32> {
        let slab = &self.slab;
        self.index
            .find(fold(*hash), |&i| hash_at(slab, i) == Some(*hash))
            .copied()
    }

    pub fn entry(&self, idx: u32) -> Option<&Entry> {
        self.slab.get(idx as usize).and_then(Option::as_ref)
    }

    fn entry_mut(&mut self, idx: u32) -> Result<&mut Entry, MemError> {
        self.slab
            .get_mut(idx as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| MemError::Invariant(format!("prefix cache entry {idx} is vacant")))
    }

    fn unlink(&mut self, idx: u32) {
        let Some(Some(e)) = self.slab.get_mut(idx as usize) else {
            return;
        };
        if !e.on_lru {
            return;
        }
        let (prev, next) = (e.prev, e.next);
        e.on_lru = false;
        e.prev = NIL;
        e.next = NIL;
        match self.slab.get_mut(prev as usize) {
            Some(Some(p)) => p.next = next,
            _ => self.head = next,
        }
        match self.slab.get_mut(next as usize) {
            Some(Some(n)) => n.prev = prev,
            _ => self.tail = prev,
        }
        self.lru_len -= 1;
    }

    fn link_tail(&mut self, idx: u32) {
        let tail = self.tail;
        match self.slab.get_mut(idx as usize) {
            Some(Some(e)) if !e.on_lru => {
                e.on_lru = true;
                e.prev = tail;
                e.next = NIL;
            }
            _ => return,
        }
        if let Some(Some(t)) = self.slab.get_mut(tail as usize) {
            t.next = idx;
        } else {
            self.head = idx;
        }
        self.tail = idx;
        self.lru_len += 1;
    }

    /// Applies a change of `users`/`pins` to an entry and moves it between
    /// the states. `was` are the counters before.
    fn transition(&mut self, idx: u32, was: (u32, u32)) {
        let Some(e) = self.entry(idx) else { return };
        let now = (e.users, e.pins);
        let evictable = e.evictable();
        let pinned_idle = |(u, p): (u32, u32)| u == 0 && p > 0;
        match (was.1 > 0, now.1 > 0) {
            (false, true) => self.pinned += 1,
            (true, false) => self.pinned -= 1,
            _ => {}
        }
        match (pinned_idle(was), pinned_idle(now)) {
            (false, true) => self.pinned_idle += 1,
            (true, false) => self.pinned_idle -= 1,
            _ => {}
        }
        if evictable {
            self.link_tail(idx);
        } else {
            self.unlink(idx);
        }
    }

    /// A prefix hit on each of `idxs`: one more user each, which takes the
    /// entry off the LRU; `push` gets each entry and its block id. The
    /// entry keeps owning the block's ref (K16). A vacant index (a caller's
    /// bug: hits come from `get` under the same borrow) stops it with an
    /// error after the entries already pushed, which the caller gives back
    /// (`admit` releases the slots it was handed, so all or nothing holds).
    pub fn acquire(
        &mut self,
        idxs: &[u32],
        mut push: impl FnMut(u32, BlockId),
    ) -> Result<(), MemError> {
        for &idx in idxs {
            let e = self.entry_mut(idx)?;
            e.users += 1;
            push(idx, e.block.id());
            // Only the first user changes the entry's state (`transition`,
            // unrolled for the hot path): off the LRU, or no longer idle.
            if e.users == 1 {
                if e.pins == 0 {
                    self.unlink(idx);
                } else {
                    self.pinned_idle -= 1;
                }
            }
        }
        Ok(())
    }

    /// A sequence gave back its use of entry `idx`.
    pub fn release_user(&mut self, idx: u32) {
        let Ok(e) = self.entry_mut(idx) else { return };
        if e.users == 0 {
            return;
        }
        e.users -= 1;
        // Only the last user's leaving changes the state (`transition`,
        // unrolled): evictable again, or pinned and idle.
        if e.users == 0 {
            if e.pins == 0 {
                self.link_tail(idx);
            } else {
                self.pinned_idle += 1;
            }
        }
    }

    pub fn pin(&mut self, idx: u32) {
        if let Ok(e) = self.entry_mut(idx) {
            let was = (e.users, e.pins);
            e.pins += 1;
            self.transition(idx, was);
        }
    }

    pub fn unpin(&mut self, idx: u32) {
        if let Ok(e) = self.entry_mut(idx) {
            let was = (e.users, e.pins);
            e.pins = e.pins.saturating_sub(1);
            self.transition(idx, was);
        }
    }

    /// Adds an entry that owns `block`, with `users` sequences using it (0:
    /// evictable, most recently used). If `hash` is already cached the block
    /// is handed back (the caller releases it: a duplicate of content the
    /// cache already holds).
    /// A token from another pool (an SWA block) is refused and handed back
    /// with the error.
    pub fn insert(
        &mut self,
        hash: BlockHash,
        block: BlockToken,
        users: u32,
    ) -> Result<Insert, (MemError, BlockToken)> {
        if block.pool_tag() != self.pool_tag {
            let e = MemError::invalid(format!(
                "the prefix cache holds blocks of pool tag {} only; block {} is from pool tag {} \
                 (an SWA block is never cached)",
                self.pool_tag,
                block.id(),
                block.pool_tag()
            ));
            return Err((e, block));
        }
        let slab = &self.slab;
        let slot = match self.index.entry(
            fold(hash),
            |&i| hash_at(slab, i) == Some(hash),
            |&i| hash_at(slab, i).map_or(0, fold),
        ) {
            hashbrown::hash_table::Entry::Occupied(_) => return Ok(Insert::Present(block)),
            hashbrown::hash_table::Entry::Vacant(v) => v,
        };
        let entry = Entry {
            hash,
            block,
            users,
            pins: 0,
            prev: NIL,
            next: NIL,
            on_lru: false,
        };
        let idx = self
            .vacant
            .last()
            .copied()
            .unwrap_or(self.slab.len() as u32);
        slot.insert(idx);
        if self.vacant.pop().is_some() {
            self.slab[idx as usize] = Some(entry);
        } else {
            self.slab.push(Some(entry));
        }
        if users == 0 {
            self.link_tail(idx);
        }
        Ok(Insert::Added(idx))
    }

    /// Evicts the LRU head and hands over its hash and token (the block's
    /// only ref, for the caller to reuse as it is or release).
    pub fn evict_take_hashed(&mut self) -> Option<(BlockHash, BlockToken)> {
        let idx = self.head;
        // The head has no predecessor: unlinking it only moves the head.
        let entry = self.slab.get_mut(idx as usize)?.take()?;
        debug_assert!(entry.on_lru && entry.prev == NIL);
        self.head = entry.next;
        match self.slab.get_mut(entry.next as usize) {
            Some(Some(n)) => n.prev = NIL,
            _ => self.tail = NIL,
        }
        self.lru_len -= 1;
        self.vacant.push(idx);
        if let Ok(bucket) = self.index.find_entry(fold(entry.hash), |&i| i == idx) {
            bucket.remove();
        }
        Some((entry.hash, entry.block))
    }

    /// Evicts every evictable entry whose block id is `from` or above (the
    /// top chunks of a pool that gives memory back), handing over hashes
    /// and tokens. O(evictable entries).
    pub fn evict_from(&mut self, from: BlockId) -> Vec<(BlockHash, BlockToken)> {
        let mut chosen = Vec::new();
        let mut cursor = self.head;
        while let Some(e) = self.entry(cursor) {
            if e.block.id() >= from {
                chosen.push(cursor);
            }
            cursor = e.next;
        }
        let mut out = Vec::with_capacity(chosen.len());
        for idx in chosen {
            self.unlink(idx);
            let Some(entry) = self.slab.get_mut(idx as usize).and_then(Option::take) else {
                continue;
            };
            self.vacant.push(idx);
            if let Ok(bucket) = self.index.find_entry(fold(entry.hash), |&i| i == idx) {
                bucket.remove();
            }
            out.push((entry.hash, entry.block));
        }
        out
    }

    /// Empties the cache, handing back every entry's token (for the
    /// manager to release).
    pub fn drain(&mut self) -> Vec<BlockToken> {
        let tokens = self.slab.drain(..).flatten().map(|e| e.block).collect();
        *self = Self {
            pool_tag: self.pool_tag,
            head: NIL,
            tail: NIL,
            ..Default::default()
        };
        tokens
    }

    /// Every entry, in-use and pinned ones first, then the LRU oldest first
    /// (so that reloading in this order keeps the recency).
    pub fn entries_in_order(&self) -> Vec<&Entry> {
        let mut out: Vec<&Entry> = self.slab.iter().flatten().filter(|e| !e.on_lru).collect();
        let mut cursor = self.head;
        while let Some(e) = self.entry(cursor) {
            out.push(e);
            cursor = e.next;
        }
        out
    }

    /// Checks the LRU list, the counters, and that every entry's block has
    /// one ref, the entry's own (its users hold none, K16).
    pub fn check(&self, refcount: impl Fn(BlockId) -> u32) -> Result<(), MemError> {
        let broken = |what: String| Err(MemError::Invariant(format!("prefix cache: {what}")));
        let mut on_list = 0u32;
        let mut cursor = self.head;
        let mut prev = NIL;
        while cursor != NIL {
            let Some(e) = self.entry(cursor) else {
                return broken(format!("LRU link {cursor} is vacant"));
            };
            if !e.on_lru || !e.evictable() || e.prev != prev {
                return broken(format!("LRU entry {cursor} is inconsistent: {e:?}"));
            }
            on_list += 1;
            if on_list > self.len() {
                return broken("the LRU list has a cycle".into());
            }
            prev = cursor;
            cursor = e.next;
        }
        if prev != self.tail || on_list != self.lru_len {
            return broken(format!(
                "LRU length {on_list} / tail {prev} disagree with {} / {}",
                self.lru_len, self.tail
            ));
        }
        let (mut pinned, mut pinned_idle) = (0, 0);
        for (idx, e) in self.slab.iter().enumerate() {
            let Some(e) = e else { continue };
            if self.get(&e.hash) != Some(idx as u32) {
                return broken(format!("entry {idx} is not indexed by its hash"));
            }
            if e.on_lru != e.evictable() {
                return broken(format!(
                    "entry {idx} is evictable={} but on_lru={}",
                    e.evictable(),
                    e.on_lru
                ));
            }
            let refs = refcount(e.block.id());
            if refs != 1 {
                return broken(format!(
                    "cached block {} has {refs} refs; its entry should hold the only one",
                    e.block.id()
                ));
            }
            pinned += u32::from(e.pins > 0);
            pinned_idle += u32::from(e.pins > 0 && e.users == 0);
        }
        if (pinned, pinned_idle) != (self.pinned, self.pinned_idle) {
            return broken("pin counters drifted".into());
        }
        if self.index.len() != self.slab.len() - self.vacant.len() {
            return broken("map and slab sizes disagree".into());
        }
        Ok(())
    }
}
