//! T4 — the forward-pass scratch stack (seed A2, A3.3, V6).
//!
//! Algorithm: one backend [`Region`] and a bump offset, like an arena, plus a
//! stack of marks. A forward pass opens a mark at entry; every intermediate
//! takes from the innermost open mark; closing the mark rewinds the offset to
//! where it was when the mark opened. LIFO cannot fragment, and a mark that
//! rewinds when dropped cannot leak (it unwinds on errors and panics too).
//! The high-water mark is exactly the number the planner sizes T4 from.
//!
//! Rules (each enforced once, in [`ScratchCore`]):
//!
//! * a take comes from the innermost open mark; taking from an outer mark
//!   while an inner one is open is refused (its bytes would be rewound by the
//!   inner mark);
//! * marks close in LIFO order (V6). Closing one while a mark opened after it
//!   is still open is a hard error: the call fails, and the stack refuses
//!   every take and mark until [`ScratchStack::reset`]. The offsets stay
//!   coherent meanwhile: the early-closed mark is rewound when the marks
//!   above it close;
//! * `take` fails cleanly (`Capacity`, nothing changed) when the stack is
//!   exhausted.
//!
//! Two façades: [`ScratchStack`] (borrowed: a [`Mark<'s>`](Mark) borrows the
//! stack and a take borrows its mark, so a span cannot outlive its mark, at
//! compile time) and [`SharedScratchStack`] (`Arc` + mutex, handing out
//! [`SharedMark`]s and [`ScratchSpan`] tickets that are checked on every use:
//! a span is valid while its mark is open).

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::arena::{check_take, placement_of};
use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT};
use crate::error::MemError;
use crate::source::Placement;
use crate::span::{MintKey, StableSpan};
use crate::tag::Tag;
use crate::tier::{next_tier_id, Tier};
use crate::units::{align_up, human_bytes};

/// Counters of one scratch stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchStats {
    /// Bytes in use now.
    pub used: usize,
    /// Bytes it can hand out in all.
    pub capacity: usize,
    /// The largest `used` reached since the last [`ScratchStack::reset_high_water`].
    pub high_water: usize,
    /// Marks open now.
    pub open_marks: usize,
    /// Resets so far.
    pub generation: u64,
    /// Out-of-order rewinds seen (V6 violations); nonzero until a reset.
    pub violations: u64,
}

#[derive(Debug, Clone, Copy)]
struct MarkEntry {
    id: u64,
    offset: usize,
    /// Closed out of order; rewound when it becomes the innermost mark.
    closed_early: bool,
}

/// One open mark, as the core knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkToken {
    id: u64,
    depth: usize,
    generation: u64,
}

/// The state and the rules of one scratch stack, shared by both façades.
#[derive(Debug)]
pub struct ScratchCore {
    id: u64,
    region: Region,
    placement: Placement,
    top: usize,
    high_water: usize,
    generation: u64,
    marks: Vec<MarkEntry>,
    next_mark: u64,
    broken: Option<String>,
    violations: u64,
}

impl ScratchCore {
    fn new(region: Region) -> Self {
        Self {
            id: next_tier_id(),
            placement: placement_of(&region),
            region,
            top: 0,
            high_water: 0,
            generation: 0,
            marks: Vec::new(),
            next_mark: 1,
            broken: None,
            violations: 0,
        }
    }

    fn check_usable(&self) -> Result<(), MemError> {
        match &self.broken {
            Some(why) => Err(MemError::invalid(format!(
                "{why}; this scratch stack refuses takes and marks until reset()"
            ))),
            None => Ok(()),
        }
    }

    fn mark(&mut self) -> Result<MarkToken, MemError> {
        self.check_usable()?;
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.push(MarkEntry {
            id,
            offset: self.top,
            closed_early: false,
        });
        Ok(MarkToken {
            id,
            depth: self.marks.len() - 1,
            generation: self.generation,
        })
    }

    fn is_open(&self, token: &MarkToken) -> bool {
        token.generation == self.generation
            && self
                .marks
                .get(token.depth)
                .is_some_and(|m| m.id == token.id && !m.closed_early)
    }

    fn not_open(&self, token: &MarkToken) -> MemError {
        MemError::StaleSpan(format!(
            "scratch mark #{} is closed (rewound, or the stack was reset); its takes are gone — \
             open a new mark",
            token.id
        ))
    }

    fn take(&mut self, token: &MarkToken, bytes: usize, align: usize) -> Result<usize, MemError> {
        check_take(bytes, align)?;
        self.check_usable()?;
        if !self.is_open(token) {
            return Err(self.not_open(token));
        }
        if token.depth + 1 != self.marks.len() {
            return Err(MemError::invalid(format!(
                "take from scratch mark #{} while {} mark(s) opened after it are still open; take \
                 from the innermost mark (its bytes would be rewound with the inner one)",
                token.id,
                self.marks.len() - token.depth - 1
            )));
        }
        let base = self.region.base();
        let capacity = self.region.reserved();
        let start = align_up(base + self.top, align).map(|a| a - base);
        let (start, end) = match start.and_then(|s| s.checked_add(bytes).map(|e| (s, e))) {
            Some((s, e)) if e <= capacity => (s, e),
            _ => {
                return Err(MemError::Capacity(format!(
                    "scratch stack has {} of {} free; asked {} aligned to {align}; plan a larger \
                     T4 (its high-water mark is {})",
                    human_bytes((capacity - self.top) as u64),
                    human_bytes(capacity as u64),
                    human_bytes(bytes as u64),
                    human_bytes(self.high_water as u64)
                )))
            }
        };
        if end > self.region.len() {
            self.region.commit(end as u64)?;
        }
        self.top = end;
        self.high_water = self.high_water.max(end);
        Ok(base + start)
    }

    /// Closes a mark. LIFO: the innermost open mark rewinds (and any marks
    /// below it that were closed early); another open mark is a V6 violation.
    fn rewind(&mut self, token: &MarkToken) -> Result<(), MemError> {
        if !self.is_open(token) {
            return Err(self.not_open(token));
        }
        if token.depth + 1 != self.marks.len() {
            let above = self.marks.len() - token.depth - 1;
            let why = format!(
                "V6: scratch mark #{} was rewound while {above} mark(s) opened after it were still \
                 open; marks must close in LIFO order (innermost first)",
                token.id
            );
            self.marks[token.depth].closed_early = true;
            self.violations += 1;
            self.broken = Some(why.clone());
            return Err(MemError::invalid(why));
        }
        let mut offset = self.top;
        while let Some(last) = self.marks.last() {
            if last.id != token.id && !last.closed_early {
                break;
            }
            offset = last.offset;
            self.marks.pop();
        }
        // SAFETY: `[offset, top)` held only takes of the marks just closed; their
        // spans are refused from now on (and the borrowed API's spans borrowed
        // those marks, which are gone), so no live handle refers to it.
        unsafe { self.region.scrub(offset, self.top - offset) };
        self.top = offset;
        Ok(())
    }

    fn reset(&mut self) {
        // SAFETY: a reset closes every mark; their spans are refused from now
        // on (the borrowed API's reset needs `&mut self`, so none is alive).
        unsafe { self.region.scrub(0, self.top) };
        self.top = 0;
        self.marks.clear();
        self.broken = None;
        self.violations = 0;
        self.generation += 1;
    }

    fn check_span(&self, span: &ScratchSpan) -> Result<(), MemError> {
        if span.stack_id != self.id {
            return Err(MemError::invalid(format!(
                "this span belongs to scratch stack #{}, not #{}",
                span.stack_id, self.id
            )));
        }
        if !self.is_open(&span.mark) {
            return Err(MemError::StaleSpan(format!(
                "scratch span of {} B used after its mark #{} closed; its bytes belong to later \
                 takes — use scratch only inside the mark that took it",
                span.len, span.mark.id
            )));
        }
        Ok(())
    }

    fn stats(&self) -> ScratchStats {
        ScratchStats {
            used: self.top,
            capacity: self.region.reserved(),
            high_water: self.high_water,
            open_marks: self.marks.iter().filter(|m| !m.closed_early).count(),
            generation: self.generation,
            violations: self.violations,
        }
    }
}

fn acquire(backend: &Backend, bytes: u64, tag: Option<Tag>) -> Result<Region, MemError> {
    backend.acquire(
        bytes,
        DEFAULT_ALIGNMENT as u64,
        tag.unwrap_or(Tier::Scratch.default_tag()),
    )
}

fn reentered() -> MemError {
    MemError::Invariant("scratch stack re-entered while it was updating its state".into())
}

/// A scratch stack with the borrowed API. Single-threaded (`!Sync`).
#[derive(Debug)]
pub struct ScratchStack {
    core: RefCell<ScratchCore>,
}

impl ScratchStack {
    /// A stack of `bytes` acquired from `backend`.
    pub fn new(backend: &Backend, bytes: u64, tag: Option<Tag>) -> Result<Self, MemError> {
        Ok(Self::from_region(acquire(backend, bytes, tag)?))
    }

    /// A stack over a region already acquired.
    pub fn from_region(region: Region) -> Self {
        Self {
            core: RefCell::new(ScratchCore::new(region)),
        }
    }

    fn core(&self) -> Result<std::cell::RefMut<'_, ScratchCore>, MemError> {
        self.core.try_borrow_mut().map_err(|_| reentered())
    }

    /// Opens a mark; it rewinds when dropped.
    pub fn mark(&self) -> Result<Mark<'_>, MemError> {
        let token = self.core()?.mark()?;
        Ok(Mark {
            stack: self,
            token,
            open: true,
        })
    }

    /// Closes every mark, clears a V6 violation, bumps the generation.
    pub fn reset(&mut self) {
        self.core.get_mut().reset();
    }

    /// Starts a new high-water measurement from the current use.
    pub fn reset_high_water(&self) {
        let mut core = self.core.borrow_mut();
        core.high_water = core.top;
    }

    /// The counters.
    pub fn stats(&self) -> ScratchStats {
        self.core.borrow().stats()
    }
}

/// An open mark of a [`ScratchStack`]. Takes borrow it; dropping it rewinds.
#[derive(Debug)]
#[must_use = "a mark rewinds as soon as it is dropped"]
pub struct Mark<'s> {
    stack: &'s ScratchStack,
    token: MarkToken,
    open: bool,
}

impl Mark<'_> {
    /// Takes `bytes` aligned to `align`; the span cannot outlive this mark.
    pub fn take(&self, bytes: usize, align: usize) -> Result<StableSpan<'_>, MemError> {
        let mut core = self.stack.core()?;
        let addr = core.take(&self.token, bytes, align)?;
        Ok(StableSpan::new(MintKey::new(), addr, bytes, core.placement))
    }

    /// Rewinds now, reporting a V6 violation as an error.
    pub fn rewind(mut self) -> Result<(), MemError> {
        self.open = false;
        self.stack.core()?.rewind(&self.token)
    }
}

impl Drop for Mark<'_> {
    fn drop(&mut self) {
        if self.open {
            // A V6 violation is recorded in the stack (it refuses further work
            // until reset), which is how a drop reports it.
            if let Ok(mut core) = self.stack.core() {
                let _ = core.rewind(&self.token);
            }
        }
    }
}

#[derive(Debug)]
struct SharedScratchInner {
    id: u64,
    placement: Placement,
    core: Mutex<ScratchCore>,
}

/// A scratch stack with the run-time-checked API: clonable (`Arc`), `Send +
/// Sync`.
#[derive(Debug, Clone)]
pub struct SharedScratchStack {
    inner: Arc<SharedScratchInner>,
}

impl SharedScratchStack {
    /// A stack of `bytes` acquired from `backend`.
    pub fn new(backend: &Backend, bytes: u64, tag: Option<Tag>) -> Result<Self, MemError> {
        Ok(Self::from_region(acquire(backend, bytes, tag)?))
    }

    /// A stack over a region already acquired.
    pub fn from_region(region: Region) -> Self {
        let core = ScratchCore::new(region);
        Self {
            inner: Arc::new(SharedScratchInner {
                id: core.id,
                placement: core.placement,
                core: Mutex::new(core),
            }),
        }
    }

    fn core(&self) -> MutexGuard<'_, ScratchCore> {
        self.inner.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a mark; it rewinds when dropped (or with [`SharedMark::rewind`]).
    pub fn mark(&self) -> Result<SharedMark, MemError> {
        let token = self.core().mark()?;
        Ok(SharedMark {
            stack: self.clone(),
            token,
            open: true,
        })
    }

    /// The span a ticket stands for, if its mark is still open.
    pub fn span(&self, ticket: &ScratchSpan) -> Result<StableSpan<'_>, MemError> {
        self.core().check_span(ticket)?;
        Ok(StableSpan::new(
            MintKey::new(),
            ticket.addr,
            ticket.len,
            self.inner.placement,
        ))
    }

    /// Whether a ticket is still valid.
    pub fn is_valid(&self, ticket: &ScratchSpan) -> bool {
        self.core().check_span(ticket).is_ok()
    }

    /// Closes every mark (their tickets go stale), clears a V6 violation,
    /// bumps the generation.
    pub fn reset(&self) {
        self.core().reset();
    }

    /// Starts a new high-water measurement from the current use.
    pub fn reset_high_water(&self) {
        let mut core = self.core();
        core.high_water = core.top;
    }

    /// The counters.
    pub fn stats(&self) -> ScratchStats {
        self.core().stats()
    }

    /// Where its memory lives.
    pub fn placement(&self) -> Placement {
        self.inner.placement
    }

    /// The process-unique id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }
}

/// An open mark of a [`SharedScratchStack`]; holds the stack alive and
/// rewinds when dropped.
#[derive(Debug)]
#[must_use = "a mark rewinds as soon as it is dropped"]
pub struct SharedMark {
    stack: SharedScratchStack,
    token: MarkToken,
    open: bool,
}

impl SharedMark {
    /// Takes `bytes` aligned to `align` from this mark.
    pub fn take(&self, bytes: usize, align: usize) -> Result<ScratchSpan, MemError> {
        let addr = self.stack.core().take(&self.token, bytes, align)?;
        Ok(ScratchSpan {
            stack_id: self.stack.inner.id,
            mark: self.token,
            addr,
            len: bytes,
        })
    }

    /// Rewinds now, reporting a V6 violation or a closed mark as an error.
    pub fn rewind(mut self) -> Result<(), MemError> {
        self.open = false;
        self.stack.core().rewind(&self.token)
    }

    /// Whether the mark is still open (false after a reset).
    pub fn is_open(&self) -> bool {
        self.stack.core().is_open(&self.token)
    }

    /// The stack it belongs to.
    pub fn stack(&self) -> &SharedScratchStack {
        &self.stack
    }
}

impl Drop for SharedMark {
    fn drop(&mut self) {
        if self.open {
            let _ = self.stack.core().rewind(&self.token);
        }
    }
}

/// A ticket for memory taken from a [`SharedMark`]; valid while the mark is
/// open, checked on every use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchSpan {
    stack_id: u64,
    mark: MarkToken,
    addr: usize,
    len: usize,
}

impl ScratchSpan {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: takes are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeBackend, FakeConfig};

    fn stack(bytes: u64) -> (FakeBackend, ScratchStack) {
        let fb = FakeBackend::new(FakeConfig::default()).unwrap();
        let s = ScratchStack::new(&fb, bytes, None).unwrap();
        (fb, s)
    }

    #[test]
    fn marks_rewind_on_drop_and_track_high_water() {
        let (fb, stack) = stack(4096);
        let addr;
        {
            let outer = stack.mark().unwrap();
            let a = outer.take(100, 16).unwrap();
            {
                let inner = stack.mark().unwrap();
                let b = inner.take(200, 64).unwrap();
                fb.write(b.addr(), &[3u8; 200]).unwrap();
                addr = b.addr();
                assert_eq!(stack.stats().open_marks, 2);
            }
            assert!(fb.is_poisoned(addr, 200).unwrap());
            assert_eq!(stack.stats().used, 100);
            assert_eq!(a.len(), 100);
        }
        let s = stack.stats();
        assert_eq!((s.used, s.open_marks), (0, 0));
        assert!(s.high_water >= 300);
    }

    #[test]
    fn exhaustion_is_clean() {
        let (_fb, stack) = stack(1024);
        let m = stack.mark().unwrap();
        m.take(1000, 8).unwrap();
        let before = stack.stats();
        assert!(matches!(m.take(100, 8), Err(MemError::Capacity(_))));
        assert_eq!(stack.stats(), before);
    }

    #[test]
    fn out_of_order_rewind_is_a_hard_error_until_reset() {
        let (_fb, mut stack) = stack(4096);
        {
            let outer = stack.mark().unwrap();
            outer.take(64, 8).unwrap();
            let inner = stack.mark().unwrap();
            inner.take(64, 8).unwrap();
            let err = outer.rewind().unwrap_err();
            assert!(err.to_string().contains("LIFO"), "{err}");
            assert!(matches!(stack.mark(), Err(MemError::InvalidArgument(_))));
            assert!(inner.take(8, 8).is_err());
            drop(inner);
            let s = stack.stats();
            assert_eq!((s.used, s.open_marks, s.violations), (0, 0, 1));
        }
        assert!(stack.mark().is_err());
        stack.reset();
        let m = stack.mark().unwrap();
        assert!(m.take(8, 8).is_ok());
    }

    #[test]
    fn takes_come_from_the_innermost_mark() {
        let (_fb, stack) = stack(4096);
        let outer = stack.mark().unwrap();
        let inner = stack.mark().unwrap();
        assert!(matches!(
            outer.take(8, 8),
            Err(MemError::InvalidArgument(_))
        ));
        assert!(inner.take(8, 8).is_ok());
    }

    #[test]
    fn shared_tickets_go_stale_with_their_mark() {
        let fb = FakeBackend::new(FakeConfig::default()).unwrap();
        let stack = SharedScratchStack::new(&fb, 4096, None).unwrap();
        let m = stack.mark().unwrap();
        let t = m.take(32, 8).unwrap();
        assert_eq!(stack.span(&t).unwrap().len(), 32);
        m.rewind().unwrap();
        assert!(matches!(stack.span(&t), Err(MemError::StaleSpan(_))));
        let m2 = stack.mark().unwrap();
        let t2 = m2.take(32, 8).unwrap();
        stack.reset();
        assert!(!stack.is_valid(&t2));
        assert!(!m2.is_open());
        assert!(matches!(m2.rewind(), Err(MemError::StaleSpan(_))));
    }
}
