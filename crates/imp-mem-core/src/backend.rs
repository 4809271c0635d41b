//! L1 — the backend contract (seed A3.1, A3.2).
//!
//! A [`Backend`] is the only thing in imp-mem that acquires memory. It is split
//! in two so that each rule exists once:
//!
//! * a [`MemorySource`] (in [`crate::source`], the floor under this module)
//!   does the physical work for one kind of memory (host memory for the fake,
//!   `cuMemAlloc`, VMM reserve/map, pinned host pages). It knows nothing
//!   about phases, budgets or tags.
//! * [`Backend`] wraps any source with the rules that hold for all of them: the
//!   phase guard, the budget cap, per-tag accounting and the journal.
//!
//! Acquisition returns a [`Region`]: move-only, the only type that holds an
//! address obtained from a source, and released exactly once — when it is
//! dropped, or explicitly with [`Backend::release`]. Growable regions reserve
//! address space for their maximum and commit physical memory in granules; their
//! base never moves (V9).
//!
//! Thread safety: a `Backend` is a cheap, clonable handle (`Arc`) and is `Send +
//! Sync`. Its bookkeeping sits behind one mutex, held across the source call so
//! that the budget check and the acquisition it admits are one atomic step.
//! Notices (warnings, re-entry logs) are delivered after the lock is dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::accounting::{BackendStats, JournalEntry, JournalOp, Ledger};
use crate::error::{MemError, OomReport};
use crate::ledger::Tenant;
use crate::phase::{Admission, Phase, PhaseGuard, PhaseMode};
use crate::source::{PinnedHostOps, StreamOrder, TierIo};
use crate::tag::Tag;
use crate::units::{human_bytes, round_up};

// The source trait and its kinds moved to `source`; their old paths stay.
pub use crate::source::{
    DeviceReading, MemoryKind, MemorySource, SourceCharge, SourceError, SourceInfo,
};

mod region;

pub use region::{Region, FILL_PIECE_BYTES};

/// The largest single request accepted at all (1 PiB). Anything larger is a
/// unit mistake, not a memory request.
pub const MAX_REQUEST_BYTES: u64 = 1 << 50;
/// The largest alignment accepted (1 GiB).
pub const MAX_ALIGNMENT: u64 = 1 << 30;
/// The alignment used when a caller has no opinion (what `cudaMalloc` gives).
pub const DEFAULT_ALIGNMENT: usize = 256;

/// How serious a notice is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeLevel {
    /// Worth recording (a re-entry to planning).
    Info,
    /// Something an operator should fix (an acquisition while serving).
    Warning,
}

/// Where a backend sends its notices. The Python binding routes warnings to
/// `warnings.warn` and infos to `logging`.
pub type Notifier = Arc<dyn Fn(NoticeLevel, &str) + Send + Sync>;

static NEXT_BACKEND_ID: AtomicU64 = AtomicU64::new(1);

struct State {
    guard: PhaseGuard,
    ledger: Ledger,
    budget: u64,
    journal: Option<Vec<JournalEntry>>,
    /// The device ledger's tenant this backend commits through, if any.
    tenant: Option<Arc<Tenant>>,
}

impl State {
    fn record(&mut self, tag: Tag, bytes: u64, op: JournalOp) {
        let phase = self.guard.phase();
        if let Some(journal) = self.journal.as_mut() {
            let seq = journal.len() as u64;
            journal.push(JournalEntry {
                seq,
                phase,
                tag,
                bytes,
                op,
            });
        }
    }

    fn oom(&self, asked: u64, tag: Tag, capacity: u64, device_refused: bool) -> MemError {
        MemError::OutOfMemory(self.oom_report(asked, tag, capacity, device_refused))
    }

    fn oom_report(&self, asked: u64, tag: Tag, capacity: u64, device_refused: bool) -> OomReport {
        OomReport {
            asked,
            live: self.ledger.live(),
            budget: self.budget,
            capacity,
            tag,
            device_refused,
            ledger_headroom: None,
            ledger_tenant: None,
        }
    }

    /// The budget check every acquisition and commit passes; on a ledger,
    /// also the ledger's grant of `asked` bytes, which the caller gives
    /// back ([`State::refund`]) if the acquisition then fails.
    fn check_budget(&self, asked: u64, tag: Tag, capacity: u64) -> Result<(), MemError> {
        if self.ledger.committed().saturating_add(asked) > self.budget {
            return Err(self.oom(asked, tag, capacity, false));
        }
        if let (Some(tenant), true) = (&self.tenant, asked > 0) {
            if let Err(refused) = tenant.grow(asked)? {
                return Err(MemError::OutOfMemory(OomReport {
                    ledger_headroom: Some(refused.headroom),
                    ledger_tenant: Some(refused.share(true)),
                    ..self.oom_report(asked, tag, capacity, false)
                }));
            }
        }
        Ok(())
    }

    /// Gives `bytes` back to the ledger (a release, a decommit, or a grant
    /// whose acquisition failed). A ledger that cannot be written is left
    /// to be corrected when this process exits (its slot is reaped).
    fn refund(&self, bytes: u64) {
        if let (Some(tenant), true) = (&self.tenant, bytes > 0) {
            let _ = tenant.shrink(bytes);
        }
    }
}

struct Shared {
    id: u64,
    source: Arc<dyn MemorySource>,
    info: SourceInfo,
    state: Mutex<State>,
    notifier: RwLock<Option<Notifier>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a panic elsewhere; the counters are still the
        // best record there is, so keep serving them.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn notify(&self, level: NoticeLevel, message: &str) {
        let notifier = self
            .notifier
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(notifier) = notifier {
            notifier(level, message);
        }
    }

    fn map_source_error(&self, state: &State, err: SourceError, asked: u64, tag: Tag) -> MemError {
        match err {
            SourceError::OutOfMemory => state.oom(asked, tag, self.info.capacity, true),
            other => self.map_query_error(other),
        }
    }

    /// The error of a source call that acquires nothing (a device reading):
    /// as [`Shared::map_source_error`], with an out-of-memory reported as the
    /// driver's failure, there being no request to itemise.
    fn map_query_error(&self, err: SourceError) -> MemError {
        match err {
            SourceError::OutOfMemory => MemError::Driver(format!(
                "the {} source ran out of memory answering a query",
                self.info.name
            )),
            SourceError::NotGrowable => MemError::invalid(format!(
                "the {} backend has no growable regions; use acquire() for a fixed size, or a \
                 VMM backend for a region that grows",
                self.info.name
            )),
            SourceError::Driver(msg) => MemError::Driver(msg),
            SourceError::Invariant(msg) => MemError::Invariant(msg),
            SourceError::Unsupported(msg) => MemError::BackendUnavailable(msg),
        }
    }

    fn release(&self, region: &Region) {
        let mut state = self.state();
        if region.growable {
            // SAFETY: the region is the unique owner of this reservation (Region
            // is move-only and released once, from its Drop), and its sizes are
            // the ones the source was given.
            unsafe {
                self.source
                    .unreserve(region.base, region.reserved, region.committed)
            };
        } else {
            // SAFETY: as above, for a plain allocation made with these sizes.
            unsafe { self.source.free(region.base, region.reserved, region.align) };
        }
        state
            .ledger
            .on_release(region.tag, region.reserved as u64, region.committed as u64);
        state.refund(region.committed as u64);
        state.record(region.tag, region.committed as u64, JournalOp::Release);
    }
}

/// The backend: a memory source plus the phase guard, the budget and the
/// accounting. Cloning gives another handle to the same backend.
#[derive(Clone)]
pub struct Backend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("id", &self.shared.id)
            .field("source", &self.shared.info.name)
            .finish()
    }
}

fn check_size(what: &str, bytes: u64) -> Result<usize, MemError> {
    if bytes == 0 {
        return Err(MemError::invalid(format!("{what} must be positive, got 0")));
    }
    if bytes > MAX_REQUEST_BYTES {
        return Err(MemError::invalid(format!(
            "{what} of {bytes} B is larger than any device (over 1 PiB); check the units"
        )));
    }
    usize::try_from(bytes).map_err(|_| MemError::invalid(format!("{what} does not fit this host")))
}

fn check_alignment(align: u64) -> Result<usize, MemError> {
    if align == 0 || !align.is_power_of_two() {
        return Err(MemError::invalid(format!(
            "alignment must be a power of two, got {align}; use e.g. 256"
        )));
    }
    if align > MAX_ALIGNMENT {
        return Err(MemError::invalid(format!(
            "alignment {align} is larger than 1 GiB; use a smaller power of two"
        )));
    }
    Ok(align as usize)
}

impl Backend {
    /// A backend over `source`, in `LOADING`, with `budget` (default: the
    /// source's capacity). The journal is off; see [`Backend::enable_journal`].
    pub fn new(
        source: Arc<dyn MemorySource>,
        mode: PhaseMode,
        budget: Option<u64>,
    ) -> Result<Self, MemError> {
        let info = source.info();
        let budget = budget.unwrap_or(info.capacity);
        if budget > info.capacity {
            return Err(MemError::invalid(format!(
                "budget {} is larger than the device's capacity {}; use at most {} B",
                human_bytes(budget),
                human_bytes(info.capacity),
                info.capacity
            )));
        }
        let state = State {
            guard: PhaseGuard::new(mode),
            ledger: Ledger::default(),
            budget,
            journal: None,
            tenant: None,
        };
        Ok(Self {
            shared: Arc::new(Shared {
                id: NEXT_BACKEND_ID.fetch_add(1, Ordering::Relaxed),
                source,
                info,
                state: Mutex::new(state),
                notifier: RwLock::new(None),
            }),
        })
    }

    /// A process-unique id, for identity checks (a region or block from one
    /// backend is never accepted by another).
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// What the source is.
    pub fn info(&self) -> &SourceInfo {
        &self.shared.info
    }

    /// Whether its addresses refer to memory a consumer may read (see
    /// [`MemorySource::addressable`]); spans of an unaddressable backend are
    /// never exported.
    pub fn addressable(&self) -> bool {
        self.shared.source.addressable()
    }

    /// The source's pinned host memory ([`MemorySource::pinned_host`]).
    pub fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        self.shared.source.pinned_host()
    }

    /// The order between streams an activation pool over this backend's
    /// memory keeps ([`MemorySource::stream_order`]).
    pub fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        self.shared.source.stream_order()
    }

    /// The copy engine of a KV host tier of `slots` blocks of `block_bytes`
    /// over this backend's memory ([`MemorySource::host_tier_io`]); `None`
    /// where the source has none.
    pub fn host_tier_io(
        &self,
        block_bytes: usize,
        slots: u32,
    ) -> Result<Option<Box<dyn TierIo>>, MemError> {
        Arc::clone(&self.shared.source).host_tier_io(block_bytes, slots)
    }

    /// Starts recording every acquire / release / commit / decommit.
    pub fn enable_journal(&self) {
        let mut state = self.shared.state();
        if state.journal.is_none() {
            state.journal = Some(Vec::new());
        }
    }

    /// The journal so far, if it is enabled.
    pub fn journal(&self) -> Option<Vec<JournalEntry>> {
        self.shared.state().journal.clone()
    }

    /// Routes notices (steady-state warnings, re-entry logs) to `notifier`.
    pub fn set_notifier(&self, notifier: Option<Notifier>) {
        *self
            .shared
            .notifier
            .write()
            .unwrap_or_else(|p| p.into_inner()) = notifier;
    }

    /// The phase now.
    pub fn phase(&self) -> Phase {
        self.shared.state().guard.phase()
    }

    /// Moves one phase forward (`LOADING → PLANNING → SERVING`).
    pub fn advance(&self, to: Phase) -> Result<(), MemError> {
        self.shared.state().guard.advance(to)
    }

    /// `LOADING → PLANNING`.
    pub fn begin_planning(&self) -> Result<(), MemError> {
        self.advance(Phase::Planning)
    }

    /// `PLANNING → SERVING`.
    pub fn begin_serving(&self) -> Result<(), MemError> {
        self.advance(Phase::Serving)
    }

    /// Opens the bracketed re-entry to planning (a model swap). The phase
    /// reads `PLANNING` until the returned guard is dropped, then `SERVING`.
    /// Both edges are logged.
    pub fn replanning(&self, reason: &str) -> Result<ReplanGuard, MemError> {
        self.shared.state().guard.enter_replanning()?;
        self.shared.notify(
            NoticeLevel::Info,
            &format!("re-entering PLANNING while serving ({reason}); acquisitions are allowed until it closes"),
        );
        Ok(ReplanGuard {
            backend: self.clone(),
            reason: reason.to_string(),
        })
    }

    /// Marks `tag` asleep at `level` (1 or 2), or awake with `None`: while
    /// a tag sleeps the phase guard refuses acquisitions for it
    /// ([`MemError::Asleep`]), and [`Backend::asleep`] lists it. Set by
    /// [`MemorySystem::sleep`](crate::system::MemorySystem::sleep) and `wake`.
    pub fn set_asleep(&self, tag: Tag, level: Option<u8>) {
        self.shared.state().guard.set_asleep(tag, level);
    }

    /// The tags asleep now, with their levels.
    pub fn asleep(&self) -> Vec<(Tag, u8)> {
        self.shared.state().guard.asleep()
    }

    /// Commits through `tenant` of a device ledger from now on: every
    /// acquisition and growth asks the ledger first, every release and
    /// decommit returns to it. What is committed already is charged to the
    /// tenant now (refused as `OutOfMemory` when the ledger cannot grant
    /// it). The backend's budget becomes the smaller of itself and the
    /// tenant's cap. Refused when a tenant is attached already.
    pub fn attach_ledger(&self, tenant: Arc<Tenant>) -> Result<(), MemError> {
        let mut state = self.shared.state();
        if state.tenant.is_some() {
            return Err(MemError::invalid(
                "this backend already commits through a device ledger tenant; open another \
                 backend for another tenant",
            ));
        }
        let record = tenant.record()?;
        let committed = state.ledger.committed();
        if committed > 0 {
            if let Err(refused) = tenant.grow(committed)? {
                return Err(MemError::OutOfMemory(OomReport {
                    ledger_headroom: Some(refused.headroom),
                    ledger_tenant: Some(refused.share(true)),
                    ..state.oom_report(committed, Tag::Weights, self.shared.info.capacity, false)
                }));
            }
        }
        state.tenant = Some(tenant);
        state.budget = state.budget.min(record.cap.max(committed));
        Ok(())
    }

    /// Stops committing through the device ledger and hands its tenant back
    /// (`None` when there was none). Refused while anything is committed:
    /// the ledger would stop counting memory still held.
    pub fn detach_ledger(&self) -> Result<Option<Arc<Tenant>>, MemError> {
        let mut state = self.shared.state();
        let committed = state.ledger.committed();
        if committed > 0 && state.tenant.is_some() {
            return Err(MemError::invalid(format!(
                "cannot leave the device ledger with {} still committed; release the regions \
                 (close the MemorySystem) first",
                human_bytes(committed)
            )));
        }
        Ok(state.tenant.take())
    }

    /// The device ledger's tenant this backend commits through.
    pub fn tenant(&self) -> Option<Arc<Tenant>> {
        self.shared.state().tenant.clone()
    }

    /// The bytes this backend could commit now: its budget less what it
    /// has committed, and on a ledger no more than the ledger would grant.
    pub fn headroom(&self) -> Result<u64, MemError> {
        let (local, tenant) = {
            let state = self.shared.state();
            (
                state.budget.saturating_sub(state.ledger.committed()),
                state.tenant.clone(),
            )
        };
        match tenant {
            Some(t) => Ok(local.min(t.headroom()?)),
            None => Ok(local),
        }
    }

    /// The budget cap.
    pub fn budget(&self) -> u64 {
        self.shared.state().budget
    }

    /// Changes the budget cap. Refused if it is below what is committed now
    /// or above the device's capacity.
    pub fn set_budget(&self, budget: u64) -> Result<(), MemError> {
        let mut state = self.shared.state();
        let committed = state.ledger.committed();
        if budget < committed {
            return Err(MemError::invalid(format!(
                "budget {} is below the {} already committed; release regions first or choose \
                 at least {committed} B",
                human_bytes(budget),
                human_bytes(committed)
            )));
        }
        if budget > self.shared.info.capacity {
            return Err(MemError::invalid(format!(
                "budget {} is larger than the device's capacity {}",
                human_bytes(budget),
                human_bytes(self.shared.info.capacity)
            )));
        }
        state.budget = budget;
        Ok(())
    }

    /// Acquires `bytes` aligned to `align` for `tag`.
    pub fn acquire(&self, bytes: u64, align: u64, tag: Tag) -> Result<Region, MemError> {
        let size = check_size("size", bytes)?;
        let align = check_alignment(align)?;
        let (region, admission) = {
            let mut state = self.shared.state();
            state.check_budget(bytes, tag, self.shared.info.capacity)?;
            let admission = match state.guard.admit(tag, bytes) {
                Ok(a) => a,
                Err(e) => {
                    state.refund(bytes);
                    return Err(e);
                }
            };
            let base = match self.shared.source.allocate(size, align) {
                Ok(base) => base,
                Err(e) => {
                    state.refund(bytes);
                    return Err(self.shared.map_source_error(&state, e, bytes, tag));
                }
            };
            state.ledger.on_acquire(tag, bytes, bytes);
            state.record(tag, bytes, JournalOp::Acquire);
            let region = Region {
                base,
                reserved: size,
                committed: size,
                align,
                tag,
                growable: false,
                backend: self.clone(),
            };
            (region, admission)
        };
        self.warn_if_first(admission, tag, bytes);
        Ok(region)
    }

    /// Acquires a growable region: `reserve` bytes of address space, of which
    /// `initial` (rounded up to the granularity) are committed now.
    pub fn acquire_growable(
        &self,
        reserve: u64,
        initial: u64,
        tag: Tag,
    ) -> Result<Region, MemError> {
        let granule = self.shared.info.granularity.max(1);
        let reserved = check_size("reservation", reserve)?;
        let reserved = round_up(reserved, granule).ok_or_else(|| {
            MemError::invalid("reservation overflows when rounded to the granularity")
        })?;
        if initial > reserve {
            return Err(MemError::invalid(format!(
                "initial commit {initial} B is larger than the reservation {reserve} B"
            )));
        }
        let initial = round_up(initial as usize, granule)
            .ok_or_else(|| MemError::invalid("initial commit overflows"))?
            .min(reserved);
        let align = granule.max(DEFAULT_ALIGNMENT).next_power_of_two();
        let (region, admission) = {
            let mut state = self.shared.state();
            state.check_budget(initial as u64, tag, self.shared.info.capacity)?;
            let admission = match state.guard.admit(tag, initial as u64) {
                Ok(a) => a,
                Err(e) => {
                    state.refund(initial as u64);
                    return Err(e);
                }
            };
            let base = match self.shared.source.reserve(reserved, align) {
                Ok(base) => base,
                Err(e) => {
                    state.refund(initial as u64);
                    return Err(self.shared.map_source_error(&state, e, initial as u64, tag));
                }
            };
            if initial > 0 {
                if let Err(e) = self.shared.source.commit(base, 0, initial) {
                    // SAFETY: `base` was reserved just above with these sizes and
                    // nothing else has seen it.
                    unsafe { self.shared.source.unreserve(base, reserved, 0) };
                    state.refund(initial as u64);
                    return Err(self.shared.map_source_error(&state, e, initial as u64, tag));
                }
            }
            state
                .ledger
                .on_acquire(tag, reserved as u64, initial as u64);
            state.record(tag, initial as u64, JournalOp::Acquire);
            let region = Region {
                base,
                reserved,
                committed: initial,
                align,
                tag,
                growable: true,
                backend: self.clone(),
            };
            (region, admission)
        };
        self.warn_if_first(admission, tag, initial as u64);
        Ok(region)
    }

    fn warn_if_first(&self, admission: Admission, tag: Tag, bytes: u64) {
        if admission == (Admission::Counted { first: true }) {
            self.shared.notify(
                NoticeLevel::Warning,
                &format!(
                    "steady-state acquisition of {bytes} B for tag '{tag}' while SERVING; it is \
                     counted in steady_state_allocations_total and reported once per tag — \
                     plan this memory before serving"
                ),
            );
        }
    }

    /// Releases a region now. A region from another backend is refused (and
    /// still released, to its own backend).
    pub fn release(&self, region: Region) -> Result<(), MemError> {
        if region.backend.id() != self.id() {
            let owner = region.backend.id();
            drop(region);
            return Err(MemError::invalid(format!(
                "region belongs to backend #{owner}, not #{}; release it through its own backend",
                self.id()
            )));
        }
        drop(region);
        Ok(())
    }

    /// A snapshot of the accounting.
    pub fn stats(&self) -> BackendStats {
        let state = self.shared.state();
        let guard = &state.guard;
        state.ledger.snapshot(
            guard.phase(),
            guard.mode(),
            state.budget,
            self.shared.info.capacity,
            |tag| guard.steady_state_allocations(tag),
        )
    }

    /// The source's device reading now ([`MemorySource::mem_info`]); `None`
    /// for a source with no device.
    pub fn mem_info(&self) -> Result<Option<DeviceReading>, MemError> {
        self.shared
            .source
            .mem_info()
            .map_err(|e| self.shared.map_query_error(e))
    }

    /// What the source holds beyond the ledger's committed bytes
    /// ([`MemorySource::extra_charges`]). Read under the backend's lock, so
    /// no commit or release lands between the ledger's figure and the
    /// source's.
    pub fn extra_charges(&self) -> Vec<SourceCharge> {
        let state = self.shared.state();
        self.shared.source.extra_charges(state.ledger.committed())
    }

    /// Bytes live now.
    pub fn live(&self) -> u64 {
        self.shared.state().ledger.live()
    }

    /// Checks the accounting's own invariants: V1 against the journal when it
    /// is on, per-tag sums, and the budget.
    pub fn check_invariants(&self) -> Result<(), MemError> {
        let state = self.shared.state();
        let live = state.ledger.live();
        if let Some(journal) = &state.journal {
            let replayed: i128 = journal
                .iter()
                .map(|e| e.op.sign() as i128 * e.bytes as i128)
                .sum();
            if replayed != live as i128 {
                return Err(MemError::Invariant(format!(
                    "V1: journal replays to {replayed} B live, ledger says {live} B"
                )));
            }
        }
        let tag_live: u64 = Tag::ALL.iter().map(|&t| state.ledger.tag(t).live).sum();
        if tag_live != live {
            return Err(MemError::Invariant(format!(
                "per-tag live sums to {tag_live} B, total is {live} B"
            )));
        }
        if state.ledger.committed() > state.budget {
            return Err(MemError::Invariant(format!(
                "{} B committed over a budget of {} B",
                state.ledger.committed(),
                state.budget
            )));
        }
        Ok(())
    }
}

/// The open re-entry to planning; dropping it returns the backend to
/// `SERVING`.
#[must_use = "the re-entry closes when this guard is dropped"]
pub struct ReplanGuard {
    backend: Backend,
    reason: String,
}

impl Drop for ReplanGuard {
    fn drop(&mut self) {
        let closed = self.backend.shared.state().guard.exit_replanning();
        if closed.is_ok() {
            self.backend.shared.notify(
                NoticeLevel::Info,
                &format!(
                    "re-entry to PLANNING closed ({}); back to SERVING",
                    self.reason
                ),
            );
        }
    }
}
