//! Per-tag accounting and the allocation journal.
//!
//! Every byte a backend hands out is counted here, by tag: address space
//! reserved, physical memory committed, bytes live in callers' hands, their
//! peak, and how many acquisitions and releases there were. The ledger also
//! keeps the two running totals V1 is stated over — Σ acquired and
//! Σ released — so conservation is checkable after every operation.

use std::collections::BTreeMap;

use crate::phase::{Phase, PhaseMode};
use crate::tag::Tag;

/// Counters for one tag.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Address space reserved (a plain region reserves what it commits).
    pub reserved: u64,
    /// Physical memory committed.
    pub committed: u64,
    /// Bytes held by live regions.
    pub live: u64,
    /// The largest `live` has been.
    pub peak: u64,
    /// Successful acquisitions.
    pub acquisitions: u64,
    /// Releases.
    pub releases: u64,
}

/// One journal operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JournalOp {
    /// A region was acquired; `bytes` is what it committed.
    Acquire,
    /// A region was released; `bytes` is what it had committed.
    Release,
    /// A growable region committed `bytes` more.
    Commit,
    /// A growable region decommitted `bytes`.
    Decommit,
}

impl JournalOp {
    /// The operation's name in Python and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            JournalOp::Acquire => "acquire",
            JournalOp::Release => "release",
            JournalOp::Commit => "commit",
            JournalOp::Decommit => "decommit",
        }
    }

    /// +1 for operations that add live bytes, -1 for those that remove them.
    pub const fn sign(self) -> i64 {
        match self {
            JournalOp::Acquire | JournalOp::Commit => 1,
            JournalOp::Release | JournalOp::Decommit => -1,
        }
    }
}

/// One journal record: `(seq, phase, tag, bytes, op)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntry {
    /// Position in the journal, from 0.
    pub seq: u64,
    /// The phase when it happened.
    pub phase: Phase,
    /// The region's tag.
    pub tag: Tag,
    /// Bytes moved by the operation.
    pub bytes: u64,
    /// What happened.
    pub op: JournalOp,
}

/// A snapshot of a backend's accounting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendStats {
    /// The phase now.
    pub phase: Phase,
    /// Strict or production.
    pub mode: PhaseMode,
    /// The budget cap.
    pub budget: u64,
    /// The device's capacity.
    pub capacity: u64,
    /// Totals over every tag.
    pub total: TagStats,
    /// Σ bytes ever acquired or committed.
    pub acquired_bytes_total: u64,
    /// Σ bytes ever released or decommitted.
    pub released_bytes_total: u64,
    /// Per tag, only tags that have seen any traffic.
    pub tags: BTreeMap<Tag, TagStats>,
    /// Acquisitions made while serving, per tag (production mode).
    pub steady_state_allocations_total: BTreeMap<Tag, u64>,
}

/// The counters themselves. Owned by a backend, behind its lock.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    tags: [TagStats; Tag::ALL.len()],
    peak_total: u64,
    acquired_total: u64,
    released_total: u64,
}

impl Ledger {
    /// Bytes live over every tag.
    pub fn live(&self) -> u64 {
        self.acquired_total - self.released_total
    }

    /// Bytes committed over every tag.
    pub fn committed(&self) -> u64 {
        self.tags.iter().map(|t| t.committed).sum()
    }

    /// Counters for one tag.
    pub fn tag(&self, tag: Tag) -> &TagStats {
        &self.tags[tag.index()]
    }

    /// Records an acquisition that reserved `reserved` and committed `committed`.
    pub fn on_acquire(&mut self, tag: Tag, reserved: u64, committed: u64) {
        let t = &mut self.tags[tag.index()];
        t.reserved += reserved;
        t.acquisitions += 1;
        self.add_live(tag, committed);
    }

    /// Records a release of a region that reserved `reserved` and had
    /// `committed` committed.
    pub fn on_release(&mut self, tag: Tag, reserved: u64, committed: u64) {
        let t = &mut self.tags[tag.index()];
        t.reserved -= reserved;
        t.releases += 1;
        self.sub_live(tag, committed);
    }

    /// Records `bytes` more committed to a live growable region.
    pub fn on_commit(&mut self, tag: Tag, bytes: u64) {
        self.add_live(tag, bytes);
    }

    /// Records `bytes` decommitted from a live growable region.
    pub fn on_decommit(&mut self, tag: Tag, bytes: u64) {
        self.sub_live(tag, bytes);
    }

    fn add_live(&mut self, tag: Tag, bytes: u64) {
        let t = &mut self.tags[tag.index()];
        t.committed += bytes;
        t.live += bytes;
        t.peak = t.peak.max(t.live);
        self.acquired_total += bytes;
        self.peak_total = self.peak_total.max(self.live());
    }

    fn sub_live(&mut self, tag: Tag, bytes: u64) {
        let t = &mut self.tags[tag.index()];
        t.committed -= bytes;
        t.live -= bytes;
        self.released_total += bytes;
    }

    /// Builds the public snapshot.
    pub fn snapshot(
        &self,
        phase: Phase,
        mode: PhaseMode,
        budget: u64,
        capacity: u64,
        steady_state: impl Fn(Tag) -> u64,
    ) -> BackendStats {
        let mut total = TagStats::default();
        let mut tags = BTreeMap::new();
        for tag in Tag::ALL {
            let t = self.tag(tag);
            total.reserved += t.reserved;
            total.committed += t.committed;
            total.live += t.live;
            total.acquisitions += t.acquisitions;
            total.releases += t.releases;
            if *t != TagStats::default() {
                tags.insert(tag, *t);
            }
        }
        total.peak = self.peak_total;
        let steady_state_allocations_total = Tag::ALL
            .iter()
            .map(|&tag| (tag, steady_state(tag)))
            .filter(|&(_, n)| n > 0)
            .collect();
        BackendStats {
            phase,
            mode,
            budget,
            capacity,
            total,
            acquired_bytes_total: self.acquired_total,
            released_bytes_total: self.released_total,
            tags,
            steady_state_allocations_total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_is_acquired_minus_released_and_peak_holds() {
        let mut l = Ledger::default();
        l.on_acquire(Tag::Weights, 100, 100);
        l.on_acquire(Tag::KvCache, 1000, 10);
        l.on_commit(Tag::KvCache, 30);
        assert_eq!(l.live(), 140);
        l.on_decommit(Tag::KvCache, 20);
        l.on_release(Tag::Weights, 100, 100);
        assert_eq!(l.live(), 20);
        let s = l.snapshot(Phase::Loading, PhaseMode::Strict, 1 << 20, 1 << 20, |_| 0);
        assert_eq!(s.total.peak, 140);
        assert_eq!(s.tags[&Tag::KvCache].peak, 40);
        assert_eq!(s.tags[&Tag::KvCache].reserved, 1000);
        assert_eq!(
            s.acquired_bytes_total - s.released_bytes_total,
            s.total.live
        );
    }
}
