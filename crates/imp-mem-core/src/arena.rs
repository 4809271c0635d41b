//! T1 / T2 — the bump arena (seed A2, A3.3).
//!
//! Algorithm: one backend [`Region`]; a take rounds the bump offset up to the
//! requested alignment (of the absolute address) and advances it. Nothing is
//! freed individually, so nothing can leak individually: [`Arena::reset`]
//! frees everything at once and bumps a generation counter. Takes are O(1).
//! Over a growable region the arena commits more of it when a take runs past
//! the committed part; the base never moves, so earlier spans stay valid.
//! The high-water mark (the largest offset ever reached) is what the planner
//! sizes the next arena from.
//!
//! T1 (model-resident) and T2 (engine-persistent) are separate arenas so a
//! model swap can reset T1 while T2 survives (A2).
//!
//! Two façades over one [`ArenaCore`], so each rule exists once:
//!
//! * [`Arena`] — the borrowed API. `take(&self)` returns a
//!   [`StableSpan<'_>`](StableSpan) that borrows the arena, and
//!   `reset(&mut self)` cannot be called while any span is alive: staleness
//!   is a compile error. Single-threaded (`!Sync`), like `bumpalo`.
//! * [`SharedArena`] — the run-time-checked API for callers that cannot
//!   borrow (the Python binding, structures without lifetimes). A take returns
//!   an [`ArenaSpan`] ticket carrying the arena's id and generation; every use
//!   goes through [`SharedArena::span`], which refuses a ticket from another
//!   arena (`InvalidArgument`) or from an older generation (`StaleSpan`).
//!   `Send + Sync`; the state sits behind one mutex.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT, MAX_ALIGNMENT};
use crate::error::MemError;
use crate::pinned::{PinnedBuffer, PinnedHost};
use crate::source::Placement;
use crate::span::{MintKey, StableSpan};
use crate::tag::Tag;
use crate::tier::{next_tier_id, Tier};
use crate::units::{align_up, human_bytes};

/// Checks a take's size and alignment, the same way for every tier.
pub(crate) fn check_take(bytes: usize, align: usize) -> Result<(), MemError> {
    if bytes == 0 {
        return Err(MemError::invalid(
            "size must be positive, got 0; ask for at least 1 byte",
        ));
    }
    if align == 0 || !align.is_power_of_two() {
        return Err(MemError::invalid(format!(
            "alignment must be a power of two, got {align}; use e.g. {DEFAULT_ALIGNMENT}"
        )));
    }
    if align as u64 > MAX_ALIGNMENT {
        return Err(MemError::invalid(format!(
            "alignment {align} is larger than 1 GiB; use a smaller power of two"
        )));
    }
    Ok(())
}

/// Where a region's memory lives.
pub(crate) fn placement_of(region: &Region) -> Placement {
    let info = region.backend().info();
    Placement {
        kind: info.kind,
        device: info.device,
    }
}

/// Statistics of one arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes handed out since the last reset (including alignment padding).
    pub used: usize,
    /// Bytes the arena can hand out in all (its reservation, or the limit
    /// a memory system set inside it).
    pub capacity: usize,
    /// Bytes committed now (equal to `capacity` unless the region grows).
    pub committed: usize,
    /// The largest `used` ever reached.
    pub high_water: usize,
    /// Resets so far.
    pub generation: u64,
    /// Takes since the last reset.
    pub takes: u64,
}

/// The state and the rules of one arena, shared by both façades.
#[derive(Debug)]
pub struct ArenaCore {
    id: u64,
    tier: Tier,
    region: Region,
    placement: Placement,
    offset: usize,
    high_water: usize,
    generation: u64,
    takes: u64,
    /// Live exports of this generation ([`ArenaExport`]).
    exports: usize,
    /// Takes end here (at most the reservation): a memory system reserves
    /// T1 larger than its plan so that a model swap grows it in place.
    limit: usize,
    /// Set while the arena sleeps: its region is decommitted.
    sleep: Option<ArenaSleep>,
    /// The pinned buffer of the last level-1 sleep, kept after wake so the
    /// next sleep copies at once instead of pinning gigabytes again (the
    /// planned T5b charge); freed by [`SharedArena::release_host_copy`].
    spare_copy: Option<PinnedBuffer>,
}

/// What a sleeping arena needs to wake: the committed length to restore,
/// and at level 1 the host copy of its used bytes.
#[derive(Debug)]
struct ArenaSleep {
    level: u8,
    committed: usize,
    copy: Option<PinnedBuffer>,
    /// Bytes of `copy` that hold T1's (the buffer may be a larger spare).
    saved: usize,
}

impl ArenaCore {
    fn new(tier: Tier, region: Region) -> Result<Self, MemError> {
        if !matches!(tier, Tier::ModelResident | Tier::EnginePersistent) {
            return Err(MemError::invalid(format!(
                "an arena serves T1 (MODEL_RESIDENT) or T2 (ENGINE_PERSISTENT), not {tier}; use \
                 BlockPool for POOLED and ScratchStack for SCRATCH"
            )));
        }
        let placement = placement_of(&region);
        Ok(Self {
            id: next_tier_id(),
            tier,
            placement,
            offset: 0,
            high_water: 0,
            generation: 0,
            takes: 0,
            exports: 0,
            limit: region.reserved(),
            sleep: None,
            spare_copy: None,
            region,
        })
    }

    fn asleep_error(&self, what: &str) -> Option<MemError> {
        self.sleep.as_ref().map(|s| {
            MemError::Asleep(format!(
                "{what} on arena {} ({}), which sleeps (level {}); call wake() first",
                self.tier.label(),
                self.region.tag(),
                s.level
            ))
        })
    }

    /// Bumps: returns the address of `bytes` aligned to `align`.
    fn take(&mut self, bytes: usize, align: usize) -> Result<usize, MemError> {
        check_take(bytes, align)?;
        if let Some(err) = self.asleep_error("take") {
            return Err(err);
        }
        let base = self.region.base();
        let capacity = self.limit;
        let start = align_up(base + self.offset, align).map(|a| a - base);
        let end = start.and_then(|s| s.checked_add(bytes));
        let (start, end) = match (start, end) {
            (Some(s), Some(e)) if e <= capacity => (s, e),
            _ => {
                return Err(MemError::Capacity(format!(
                    "arena {} ({}) has {} of {} free; asked {} aligned to {align}; plan a larger \
                     arena (its high-water mark is {}) or reset it",
                    self.tier.label(),
                    self.region.tag(),
                    human_bytes((capacity - self.offset) as u64),
                    human_bytes(capacity as u64),
                    human_bytes(bytes as u64),
                    human_bytes(self.high_water as u64),
                )))
            }
        };
        if end > self.region.len() {
            self.region.commit(end as u64)?;
        }
        self.offset = end;
        self.high_water = self.high_water.max(end);
        self.takes += 1;
        Ok(base + start)
    }

    fn reset(&mut self) {
        // A sleeping arena's old bytes are not worth restoring any more.
        if let Some(sleep) = self.sleep.as_mut() {
            sleep.copy = None;
        }
        // SAFETY: every span of the old generation is refused from now on (the
        // borrowed API cannot even hold one across `reset(&mut self)`), so no
        // live handle refers to `[0, offset)`.
        unsafe { self.region.scrub(0, self.offset) };
        self.offset = 0;
        self.takes = 0;
        self.generation += 1;
        self.exports = 0;
    }

    /// Sleep (see [`SharedArena::sleep`]). All or nothing.
    fn sleep(&mut self, level: u8, host: Option<&PinnedHost>) -> Result<u64, MemError> {
        if let Some(s) = &self.sleep {
            return Err(MemError::invalid(format!(
                "arena {} already sleeps (level {}); call wake() first",
                self.tier.label(),
                s.level
            )));
        }
        if !self.region.is_growable() {
            return Err(MemError::BackendUnavailable(format!(
                "arena {} cannot sleep: its region is fixed, and only a growable (VMM) region \
                 can give its physical memory back and take it again at the same addresses; open \
                 the system on a VMM backend",
                self.tier.label()
            )));
        }
        let copy = match (level, host) {
            (1, _) if self.offset == 0 => None,
            (1, Some(host)) => {
                let mut buffer = match self.spare_copy.take() {
                    Some(b) if b.len() >= self.offset => b,
                    _ => host.allocate(self.offset)?,
                };
                if let Err(err) = self
                    .region
                    .copy_to_host(0, &mut buffer.as_mut_slice()[..self.offset])
                {
                    self.spare_copy = Some(buffer);
                    return Err(err);
                }
                Some(buffer)
            }
            (1, None) => {
                return Err(MemError::invalid(
                    "sleep level 1 copies T1 to pinned host memory; pass a PinnedHost",
                ))
            }
            (2, _) => None,
            (other, _) => {
                return Err(MemError::invalid(format!(
                    "level={other}: a sleep level is 1 (keep the bytes in host memory) or 2 (drop \
                     them)"
                )))
            }
        };
        let host_bytes = copy.as_ref().map_or(0, |_| self.offset as u64);
        let committed = self.region.len();
        if let Err(err) = self.region.decommit(0) {
            self.spare_copy = copy;
            return Err(err);
        }
        self.sleep = Some(ArenaSleep {
            level,
            committed,
            copy,
            saved: host_bytes as usize,
        });
        Ok(host_bytes)
    }

    /// Wake (see [`SharedArena::wake`]). On failure it still sleeps.
    fn wake(&mut self) -> Result<(), MemError> {
        let Some(sleep) = self.sleep.as_ref() else {
            return Ok(());
        };
        match &sleep.copy {
            // The commit of each piece overlaps the copy of the one before.
            Some(copy) => {
                let len = sleep.saved.min(copy.len());
                let filled = self
                    .region
                    .commit_and_fill(sleep.committed as u64, &copy.as_slice()[..len]);
                if let Err(err) = filled {
                    let _ = self.region.decommit(0);
                    return Err(err);
                }
            }
            None => self.region.commit(sleep.committed as u64)?,
        }
        if let Some(sleep) = self.sleep.take() {
            // The larger buffer stays for the next sleep (a pin may have
            // installed one while this arena slept).
            let spare = self.spare_copy.as_ref().map_or(0, PinnedBuffer::len);
            if sleep.copy.as_ref().map_or(0, PinnedBuffer::len) >= spare {
                self.spare_copy = sleep.copy;
            }
        }
        Ok(())
    }

    fn stats(&self) -> ArenaStats {
        ArenaStats {
            used: self.offset,
            capacity: self.limit,
            committed: self.region.len(),
            high_water: self.high_water,
            generation: self.generation,
            takes: self.takes,
        }
    }

    /// Checks a ticket against this arena: identity, generation, and that
    /// the arena is awake.
    fn check(&self, span: &ArenaSpan) -> Result<(), MemError> {
        self.check_ticket(span)?;
        match self.asleep_error("use of a span") {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    fn check_ticket(&self, span: &ArenaSpan) -> Result<(), MemError> {
        if span.arena_id != self.id {
            return Err(MemError::invalid(format!(
                "this span belongs to arena #{}, not #{}; use it with the arena that took it",
                span.arena_id, self.id
            )));
        }
        if span.generation != self.generation {
            return Err(MemError::StaleSpan(format!(
                "span of {} B from arena {} generation {} used after reset (the arena is at \
                 generation {}); its memory now belongs to newer takes — take a new span after \
                 each reset",
                span.len,
                self.tier.label(),
                span.generation,
                self.generation
            )));
        }
        Ok(())
    }
}

/// Opens the region for an arena.
fn acquire(
    backend: &Backend,
    tier: Tier,
    bytes: u64,
    tag: Option<Tag>,
) -> Result<Region, MemError> {
    backend.acquire(
        bytes,
        DEFAULT_ALIGNMENT as u64,
        tag.unwrap_or(tier.default_tag()),
    )
}

/// A bump arena with the borrowed API: spans borrow the arena.
#[derive(Debug)]
pub struct Arena {
    core: RefCell<ArenaCore>,
}

impl Arena {
    /// An arena of `bytes` acquired from `backend` for `tier` (T1 or T2),
    /// charged to `tag` (default: the tier's).
    pub fn new(
        backend: &Backend,
        tier: Tier,
        bytes: u64,
        tag: Option<Tag>,
    ) -> Result<Self, MemError> {
        let core = ArenaCore::new(tier, acquire(backend, tier, bytes, tag)?)?;
        Ok(Self {
            core: RefCell::new(core),
        })
    }

    /// An arena over a region already acquired (a growable one grows on
    /// demand).
    pub fn from_region(tier: Tier, region: Region) -> Result<Self, MemError> {
        Ok(Self {
            core: RefCell::new(ArenaCore::new(tier, region)?),
        })
    }

    /// Takes `bytes` aligned to `align`. The span borrows the arena, so it
    /// cannot outlive it or survive a reset.
    pub fn take(&self, bytes: usize, align: usize) -> Result<StableSpan<'_>, MemError> {
        let mut core = self.core.try_borrow_mut().map_err(|_| reentered())?;
        let addr = core.take(bytes, align)?;
        Ok(StableSpan::new(MintKey::new(), addr, bytes, core.placement))
    }

    /// Frees everything at once and bumps the generation. Needs `&mut self`,
    /// so no span can be alive across it.
    pub fn reset(&mut self) {
        self.core.get_mut().reset();
    }

    /// The counters.
    pub fn stats(&self) -> ArenaStats {
        self.core.borrow().stats()
    }

    /// Resets so far.
    pub fn generation(&self) -> u64 {
        self.core.borrow().generation
    }

    /// The tier it serves.
    pub fn tier(&self) -> Tier {
        self.core.borrow().tier
    }

    /// Gives the region back (to drop it, or to open it as a [`SharedArena`]).
    pub fn into_region(self) -> Region {
        self.core.into_inner().region
    }
}

fn reentered() -> MemError {
    MemError::Invariant("tier allocator re-entered while it was updating its state".into())
}

/// A ticket for memory taken from a [`SharedArena`]: plain data (address,
/// length, the arena's id and generation), checked on every use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaSpan {
    arena_id: u64,
    generation: u64,
    addr: usize,
    len: usize,
}

impl ArenaSpan {
    /// The generation it was taken in.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Its length in bytes (always known, valid or not).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: takes are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// An export of a [`SharedArena`]'s memory, counted while it lives.
#[derive(Debug)]
pub struct ArenaExport {
    arena: SharedArena,
    generation: u64,
}

impl Drop for ArenaExport {
    fn drop(&mut self) {
        let mut core = self.arena.core();
        if core.generation == self.generation {
            core.exports = core.exports.saturating_sub(1);
        }
    }
}

#[derive(Debug)]
struct SharedArenaInner {
    tier: Tier,
    tag: Tag,
    placement: Placement,
    core: Mutex<ArenaCore>,
}

/// A bump arena with the run-time-checked API: clonable (`Arc`), `Send +
/// Sync`, handing out [`ArenaSpan`] tickets.
#[derive(Debug, Clone)]
pub struct SharedArena {
    inner: Arc<SharedArenaInner>,
}

impl SharedArena {
    /// An arena of `bytes` acquired from `backend` for `tier` (T1 or T2).
    pub fn new(
        backend: &Backend,
        tier: Tier,
        bytes: u64,
        tag: Option<Tag>,
    ) -> Result<Self, MemError> {
        Self::from_region(tier, acquire(backend, tier, bytes, tag)?)
    }

    /// An arena over a region already acquired.
    pub fn from_region(tier: Tier, region: Region) -> Result<Self, MemError> {
        let core = ArenaCore::new(tier, region)?;
        Ok(Self {
            inner: Arc::new(SharedArenaInner {
                tier,
                tag: core.region.tag(),
                placement: core.placement,
                core: Mutex::new(core),
            }),
        })
    }

    fn core(&self) -> MutexGuard<'_, ArenaCore> {
        self.inner.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `bytes` aligned to `align`.
    pub fn take(&self, bytes: usize, align: usize) -> Result<ArenaSpan, MemError> {
        let mut core = self.core();
        let addr = core.take(bytes, align)?;
        Ok(ArenaSpan {
            arena_id: core.id,
            generation: core.generation,
            addr,
            len: bytes,
        })
    }

    /// The span a ticket stands for, if it is from this arena and this
    /// generation. The span borrows this handle, which keeps the region alive.
    pub fn span(&self, ticket: &ArenaSpan) -> Result<StableSpan<'_>, MemError> {
        self.core().check(ticket)?;
        Ok(StableSpan::new(
            MintKey::new(),
            ticket.addr,
            ticket.len,
            self.inner.placement,
        ))
    }

    /// Counts an export of `ticket`'s memory (a DLPack capsule, a tensor
    /// viewing it) until the returned guard drops, and keeps the arena alive
    /// meanwhile. A model swap refuses while exports of T1's current
    /// generation live, and so does [`Self::reset_checked`] for this arena's.
    pub fn export(&self, ticket: &ArenaSpan) -> Result<ArenaExport, MemError> {
        let mut core = self.core();
        core.check(ticket)?;
        core.exports += 1;
        Ok(ArenaExport {
            arena: self.clone(),
            generation: core.generation,
        })
    }

    /// Live exports of the current generation.
    pub fn live_exports(&self) -> usize {
        self.core().exports
    }

    /// [`Self::reset`], refused while exports of the current generation are
    /// alive (their views would read what the arena hands out next) unless
    /// `allow_live_exports`, which leaves those views dangling.
    pub fn reset_checked(&self, allow_live_exports: bool) -> Result<(), MemError> {
        let mut core = self.core();
        if core.exports > 0 && !allow_live_exports {
            return Err(MemError::invalid(format!(
                "reset refused: {} export(s) of this arena's memory (DLPack capsules, or the \
                 tensors and arrays made from them) are alive, and after a reset they would read \
                 whatever the arena hands out next; drop them first, or pass \
                 unsafe_allow_live_exports=True to reset anyway (those views then dangle)",
                core.exports
            )));
        }
        core.reset();
        Ok(())
    }

    /// Whether a ticket is still valid here (and the arena awake).
    pub fn is_valid(&self, ticket: &ArenaSpan) -> bool {
        self.core().check(ticket).is_ok()
    }

    /// Puts the arena to sleep: at level 1 its used bytes are copied to
    /// pinned memory from `host` first; at level 2 they are dropped. Then
    /// the whole region is decommitted (its reservation, and so every
    /// address, stays). Takes and spans are refused with
    /// [`MemError::Asleep`] until [`SharedArena::wake`]. Needs a growable
    /// region ([`MemError::BackendUnavailable`] otherwise). All or nothing:
    /// on failure the arena is awake and unchanged. Returns the host bytes
    /// held.
    pub fn sleep(&self, level: u8, host: Option<&PinnedHost>) -> Result<u64, MemError> {
        self.core().sleep(level, host)
    }

    /// Recommits the region at the same base and, after a level-1 sleep,
    /// copies the saved bytes back; the host copy is freed. After level 2
    /// the bytes are undefined (the caller reloads them into the same
    /// spans). A no-op when awake; on failure it still sleeps.
    pub fn wake(&self) -> Result<(), MemError> {
        self.core().wake()
    }

    /// The sleep level, `None` when awake.
    pub fn asleep(&self) -> Option<u8> {
        self.core().sleep.as_ref().map(|s| s.level)
    }

    /// Bytes of pinned host memory the arena holds for sleeping: the copy
    /// of a sleeping arena, and the buffer kept for the next sleep (after a
    /// wake, or pinned ahead by [`SharedArena::pin_host_copy`]).
    pub fn host_bytes(&self) -> u64 {
        let core = self.core();
        let copy = core.sleep.as_ref().and_then(|s| s.copy.as_ref());
        let spare = core.spare_copy.as_ref();
        (copy.map_or(0, PinnedBuffer::len) + spare.map_or(0, PinnedBuffer::len)) as u64
    }

    /// Pins `bytes` of host memory from `host` and keeps it as the buffer
    /// the next level-1 sleep copies into, so that sleep does not pin.
    /// Pinning takes seconds for gigabytes, so it runs outside the arena's
    /// lock (takes go on meanwhile: a weight load); only the install takes
    /// it. A buffer already held (a spare, or a sleeping copy) of at least
    /// `bytes` is kept and nothing is pinned; a smaller spare is replaced.
    /// Returns the bytes now held.
    pub fn pin_host_copy(&self, bytes: usize, host: &PinnedHost) -> Result<u64, MemError> {
        let held = |core: &ArenaCore| {
            let copy = core.sleep.as_ref().and_then(|s| s.copy.as_ref());
            let spare = core.spare_copy.as_ref();
            copy.map_or(0, PinnedBuffer::len)
                .max(spare.map_or(0, PinnedBuffer::len))
        };
        let before = held(&self.core());
        if before >= bytes {
            return Ok(before as u64);
        }
        let buffer = host.allocate(bytes)?;
        let mut core = self.core();
        let now = held(&core);
        // A sleep may have pinned its own meanwhile; the larger one stays.
        let dropped = if now >= bytes {
            Some(buffer)
        } else {
            core.spare_copy.replace(buffer)
        };
        let kept = held(&core) as u64;
        drop(core);
        // Freed outside the lock too: unpinning is not free either.
        drop(dropped);
        Ok(kept)
    }

    /// Frees the pinned buffer kept after a wake (a no-op while asleep:
    /// that copy is T1's bytes). Returns the bytes freed.
    pub fn release_host_copy(&self) -> u64 {
        self.core().spare_copy.take().map_or(0, |c| c.len() as u64)
    }

    /// Whether its region is growable (it can sleep, and a swap resizes it
    /// in place).
    pub fn is_growable(&self) -> bool {
        self.core().region.is_growable()
    }

    /// Handles to this arena alive now (this one included).
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// What a sleeping arena had committed (0 when awake).
    pub fn sleeping_committed(&self) -> usize {
        self.core().sleep.as_ref().map_or(0, |s| s.committed)
    }

    /// Address space held by the region (at least the capacity).
    pub fn reserved(&self) -> usize {
        self.core().region.reserved()
    }

    /// The first address.
    pub fn base(&self) -> usize {
        self.core().region.base()
    }

    /// A new size for a model swap: resets the arena, sets the limit of
    /// its takes to `limit` and commits or decommits its region to it. The
    /// commit (growth) comes before the reset, so a refused commit changes
    /// nothing; a decommit runs after it. Refused while asleep or when
    /// `limit` is past the reservation.
    pub(crate) fn resize_for_swap(&self, limit: usize) -> Result<(), MemError> {
        let mut core = self.core();
        if let Some(err) = core.asleep_error("a resize") {
            return Err(err);
        }
        if limit > core.region.reserved() {
            return Err(MemError::invalid(format!(
                "a limit of {limit} B is past the arena's reservation of {} B",
                core.region.reserved()
            )));
        }
        if core.region.is_growable() && limit > core.region.len() {
            core.region.commit(limit as u64)?;
        }
        core.reset();
        core.limit = limit;
        if core.region.is_growable() && limit < core.region.len() {
            core.region.decommit(limit as u64)?;
        }
        Ok(())
    }

    /// An arena over `region` whose takes end at `limit` (at most the
    /// reservation).
    pub fn from_region_limited(tier: Tier, region: Region, limit: usize) -> Result<Self, MemError> {
        let arena = Self::from_region(tier, region)?;
        {
            let mut core = arena.core();
            core.limit = limit.min(core.region.reserved());
        }
        Ok(arena)
    }

    /// Frees everything at once and bumps the generation; older tickets are
    /// refused from now on.
    pub fn reset(&self) {
        self.core().reset();
    }

    /// The counters.
    pub fn stats(&self) -> ArenaStats {
        self.core().stats()
    }

    /// The tier it serves.
    pub fn tier(&self) -> Tier {
        self.inner.tier
    }

    /// The tag its region is charged to.
    pub fn tag(&self) -> Tag {
        self.inner.tag
    }

    /// Where its memory lives.
    pub fn placement(&self) -> Placement {
        self.inner.placement
    }

    /// The process-unique id its tickets carry.
    pub fn id(&self) -> u64 {
        self.core().id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeBackend, FakeConfig};

    fn fake() -> FakeBackend {
        FakeBackend::new(FakeConfig::default()).unwrap()
    }

    #[test]
    fn takes_are_aligned_disjoint_and_counted() {
        let fb = fake();
        let arena = Arena::new(&fb, Tier::ModelResident, 4096, None).unwrap();
        let a = arena.take(10, 1).unwrap();
        let b = arena.take(100, 64).unwrap();
        assert_eq!(b.addr() % 64, 0);
        assert!(b.addr() >= a.addr() + 10);
        let stats = arena.stats();
        assert_eq!(stats.used, b.addr() + 100 - a.addr());
        assert_eq!(stats.takes, 2);
        assert_eq!(
            fb.stats().tags.get(&Tag::Weights).map(|t| t.live),
            Some(4096)
        );
    }

    #[test]
    fn a_checked_reset_refuses_live_exports_of_this_generation_only() {
        let fb = fake();
        let arena = SharedArena::new(fb.backend(), Tier::ModelResident, 4096, None).unwrap();
        let t = arena.take(64, 8).unwrap();
        let (e1, e2) = (arena.export(&t).unwrap(), arena.export(&t).unwrap());
        let err = arena.reset_checked(false).unwrap_err();
        assert!(err.to_string().contains("2 export(s)"), "{err}");
        drop(e1);
        assert_eq!(arena.live_exports(), 1);
        arena.reset_checked(true).unwrap();
        // The forced reset left e2 dangling; it no longer counts, and its
        // drop does not touch the new generation's count.
        let t2 = arena.take(64, 8).unwrap();
        let e3 = arena.export(&t2).unwrap();
        drop(e2);
        assert_eq!(arena.live_exports(), 1);
        assert!(
            arena.export(&t).is_err(),
            "a stale ticket cannot be exported"
        );
        drop(e3);
        arena.reset_checked(false).unwrap();
    }

    #[test]
    fn exhaustion_is_a_capacity_error_that_changes_nothing() {
        let fb = fake();
        let arena = Arena::new(&fb, Tier::EnginePersistent, 1024, None).unwrap();
        arena.take(1000, 8).unwrap();
        let before = arena.stats();
        let err = arena.take(100, 8).unwrap_err();
        assert!(matches!(err, MemError::Capacity(_)), "{err}");
        assert!(err.to_string().contains("plan a larger arena"), "{err}");
        assert_eq!(arena.stats(), before);
    }

    #[test]
    fn reset_frees_wholesale_poisons_and_bumps_generation() {
        let fb = fake();
        let mut arena = Arena::new(&fb, Tier::ModelResident, 4096, None).unwrap();
        let addr = {
            let s = arena.take(64, 16).unwrap();
            fb.write(s.addr(), &[7u8; 64]).unwrap();
            s.addr()
        };
        arena.reset();
        assert!(fb.is_poisoned(addr, 64).unwrap());
        let stats = arena.stats();
        assert_eq!((stats.used, stats.generation, stats.high_water), (0, 1, 64));
        assert_eq!(arena.take(64, 16).unwrap().addr(), addr);
    }

    #[test]
    fn shared_tickets_are_refused_after_reset_and_by_other_arenas() {
        let fb = fake();
        let one = SharedArena::new(&fb, Tier::ModelResident, 4096, None).unwrap();
        let two = SharedArena::new(&fb, Tier::EnginePersistent, 4096, None).unwrap();
        let t = one.take(32, 8).unwrap();
        assert_eq!(one.span(&t).unwrap().len(), 32);
        assert!(matches!(two.span(&t), Err(MemError::InvalidArgument(_))));
        one.reset();
        assert!(matches!(one.span(&t), Err(MemError::StaleSpan(_))));
        assert!(!one.is_valid(&t));
    }

    #[test]
    fn growable_region_commits_on_demand_without_moving() {
        let fb = fake();
        let region = fb.acquire_growable(1 << 20, 4096, Tag::Workspace).unwrap();
        let base = region.base();
        let arena = Arena::from_region(Tier::EnginePersistent, region).unwrap();
        let a = arena.take(4096, 256).unwrap();
        let b = arena.take(100_000, 256).unwrap();
        assert_eq!(a.addr(), base);
        assert!(arena.stats().committed >= b.addr() + 100_000 - base);
    }

    #[test]
    fn wrong_tier_and_bad_arguments_are_refused() {
        let fb = fake();
        assert!(matches!(
            Arena::new(&fb, Tier::Scratch, 4096, None),
            Err(MemError::InvalidArgument(_))
        ));
        let arena = Arena::new(&fb, Tier::ModelResident, 4096, None).unwrap();
        assert!(matches!(
            arena.take(0, 8),
            Err(MemError::InvalidArgument(_))
        ));
        assert!(matches!(
            arena.take(8, 3),
            Err(MemError::InvalidArgument(_))
        ));
        assert!(matches!(
            arena.take(8, 1 << 31),
            Err(MemError::InvalidArgument(_))
        ));
        assert!(matches!(
            arena.take(usize::MAX, 1),
            Err(MemError::Capacity(_))
        ));
    }
}
