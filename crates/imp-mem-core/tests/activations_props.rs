//! State machines over the activation pool (T4a), against a shadow model.
//!
//! * No overlap: every live block gets its own marker byte written over its
//!   requested bytes on the fake's host memory; the marker must be intact
//!   when the block is freed (and at the end), and the model's intervals
//!   never overlap.
//! * free + live == capacity, the lists and the map consistent
//!   (`check_invariants` after every step).
//! * Freeing everything and asking for the whole region succeeds (a reclaim
//!   merges every stream's blocks); freeing that leaves one block the size
//!   of the region. On one stream, freeing everything leaves one block at
//!   once.
//! * The stream rule: the model remembers, per 512-B unit, the stream that
//!   last freed it and how many orders had been recorded then; a block
//!   handed out on stream W whose units were freed on P != W must find an
//!   `order_after(W, P)` recorded after that free, or a chain of them
//!   (W after X after P, in that order: a reclaim moves P's blocks to X).
//! * Refused frees (foreign, double, interior) change nothing but their
//!   counter.
//! * Production mode: what the region cannot hold falls back to the
//!   backend, accounted to the byte and counted as steady-state while
//!   serving.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::Arc;

use imp_mem_core::activations::{
    ActivationConfig, ActivationPool, ActivationStats, FakeStreamOrder, FRESH_STREAM,
};
use imp_mem_core::{FakeBackend, FakeConfig, MemError, PhaseMode, Tag};
use proptest::prelude::*;

const ALIGN: u64 = 512;
const UNITS: u64 = 128;
const CAP: u64 = ALIGN * UNITS;

#[derive(Debug, Clone)]
enum Op {
    Alloc { bytes: u64, stream: u64 },
    Free { pick: usize, stream: u64 },
    FreeForeign,
    FreeTwice { pick: usize },
    FreeInterior { pick: usize },
    FailNextOrder,
}

fn op(streams: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u64..=16 * ALIGN, 1..=streams).prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        5 => (any::<usize>(), 1..=streams).prop_map(|(pick, stream)| Op::Free { pick, stream }),
        1 => Just(Op::FreeForeign),
        1 => any::<usize>().prop_map(|pick| Op::FreeTwice { pick }),
        1 => any::<usize>().prop_map(|pick| Op::FreeInterior { pick }),
        1 => Just(Op::FailNextOrder),
    ]
}

/// Whether `calls` (oldest first, all made after the producer's free)
/// order `waiter` after `producer`: directly, or through a chain — each
/// call orders its waiter after all work queued on its producer so far,
/// including the producer's own earlier waits.
fn ordered_after(calls: &[(u64, u64)], waiter: u64, producer: u64) -> bool {
    let mut reached = vec![producer];
    for &(w, p) in calls {
        if reached.contains(&p) && !reached.contains(&w) {
            reached.push(w);
        }
    }
    reached.contains(&waiter)
}

#[derive(Debug, Clone, Copy)]
struct Live {
    addr: usize,
    requested: u64,
    marker: u8,
}

struct Model {
    fb: FakeBackend,
    order: FakeStreamOrder,
    pool: ActivationPool,
    live: Vec<Live>,
    /// Per unit: the stream that last freed it and the order count then.
    freed_by: Vec<(u64, usize)>,
    freed: Vec<usize>,
    next_marker: u8,
}

impl Model {
    fn new() -> Self {
        let fb = FakeBackend::new(FakeConfig {
            capacity: 1 << 20,
            ..FakeConfig::default()
        })
        .unwrap();
        let order = FakeStreamOrder::new();
        let pool =
            ActivationPool::new(&fb, &ActivationConfig::new(CAP), Arc::new(order.clone())).unwrap();
        Self {
            fb,
            order,
            pool,
            live: Vec::new(),
            freed_by: vec![(FRESH_STREAM, 0); UNITS as usize],
            freed: Vec::new(),
            next_marker: 1,
        }
    }

    fn units(&self, addr: usize, bytes: u64) -> std::ops::Range<usize> {
        let first = (addr - self.pool.base()) / ALIGN as usize;
        first..first + bytes.div_ceil(ALIGN) as usize
    }

    fn check_marker(&self, l: &Live) -> Result<(), TestCaseError> {
        let bytes = self.fb.read(l.addr, l.requested as usize).unwrap();
        prop_assert!(
            bytes.iter().all(|&b| b == l.marker),
            "block at {:#x} lost its marker: another block overlaps it",
            l.addr
        );
        Ok(())
    }

    fn alloc(&mut self, bytes: u64, stream: u64) -> Result<(), TestCaseError> {
        let before = self.pool.stats();
        match self.pool.allocate(bytes, stream) {
            Ok(addr) => {
                prop_assert!(self.pool.contains(addr), "strict pools never fall back");
                prop_assert_eq!((addr - self.pool.base()) as u64 % ALIGN, 0);
                let calls = self.order.calls();
                for u in self.units(addr, bytes) {
                    let (producer, since) = self.freed_by[u];
                    if producer != stream && producer != FRESH_STREAM {
                        prop_assert!(
                            ordered_after(&calls[since..], stream, producer),
                            "unit {} freed on stream {} reused on {} with no order after the free",
                            u,
                            producer,
                            stream
                        );
                    }
                }
                for l in &self.live {
                    let (a, b) = (self.units(l.addr, l.requested), self.units(addr, bytes));
                    prop_assert!(a.end <= b.start || b.end <= a.start, "overlap");
                }
                let marker = self.next_marker;
                self.next_marker = self.next_marker.wrapping_add(1).max(1);
                self.fb.write(addr, &vec![marker; bytes as usize]).unwrap();
                self.live.push(Live {
                    addr,
                    requested: bytes,
                    marker,
                });
            }
            Err(MemError::OutOfMemory(_)) | Err(MemError::Driver(_)) => {
                let after = self.pool.stats();
                prop_assert_eq!(after.live, before.live);
                prop_assert_eq!(after.allocated, before.allocated);
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
        Ok(())
    }

    fn free(&mut self, pick: usize, stream: u64) -> Result<(), TestCaseError> {
        if self.live.is_empty() {
            return Ok(());
        }
        let l = self.live.swap_remove(pick % self.live.len());
        self.check_marker(&l)?;
        let freed = self.pool.free(l.addr, stream).unwrap();
        prop_assert_eq!(freed.requested, l.requested);
        let n = self.order.len();
        for u in self.units(l.addr, freed.size) {
            self.freed_by[u] = (stream, n);
        }
        self.freed.push(l.addr);
        Ok(())
    }

    fn refused(&mut self, addr: usize) -> Result<(), TestCaseError> {
        let before = self.pool.stats();
        prop_assert!(self.pool.free(addr, 1).is_err());
        let after = self.pool.stats();
        prop_assert_eq!(
            after,
            ActivationStats {
                refused_frees: before.refused_frees + 1,
                ..before
            }
        );
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Alloc { bytes, stream } => self.alloc(bytes, stream)?,
            Op::Free { pick, stream } => self.free(pick, stream)?,
            Op::FreeForeign => self.refused(0x10)?,
            Op::FreeTwice { pick } => {
                let live: Vec<usize> = self.live.iter().map(|l| l.addr).collect();
                if let Some(&addr) = self
                    .freed
                    .get(pick % self.freed.len().max(1))
                    .filter(|a| !live.contains(a))
                {
                    self.refused(addr)?;
                }
            }
            Op::FreeInterior { pick } => {
                if let Some(l) = self.live.get(pick % self.live.len().max(1)).copied() {
                    self.refused(l.addr + 1)?;
                    if l.requested > ALIGN {
                        self.refused(l.addr + ALIGN as usize)?;
                    }
                }
            }
            Op::FailNextOrder => self.order.fail_next(1),
        }
        self.pool
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let s = self.pool.stats();
        prop_assert_eq!(s.free_bytes + s.allocated, CAP, "free + live == capacity");
        prop_assert_eq!(s.live, self.live.len() as u64);
        Ok(())
    }

    /// Frees everything on `stream`, then checks the whole region can be
    /// had again and returns to one block.
    fn drain(&mut self, stream: u64) -> Result<(), TestCaseError> {
        for l in self.live.clone() {
            self.check_marker(&l)?;
        }
        while !self.live.is_empty() {
            self.free(0, stream)?;
        }
        self.order.fail_next(0);
        let whole = self.pool.allocate(CAP, 99).unwrap();
        prop_assert_eq!(whole, self.pool.base());
        self.pool.free(whole, 99).unwrap();
        let s = self.pool.stats();
        prop_assert_eq!((s.free_blocks, s.largest_free, s.allocated), (1, CAP, 0));
        self.pool
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Three streams: no overlap, the accounting, the stream rule, refused
    /// frees, and the whole region back at the end.
    #[test]
    fn three_streams_keep_every_rule(ops in prop::collection::vec(op(3), 1..60)) {
        let mut m = Model::new();
        for op in &ops {
            m.step(op)?;
        }
        m.drain(1)?;
    }

    /// One stream: freeing everything coalesces to one block at once, and
    /// no order is ever needed.
    #[test]
    fn one_stream_coalesces_back_to_one_block(ops in prop::collection::vec(op(1), 1..60)) {
        let mut m = Model::new();
        for op in &ops {
            m.step(op)?;
        }
        while !m.live.is_empty() {
            m.free(0, 1)?;
        }
        let s = m.pool.stats();
        prop_assert_eq!((s.free_blocks, s.largest_free), (1, CAP));
        prop_assert!(m.order.is_empty(), "one stream never orders: {:?}", m.order.calls());
        prop_assert_eq!(s.cross_stream_reuses, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Production mode: allocations the region cannot hold come from the
    /// backend, are accounted to the byte, counted as steady-state while
    /// serving, and released by their free.
    #[test]
    fn production_falls_back_and_accounts(
        ops in prop::collection::vec((1u64..=24 * ALIGN, any::<bool>(), any::<usize>()), 1..40),
    ) {
        let fb = FakeBackend::new(FakeConfig {
            capacity: 8 << 20,
            mode: PhaseMode::Production,
            ..FakeConfig::default()
        })
        .unwrap();
        let pool = ActivationPool::new(
            &fb,
            &ActivationConfig::new(CAP),
            Arc::new(FakeStreamOrder::new()),
        )
        .unwrap();
        prop_assert!(!pool.is_strict());
        fb.begin_planning().unwrap();
        fb.begin_serving().unwrap();
        let mut live: Vec<(usize, u64)> = Vec::new();
        let mut fallback_bytes = 0u64;
        let mut fallbacks = 0u64;
        for (bytes, free, pick) in ops {
            if free && !live.is_empty() {
                let (addr, size) = live.swap_remove(pick % live.len());
                let freed = pool.free(addr, 1).unwrap();
                prop_assert_eq!(freed.fallback, !pool.contains(addr));
                if freed.fallback {
                    fallback_bytes -= size;
                }
            } else {
                let addr = pool.allocate(bytes, 1).unwrap();
                let size = bytes.div_ceil(ALIGN) * ALIGN;
                if !pool.contains(addr) {
                    fallback_bytes += size;
                    fallbacks += 1;
                }
                live.push((addr, size));
            }
            let s = pool.stats();
            prop_assert_eq!(s.fallback_bytes, fallback_bytes);
            prop_assert_eq!(s.fallbacks_total, fallbacks);
            let tag = fb.stats().tags[&Tag::Activations];
            prop_assert_eq!(tag.live, CAP + fallback_bytes);
            let steady = fb.stats().steady_state_allocations_total.get(&Tag::Activations).copied();
            prop_assert_eq!(steady.unwrap_or(0), fallbacks);
            pool.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        for (addr, _) in live {
            pool.free(addr, 1).unwrap();
        }
        prop_assert_eq!(fb.stats().tags[&Tag::Activations].live, CAP);
        prop_assert_eq!(pool.stats().fallback_live, 0);
    }
}
