//! The pool's bookkeeping under its lock ([`Core`]): the block slab, the
//! pointer map, the per-stream lanes of the segregated-fit index, and the
//! list operations — carve a block, merge free neighbours, move a lane.

use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashMap;

use crate::backend::Region;

use super::tlsf::{Block, BlockState, Lane, NONE};
use super::FRESH_STREAM;

/// Hashes a block's unit offset: one folded multiply, enough for keys that
/// are distinct small integers.
#[derive(Default)]
pub(super) struct OffsetHasher(u64);

impl Hasher for OffsetHasher {
    fn finish(&self) -> u64 {
        let m = u128::from(self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (m as u64) ^ ((m >> 64) as u64)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(super) type OffsetMap<V> = HashMap<u64, V, BuildHasherDefault<OffsetHasher>>;

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Counters {
    pub(super) allocated: u64,
    pub(super) allocated_peak: u64,
    pub(super) in_use_peak: u64,
    pub(super) requested: u64,
    pub(super) live: u64,
    pub(super) live_peak: u64,
    pub(super) allocs_total: u64,
    pub(super) frees_total: u64,
    pub(super) allocated_bytes_total: u64,
    pub(super) freed_bytes_total: u64,
    pub(super) fallbacks_total: u64,
    pub(super) fallback_bytes_total: u64,
    pub(super) fallback_bytes: u64,
    pub(super) reserved_peak: u64,
    pub(super) ooms: u64,
    pub(super) refused_frees: u64,
    pub(super) cross_stream_reuses: u64,
    pub(super) reclaims: u64,
    pub(super) parked_blocks: u64,
}

pub(super) struct Fallback {
    pub(super) region: Region,
    pub(super) requested: u64,
    pub(super) stream: u64,
}

pub(super) struct Core {
    pub(super) slab: Vec<Block>,
    /// Head of the spare slab entries (linked through `next_free`).
    pub(super) spare: u32,
    pub(super) lanes: Vec<Lane>,
    /// Live block by unit offset.
    pub(super) live: OffsetMap<u32>,
    /// Live fallback regions by address.
    pub(super) fallback: OffsetMap<Fallback>,
    /// Freed fallback regions whose streams could not be waited for (a
    /// capture in progress, a failed context): kept, still the backend's
    /// acquisitions under the tag, until the pool is dropped, rather than
    /// unmapped under a kernel that may still touch them.
    pub(super) parked: Vec<Fallback>,
    pub(super) c: Counters,
    /// While the region sleeps: its level and the committed bytes to
    /// restore.
    pub(super) asleep: Option<(u8, usize)>,
    /// A measured pool that has not been frozen: it commits as it grows.
    pub(super) measuring: bool,
    /// The highest end offset a block has reached.
    pub(super) extent_peak: u64,
    /// What the freeze fixed.
    pub(super) frozen: Option<super::config::Frozen>,
    /// A pass being recorded (`plan.rs`).
    pub(super) recording: Option<Box<super::plan::Recording>>,
    /// The hints of a planned pass (`plan.rs`).
    pub(super) plan: Option<Box<super::plan::PassHints>>,
    /// What the last plan laid out (`plan.rs`), installed or not.
    pub(super) last_plan: Option<super::plan::PassPlan>,
}

impl Core {
    /// A free slab entry, growing the slab (fallibly) when none is spare.
    fn new_slot(&mut self) -> Option<u32> {
        if self.spare != NONE {
            let idx = self.spare;
            self.spare = self.slab[idx as usize].next_free;
            return Some(idx);
        }
        if self.slab.len() >= NONE as usize - 1 {
            return None;
        }
        if self.slab.len() == self.slab.capacity() {
            self.slab.try_reserve(self.slab.len().max(64)).ok()?;
        }
        self.slab.push(Block::spare());
        Some((self.slab.len() - 1) as u32)
    }

    fn drop_slot(&mut self, idx: u32) {
        let b = &mut self.slab[idx as usize];
        *b = Block::spare();
        b.next_free = self.spare;
        self.spare = idx;
    }

    /// The lane of `stream`, if it has one.
    #[inline]
    pub(super) fn lane_of(&self, stream: u64) -> Option<u32> {
        self.lanes
            .iter()
            .position(|l| l.stream == stream)
            .map(|i| i as u32)
    }

    /// The lane of `stream`, taking an empty one or adding one (fallibly).
    fn lane_for(&mut self, stream: u64) -> Option<u32> {
        if let Some(i) = self.lane_of(stream) {
            return Some(i);
        }
        if let Some(i) = self.lanes.iter().position(|l| l.blocks == 0) {
            self.lanes[i].stream = stream;
            return Some(i as u32);
        }
        if self.lanes.len() == self.lanes.capacity() {
            self.lanes.try_reserve(self.lanes.len().max(4)).ok()?;
        }
        self.lanes.push(Lane::new(stream));
        Some((self.lanes.len() - 1) as u32)
    }

    fn unlist(&mut self, idx: u32) {
        let lane = self.slab[idx as usize].lane;
        self.lanes[lane as usize].remove(&mut self.slab, idx);
    }

    /// Makes `idx` a free block of `stream`, merged with its free physical
    /// neighbours of the same stream or never used, and lists it.
    pub(super) fn put_free(&mut self, mut idx: u32, stream: u64, shift: u32) {
        self.slab[idx as usize].stream = stream;
        self.slab[idx as usize].requested = 0;
        let Some(lane) = self.lane_for(stream) else {
            let b = &mut self.slab[idx as usize];
            b.state = BlockState::Parked;
            b.lane = NONE;
            self.c.parked_blocks += 1;
            return;
        };
        let prev = self.slab[idx as usize].prev_phys;
        if prev != NONE && self.mergeable(prev, stream) {
            self.unlist(prev);
            self.absorb_next(prev);
            idx = prev;
        }
        let next = self.slab[idx as usize].next_phys;
        if next != NONE && self.mergeable(next, stream) {
            self.unlist(next);
            self.absorb_next(idx);
        }
        // The merged block may be a fresh neighbour's entry: it is now
        // `stream`'s.
        self.slab[idx as usize].stream = stream;
        self.lanes[lane as usize].insert(&mut self.slab, idx, shift, lane);
    }

    /// Whether free-block `idx` may join a block freed on `stream`: it was
    /// freed on that stream too, or it was never used (no work can be
    /// pending on fresh memory, so it may take any stream).
    #[inline]
    fn mergeable(&self, idx: u32, stream: u64) -> bool {
        let b = &self.slab[idx as usize];
        b.state == BlockState::Free && (b.stream == stream || b.stream == FRESH_STREAM)
    }

    /// Merges `idx`'s next physical neighbour (unlisted) into `idx`.
    fn absorb_next(&mut self, idx: u32) {
        let next = self.slab[idx as usize].next_phys;
        let (size, after) = {
            let n = &self.slab[next as usize];
            (n.size, n.next_phys)
        };
        self.slab[idx as usize].size += size;
        self.slab[idx as usize].next_phys = after;
        if after != NONE {
            self.slab[after as usize].prev_phys = idx;
        }
        self.drop_slot(next);
    }

    /// Hands out `idx` (unlisted) as a live block of `need` bytes on
    /// `stream`, splitting its tail back onto the lane it came from. The
    /// map has room for one more entry.
    pub(super) fn carve(&mut self, idx: u32, need: u64, stream: u64, requested: u64, shift: u32) {
        if self.slab[idx as usize].size > need {
            // Without a slot the whole block is handed out: internal
            // fragmentation, not an error.
            if let Some(tail) = self.split_off(idx, need) {
                // The tail's next neighbour cannot be a free block of its
                // stream (it would have been merged), so it is listed as is.
                let lane = self.slab[tail as usize].lane;
                self.lanes[lane as usize].insert(&mut self.slab, tail, shift, lane);
            }
        }
        let size = {
            let blk = &mut self.slab[idx as usize];
            blk.state = BlockState::Live;
            blk.stream = stream;
            blk.requested = requested;
            blk.lane = NONE;
            blk.size
        };
        let offset = self.slab[idx as usize].offset;
        self.live.insert(offset >> shift, idx);
        let c = &mut self.c;
        c.allocated += size;
        c.allocated_peak = c.allocated_peak.max(c.allocated);
        c.in_use_peak = c.in_use_peak.max(c.allocated + c.fallback_bytes);
        c.requested += requested;
        c.live += 1;
        c.live_peak = c.live_peak.max(c.live);
        c.allocs_total += 1;
        c.allocated_bytes_total += size;
    }

    /// Hands out `need` bytes `lead` bytes into free block `idx` (listed):
    /// the lead stays a free block of its lane, then [`Core::carve`]. None,
    /// nothing changed, when no slab entry is left for the split.
    pub(super) fn carve_at(
        &mut self,
        idx: u32,
        lead: u64,
        need: u64,
        stream: u64,
        requested: u64,
        shift: u32,
    ) -> Option<u32> {
        self.take(idx);
        let at = if lead == 0 {
            idx
        } else {
            let lane = self.slab[idx as usize].lane;
            let rest = self.split_off(idx, lead);
            // The lead (the whole block, without a slot) back on its lane.
            self.lanes[lane as usize].insert(&mut self.slab, idx, shift, lane);
            rest?
        };
        self.carve(at, need, stream, requested, shift);
        Some(at)
    }

    /// Cuts block `idx` at `at` bytes: a new free, unlisted entry (of
    /// `idx`'s stream and lane) takes the rest, linked after it. None,
    /// nothing changed, when the slab has no entry to spare.
    fn split_off(&mut self, idx: u32, at: u64) -> Option<u32> {
        let rest = self.new_slot()?;
        let b = self.slab[idx as usize];
        self.slab[rest as usize] = Block {
            offset: b.offset + at,
            size: b.size - at,
            requested: 0,
            stream: b.stream,
            prev_phys: idx,
            next_phys: b.next_phys,
            prev_free: NONE,
            next_free: NONE,
            lane: b.lane,
            listed: 0,
            state: BlockState::Free,
        };
        if b.next_phys != NONE {
            self.slab[b.next_phys as usize].prev_phys = rest;
        }
        self.slab[idx as usize].next_phys = rest;
        self.slab[idx as usize].size = at;
        Some(rest)
    }

    /// Unlists `idx` for a carve (its lane is kept in the block for the
    /// tail).
    pub(super) fn take(&mut self, idx: u32) {
        let lane = self.slab[idx as usize].lane;
        self.lanes[lane as usize].remove(&mut self.slab, idx);
        self.slab[idx as usize].lane = lane;
    }

    /// Cuts the region at `target` (a freeze): every block that ends above
    /// `target` must be free (or parked); those starting at or past it are
    /// dropped, and the one across it is shortened to end there. False,
    /// nothing changed, when a live block ends above `target`.
    pub(super) fn trim_top(&mut self, cap: u64, target: u64, shift: u32) -> bool {
        if target >= cap {
            return true;
        }
        let live_above = self
            .slab
            .iter()
            .any(|b| b.state == BlockState::Live && b.offset + b.size > target);
        if live_above {
            return false;
        }
        let mut end = cap;
        while end > target {
            let Some(top) = self.slab.iter().position(|b| {
                matches!(b.state, BlockState::Free | BlockState::Parked)
                    && b.size > 0
                    && b.offset + b.size == end
            }) else {
                return false;
            };
            let top = top as u32;
            let b = self.slab[top as usize];
            if b.state == BlockState::Free {
                self.unlist(top);
            }
            if b.offset >= target {
                if b.prev_phys != NONE {
                    // Its neighbour becomes the top, listed in the top's
                    // class from now on.
                    let prev = b.prev_phys;
                    let lane = self.slab[prev as usize].lane;
                    let listed = self.slab[prev as usize].state == BlockState::Free;
                    if listed {
                        self.unlist(prev);
                    }
                    self.slab[prev as usize].next_phys = NONE;
                    if listed {
                        self.lanes[lane as usize].insert(&mut self.slab, prev, shift, lane);
                    }
                }
                if b.state == BlockState::Parked {
                    self.c.parked_blocks -= 1;
                }
                self.drop_slot(top);
                end = b.offset;
                continue;
            }
            let rest = target - b.offset;
            self.slab[top as usize].size = rest;
            if b.state == BlockState::Free {
                let lane = b.lane;
                self.lanes[lane as usize].insert(&mut self.slab, top, shift, lane);
            }
            end = target;
        }
        true
    }

    /// The highest end of a live block (0 when none is live).
    pub(super) fn live_extent(&self) -> u64 {
        self.slab
            .iter()
            .filter(|b| b.state == BlockState::Live)
            .map(|b| b.offset + b.size)
            .max()
            .unwrap_or(0)
    }

    /// Moves every free block of lane `from` to `stream`'s lane, merging.
    /// False (nothing moved) when `stream` can get no lane.
    pub(super) fn move_lane(&mut self, from: u32, stream: u64, shift: u32) -> bool {
        // The target lane must exist before `from` empties, or `lane_for`
        // would hand `from` itself back as the empty lane to reuse.
        if self.lane_for(stream).is_none() {
            return false;
        }
        while let Some(idx) = self.lanes[from as usize].any() {
            self.unlist(idx);
            self.put_free(idx, stream, shift);
        }
        true
    }
}
