//! Planned passes: one pass of repeated work (a compiled `generate()`, a
//! training step) recorded as sizes and lifetimes, laid out offline, and
//! replayed by placement hints.
//!
//! **Why.** An online allocator places a block knowing nothing of when it
//! will be freed. Where long-lived blocks are made one by one among larger
//! temporaries (Hugging Face's static cache under `torch.compile`: 56 blocks
//! of 67.9 MiB made a layer at a time inside the prefill's 64-192 MiB
//! temporaries), they end up with holes between them that no later request
//! fits, and the pool's high-water lies 5.5 % over the live bytes' peak
//! (H200, 2026-12-03, issue 28). The same pass laid out with every lifetime known
//! needs 0.1 % (`benches/bench_measured_replay.py` on the H200's trace).
//!
//! **Recording** ([`ActivationPool::record_pass`]). From the call on, every
//! allocation (in the region or a fallback) and every free is an op; an
//! allocation is a [`PassItem`]: its units and the ops it was alive
//! between. The blocks live when the recording starts, and those live when
//! it is planned, are fixed obstacles of the layout, where they lie.
//!
//! **Layout** ([`plan_layout`]). Offline greedy placement: items in an
//! order, each at the lowest offset free of every obstacle and every placed
//! item alive at the same time. Five layouts are tried and the lowest top
//! kept: by size (largest first); long-lived first (alive for more than
//! half, then a twentieth, of the pass), each then by size; and the same
//! two with the long-lived ones above every obstacle, so that the holes
//! between obstacles are the temporaries'. By size alone is the classic
//! heuristic; on the H200's compiled trace it put the decode's 135.9 MiB
//! logits first and the static cache above them (2.1 % over the live
//! peak). Long-lived first stacks the cache low (0.1 % with the obstacles
//! packed), but where an obstacle stands apart (the first pass's 32 MiB
//! output, above a 193 MiB hole) the cache half-fills the hole (3.1 %);
//! lifted above the obstacles it leaves the hole to the prefill's
//! temporaries (0.1 %).
//!
//! **Hints** ([`ActivationPool::plan_pass`]). The layout becomes one hint a
//! recorded allocation, in order: its units, its offset, and the start of
//! the block that lies just below it then (its left neighbour, live in the
//! pool when the pass is followed). An allocation takes the hint under the
//! cursor when the units match (else the next of the same units within
//! [`RESYNC`] hints, or from the first: a pass beginning again), finds its
//! left neighbour through the pointer map, walks to the free block across
//! the offset, and carves the hinted range out of it. Anything that does
//! not fit the hint (a different size, the range not free, another
//! stream's free block) takes the ordinary search: a hint never changes
//! what is correct, only where a block goes. The cursor wraps at the end,
//! so each repetition of the pass follows the layout again.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use crate::error::MemError;

use super::blocks::{Core, OffsetMap};
use super::pool::ActivationPool;
use super::tlsf::{BlockState, NONE};
use super::FRESH_STREAM;

/// An allocation of a recorded pass, in units of the pool's alignment,
/// alive from op `start` until op `end` (the free; [`OUTLIVES`] for a
/// block still live when the recording was planned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassItem {
    /// Its size in units of the pool's alignment.
    pub units: u64,
    /// The op that allocated it.
    pub start: u32,
    /// The op that freed it, or [`OUTLIVES`].
    pub end: u32,
}

/// `PassItem::end` of a block live when the recording is planned.
pub const OUTLIVES: u32 = u32::MAX;
/// An offset that is none: an item not laid out, a hint with no left
/// neighbour (the region's start).
pub const NO_OFFSET: u64 = u64::MAX;
/// How many hints past the cursor (and from the first) an allocation whose
/// units differ from the cursor's looks for its own.
pub const RESYNC: usize = 64;
/// The most ops a recording holds; past it the recording is spoilt and
/// `plan_pass` refuses.
pub const MAX_PASS_OPS: u32 = 1 << 23;
/// Ops a time bucket of the layout's index spans.
const BUCKET: u32 = 256;
/// Buckets an item must cross to be checked by every query instead.
const SPANNING_BUCKETS: usize = 16;
/// Placed items one layout may visit in all (about a second on the host):
/// past it that order is given up. The H200's compiled generate() (59 503
/// allocations) visits far fewer.
pub const LAYOUT_WORK: u64 = 400_000_000;
/// Physical neighbours a hint walks past its left neighbour.
const WALK: usize = 8;

/// Where [`plan_layout`] puts a pass's items (units; [`NO_OFFSET`] for an
/// item that outlives the pass) and the top of the layout (the highest end
/// of an item or an obstacle).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Each item's offset in units ([`NO_OFFSET`]: not laid out).
    pub offsets: Vec<u64>,
    /// The highest end of an item or an obstacle, in units.
    pub top: u64,
}

/// Lays out `items` (module documentation) around `obstacles` (`(offset,
/// units)`, alive through the whole pass); `ops`: the pass's length in ops.
/// Items that outlive the pass are not laid out. None when every order
/// would cost more than [`LAYOUT_WORK`] (a pass of many blocks all alive
/// at once: the layout's search is quadratic in the blocks alive together).
pub fn plan_layout(items: &[PassItem], obstacles: &[(u64, u64)], ops: u32) -> Option<Layout> {
    plan_layout_within(items, obstacles, ops, LAYOUT_WORK)
}

/// [`plan_layout`] with `budget` in place of [`LAYOUT_WORK`].
pub fn plan_layout_within(
    items: &[PassItem],
    obstacles: &[(u64, u64)],
    ops: u32,
    budget: u64,
) -> Option<Layout> {
    let fixed = coalesce(obstacles);
    // Every item starts inside the pass, whatever `ops` says.
    let ops = items
        .iter()
        .map(|i| i.start.saturating_add(1))
        .max()
        .unwrap_or(0)
        .max(ops);
    let len = |i: usize| u64::from(items[i].end.min(ops).saturating_sub(items[i].start));
    let long = |i: usize, share: u64| len(i).saturating_mul(share) > u64::from(ops);
    let by = |share: u64| {
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| {
            (
                !long(i, share),
                std::cmp::Reverse(items[i].units),
                items[i].start,
            )
        });
        order
    };
    // (share, long ones above the obstacles): share 1 makes none long.
    let tries = [(1, false), (2, false), (20, false), (2, true), (20, true)];
    tries
        .iter()
        .filter_map(|&(share, above)| {
            let lift = |i: usize| above && long(i, share);
            greedy(items, &fixed, ops, &by(share), &lift, budget)
        })
        .min_by_key(|l| l.top)
}

/// The obstacles sorted and merged where they touch or overlap.
fn coalesce(obstacles: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = obstacles
        .iter()
        .filter(|o| o.1 > 0)
        .map(|&(o, u)| (o, o.saturating_add(u)))
        .collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// One greedy layout in `order`: each item at the lowest offset clear of
/// the obstacles (`[start, end)`) and of the placed items alive with it;
/// an item `lift` holds goes above every obstacle, leaving the holes
/// between them to the temporaries.
fn greedy(
    items: &[PassItem],
    fixed: &[(u64, u64)],
    ops: u32,
    order: &[usize],
    lift: &dyn Fn(usize) -> bool,
    budget: u64,
) -> Option<Layout> {
    let buckets = (ops / BUCKET) as usize + 1;
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); buckets];
    // Items over many buckets are checked by every query instead of being
    // listed in each bucket they cross.
    let mut spanning: Vec<u32> = Vec::new();
    let mut offsets = vec![NO_OFFSET; items.len()];
    let mut seen = vec![u32::MAX; items.len()];
    let mut near: Vec<(u64, u64)> = Vec::new();
    let mut top = fixed.last().map_or(0, |f| f.1);
    let above = [(0, top)];
    let mut work = 0u64;
    for (q, &j) in order.iter().enumerate() {
        let it = items[j];
        if it.end == OUTLIVES || it.units == 0 {
            continue;
        }
        let end = it.end.min(ops).max(it.start + 1);
        let (b0, b1) = ((it.start / BUCKET) as usize, ((end - 1) / BUCKET) as usize);
        let b1 = b1.min(buckets - 1);
        near.clear();
        near.extend_from_slice(if lift(j) { &above } else { fixed });
        for list in lists[b0..=b1].iter().chain(std::iter::once(&spanning)) {
            work += list.len() as u64;
            for &p in list {
                let p = p as usize;
                let other = items[p];
                if seen[p] != q as u32 && other.start < end && other.end.min(ops) > it.start {
                    seen[p] = q as u32;
                    near.push((offsets[p], offsets[p].saturating_add(other.units)));
                }
            }
        }
        if work > budget {
            return None;
        }
        near.sort_unstable();
        let mut at = 0u64;
        for &(s, e) in &near {
            if s >= at.saturating_add(it.units) {
                break;
            }
            at = at.max(e);
        }
        offsets[j] = at;
        top = top.max(at.saturating_add(it.units));
        if b1 - b0 >= SPANNING_BUCKETS {
            spanning.push(j as u32);
        } else {
            for list in &mut lists[b0..=b1] {
                list.push(j as u32);
            }
        }
    }
    Some(Layout { offsets, top })
}

/// The left neighbour of each laid-out item when it is allocated: the start
/// of the live block (an obstacle or an item) that lies just below its
/// offset, or [`NO_OFFSET`] where none does.
fn left_neighbours(items: &[PassItem], obstacles: &[(u64, u64)], offsets: &[u64]) -> Vec<u64> {
    let mut events: Vec<(u32, bool, usize)> = Vec::with_capacity(items.len() * 2);
    for (i, it) in items.iter().enumerate() {
        if offsets[i] == NO_OFFSET {
            continue;
        }
        events.push((it.start, true, i));
        if it.end != OUTLIVES {
            events.push((it.end, false, i));
        }
    }
    // A free and an allocation never share an op; at one op (impossible
    // but harmless) the free goes first.
    events.sort_unstable_by_key(|&(op, alloc, _)| (op, alloc));
    let mut live: BTreeMap<u64, u64> = obstacles.iter().copied().collect();
    let mut left = vec![NO_OFFSET; items.len()];
    for (_, alloc, i) in events {
        let off = offsets[i];
        if alloc {
            left[i] = live.range(..off).next_back().map_or(NO_OFFSET, |(&s, _)| s);
            live.insert(off, items[i].units);
        } else {
            live.remove(&off);
        }
    }
    left
}

/// The largest sum of units alive at once: the obstacles and the items.
fn live_peak(items: &[PassItem], obstacles: &[(u64, u64)]) -> u64 {
    let mut events: Vec<(u32, i128)> = Vec::with_capacity(items.len() * 2);
    for it in items {
        events.push((it.start, i128::from(it.units)));
        if it.end != OUTLIVES {
            events.push((it.end, -i128::from(it.units)));
        }
    }
    events.sort_unstable();
    let base: u64 = obstacles.iter().map(|o| o.1).sum();
    let (mut now, mut peak) = (i128::from(base), i128::from(base));
    for (_, d) in events {
        now += d;
        peak = peak.max(now);
    }
    peak as u64
}

/// What [`ActivationPool::plan_pass`] laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassPlan {
    /// Allocations recorded.
    pub allocations: u64,
    /// Of them, laid out (the rest outlived the pass).
    pub hinted: u64,
    /// Ops recorded (allocations and frees).
    pub ops: u64,
    /// The live bytes' peak over the pass (obstacles included).
    pub live_peak: u64,
    /// The layout's top (bytes): what the pool needs for the pass laid out.
    pub top: u64,
    /// The pool's high-water when the recording was planned.
    pub recorded_high_water: u64,
    /// Whether the hints were kept: the layout is lower than the
    /// recorded high-water (a measuring pool) or fits the capacity (a
    /// fixed one).
    pub installed: bool,
}

/// The hints' counters since they were installed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HintStats {
    /// Hints installed (one a recorded allocation).
    pub hints: u64,
    /// Allocations placed where their hint said.
    pub hits: u64,
    /// Allocations with no hint of their units near the cursor.
    pub misses: u64,
    /// Allocations whose hint could not be taken (the range not free,
    /// another stream's block, no left neighbour where planned).
    pub refused: u64,
}

#[derive(Debug, Clone, Copy)]
struct Hint {
    units: u64,
    offset: u64,
    left: u64,
}

/// A recording in progress (under the pool's lock).
pub(super) struct Recording {
    items: Vec<PassItem>,
    /// Item of each live recorded block, by address.
    open: OffsetMap<u32>,
    ops: u32,
    /// Blocks live when it began: `(offset, units)`.
    before: Vec<(u64, u64)>,
    spoilt: bool,
}

impl Recording {
    /// Records an allocation; false once the recording is spoilt (too
    /// long, or the host refused memory), its memory then given back.
    pub(super) fn alloc(&mut self, addr: usize, units: u64) -> bool {
        let full = self.ops >= MAX_PASS_OPS;
        if self.spoilt
            || full
            || self.items.try_reserve(1).is_err()
            || self.open.try_reserve(1).is_err()
        {
            self.spoilt = true;
            self.items = Vec::new();
            self.open = OffsetMap::default();
            return false;
        }
        self.open.insert(addr as u64, self.items.len() as u32);
        self.items.push(PassItem {
            units,
            start: self.ops,
            end: OUTLIVES,
        });
        self.ops += 1;
        true
    }

    pub(super) fn free(&mut self, addr: usize) {
        if self.spoilt {
            return;
        }
        if let Some(i) = self.open.remove(&(addr as u64)) {
            self.items[i as usize].end = self.ops;
            self.ops += 1;
        }
    }
}

/// Installed hints (under the pool's lock).
pub(super) struct PassHints {
    hints: Vec<Hint>,
    cursor: usize,
    stats: HintStats,
}

impl PassHints {
    /// The hint for an allocation of `units`: the cursor's, or the next of
    /// those units within `RESYNC`, or one within `RESYNC` of the first.
    fn take(&mut self, units: u64) -> Option<Hint> {
        let n = self.hints.len();
        let k = self.cursor;
        let near = (0..RESYNC.min(n)).map(|d| (k + d) % n);
        let found = near
            .chain(0..RESYNC.min(n))
            .find(|&j| self.hints[j].units == units);
        match found {
            Some(j) => {
                self.cursor = (j + 1) % n;
                Some(self.hints[j])
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }
}

impl Core {
    /// The live blocks: `(offset, units)`.
    fn live_blocks(&self, shift: u32) -> Vec<(u64, u64)> {
        self.slab
            .iter()
            .filter(|b| b.state == BlockState::Live)
            .map(|b| (b.offset >> shift, b.size >> shift))
            .collect()
    }

    /// The free block across unit offset `off` for `units`, found from the
    /// hint's left neighbour: free, on `stream`'s lane or never used, and
    /// holding the whole range.
    fn hinted_block(&self, hint: &Hint, stream: u64, shift: u32) -> Option<u32> {
        let (off, end) = (
            hint.offset << shift,
            hint.offset.saturating_add(hint.units) << shift,
        );
        let mut at = if hint.left == NO_OFFSET {
            // The block at the region's start is always slab entry 0: a
            // carve keeps the head's entry, a merge the lower one's.
            0
        } else {
            *self.live.get(&hint.left)?
        };
        for _ in 0..=WALK {
            let b = self.slab.get(at as usize)?;
            if b.state == BlockState::Spare {
                return None;
            }
            if b.offset + b.size > off {
                let fits = b.state == BlockState::Free
                    && b.offset <= off
                    && b.offset + b.size >= end
                    && (b.stream == stream || b.stream == FRESH_STREAM);
                return fits.then_some(at);
            }
            at = b.next_phys;
            if at == NONE {
                return None;
            }
        }
        None
    }
}

impl ActivationPool {
    /// Starts recording a pass (module documentation): every allocation and
    /// free from now until [`ActivationPool::plan_pass`]. Hints installed
    /// before are dropped (the pass is recorded as the ordinary search
    /// places it). A recording already running starts again.
    pub fn record_pass(&self) {
        let shift = self.inner.shift;
        let mut core = self.core();
        let before = core.live_blocks(shift);
        core.plan = None;
        core.recording = Some(Box::new(Recording {
            items: Vec::new(),
            open: OffsetMap::default(),
            ops: 0,
            before,
            spoilt: false,
        }));
        self.inner.recording.store(true, Ordering::Relaxed);
    }

    /// Whether a pass is being recorded.
    pub fn recording(&self) -> bool {
        self.core().recording.is_some()
    }

    /// Ends the recording, lays the pass out and installs its hints when
    /// the layout is lower than the recorded high-water (a measuring pool:
    /// the high-water then becomes the layout's top, so a freeze after fixes
    /// the pool there) or fits the capacity (a fixed pool). Refused with
    /// `InvalidArgument` when no recording runs or it grew past
    /// [`MAX_PASS_OPS`] (or the host's memory).
    pub fn plan_pass(&self) -> Result<PassPlan, MemError> {
        let shift = self.inner.shift;
        let (rec, now_live, recorded_high_water) = {
            let mut core = self.core();
            self.inner.recording.store(false, Ordering::Relaxed);
            let Some(rec) = core.recording.take() else {
                return Err(MemError::invalid(
                    "plan_pass: no pass is being recorded; call record_pass() before the pass",
                ));
            };
            let live = core.live_blocks(shift);
            (rec, live, core.extent_peak)
        };
        if rec.spoilt {
            return Err(MemError::invalid(format!(
                "plan_pass: the recorded pass ran past {MAX_PASS_OPS} ops (or the host's memory); \
                 record one pass of the work, not the whole run"
            )));
        }
        // Live now or when it began: fixed for the whole pass, where they lie.
        let mut obstacles = rec.before.clone();
        obstacles.extend_from_slice(&now_live);
        obstacles.sort_unstable();
        obstacles.dedup();
        let layout = plan_layout(&rec.items, &obstacles, rec.ops).unwrap_or(Layout {
            offsets: vec![NO_OFFSET; rec.items.len()],
            top: 0,
        });
        // Left neighbours among the blocks that stay: one freed during the
        // pass is gone when the pass runs again.
        let left = left_neighbours(&rec.items, &now_live, &layout.offsets);
        let hints: Vec<Hint> = rec
            .items
            .iter()
            .enumerate()
            .map(|(i, it)| Hint {
                units: it.units,
                offset: layout.offsets[i],
                left: left[i],
            })
            .collect();
        let hinted = hints.iter().filter(|h| h.offset != NO_OFFSET).count() as u64;
        let top = layout.top << shift;
        let mut core = self.core();
        let installed = !hints.is_empty()
            && hinted > 0
            && if core.measuring {
                top < recorded_high_water
            } else {
                top <= self.capacity()
            };
        if installed {
            if core.measuring {
                core.extent_peak = top.max(core.live_extent());
            }
            core.plan = Some(Box::new(PassHints {
                stats: HintStats {
                    hints: hints.len() as u64,
                    ..HintStats::default()
                },
                hints,
                cursor: 0,
            }));
        }
        let plan = PassPlan {
            allocations: rec.items.len() as u64,
            hinted,
            ops: u64::from(rec.ops),
            live_peak: live_peak(&rec.items, &obstacles) << shift,
            top,
            recorded_high_water,
            installed,
        };
        core.last_plan = Some(plan);
        Ok(plan)
    }

    /// What the last [`ActivationPool::plan_pass`] laid out, if one ran.
    pub fn pass_plan(&self) -> Option<PassPlan> {
        self.core().last_plan
    }

    /// The installed hints' counters, if hints are installed.
    pub fn pass_hints(&self) -> Option<HintStats> {
        self.core().plan.as_ref().map(|p| p.stats)
    }

    /// Drops the installed hints (and a recording in progress): placement
    /// is the ordinary search's again.
    pub fn drop_pass_plan(&self) {
        let mut core = self.core();
        core.plan = None;
        core.recording = None;
        self.inner.recording.store(false, Ordering::Relaxed);
    }

    /// Places an allocation where the hint under the cursor says, if it
    /// can (module documentation); None leaves the pool as it was.
    pub(super) fn place_hinted(
        &self,
        core: &mut Core,
        units: u64,
        need: u64,
        stream: u64,
        bytes: u64,
    ) -> Option<usize> {
        let shift = self.inner.shift;
        let hint = core.plan.as_mut()?.take(units)?;
        let refuse = |core: &mut Core| {
            if let Some(p) = core.plan.as_mut() {
                p.stats.refused += 1;
            }
            None
        };
        if hint.offset == NO_OFFSET {
            return refuse(core);
        }
        let Some(idx) = core.hinted_block(&hint, stream, shift) else {
            return refuse(core);
        };
        let off = hint.offset << shift;
        if !self.reach_end(core, off + need) {
            return refuse(core);
        }
        let lead = off - core.slab[idx as usize].offset;
        if core
            .carve_at(idx, lead, need, stream, bytes, shift)
            .is_none()
        {
            return refuse(core);
        }
        if let Some(p) = core.plan.as_mut() {
            p.stats.hits += 1;
        }
        Some(self.inner.base + off as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(units: u64, start: u32, end: u32) -> PassItem {
        PassItem { units, start, end }
    }

    #[test]
    fn long_lived_blocks_made_among_temporaries_are_stacked_below_them() {
        // A block alive for most of the pass (1), made with a temporary (3)
        // and followed by shorter ones: by size the temporary takes 0 and
        // the long block sits above it, a hole under it later (top 16);
        // long-lived first reaches the live peak, 13.
        let items = [
            item(4, 10, 20),
            item(5, 4, 20),
            item(4, 14, 20),
            item(7, 4, 8),
        ];
        let by_size = greedy(&items, &[], 21, &[3, 1, 0, 2], &|_| false, u64::MAX).unwrap();
        assert_eq!(by_size.top, 16);
        let l = plan_layout(&items, &[], 21).unwrap();
        assert_eq!(live_peak(&items, &[]), 13);
        assert_eq!(l.top, 13);
        assert_eq!(l.offsets[1], 0);
    }

    #[test]
    fn a_layout_past_its_work_budget_is_given_up() {
        // 2 000 blocks all alive until the end: each query visits every
        // block placed before it, about two million visits an order.
        let items: Vec<PassItem> = (0..2000u32)
            .map(|i| item(1 + u64::from(i % 5), i, 8000 + i))
            .collect();
        assert!(plan_layout_within(&items, &[], 12_000, 1_000_000).is_none());
        let l = plan_layout_within(&items, &[], 12_000, 10_000_000).unwrap();
        assert_eq!(l.top, live_peak(&items, &[]));
    }

    #[test]
    fn items_past_the_stated_length_or_of_absurd_sizes_do_not_panic() {
        let items = [
            item(u64::MAX / 2, 7, 9),
            item(3, 9, OUTLIVES),
            item(1, 2, 3),
        ];
        let l = plan_layout(&items, &[(0, 1000)], 1).unwrap();
        assert_eq!(l.offsets[1], NO_OFFSET);
        assert!(l.offsets[0] >= 1000 && l.offsets[2] >= 1000);
        assert_eq!(l.top, u64::MAX / 2 + 1000);
    }

    #[test]
    fn obstacles_are_kept_clear_and_outliving_items_are_not_laid_out() {
        let items = [item(4, 0, 3), item(4, 1, OUTLIVES), item(2, 2, 4)];
        let l = plan_layout(&items, &[(0, 3), (3, 1)], 5).unwrap();
        assert_eq!(l.offsets[1], NO_OFFSET);
        assert!(l.offsets[0] >= 4 && l.offsets[2] >= 4);
        assert!(l.offsets[0] + 4 <= l.offsets[2] || l.offsets[2] + 2 <= l.offsets[0]);
        let left = left_neighbours(&items, &[(0, 3), (3, 1)], &l.offsets);
        assert_eq!(left[0], 3);
        assert_eq!(left[1], NO_OFFSET);
    }
}
