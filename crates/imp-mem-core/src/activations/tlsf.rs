//! The two-level segregated-fit index of the activation pool.
//!
//! Block metadata lives in one slab (`Vec<Block>`, indices as `u32`); the
//! blocks of the region form a doubly linked list in address order (the
//! physical neighbours), and each free block is also on one segregated free
//! list of one [`Lane`] (one lane per stream).
//!
//! Size classes, in units of the pool's alignment: a size `u < 16` has its
//! own class `(0, u)`; otherwise the first level is the position of its top
//! bit and the second level the next four bits, so each power-of-two range
//! is cut into 16 classes and a class spans at most 1/16 of its lower bound.
//! A lane keeps a bitmap of non-empty first levels and, per first level, one
//! of non-empty second levels, so finding a non-empty class at or above a
//! given one is two `trailing_zeros`. A search first rounds the request up
//! to the next class boundary, so any block of the class found fits without
//! looking at it (good fit, O(1)); [`Lane::find_exact`] scans the one class
//! below that boundary when nothing larger is free.
//!
//! The top block (the last of the region, no physical neighbour after it:
//! the memory never reached, or reached and given back) is listed in a class
//! of its own above every size ([`TOP_UNITS`]), so a search takes it only
//! when no other free block fits, whatever its size. A measuring pool's top
//! is its whole reservation and sorts last by size anyway; listing it by its
//! size in a pool of fixed capacity let a small top win over larger holes,
//! so the same work reached further than it had while measuring (a served
//! HF generate() fell back on the H200 at its measured size).

/// "No block": the end of a list, an unset link.
pub(crate) const NONE: u32 = u32::MAX;
/// Second-level classes per first level (log2).
const SL_LOG2: u32 = 4;
const SL: usize = 1 << SL_LOG2;
/// First levels: enough for any size in units up to 2^63.
const FL: usize = 64;
/// The units the top block is listed under: a class above every request
/// (at most 1 PiB, 2^41 units of the smallest alignment).
pub(crate) const TOP_UNITS: u64 = 1 << 62;

/// What a slab entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Handed out (or on its way out).
    Live,
    /// On the free list of the lane `lane`.
    Free,
    /// Free but on no list: a free whose stream could get no lane (metadata
    /// allocation failed). Never reused, never merged; counted.
    Parked,
    /// An unused slab entry, on the spare list (linked through `next_free`).
    Spare,
}

/// One block of the region.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Block {
    /// Bytes from the region's base.
    pub offset: u64,
    /// Bytes, a multiple of the pool's alignment.
    pub size: u64,
    /// The bytes the caller asked for (live blocks only).
    pub requested: u64,
    /// Live: the stream it was allocated on. Free: the stream it was freed on.
    pub stream: u64,
    pub prev_phys: u32,
    pub next_phys: u32,
    pub prev_free: u32,
    pub next_free: u32,
    /// The lane whose list holds it (free blocks).
    pub lane: u32,
    /// The units it is listed under (free blocks): its size's, or
    /// [`TOP_UNITS`] for the top block.
    pub listed: u64,
    pub state: BlockState,
}

impl Block {
    pub(crate) const fn spare() -> Self {
        Block {
            offset: 0,
            size: 0,
            requested: 0,
            stream: 0,
            prev_phys: NONE,
            next_phys: NONE,
            prev_free: NONE,
            next_free: NONE,
            lane: NONE,
            listed: 0,
            state: BlockState::Spare,
        }
    }

    /// The units to list it under now (module doc: the top's own class).
    #[inline]
    pub(crate) fn list_units(&self, shift: u32) -> u64 {
        if self.next_phys == NONE {
            TOP_UNITS
        } else {
            self.size >> shift
        }
    }
}

/// The class `(first, second)` of a size in units (`u >= 1`).
#[inline]
pub(crate) fn class_of(u: u64) -> (usize, usize) {
    if u < SL as u64 {
        (0, u as usize)
    } else {
        let msb = 63 - u.leading_zeros();
        let fl = (msb - SL_LOG2 + 1) as usize;
        let sl = ((u >> (msb - SL_LOG2)) as usize) & (SL - 1);
        (fl, sl)
    }
}

/// The class a search for `u` units starts at: the first whose every block
/// holds at least `u` units.
#[inline]
pub(crate) fn search_class(u: u64) -> (usize, usize) {
    if u < SL as u64 {
        (0, u as usize)
    } else {
        let msb = 63 - u.leading_zeros();
        class_of(u.saturating_add((1u64 << (msb - SL_LOG2)) - 1))
    }
}

/// The free blocks of one stream, by class.
#[derive(Clone)]
pub(crate) struct Lane {
    /// The stream they were freed on.
    pub stream: u64,
    fl_map: u64,
    sl_map: [u16; FL],
    heads: [[u32; SL]; FL],
    /// Free blocks listed.
    pub blocks: u32,
    /// Their bytes.
    pub bytes: u64,
}

impl Lane {
    pub(crate) fn new(stream: u64) -> Self {
        Lane {
            stream,
            fl_map: 0,
            sl_map: [0; FL],
            heads: [[NONE; SL]; FL],
            blocks: 0,
            bytes: 0,
        }
    }

    /// Lists block `idx` (free, its size and physical links set) at the
    /// head of its class ([`Block::list_units`]).
    #[inline]
    pub(crate) fn insert(&mut self, slab: &mut [Block], idx: u32, shift: u32, me: u32) {
        let units = slab[idx as usize].list_units(shift);
        let (f, s) = class_of(units);
        let head = self.heads[f][s];
        {
            let b = &mut slab[idx as usize];
            b.prev_free = NONE;
            b.next_free = head;
            b.lane = me;
            b.listed = units;
            b.state = BlockState::Free;
        }
        if head != NONE {
            slab[head as usize].prev_free = idx;
        }
        self.heads[f][s] = idx;
        self.fl_map |= 1 << f;
        self.sl_map[f] |= 1 << s;
        self.blocks += 1;
        self.bytes += slab[idx as usize].size;
    }

    /// Unlists block `idx`, which is on this lane in the class it was
    /// listed under.
    #[inline]
    pub(crate) fn remove(&mut self, slab: &mut [Block], idx: u32) {
        let (f, s) = class_of(slab[idx as usize].listed);
        let (prev, next, size) = {
            let b = &slab[idx as usize];
            (b.prev_free, b.next_free, b.size)
        };
        if prev != NONE {
            slab[prev as usize].next_free = next;
        } else {
            self.heads[f][s] = next;
            if next == NONE {
                self.sl_map[f] &= !(1 << s);
                if self.sl_map[f] == 0 {
                    self.fl_map &= !(1 << f);
                }
            }
        }
        if next != NONE {
            slab[next as usize].prev_free = prev;
        }
        let b = &mut slab[idx as usize];
        b.prev_free = NONE;
        b.next_free = NONE;
        b.lane = NONE;
        self.blocks -= 1;
        self.bytes -= size;
    }

    /// The head of the first non-empty class that guarantees `units` units.
    #[inline]
    pub(crate) fn find(&self, slab: &[Block], units: u64, need: u64) -> Option<u32> {
        let (f, s) = search_class(units);
        if f >= FL {
            return None;
        }
        let here = u32::from(self.sl_map[f]) & (u32::MAX << s);
        let (f, s) = if here != 0 {
            (f, here.trailing_zeros() as usize)
        } else {
            let above = if f + 1 >= FL {
                0
            } else {
                self.fl_map & (u64::MAX << (f + 1))
            };
            if above == 0 {
                return None;
            }
            let f = above.trailing_zeros() as usize;
            (f, u32::from(self.sl_map[f]).trailing_zeros() as usize)
        };
        let head = self.heads[f][s];
        // Every block of the class fits, except the top, whose class says
        // nothing of its size.
        (head != NONE && slab[head as usize].size >= need).then_some(head)
    }

    /// A block of at least `bytes` in the class of `units` (which
    /// [`Lane::find`] skips, as some of its blocks may be too small), by
    /// scanning that one list.
    pub(crate) fn find_exact(&self, slab: &[Block], units: u64, bytes: u64) -> Option<u32> {
        let (f, s) = class_of(units);
        let mut at = self.heads[f][s];
        while at != NONE {
            let b = &slab[at as usize];
            if b.size >= bytes {
                return Some(at);
            }
            at = b.next_free;
        }
        None
    }

    /// Any listed block (the head of the lowest non-empty class).
    pub(crate) fn any(&self) -> Option<u32> {
        if self.fl_map == 0 {
            return None;
        }
        let f = self.fl_map.trailing_zeros() as usize;
        let s = u32::from(self.sl_map[f]).trailing_zeros() as usize;
        Some(self.heads[f][s])
    }

    /// The largest listed block's size: a scan of the top's class and of
    /// the highest other non-empty class.
    pub(crate) fn largest(&self, slab: &[Block]) -> u64 {
        let (top_f, top_s) = class_of(TOP_UNITS);
        let scan = |f: usize, s: usize| {
            let mut at = self.heads[f][s];
            let mut best = 0;
            while at != NONE {
                let b = &slab[at as usize];
                best = best.max(b.size);
                at = b.next_free;
            }
            best
        };
        let mut rows = self.sl_map;
        rows[top_f] &= !(1u16 << top_s);
        let sized = (0..FL).rev().find(|&f| rows[f] != 0);
        let below = sized.map_or(0, |f| scan(f, 15 - rows[f].leading_zeros() as usize));
        below.max(scan(top_f, top_s))
    }

    /// Every listed block, class by class (for the invariant check).
    pub(crate) fn listed(&self, slab: &[Block], mut visit: impl FnMut(u32, (usize, usize))) {
        for f in 0..FL {
            for s in 0..SL {
                let mut at = self.heads[f][s];
                while at != NONE {
                    visit(at, (f, s));
                    at = slab[at as usize].next_free;
                }
            }
        }
    }

    /// Whether the bitmaps agree with the heads.
    pub(crate) fn maps_consistent(&self) -> bool {
        (0..FL).all(|f| {
            let row = (0..SL).all(|s| (self.heads[f][s] != NONE) == (self.sl_map[f] >> s & 1 == 1));
            row && ((self.sl_map[f] != 0) == (self.fl_map >> f & 1 == 1))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_class_only_holds_sizes_that_fit() {
        for u in 1..5000u64 {
            let (f, s) = search_class(u);
            // The smallest size in that class.
            let lo = (1..=u * 2).find(|&v| class_of(v) == (f, s));
            let lo = lo.unwrap_or(u64::MAX);
            assert!(lo >= u, "u={u}: class ({f},{s}) starts at {lo}");
            // And the class of u itself is at most one below.
            assert!(class_of(u) <= (f, s));
        }
    }

    #[test]
    fn classes_are_monotone() {
        let mut last = (0, 0);
        for u in 1..100_000u64 {
            let c = class_of(u);
            assert!(c >= last);
            last = c;
        }
        assert!(class_of(1 << 50).0 < FL);
    }
}
