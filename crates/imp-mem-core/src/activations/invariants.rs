//! The pool's invariant scanner: the blocks tile the region, the lists
//! and the pointer map agree with the blocks, and the counters add up.

use crate::error::MemError;

use super::pool::{parked_bytes, ActivationPool};
use super::tlsf::{BlockState, NONE};
use super::{tlsf, FRESH_STREAM};

impl ActivationPool {
    /// Checks the pool's invariants: the blocks tile the region in address
    /// order with no overlap or gap; free + live == capacity; no two
    /// adjacent free blocks of one stream; every free block is listed once,
    /// in its size's class of its stream's lane; every live block is in the
    /// pointer map and nothing else is; the counters agree.
    pub fn check_invariants(&self) -> Result<(), MemError> {
        let core = self.core();
        let bad = |what: String| Err(MemError::Invariant(format!("activation pool: {what}")));
        let shift = self.inner.shift;
        let (mut at, mut prev, mut offset) = (0u32, NONE, 0u64);
        let (mut live_bytes, mut free_bytes, mut live_n, mut free_n, mut parked) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut steps = 0usize;
        while at != NONE {
            steps += 1;
            if steps > core.slab.len() {
                return bad("the physical list has a cycle".into());
            }
            let b = core.slab[at as usize];
            if b.prev_phys != prev {
                return bad(format!("block {at}: prev link {} != {prev}", b.prev_phys));
            }
            if b.offset != offset {
                return bad(format!(
                    "block {at} starts at {} but the previous ends at {offset}: overlap or gap",
                    b.offset
                ));
            }
            if b.size == 0 || b.size & (self.inner.align - 1) != 0 {
                return bad(format!("block {at} has size {}", b.size));
            }
            match b.state {
                BlockState::Live => {
                    live_bytes += b.size;
                    live_n += 1;
                    if core.live.get(&(b.offset >> shift)) != Some(&at) {
                        return bad(format!("live block {at} is not in the pointer map"));
                    }
                }
                BlockState::Free => {
                    free_bytes += b.size;
                    free_n += 1;
                    let lane = core.lanes.get(b.lane as usize);
                    if lane.map(|l| l.stream) != Some(b.stream) {
                        return bad(format!("free block {at} is on the wrong lane"));
                    }
                    if prev != NONE {
                        let p = core.slab[prev as usize];
                        let joinable = p.stream == b.stream
                            || p.stream == FRESH_STREAM
                            || b.stream == FRESH_STREAM;
                        if p.state == BlockState::Free && joinable {
                            return bad(format!(
                                "blocks {prev} and {at} are adjacent free blocks of one stream"
                            ));
                        }
                    }
                }
                BlockState::Parked => {
                    free_bytes += b.size;
                    parked += 1;
                }
                BlockState::Spare => return bad(format!("spare entry {at} is in the region")),
            }
            offset += b.size;
            prev = at;
            at = b.next_phys;
        }
        if offset != self.capacity() {
            return bad(format!(
                "blocks cover {offset} B of a {} B region",
                self.capacity()
            ));
        }
        if live_bytes + free_bytes != self.capacity() {
            return bad(format!(
                "free {free_bytes} + live {live_bytes} != capacity {}",
                self.capacity()
            ));
        }
        if live_n as usize != core.live.len() {
            return bad(format!(
                "{live_n} live blocks but {} map entries",
                core.live.len()
            ));
        }
        if core.c.allocated != live_bytes {
            return bad(format!(
                "allocated counter {} != {live_bytes} live bytes",
                core.c.allocated
            ));
        }
        if core.c.live != live_n + core.fallback.len() as u64 {
            return bad(format!(
                "live counter {} != {live_n} blocks + {} fallbacks",
                core.c.live,
                core.fallback.len()
            ));
        }
        if core.c.parked_blocks != parked {
            return bad("parked counter disagrees".into());
        }
        let told = self
            .inner
            .fallbacks
            .load(std::sync::atomic::Ordering::Acquire);
        if told != core.fallback.len() {
            return bad(format!(
                "fallback count {told} != {} fallback blocks",
                core.fallback.len()
            ));
        }
        let fb: u64 = core.fallback.values().map(|f| f.region.len() as u64).sum();
        if fb != core.c.fallback_bytes {
            return bad(format!(
                "fallback bytes {fb} != counter {}",
                core.c.fallback_bytes
            ));
        }
        let mut listed = 0u64;
        let mut listed_bytes = 0u64;
        for (li, lane) in core.lanes.iter().enumerate() {
            if !lane.maps_consistent() {
                return bad(format!("lane {li}: bitmaps disagree with the lists"));
            }
            let mut n = 0u32;
            let mut bytes = 0u64;
            let mut wrong = None;
            lane.listed(&core.slab, |idx, class| {
                let b = &core.slab[idx as usize];
                n += 1;
                bytes += b.size;
                if b.state != BlockState::Free
                    || b.lane as usize != li
                    || b.listed != b.list_units(shift)
                    || tlsf::class_of(b.listed) != class
                {
                    wrong = Some(idx);
                }
            });
            if let Some(idx) = wrong {
                return bad(format!("lane {li}: block {idx} is listed wrongly"));
            }
            if n != lane.blocks || bytes != lane.bytes {
                return bad(format!("lane {li}: counters disagree with its lists"));
            }
            listed += u64::from(n);
            listed_bytes += bytes;
        }
        if listed != free_n || listed_bytes + parked_bytes(&core) != free_bytes {
            return bad(format!(
                "{listed} blocks listed, {free_n} free in the region"
            ));
        }
        Ok(())
    }
}
