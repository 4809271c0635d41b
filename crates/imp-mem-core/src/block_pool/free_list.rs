//! The pool's free blocks: a block's slot ([`Entry`], a link of an intrusive
//! list or a live block's count), the single LIFO list of a pool that never
//! grows, and the lowest-chunk-first lists of a growable one (a two-level
//! bitmap over per-chunk lists, all O(1)). The module's opening paragraph
//! says why the lowest chunk is preferred.

use crate::error::{try_reserve, MemError};

use super::config::PoolConfig;
use super::{BlockId, NIL};

/// One block's slot: a link of the free list, or a live block's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Entry {
    Vacant { next: u32 },
    Occupied { refs: u32 },
}

/// Most chunks a pool is divided into (a two-level bitmap of 64 × 64 bits).
const MAX_CHUNKS: u32 = 64 * 64;

/// The blocks per chunk for `config`: the growth step of a growable pool
/// (coarsened so that there are at most [`MAX_CHUNKS`]), the whole pool for
/// a fixed one. At least 2, which keeps [`FreeLists::chunk_of`] exact.
fn chunk_blocks_for(config: &PoolConfig) -> u32 {
    let step = if config.max_blocks > config.blocks {
        config.grow_blocks
    } else {
        config.max_blocks
    };
    step.max(config.max_blocks.div_ceil(MAX_CHUNKS)).max(2)
}

/// A pool's free blocks: one LIFO list for a pool that never grows (fixed or
/// slots: exactly one chunk, never shrinks), per-chunk lists for a growable
/// one. The single list costs one head read and write per pop or push, what
/// the pool paid before it could shrink; the chunked lists add the chunk's
/// counter, its bitmap bit and the lowest-chunk cache, which only a pool
/// that can shrink needs.
#[derive(Debug)]
pub(super) enum FreeBlocks {
    /// One intrusive LIFO list over every id.
    Single {
        head: u32,
        /// Reported as the chunk size (the whole pool).
        chunk_blocks: u32,
    },
    /// Lowest-chunk-first lists, for a growable pool.
    Chunked(FreeLists),
}

impl FreeBlocks {
    pub(super) fn new(config: &PoolConfig) -> Result<Self, MemError> {
        let chunk_blocks = chunk_blocks_for(config);
        Ok(if config.max_blocks > config.blocks {
            Self::Chunked(FreeLists::try_new(chunk_blocks, config.max_blocks)?)
        } else {
            Self::Single {
                head: NIL,
                chunk_blocks: chunk_blocks.max(2),
            }
        })
    }

    pub(super) fn chunk_blocks(&self) -> u32 {
        match self {
            Self::Single { chunk_blocks, .. } => *chunk_blocks,
            Self::Chunked(lists) => lists.chunk_blocks,
        }
    }

    /// Puts `id` (whose entry is `entry`, owned by the caller) on its list.
    #[inline(always)]
    pub(super) fn push(&mut self, entry: &mut Entry, id: BlockId) {
        match self {
            Self::Single { head, .. } => {
                *entry = Entry::Vacant { next: *head };
                *head = id;
            }
            Self::Chunked(lists) => lists.push(entry, id),
        }
    }

    /// Takes a free block (the head of the single list, or of the lowest
    /// chunk's); `None` when none is free or the list is corrupt. Leaves
    /// `entries[id]` for the caller.
    #[inline(always)]
    pub(super) fn pop(&mut self, entries: &[Entry]) -> Option<BlockId> {
        match self {
            Self::Single { head, .. } => {
                let id = *head;
                let Some(Entry::Vacant { next }) = entries.get(id as usize).copied() else {
                    return None;
                };
                *head = next;
                Some(id)
            }
            Self::Chunked(lists) => lists.pop(entries),
        }
    }

    /// The highest chunk of `[0, capacity)` holding a live block (`free`:
    /// the blocks free in `[0, capacity)`).
    pub(super) fn highest_used(&self, capacity: u32, free: u32) -> Option<usize> {
        match self {
            Self::Single { .. } => (free < capacity).then_some(0),
            Self::Chunked(lists) => lists.highest_used(capacity),
        }
    }

    /// Drops ids `[new_cap, old_cap)` (all free) from the lists.
    pub(super) fn cut(&mut self, entries: &mut [Entry], new_cap: u32, old_cap: u32) {
        match self {
            Self::Single { head, .. } => {
                if new_cap >= old_cap {
                    return;
                }
                *head = NIL;
                for id in (0..new_cap).rev() {
                    let entry = &mut entries[id as usize];
                    if matches!(entry, Entry::Vacant { .. }) {
                        *entry = Entry::Vacant { next: *head };
                        *head = id;
                    }
                }
            }
            Self::Chunked(lists) => lists.cut(entries, new_cap, old_cap),
        }
    }

    /// Walks the free lists: the single one, or each chunk's with its
    /// counter and bitmap bit, the bitmap's summary and the cached lowest
    /// chunk. The blocks on them, or what is broken.
    pub(super) fn walk(&self, entries: &[Entry], capacity: u32) -> Result<u32, String> {
        let lists = match self {
            FreeBlocks::Single { head, .. } => {
                let mut n = 0u32;
                let mut cursor = *head;
                while cursor != NIL {
                    if n > capacity {
                        return Err("the free list has a cycle".into());
                    }
                    if cursor >= capacity {
                        return Err(format!("block {cursor} is on the free list"));
                    }
                    match entries.get(cursor as usize) {
                        Some(Entry::Vacant { next }) => cursor = *next,
                        _ => return Err(format!("free-list link {cursor} is not a vacant entry")),
                    }
                    n += 1;
                }
                return Ok(n);
            }
            FreeBlocks::Chunked(lists) => lists,
        };
        let mut on_lists = 0u32;
        let mut summary = 0u64;
        for c in 0..lists.chunks.len() {
            let mut n = 0u32;
            let mut cursor = lists.chunks[c].head;
            while cursor != NIL {
                if n > capacity {
                    return Err(format!("the free list of chunk {c} has a cycle"));
                }
                if cursor >= capacity || lists.chunk_of(cursor) != c {
                    return Err(format!("block {cursor} is on the list of chunk {c}"));
                }
                match entries.get(cursor as usize) {
                    Some(Entry::Vacant { next }) => cursor = *next,
                    _ => return Err(format!("free-list link {cursor} is not a vacant entry")),
                }
                n += 1;
            }
            if n != lists.chunks[c].free {
                return Err(format!(
                    "chunk {c}: {n} on its list, counter says {}",
                    lists.chunks[c].free
                ));
            }
            let marked = lists.words[c >> 6] & (1 << (c & 63)) != 0;
            if marked != (n > 0) {
                return Err(format!("chunk {c}: bitmap bit {marked} with {n} free"));
            }
            on_lists += n;
        }
        for (w, word) in lists.words.iter().enumerate() {
            if *word != 0 {
                summary |= 1 << w;
            }
        }
        if summary != lists.summary {
            return Err("the bitmap summary disagrees with its words".into());
        }
        if lists.lowest != lists.find_lowest() {
            return Err(format!(
                "the cached lowest chunk {} is not the lowest with a free block",
                lists.lowest
            ));
        }
        Ok(on_lists)
    }
}

/// The free list, split by chunk: one intrusive list per chunk of
/// `chunk_blocks` consecutive ids, a two-level bitmap of the chunks that
/// have a free block, and the lowest such chunk cached. Allocation pops from
/// the cached chunk; release pushes onto its own chunk's list and lowers the
/// cache if its chunk is lower; only when the cached chunk runs empty is the
/// next one found in the bitmap (two `trailing_zeros`). All O(1).
/// Preferring low chunks keeps the live blocks packed at the front, so
/// under churn the tail of a grown pool drains and can be decommitted
/// (a single LIFO list scatters live blocks over the whole range).
#[derive(Debug)]
pub(super) struct FreeLists {
    chunk_blocks: u32,
    /// `⌈2^64 / chunk_blocks⌉`: `id / chunk_blocks` is the high half of
    /// `magic * id` for every `u32` id (Lemire, Kaser & Kurz 2019).
    magic: u64,
    chunks: Vec<ChunkList>,
    /// The lowest chunk with a free block; `NIL` when none has one.
    lowest: u32,
    /// Bit `c`: chunk `c` has a free block.
    words: Vec<u64>,
    /// Bit `w`: `words[w] != 0`.
    summary: u64,
}

/// One chunk's free list.
#[derive(Debug, Clone, Copy)]
struct ChunkList {
    head: u32,
    /// Free blocks on it.
    free: u32,
}

impl FreeLists {
    /// The lists of a pool of at most `max_blocks`, their bookkeeping
    /// reserved fallibly (the count is a caller's).
    pub(super) fn try_new(chunk_blocks: u32, max_blocks: u32) -> Result<Self, MemError> {
        let chunk_blocks = chunk_blocks.max(2);
        let chunks = max_blocks.div_ceil(chunk_blocks).max(1) as usize;
        let what = format!("a pool of up to {max_blocks} blocks");
        let mut lists = Vec::new();
        try_reserve(&mut lists, chunks, &what)?;
        lists.resize(chunks, ChunkList { head: NIL, free: 0 });
        let mut words = Vec::new();
        try_reserve(&mut words, chunks.div_ceil(64), &what)?;
        words.resize(chunks.div_ceil(64), 0);
        Ok(Self {
            chunk_blocks,
            magic: u64::MAX / chunk_blocks as u64 + 1,
            chunks: lists,
            lowest: NIL,
            words,
            summary: 0,
        })
    }

    #[inline]
    pub(super) fn chunk_of(&self, id: BlockId) -> usize {
        ((self.magic as u128 * id as u128) >> 64) as usize
    }

    /// `chunk_of`, skipping the multiply for a one-chunk (fixed or slots)
    /// pool.
    #[inline]
    fn chunk_of_fast(&self, id: BlockId) -> usize {
        if self.chunks.len() == 1 {
            0
        } else {
            self.chunk_of(id)
        }
    }

    #[inline]
    fn mark(&mut self, c: usize) {
        self.words[c >> 6] |= 1 << (c & 63);
        self.summary |= 1 << (c >> 6);
        if (c as u32) < self.lowest {
            self.lowest = c as u32;
        }
    }

    fn unmark(&mut self, c: usize) {
        let w = c >> 6;
        self.words[w] &= !(1 << (c & 63));
        if self.words[w] == 0 {
            self.summary &= !(1 << w);
        }
        if self.lowest == c as u32 {
            self.lowest = self.find_lowest();
        }
    }

    /// The lowest chunk with a free block, from the bitmap.
    fn find_lowest(&self) -> u32 {
        if self.summary == 0 {
            return NIL;
        }
        let w = self.summary.trailing_zeros() as usize;
        match self.words.get(w) {
            Some(bits) => (w * 64) as u32 + bits.trailing_zeros(),
            None => NIL,
        }
    }

    /// Puts `id` (whose entry is `entry`, owned by the caller) on its
    /// chunk's list.
    #[inline]
    fn push(&mut self, entry: &mut Entry, id: BlockId) {
        let c = self.chunk_of_fast(id);
        let list = &mut self.chunks[c];
        let head = list.head;
        list.head = id;
        list.free += 1;
        *entry = Entry::Vacant { next: head };
        if head == NIL {
            self.mark(c);
        }
    }

    /// Takes the head of the lowest chunk's list; `None` when no block is
    /// free or the list is corrupt. Leaves `entries[id]` for the caller.
    #[inline]
    fn pop(&mut self, entries: &[Entry]) -> Option<BlockId> {
        let c = self.lowest as usize;
        let list = self.chunks.get_mut(c)?;
        let id = list.head;
        let Some(Entry::Vacant { next }) = entries.get(id as usize).copied() else {
            return None;
        };
        list.head = next;
        list.free -= 1;
        if next == NIL {
            self.unmark(c);
        }
        Some(id)
    }

    /// The highest chunk of `[0, capacity)` holding a live block.
    fn highest_used(&self, capacity: u32) -> Option<usize> {
        if capacity == 0 {
            return None;
        }
        let cb = self.chunk_blocks as u64;
        let top = self.chunk_of(capacity - 1);
        (0..=top).rev().find(|&c| {
            let len = (capacity as u64 - c as u64 * cb).min(cb) as u32;
            self.chunks[c].free < len
        })
    }

    /// Drops ids `[new_cap, old_cap)` (all free) from the lists; the chunk
    /// that `new_cap` cuts is rebuilt from `entries`. O(blocks touched).
    fn cut(&mut self, entries: &mut [Entry], new_cap: u32, old_cap: u32) {
        if new_cap >= old_cap {
            return;
        }
        let first = self.chunk_of(new_cap);
        let last = self.chunk_of(old_cap - 1);
        for c in first..=last {
            self.chunks[c] = ChunkList { head: NIL, free: 0 };
            self.unmark(c);
        }
        let start = (first as u64 * self.chunk_blocks as u64) as u32;
        for id in (start..new_cap).rev() {
            let entry = &mut entries[id as usize];
            if matches!(entry, Entry::Vacant { .. }) {
                self.push(entry, id);
            }
        }
    }
}
