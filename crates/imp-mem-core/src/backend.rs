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
use crate::error::{try_reserve, MemError, OomReport};
use crate::ledger::Tenant;
use crate::phase::{Admission, Phase, PhaseGuard, PhaseMode};
use crate::source::{FromHost, PinnedHostOps, StreamOrder, TierIo, ToHost};
use crate::tag::Tag;
use crate::units::{human_bytes, round_up};

// The source trait and its kinds moved to `source`; their old paths stay.
pub use crate::source::{
    DeviceReading, MemoryKind, MemorySource, SourceCharge, SourceError, SourceInfo,
};

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

/// Bytes [`Region::commit_and_fill`] commits ahead of its copy at a time:
/// two 64 MiB VMM chunks, a DMA of ~2.4 ms at an H200's pinned bandwidth
/// against ~0.3 ms of driver work to commit them.
pub const FILL_PIECE_BYTES: usize = 128 << 20;

/// Memory acquired from a backend. Move-only; released exactly once, when
/// dropped.
pub struct Region {
    base: usize,
    reserved: usize,
    committed: usize,
    align: usize,
    tag: Tag,
    growable: bool,
    backend: Backend,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("base", &format_args!("{:#x}", self.base))
            .field("committed", &self.committed)
            .field("reserved", &self.reserved)
            .field("tag", &self.tag)
            .field("growable", &self.growable)
            .finish()
    }
}

impl Region {
    /// The first address. Never changes, growable or not (V9).
    pub fn base(&self) -> usize {
        self.base
    }

    /// Bytes usable now (committed).
    pub fn len(&self) -> usize {
        self.committed
    }

    /// True when nothing is committed (a growable region before its first
    /// commit).
    pub fn is_empty(&self) -> bool {
        self.committed == 0
    }

    /// Address space held: the maximum a growable region can commit.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The alignment of `base`.
    pub fn align(&self) -> usize {
        self.align
    }

    /// What the region is for.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// Whether it can commit and decommit.
    pub fn is_growable(&self) -> bool {
        self.growable
    }

    /// The backend it came from.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    fn check_growable(&self, what: &str) -> Result<usize, MemError> {
        if !self.growable {
            return Err(MemError::invalid(format!(
                "cannot {what} a fixed region; acquire it with acquire_growable() to grow it"
            )));
        }
        Ok(self.backend.shared.info.granularity.max(1))
    }

    /// Grows the committed part to at least `new_len` bytes (rounded up to the
    /// granularity). A no-op if it is already that large. The base does not
    /// move.
    pub fn commit(&mut self, new_len: u64) -> Result<(), MemError> {
        let granule = self.check_growable("commit")?;
        if new_len > self.reserved as u64 {
            return Err(MemError::invalid(format!(
                "commit to {new_len} B is past the reservation of {} B; reserve more when \
                 acquiring",
                self.reserved
            )));
        }
        let target = round_up(new_len as usize, granule)
            .ok_or_else(|| MemError::invalid("commit size overflows"))?
            .min(self.reserved);
        if target <= self.committed {
            return Ok(());
        }
        let delta = (target - self.committed) as u64;
        let shared = &self.backend.shared;
        let mut state = shared.state();
        state.check_budget(delta, self.tag, shared.info.capacity)?;
        if let Err(e) = shared.source.commit(self.base, self.committed, target) {
            state.refund(delta);
            return Err(shared.map_source_error(&state, e, delta, self.tag));
        }
        state.ledger.on_commit(self.tag, delta);
        state.record(self.tag, delta, JournalOp::Commit);
        self.committed = target;
        Ok(())
    }

    /// Shrinks the committed part to `new_len` bytes (rounded up to the
    /// granularity), returning the rest of the physical memory. A no-op if it
    /// is already that small. The caller guarantees nothing in flight still
    /// uses the decommitted tail (on a GPU: the fence has completed).
    pub fn decommit(&mut self, new_len: u64) -> Result<(), MemError> {
        let granule = self.check_growable("decommit")?;
        let target = round_up(new_len.min(self.reserved as u64) as usize, granule)
            .ok_or_else(|| MemError::invalid("decommit size overflows"))?
            .min(self.reserved);
        if target >= self.committed {
            return Ok(());
        }
        let delta = (self.committed - target) as u64;
        let shared = &self.backend.shared;
        let mut state = shared.state();
        // SAFETY: `[target, committed)` is committed in this region's live
        // reservation, and `&mut self` means no span of this crate borrows it.
        unsafe { shared.source.decommit(self.base, target, self.committed) }
            .map_err(|e| shared.map_source_error(&state, e, delta, self.tag))?;
        state.ledger.on_decommit(self.tag, delta);
        state.refund(delta);
        state.record(self.tag, delta, JournalOp::Decommit);
        self.committed = target;
        Ok(())
    }
}

impl Region {
    fn check_copy(&self, offset: usize, len: usize) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.committed => Ok(()),
            _ => Err(MemError::invalid(format!(
                "copy of {len} B at offset {offset} runs past the {} B committed in this region",
                self.committed
            ))),
        }
    }

    /// Copies `dst.len()` bytes at `offset` of this region to `dst`,
    /// through the source ([`MemorySource::copy_to_host`]); pinned host
    /// memory makes it a DMA at full speed on a device.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemError> {
        self.check_copy(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: `[base + offset, + len)` is inside this live region's
        // committed part (checked just above); `dst` is a host slice we hold
        // exclusively for the call.
        unsafe {
            shared
                .source
                .copy_to_host(self.base + offset, dst.as_mut_ptr(), dst.len())
        }
        .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// Reads `len` bytes at `offset` of this region into a new host buffer
    /// ([`Region::copy_to_host`]): the range is checked before the buffer is
    /// reserved, and the reservation fails as `HostOutOfMemory` rather than
    /// aborting.
    pub fn read_to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, MemError> {
        self.check_copy(offset, len)?;
        let mut out = Vec::new();
        try_reserve(&mut out, len, "a region read")?;
        out.resize(len, 0);
        self.copy_to_host(offset, &mut out)?;
        Ok(out)
    }

    /// Copies `src` into this region at `offset`, through the source
    /// ([`MemorySource::copy_from_host`]). `&mut self`: nothing of this
    /// crate borrows the range meanwhile.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), MemError> {
        self.check_copy(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: as in `copy_to_host`, the range is committed in this live
        // region, and `src` is a host slice borrowed for the call.
        unsafe {
            shared
                .source
                .copy_from_host(self.base + offset, src.as_ptr(), src.len())
        }
        .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// [`Region::copy_to_host`] of every `(offset, dst)` of `copies`, through
    /// one call to the source ([`MemorySource::copy_to_host_many`]): on a
    /// device every copy is enqueued and the host waits once. Every range is
    /// checked before any copy starts, so a batch with one range past the
    /// committed part copies nothing. On the source's failure the copies
    /// before the failing one may have landed.
    pub fn copy_to_host_many(&self, copies: &mut [(usize, &mut [u8])]) -> Result<(), MemError> {
        let mut batch: Vec<ToHost> = Vec::new();
        try_reserve(&mut batch, copies.len(), "a batch of region copies")?;
        for (offset, dst) in copies.iter_mut() {
            self.check_copy(*offset, dst.len())?;
            if !dst.is_empty() {
                batch.push((self.base + *offset, dst.as_mut_ptr(), dst.len()));
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: every source range is inside this live region's committed
        // part (checked above); every `dst` is a host slice borrowed
        // mutably from `copies` for the call, so no two overlap.
        unsafe { shared.source.copy_to_host_many(&batch) }
            .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// [`Region::copy_from_host`] of every `(offset, src)` of `copies`,
    /// through one call to the source
    /// ([`MemorySource::copy_from_host_many`]), in order (a later copy to the
    /// same bytes wins). Checked as [`Region::copy_to_host_many`]: a batch
    /// with one bad range copies nothing.
    pub fn copy_from_host_many(&mut self, copies: &[(usize, &[u8])]) -> Result<(), MemError> {
        let mut batch: Vec<FromHost> = Vec::new();
        try_reserve(&mut batch, copies.len(), "a batch of region copies")?;
        for &(offset, src) in copies {
            self.check_copy(offset, src.len())?;
            if !src.is_empty() {
                batch.push((self.base + offset, src.as_ptr(), src.len()));
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: as in `copy_to_host_many`, the ranges are committed in this
        // live region, which `&mut self` keeps from every span of this crate;
        // every `src` is a host slice borrowed for the call.
        unsafe { shared.source.copy_from_host_many(&batch) }
            .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// Commits the region to `new_len` bytes (as [`Region::commit`]) and
    /// copies `src` to its start, the two overlapped: a scoped worker thread
    /// commits piece after piece (whole granules, about [`FILL_PIECE_BYTES`])
    /// while this thread copies each piece once it is committed. On a device
    /// a commit is the driver creating and mapping handles, the copy a DMA
    /// from pinned memory; in sequence a wake pays both (the commit measured
    /// at ~11 % of the copy of the same bytes on an H200), overlapped about
    /// the copy alone. On failure the region keeps what it committed (the
    /// caller decommits) and the first error is returned.
    pub fn commit_and_fill(&mut self, new_len: u64, src: &[u8]) -> Result<(), MemError> {
        self.commit_and_fill_by(new_len, src, FILL_PIECE_BYTES)
    }

    /// [`Region::commit_and_fill`] with pieces of about `piece_bytes`.
    pub(crate) fn commit_and_fill_by(
        &mut self,
        new_len: u64,
        src: &[u8],
        piece_bytes: usize,
    ) -> Result<(), MemError> {
        let granule = self.check_growable("commit")?;
        if src.len() as u64 > new_len {
            return Err(MemError::invalid(format!(
                "fill of {} B is larger than the commit to {new_len} B",
                src.len()
            )));
        }
        let piece = piece_bytes.div_ceil(granule).max(1) * granule;
        if src.len() <= piece {
            self.commit(new_len)?;
            return self.copy_from_host(0, src);
        }
        let (base, tag, start) = (self.base, self.tag, self.committed);
        let shared = Arc::clone(&self.backend.shared);
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        let region = &mut *self;
        std::thread::scope(|scope| {
            let worker = scope.spawn(move || -> Result<(), MemError> {
                while (region.committed as u64) < new_len {
                    let next = (region.committed as u64).saturating_add(piece as u64);
                    region.commit(next.min(new_len))?;
                    if tx.send(region.committed).is_err() {
                        break; // the copy failed: nothing more to fill
                    }
                }
                Ok(())
            });
            let mut copied = 0usize;
            let mut copy_error = None;
            for committed in std::iter::once(start).chain(rx.iter()) {
                let upto = committed.min(src.len());
                if upto <= copied {
                    continue;
                }
                // SAFETY: `[base + copied, base + upto)` lies in the part of
                // this live region the worker has committed (it sent
                // `committed` after the commit returned); the region is
                // borrowed mutably for the whole scope, so no span of this
                // crate refers to it, and `src[copied..upto]` is a host slice
                // we borrow for the call.
                let result = unsafe {
                    shared.source.copy_from_host(
                        base + copied,
                        src[copied..].as_ptr(),
                        upto - copied,
                    )
                };
                if let Err(e) = result {
                    copy_error = Some(shared.map_source_error(&shared.state(), e, 0, tag));
                    break;
                }
                copied = upto;
            }
            drop(rx);
            let committed = worker.join().unwrap_or_else(|_| {
                Err(MemError::Invariant(
                    "the commit worker of a fill panicked".to_string(),
                ))
            });
            match (committed, copy_error) {
                (Err(e), _) | (Ok(()), Some(e)) => Err(e),
                (Ok(()), None) if copied == src.len() => Ok(()),
                (Ok(()), None) => Err(MemError::Invariant(format!(
                    "fill copied {copied} of {} B",
                    src.len()
                ))),
            }
        })
    }

    /// Tells the source that `[offset, offset + len)` of this region was
    /// released by the tier allocator that owns it (see
    /// [`MemorySource::scrub`]). Ranges past the committed part are clipped.
    ///
    /// # Safety
    /// No live handle refers to the range.
    pub(crate) unsafe fn scrub(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len).min(self.committed);
        if offset < end {
            // SAFETY: `[base + offset, base + end)` is inside this live region's
            // committed part (clipped just above); the caller promises no live
            // handle refers to it.
            unsafe {
                self.backend
                    .shared
                    .source
                    .scrub(self.base + offset, end - offset)
            };
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let shared = Arc::clone(&self.backend.shared);
        shared.release(self);
    }
}

#[cfg(test)]
mod fill_tests {
    use super::*;
    use crate::fake::{FakeBackend, FakeConfig};

    fn fake() -> FakeBackend {
        FakeBackend::new(FakeConfig {
            capacity: 64 << 20,
            granularity: 4096,
            ..FakeConfig::default()
        })
        .unwrap()
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    #[test]
    fn a_fill_in_pieces_commits_the_length_and_copies_every_byte() {
        let fb = fake();
        // Pieces of 4 granules, a fill of 10.5 granules into a commit of 13,
        // and one that starts from a region already partly committed.
        for (start, new_len, fill) in [(0, 13 * 4096, 43_008), (8192, 13 * 4096, 43_008)] {
            let mut region = fb.acquire_growable(1 << 20, start, Tag::Weights).unwrap();
            let src = pattern(fill);
            region
                .commit_and_fill_by(new_len as u64, &src, 3 * 4096 + 1)
                .unwrap();
            assert_eq!(region.len(), new_len);
            let mut back = vec![0u8; fill];
            region.copy_to_host(0, &mut back).unwrap();
            assert_eq!(back, src);
            assert_eq!(fb.stats().total.committed, new_len as u64);
        }
    }

    #[test]
    fn a_refused_commit_is_the_fills_error_and_a_bad_fill_changes_nothing() {
        let fb = fake();
        let mut region = fb.acquire_growable(1 << 20, 0, Tag::Weights).unwrap();
        fb.fail_commits(1);
        let src = pattern(40_000);
        assert!(region.commit_and_fill_by(65_536, &src, 8192).is_err());
        assert_eq!(region.len(), 0);
        let err = region.commit_and_fill_by(1024, &src, 8192).unwrap_err();
        assert!(err.to_string().contains("larger than the commit"), "{err}");
        assert_eq!(region.len(), 0);
        let mut fixed = fb.acquire(4096, 4096, Tag::Workspace).unwrap();
        assert!(fixed.commit_and_fill(4096, &src[..16]).is_err());
    }
}
