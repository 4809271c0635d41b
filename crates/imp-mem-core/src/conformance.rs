//! The [`MemorySource`] conformance suite: one set of contract checks, run
//! over every source (RMM's `mr_ref_test` is the model).
//!
//! A crate that implements a source describes how to open a fresh one in a
//! [`Subject`] (the backend over it, the source itself and a [`Probe`] into
//! its device) and expands [`memory_source_conformance!`](crate::memory_source_conformance)
//! with that opener: every check below becomes one `#[test]` of that crate,
//! and [`check_sequence`] a proptest over generated sequences of operations.
//! The core runs it over [`FakeBackend`](crate::FakeBackend)'s source
//! (`tests/source_conformance.rs`); `imp-mem-cuda` over the VMM source on its
//! simulated driver.
//!
//! What every source must show, through the real [`Backend`]:
//!
//! * acquire, commit, decommit and release keep the books: live, committed,
//!   reserved, the acquisition and release counts, the byte totals and the
//!   journal say what was done, and everything returns to the device;
//! * alignment is honoured, and live allocations do not overlap;
//! * growable regions commit in whole granules, and their base never moves
//!   (a source with none refuses them as [`MemError::InvalidArgument`], and
//!   its checks size their requests in units of [`FIXED_UNIT`]);
//! * a request past the budget, or past what the device has left, is refused
//!   as [`MemError::OutOfMemory`] (saying which refused) and changes nothing;
//! * bad input is [`MemError::InvalidArgument`] before the source is asked;
//! * a call outside the source contract is refused as
//!   [`SourceError::Invariant`], never a panic.
//!
//! Built only with the `conformance` feature.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test support: a failed unwrap is a failed test

use std::sync::Arc;

use crate::backend::{Backend, Region, MAX_ALIGNMENT, MAX_REQUEST_BYTES};
use crate::error::MemError;
use crate::phase::Phase;
use crate::source::{MemorySource, SourceError};
use crate::tag::Tag;
use crate::units::round_up;

mod sequence;

pub use sequence::{check_sequence, op, Op};

/// What the suite can see of a source's device, beyond the backend.
pub trait Probe {
    /// Physical bytes the source holds on its device now (mapped memory and
    /// anything it keeps for reuse).
    fn physical(&self) -> u64;
    /// Simulates something outside this source (another process) taking
    /// the device's memory until only `free` bytes are left beyond what the
    /// source holds now; `None` gives it all back.
    fn leave_free(&self, free: Option<u64>);
    /// Returns whatever the source keeps for reuse (a handle cache) to the
    /// device. The default: nothing is kept.
    fn settle(&self) {}
}

/// A fresh source under test, in `LOADING`, strict mode, journal on.
pub struct Subject {
    /// The backend over the source.
    pub backend: Backend,
    /// The source itself, for the checks that call it directly.
    pub source: Arc<dyn MemorySource>,
    /// Its device.
    pub probe: Box<dyn Probe>,
}

/// Opens a fresh subject with this budget (`None`: the source's capacity).
pub type Open<'a> = &'a dyn Fn(Option<u64>) -> Subject;

fn open(open: Open<'_>, budget: Option<u64>) -> Subject {
    let s = open(budget);
    s.backend.enable_journal();
    assert_eq!(
        s.backend.phase(),
        Phase::Loading,
        "a fresh source is in LOADING"
    );
    assert_eq!(s.backend.live(), 0);
    assert_eq!(s.probe.physical(), 0, "a fresh source holds nothing");
    s
}

/// The unit the checks size their requests in on a source with no growable
/// regions (whose granularity is 1): large enough that what a device
/// rounds an allocation to does not decide a refusal.
pub const FIXED_UNIT: u64 = 2 << 20;

fn granule(s: &Subject) -> u64 {
    let info = s.backend.info();
    if info.growable {
        info.granularity.max(1) as u64
    } else {
        (info.granularity as u64).max(FIXED_UNIT)
    }
}

fn growable(s: &Subject) -> bool {
    s.backend.info().growable
}

/// A source with no growable regions refuses one as `InvalidArgument`,
/// before anything is acquired.
fn refuses_growth(s: &Subject, reserve: u64, initial: u64) {
    let before = s.backend.stats().total;
    match s.backend.acquire_growable(reserve, initial, Tag::KvCache) {
        Err(MemError::InvalidArgument(_)) => {}
        other => {
            panic!("a source with no growable regions: expected InvalidArgument, got {other:?}")
        }
    }
    assert_eq!(
        s.backend.stats().total,
        before,
        "a refused growable changed the books"
    );
}

/// The journal replayed: bytes acquired or committed less bytes released
/// or decommitted (it must equal what is live).
pub fn replay(backend: &Backend) -> i128 {
    backend
        .journal()
        .unwrap_or_default()
        .iter()
        .map(|e| e.op.sign() as i128 * e.bytes as i128)
        .sum()
}

/// The books agree with each other and with the device.
fn assert_books(s: &Subject) {
    s.backend.check_invariants().unwrap();
    let stats = s.backend.stats();
    assert_eq!(
        replay(&s.backend),
        stats.total.live as i128,
        "journal vs live"
    );
    assert_eq!(
        stats.acquired_bytes_total - stats.released_bytes_total,
        stats.total.live
    );
    assert!(
        s.probe.physical() >= stats.total.committed,
        "the device holds {} B, the backend counts {} B committed",
        s.probe.physical(),
        stats.total.committed
    );
}

/// Drops everything and checks the device got every byte back.
fn assert_returns_everything(s: Subject, regions: Vec<Region>) {
    drop(regions);
    assert_eq!(s.backend.live(), 0);
    assert_books(&s);
    let stats = s.backend.stats();
    assert_eq!(stats.total.acquisitions, stats.total.releases);
    assert_eq!(stats.total.committed, 0);
    assert_eq!(stats.total.reserved, 0);
    s.probe.settle();
    assert_eq!(
        s.probe.physical(),
        0,
        "released memory went back to the device"
    );
}

fn overlaps(regions: &[&Region]) -> bool {
    let mut spans: Vec<(usize, usize)> = regions
        .iter()
        .map(|r| (r.base(), r.base() + r.reserved().max(1)))
        .collect();
    spans.sort_unstable();
    spans.windows(2).any(|w| w[0].1 > w[1].0)
}

/// Acquisitions and releases conserve bytes; the stats count each one.
pub fn acquire_release_conserves_bytes(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s);
    let sizes = [1, 255, 256, 4096, g + 7, 3 * g];
    let mut regions: Vec<Region> = sizes
        .iter()
        .map(|&n| s.backend.acquire(n, 256, Tag::Workspace).unwrap())
        .collect();
    let total: u64 = sizes.iter().sum();
    for (r, &n) in regions.iter().zip(&sizes) {
        assert_eq!(r.len() as u64, n, "a fixed region is as long as asked");
        assert!(!r.is_growable());
    }
    assert!(!overlaps(&regions.iter().collect::<Vec<_>>()));
    assert_eq!(s.backend.live(), total);
    let stats = s.backend.stats();
    assert_eq!(stats.total.committed, total);
    assert_eq!(stats.total.reserved, total);
    assert_eq!(stats.tags[&Tag::Workspace].live, total);
    assert_books(&s);

    // Release every other one, through the backend and by drop.
    let mut kept = Vec::new();
    for (i, r) in regions.drain(..).enumerate() {
        if i % 2 == 0 {
            s.backend.release(r).unwrap();
        } else {
            kept.push(r);
        }
    }
    let odd: u64 = sizes.iter().skip(1).step_by(2).sum();
    assert_eq!(s.backend.live(), odd);
    assert_books(&s);
    drop(kept);
    let stats = s.backend.stats();
    assert_eq!(stats.total.acquisitions, sizes.len() as u64);
    assert_eq!(stats.total.releases, sizes.len() as u64);
    assert_eq!(stats.acquired_bytes_total, total);
    assert_eq!(stats.released_bytes_total, total);
    assert_eq!(stats.total.peak, total);
    assert_returns_everything(s, Vec::new());
}

/// Every alignment up to a large page is honoured, by the backend and by the
/// source's own `allocate` and `reserve`.
pub fn alignment_is_honoured(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s) as usize;
    let mut regions = Vec::new();
    for align in [1u64, 256, 4096, 1 << 16, 2 << 20] {
        for i in 0..3 {
            let r = s.backend.acquire(1000 + i, align, Tag::Workspace).unwrap();
            assert_eq!(r.base() as u64 % align, 0, "align {align}");
            regions.push(r);
        }
    }
    if growable(&s) {
        let grow = s
            .backend
            .acquire_growable(4 * g as u64, 0, Tag::KvCache)
            .unwrap();
        assert_eq!(grow.base() % grow.align(), 0);
        assert!(
            grow.align() >= g,
            "a growable base is aligned to the granule"
        );
        regions.push(grow);
    }
    assert!(!overlaps(&regions.iter().collect::<Vec<_>>()));
    assert_books(&s);

    // The source's side of the contract (rule 1 and 2 of its `# Safety`).
    let addr = s.source.allocate(4096, 1 << 16).unwrap();
    assert_eq!(addr % (1 << 16), 0);
    if growable(&s) {
        let base = s.source.reserve(2 * g, g.next_power_of_two()).unwrap();
        assert_eq!(base % g.next_power_of_two(), 0);
        // SAFETY: made just above with these sizes, nothing uses it, and
        // nothing of it is committed.
        unsafe { s.source.unreserve(base, 2 * g, 0) };
    } else {
        assert_eq!(
            s.source.reserve(2 * g, g.next_power_of_two()),
            Err(SourceError::NotGrowable)
        );
    }
    // SAFETY: made just above with these sizes, and nothing uses it.
    unsafe { s.source.free(addr, 4096, 1 << 16) };
    assert_returns_everything(s, regions);
}

/// A request past the budget is `OutOfMemory` from the budget (not the
/// device) and changes nothing: fixed, growable, and growth.
pub fn budget_refusal_is_typed_and_changes_nothing(o: Open<'_>) {
    let probe_budget = {
        let s = open(o, None);
        8 * granule(&s)
    };
    let s = open(o, Some(probe_budget));
    let g = granule(&s);
    assert_eq!(s.backend.budget(), 8 * g);
    let held = s.backend.acquire(6 * g, 256, Tag::Weights).unwrap();
    let before = s.backend.stats().total;

    let refused = |err: MemError, asked: u64| match err {
        MemError::OutOfMemory(report) => {
            assert!(!report.device_refused, "the budget refused, not the device");
            assert_eq!(report.asked, asked);
            assert_eq!(report.budget, 8 * g);
            assert!(report.live + report.asked > report.budget);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    };
    refused(
        s.backend.acquire(3 * g, 256, Tag::KvCache).unwrap_err(),
        3 * g,
    );
    if growable(&s) {
        refused(
            s.backend
                .acquire_growable(8 * g, 3 * g, Tag::KvCache)
                .unwrap_err(),
            3 * g,
        );
        let mut grow = s.backend.acquire_growable(8 * g, g, Tag::KvCache).unwrap();
        let base = grow.base();
        let mid = (s.backend.stats(), s.probe.physical());
        refused(grow.commit(4 * g).unwrap_err(), 3 * g);
        assert_eq!(grow.len() as u64, g, "a refused commit leaves the length");
        assert_eq!(grow.base(), base);
        assert_eq!(s.backend.stats().total, mid.0.total);
        assert_eq!(s.probe.physical(), mid.1);
        // Exactly up to the budget is allowed.
        grow.commit(2 * g).unwrap();
        assert_eq!(s.backend.stats().total.committed, 8 * g);
        grow.decommit(0).unwrap();
        drop(grow);
    } else {
        // Exactly up to the budget is allowed.
        let rest = s.backend.acquire(2 * g, 256, Tag::KvCache).unwrap();
        assert_eq!(s.backend.stats().total.committed, 8 * g);
        drop(rest);
    }
    s.probe.settle();
    let after = s.backend.stats().total;
    assert_eq!(after.live, before.live);
    assert_eq!(after.committed, before.committed);
    assert_eq!(s.backend.live(), 6 * g);
    assert_books(&s);
    assert_returns_everything(s, vec![held]);
}

/// When the device itself has no room (something outside took it), the
/// refusal is `OutOfMemory` with `device_refused`, and changes nothing.
pub fn device_refusal_is_typed_and_changes_nothing(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s);
    let held = s.backend.acquire(2 * g, 256, Tag::Weights).unwrap();
    let mut grow =
        growable(&s).then(|| s.backend.acquire_growable(8 * g, g, Tag::KvCache).unwrap());
    let base = grow.as_ref().map(Region::base);
    // Leave the device half a granule beyond what is held now.
    s.probe.leave_free(Some(g / 2));
    let before = (s.backend.stats().total, s.probe.physical());
    let device_refused = |err: MemError| match err {
        MemError::OutOfMemory(report) => {
            assert!(report.device_refused, "the device refused, not the budget");
            assert!(report.live + report.asked <= report.budget);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    };
    device_refused(s.backend.acquire(2 * g, 256, Tag::KvCache).unwrap_err());
    if let Some(grow) = grow.as_mut() {
        device_refused(
            s.backend
                .acquire_growable(4 * g, 2 * g, Tag::KvCache)
                .unwrap_err(),
        );
        device_refused(grow.commit(3 * g).unwrap_err());
        assert_eq!(Some(grow.base()), base);
        assert_eq!(grow.len() as u64, g);
    }
    assert_eq!(s.backend.stats().total, before.0);
    assert_eq!(s.probe.physical(), before.1);
    assert_books(&s);
    // And once the device has room again, the same request succeeds.
    s.probe.leave_free(None);
    let again = match grow {
        Some(mut grow) => {
            grow.commit(3 * g).unwrap();
            assert_eq!(Some(grow.base()), base);
            grow
        }
        None => s.backend.acquire(2 * g, 256, Tag::KvCache).unwrap(),
    };
    assert_books(&s);
    assert_returns_everything(s, vec![held, again]);
}

/// Bad input is `InvalidArgument`, decided before the source is asked.
pub fn bad_input_is_invalid_argument(o: Open<'_>) {
    let s = open(o, None);
    let other = open(o, None);
    let g = granule(&s);
    let invalid = |r: Result<Region, MemError>, what: &str| match r {
        Err(MemError::InvalidArgument(_)) => {}
        got => panic!("{what}: expected InvalidArgument, got {got:?}"),
    };
    invalid(s.backend.acquire(0, 256, Tag::Workspace), "size 0");
    invalid(
        s.backend
            .acquire(MAX_REQUEST_BYTES + 1, 256, Tag::Workspace),
        "over 1 PiB",
    );
    for align in [0, 6, 3 << 10, MAX_ALIGNMENT << 1] {
        invalid(s.backend.acquire(64, align, Tag::Workspace), "alignment");
    }
    invalid(s.backend.acquire_growable(0, 0, Tag::KvCache), "reserve 0");
    invalid(
        s.backend.acquire_growable(2 * g, 3 * g, Tag::KvCache),
        "initial past the reservation",
    );
    assert_eq!(s.probe.physical(), 0, "nothing reached the device");
    assert_eq!(s.backend.stats().total.acquisitions, 0);

    let grow = if growable(&s) {
        let mut grow = s.backend.acquire_growable(4 * g, g, Tag::KvCache).unwrap();
        assert!(matches!(
            grow.commit(4 * g + 1),
            Err(MemError::InvalidArgument(_))
        ));
        assert_eq!(grow.len() as u64, g);
        Some(grow)
    } else {
        refuses_growth(&s, 4 * g, g);
        None
    };
    let held = grow.as_ref().map_or(0, |r| r.len() as u64);
    let mut fixed = s.backend.acquire(4096, 256, Tag::Workspace).unwrap();
    assert!(matches!(fixed.commit(g), Err(MemError::InvalidArgument(_))));
    assert!(matches!(
        fixed.decommit(0),
        Err(MemError::InvalidArgument(_))
    ));
    assert_eq!(fixed.len(), 4096);
    // A region released to the wrong backend is refused, and still goes
    // back to its own.
    assert!(matches!(
        other.backend.release(fixed),
        Err(MemError::InvalidArgument(_))
    ));
    assert_eq!(s.backend.live(), held);
    assert_eq!(other.backend.live(), 0);
    assert_books(&s);
    assert_returns_everything(other, Vec::new());
    assert_returns_everything(s, grow.into_iter().collect());
}

/// Growth commits whole granules, a shrink keeps whole granules, the
/// reservation is rounded to the granule, and the base never moves.
pub fn growth_rounds_to_granules_and_keeps_the_base(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s);
    if !growable(&s) {
        refuses_growth(&s, 10 * g - 1, g / 2 + 1);
        refuses_growth(&s, 4 * g, 0);
        return assert_returns_everything(s, Vec::new());
    }
    let mut r = s
        .backend
        .acquire_growable(10 * g - 1, g / 2 + 1, Tag::KvCache)
        .unwrap();
    let base = r.base();
    assert!(r.is_growable());
    assert_eq!(r.reserved() as u64, 10 * g, "the reservation rounds up");
    assert_eq!(r.len() as u64, g, "the initial commit rounds up");
    let reserved = r.reserved();
    let expect = |target: u64| round_up(target as usize, g as usize).unwrap().min(reserved);
    for target in [3 * g + 1, 5 * g, 2 * g, 2 * g - 1, 10 * g, 0, 7 * g - 3, g] {
        let before = r.len();
        let want = expect(target);
        if (target as usize) > before {
            r.commit(target).unwrap();
            assert_eq!(r.len(), want.max(before), "commit({target})");
        } else {
            r.decommit(target).unwrap();
            assert_eq!(r.len(), want.min(before), "decommit({target})");
        }
        assert_eq!(r.base(), base, "V9: the base moved");
        assert_eq!(r.len() as u64 % g, 0);
        assert_eq!(s.backend.live(), r.len() as u64);
        assert_eq!(s.backend.stats().total.committed, r.len() as u64);
        assert_eq!(s.backend.stats().total.reserved, 10 * g);
        assert_books(&s);
    }
    // A commit below the length and a decommit above it are no-ops.
    let len = r.len() as u64;
    let ops = s.backend.journal().unwrap().len();
    r.commit(len / 2).unwrap();
    r.decommit(len + g).unwrap();
    assert_eq!(r.len() as u64, len);
    assert_eq!(
        s.backend.journal().unwrap().len(),
        ops,
        "no-ops are not journalled"
    );
    // A region that starts empty grows from nothing.
    let mut empty = s.backend.acquire_growable(4 * g, 0, Tag::KvCache).unwrap();
    assert!(empty.is_empty());
    let empty_base = empty.base();
    empty.commit(1).unwrap();
    assert_eq!(empty.len() as u64, g);
    assert_eq!(empty.base(), empty_base);
    assert!(!overlaps(&[&r, &empty]));
    assert_returns_everything(s, vec![r, empty]);
}

/// A call outside the source contract (a base that moved, a commit that
/// does not extend the committed prefix, a decommit that is not the tail)
/// is refused as `SourceError::Invariant` and changes nothing.
pub fn out_of_contract_calls_are_invariant_errors(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s) as usize;
    if !growable(&s) {
        // No reservation to get wrong: growth itself is refused, typed.
        let r = s.backend.acquire(2 * g as u64, 256, Tag::KvCache).unwrap();
        assert_eq!(
            s.source.commit(r.base(), 0, g),
            Err(SourceError::NotGrowable)
        );
        // SAFETY: refused before it touches anything (the source has no
        // growable regions); the region is not used meanwhile.
        let refused = unsafe { s.source.decommit(r.base(), 0, g) };
        assert_eq!(refused, Err(SourceError::NotGrowable));
        assert_books(&s);
        return assert_returns_everything(s, vec![r]);
    }
    let r = s
        .backend
        .acquire_growable(8 * g as u64, 2 * g as u64, Tag::KvCache)
        .unwrap();
    let base = r.base();
    let physical = s.probe.physical();
    let invariant = |res: Result<(), SourceError>, what: &str| match res {
        Err(SourceError::Invariant(_)) => {}
        other => panic!("{what}: expected Invariant, got {other:?}"),
    };
    invariant(
        s.source.commit(base + 1, 2 * g, 3 * g),
        "commit at a moved base",
    );
    invariant(
        s.source.commit(base, 0, g),
        "commit below the committed prefix",
    );
    invariant(s.source.commit(base, 3 * g, 4 * g), "commit leaving a gap");
    invariant(
        s.source.commit(base, 2 * g, 9 * g),
        "commit past the reservation",
    );
    // SAFETY: each call is outside the contract and refused before it
    // touches anything; the region is not used meanwhile.
    unsafe {
        invariant(
            s.source.decommit(base + 1, g, 2 * g),
            "decommit at a moved base",
        );
        invariant(
            s.source.decommit(base, 0, g),
            "decommit that is not the tail",
        );
        invariant(
            s.source.decommit(base, 0, 3 * g),
            "decommit past the committed",
        );
    }
    assert_eq!(
        s.probe.physical(),
        physical,
        "a refused call changed the device"
    );
    assert_eq!(r.len(), 2 * g);
    // The region still works afterwards.
    let mut r = r;
    r.commit(3 * g as u64).unwrap();
    r.decommit(g as u64).unwrap();
    assert_eq!(r.base(), base);
    assert_books(&s);
    assert_returns_everything(s, vec![r]);
}

/// A batch of host copies (`copy_to_host_many` / `copy_from_host_many`,
/// through [`Region`]'s checked batches) moves exactly the bytes the same
/// copies one by one do, in order (a later copy to the same bytes wins),
/// and a batch with a range past the committed part is refused before it
/// copies anything. A source without host copies refuses the batch as it
/// refuses the single copy.
pub fn batched_copies_match_single_copies(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s) as usize;
    let mut r = s.backend.acquire(g as u64, 256, Tag::KvCache).unwrap();
    let piece = (g / 16).max(1);
    let zeros = vec![0u8; g];
    if let Err(single) = r.copy_from_host(0, &zeros) {
        let batch = r.copy_from_host_many(&[(0, &zeros[..piece])]).unwrap_err();
        assert_eq!(
            std::mem::discriminant(&batch),
            std::mem::discriminant(&single),
            "a source without host copies refuses a batch as a copy: {batch} / {single}"
        );
        return assert_returns_everything(s, vec![r]);
    }
    let fill = |seed: u8| -> Vec<u8> {
        (0..piece)
            .map(|k| seed.wrapping_mul(31).wrapping_add(k as u8))
            .collect()
    };
    let (a, b, c, d) = (fill(1), fill(2), fill(3), fill(4));
    // The model: the region as the copies one by one leave it.
    let mut model = zeros.clone();
    let writes: [(usize, &[u8]); 5] = [
        (3 * piece, &a),
        (0, &b),
        (7 * piece + 5, &c),
        (3 * piece, &d),
        (g - piece, &a),
    ];
    for &(at, bytes) in &writes {
        model[at..at + bytes.len()].copy_from_slice(bytes);
    }
    r.copy_from_host_many(&writes).unwrap();
    assert_eq!(r.read_to_vec(0, g).unwrap(), model, "a batch write");

    let mut pieces = vec![vec![0u8; piece]; 4];
    let offsets = [g - piece, 0, 3 * piece, 7 * piece + 5];
    let mut reads: Vec<(usize, &mut [u8])> = offsets
        .iter()
        .zip(pieces.iter_mut())
        .map(|(&at, buf)| (at, buf.as_mut_slice()))
        .collect();
    r.copy_to_host_many(&mut reads).unwrap();
    for (at, got) in offsets.iter().zip(&pieces) {
        assert_eq!(
            got.as_slice(),
            &model[*at..at + piece],
            "a batch read at {at}"
        );
    }

    // One range past the committed part: refused, nothing copied.
    let err = r
        .copy_from_host_many(&[(0, &c[..]), (g - piece + 1, &c[..])])
        .unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
    let mut untouched = vec![0u8; piece];
    let err = r
        .copy_to_host_many(&mut [(0, &mut untouched[..]), (g, &mut [0u8; 1][..])])
        .unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
    assert!(untouched.iter().all(|&x| x == 0), "a refused read copied");
    assert_eq!(r.read_to_vec(0, g).unwrap(), model, "a refused batch wrote");
    r.copy_from_host_many(&[]).unwrap();
    r.copy_to_host_many(&mut []).unwrap();
    assert_books(&s);
    assert_returns_everything(s, vec![r]);
}

/// The phase guard holds whatever the source: acquisitions while serving
/// are refused (strict), the bracketed re-entry admits them.
pub fn the_phase_guard_holds(o: Open<'_>) {
    let s = open(o, None);
    let g = granule(&s);
    let keep = s.backend.acquire(g, 256, Tag::Weights).unwrap();
    s.backend.begin_planning().unwrap();
    let plan = s.backend.acquire(g, 256, Tag::Workspace).unwrap();
    let mut grow =
        growable(&s).then(|| s.backend.acquire_growable(4 * g, g, Tag::KvCache).unwrap());
    s.backend.begin_serving().unwrap();
    let physical = s.probe.physical();
    assert!(matches!(
        s.backend.acquire(g, 256, Tag::Scratch),
        Err(MemError::PhaseViolation { .. })
    ));
    if grow.is_some() {
        assert!(matches!(
            s.backend.acquire_growable(4 * g, 0, Tag::KvCache),
            Err(MemError::PhaseViolation { .. })
        ));
    }
    assert_eq!(
        s.probe.physical(),
        physical,
        "a refused acquisition reached the device"
    );
    // Growing a region acquired before serving is not an acquisition.
    if let Some(grow) = grow.as_mut() {
        grow.commit(2 * g).unwrap();
    }
    let swap = {
        let _replan = s.backend.replanning("conformance").unwrap();
        s.backend.acquire(g, 256, Tag::Weights).unwrap()
    };
    assert_eq!(s.backend.phase(), Phase::Serving);
    assert_books(&s);
    let mut regions = vec![keep, plan, swap];
    regions.extend(grow);
    assert_returns_everything(s, regions);
}

/// Expands to the whole suite as tests of the calling crate: one `#[test]`
/// per contract and a proptest of [`check_sequence`] with `$cases` cases.
/// `$open` is an expression of type `fn(Option<u64>) -> Subject` (or a
/// closure of that shape); the caller needs `proptest` as a dev-dependency.
///
/// With `skip = $skip` (a `fn() -> Option<String>`), every test first asks
/// it and, given a reason, prints it and passes without opening anything:
/// the form for a source that needs hardware this machine may lack (the
/// CUDA sources with no driver).
#[macro_export]
macro_rules! memory_source_conformance {
    (@each $open:expr, $skip:expr, $($check:ident),*) => {
        $(
            #[test]
            fn $check() {
                if let Some(why) = $skip() {
                    eprintln!("skipped: {why}");
                    return;
                }
                $crate::conformance::$check(&$open);
            }
        )*
    };
    ($open:expr, cases = $cases:expr, skip = $skip:expr) => {
        $crate::memory_source_conformance!(@each $open, $skip,
            acquire_release_conserves_bytes,
            alignment_is_honoured,
            budget_refusal_is_typed_and_changes_nothing,
            device_refusal_is_typed_and_changes_nothing,
            bad_input_is_invalid_argument,
            growth_rounds_to_granules_and_keeps_the_base,
            out_of_contract_calls_are_invariant_errors,
            the_phase_guard_holds,
            batched_copies_match_single_copies
        );
        #[test]
        fn sequences_keep_the_books() {
            if let Some(why) = $skip() {
                eprintln!("skipped: {why}");
                return;
            }
            let config = ::proptest::prelude::ProptestConfig::with_cases($cases);
            let mut runner = ::proptest::test_runner::TestRunner::new(config);
            let strategy = (
                4u64..40,
                ::proptest::collection::vec($crate::conformance::op(), 1..48),
            );
            let outcome = runner.run(&strategy, |(budget_granules, ops)| {
                $crate::conformance::check_sequence(&$open, budget_granules, ops)
            });
            if let Err(e) = outcome {
                panic!("{e}");
            }
        }
    };
    ($open:expr, cases = $cases:expr) => {
        #[test]
        fn acquire_release_conserves_bytes() {
            $crate::conformance::acquire_release_conserves_bytes(&$open);
        }
        #[test]
        fn alignment_is_honoured() {
            $crate::conformance::alignment_is_honoured(&$open);
        }
        #[test]
        fn budget_refusal_is_typed_and_changes_nothing() {
            $crate::conformance::budget_refusal_is_typed_and_changes_nothing(&$open);
        }
        #[test]
        fn device_refusal_is_typed_and_changes_nothing() {
            $crate::conformance::device_refusal_is_typed_and_changes_nothing(&$open);
        }
        #[test]
        fn bad_input_is_invalid_argument() {
            $crate::conformance::bad_input_is_invalid_argument(&$open);
        }
        #[test]
        fn growth_rounds_to_granules_and_keeps_the_base() {
            $crate::conformance::growth_rounds_to_granules_and_keeps_the_base(&$open);
        }
        #[test]
        fn out_of_contract_calls_are_invariant_errors() {
            $crate::conformance::out_of_contract_calls_are_invariant_errors(&$open);
        }
        #[test]
        fn the_phase_guard_holds() {
            $crate::conformance::the_phase_guard_holds(&$open);
        }
        #[test]
        fn batched_copies_match_single_copies() {
            $crate::conformance::batched_copies_match_single_copies(&$open);
        }
        ::proptest::proptest! {
            #![proptest_config(::proptest::prelude::ProptestConfig::with_cases($cases))]
            #[test]
            fn sequences_keep_the_books(
                budget_granules in 4u64..40,
                ops in ::proptest::collection::vec($crate::conformance::op(), 1..48),
            ) {
                $crate::conformance::check_sequence(&$open, budget_granules, ops)?;
            }
        }
    };
}
