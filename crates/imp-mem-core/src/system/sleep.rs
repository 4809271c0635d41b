//! Sleep and wake (issue 19): a system's tiers hand their physical memory
//! back to the driver and take it again at the same virtual addresses.
//!
//! Algorithm: a tier sleeps by decommitting its whole growable region; the
//! reservation stays, so every base and every address inside it is the same
//! after [`MemorySystem::wake`] recommits it — a CUDA graph captured over
//! those addresses replays without re-capture. At level 1 T1's used bytes are
//! first copied to pinned host memory (T5b, planned as
//! [`MemoryPlan::sleep_host`](crate::planner::MemoryPlan::sleep_host)) and
//! copied back on wake; the KV pool's bytes are dropped at either level (it
//! must be idle). Level 2 drops T1's bytes too: the caller reloads the weights
//! into the same spans. T2 never sleeps (the engine's own buffers, graph
//! workspaces included). While a tier sleeps its allocator refuses use
//! ([`MemError::Asleep`]), the phase guard refuses acquisitions for its tag,
//! and the report lists it. A backend without growable regions refuses with
//! [`MemError::BackendUnavailable`] before anything changes.
//!
//! The pinned buffer of a level-1 sleep is kept after the wake, so the next
//! sleep copies at once instead of pinning gigabytes again (what T5b was
//! planned for); [`MemorySystem::release_sleep_host`] frees it.
//!
//! The first sleep need not pin: [`MemorySystem::pin_sleep_host`] pins that
//! buffer ahead (at load, on a background thread, overlapped with the weight
//! load), outside every lock, so the first sleep copies at the line rate.
//!
//! A sleep is all or nothing: if one tier refuses, those already asleep are
//! woken again before the error returns. A wake is staged when the caller
//! names tiers ([`MemorySystem::wake`] with `Some(["weights"])`, update the
//! weights, then `Some(["kv_cache"])`): the peak is what the named tiers
//! commit, not all of them. A wake that fails part-way (the device has no
//! room yet: a trainer's cache still holds it) leaves the tiers it could not
//! wake asleep, with their host copies; the [`WakeError`] says how many bytes
//! they need, what the device and the budget had, and which tiers still
//! sleep; calling it again retries them.
//!
//! Thread safety: each tier sleeps under its own lock; the system's methods
//! take `&self`. A sleep racing the tiers' users is refused by the tiers
//! (a live block, a take) rather than corrupting them; the caller is expected
//! to quiesce the engine first, as for any sleep.

use crate::arena::SharedArena;
use crate::error::MemError;
use crate::pinned::PinnedHost;
use crate::tag::Tag;
use crate::units::human_bytes;

use super::{Handle, MemorySystem, Slot};

/// Tier keys that sleep when the caller names none.
pub const DEFAULT_SLEEP_TIERS: [&str; 3] = ["model_resident", "activations", "kv_pool"];

/// The groups a serving engine sleeps and wakes by name, in this order,
/// each with the tags of the tiers it covers: its weights (T1), its KV cache
/// (the KV pool and the sliding-window pool: one cache in two id spaces) and
/// torch's activations (T4a). T2 and scratch never sleep; the per-sequence
/// state pools sleep by their own key.
pub const SLEEP_GROUPS: [(&str, &[Tag]); 3] = [
    ("weights", &[Tag::Weights]),
    ("kv_cache", &[Tag::KvCache, Tag::SwaCache]),
    ("activations", &[Tag::Activations]),
];

/// The sleep level `level` names: 1 or 2, anything else refused. `level`
/// is None for a value that is no integer at all (a binding's bool or
/// float); `shown` is the value as the caller wrote it, so that the
/// refusal names it as given.
pub fn sleep_level(level: Option<i64>, shown: &dyn std::fmt::Display) -> Result<u8, MemError> {
    match level {
        Some(1) => Ok(1),
        Some(2) => Ok(2),
        _ => Err(MemError::invalid(format!(
            "level={shown}: a sleep level is 1 (T1 kept in pinned host memory, the KV cache \
             dropped) or 2 (both dropped)"
        ))),
    }
}

/// One tier put to sleep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SleptTier {
    /// The tier's key (`model_resident`, `kv_pool`, ...).
    pub key: String,
    /// Its tag.
    pub tag: Tag,
    /// Bytes of device memory it gave back.
    pub released: u64,
    /// Bytes of pinned host memory now holding its copy (level 1, T1).
    pub host_bytes: u64,
}

/// What [`MemorySystem::sleep`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SleepReport {
    /// The level slept at.
    pub level: u8,
    /// The tiers, in open order.
    pub tiers: Vec<SleptTier>,
}

impl SleepReport {
    /// Device bytes given back, over every tier.
    pub fn released(&self) -> u64 {
        self.tiers.iter().map(|t| t.released).sum()
    }

    /// Pinned host bytes held, over every tier.
    pub fn host_bytes(&self) -> u64 {
        self.tiers.iter().map(|t| t.host_bytes).sum()
    }
}

/// T1's level-1 host buffer to pin ahead of the first sleep
/// ([`MemorySystem::sleep_host_pin`]): the arena and the size, checked.
#[derive(Debug, Clone)]
pub struct SleepHostPin {
    arena: SharedArena,
    bytes: usize,
}

impl SleepHostPin {
    /// The bytes it pins.
    pub fn bytes(&self) -> u64 {
        self.bytes as u64
    }

    /// Pins the buffer (seconds for gigabytes: a background thread's work)
    /// and installs it as T1's spare copy, which the next level-1 sleep
    /// copies into when it is large enough. Pinning holds no lock; only the
    /// install takes the arena's. A buffer already held of at least these
    /// bytes is kept and nothing is pinned. Returns the bytes held.
    pub fn pin(&self, host: &PinnedHost) -> Result<u64, MemError> {
        self.arena.pin_host_copy(self.bytes, host)
    }
}

/// A wake that failed or was refused. The tiers it did not wake still
/// sleep, with their host copies: the system is as it was but for the
/// tiers in `woken`, and calling wake again retries the rest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("wake failed: {error}{}", self.outcome())]
pub struct WakeError {
    /// The underlying error, whose kind the caller sees (`OutOfMemory` when
    /// the device or the budget had no room).
    pub error: MemError,
    /// Bytes the tiers this wake did not wake need to commit (0 for a
    /// refusal of the arguments).
    pub needed: u64,
    /// The device's free bytes when it failed, where the backend can read
    /// its device (a VMM or CUDA backend; the fake cannot).
    pub device_free: Option<u64>,
    /// What the backend's budget still allowed when it failed.
    pub budget_free: u64,
    /// Tiers this call woke before it failed.
    pub woken: Vec<String>,
    /// Every tier still asleep, in open order.
    pub still_asleep: Vec<String>,
}

impl WakeError {
    fn refused(system: &MemorySystem, error: MemError) -> Box<Self> {
        Self::failed(system, error, 0, Vec::new())
    }

    fn failed(
        system: &MemorySystem,
        error: MemError,
        needed: u64,
        woken: Vec<String>,
    ) -> Box<Self> {
        let stats = system.backend.stats();
        let device_free = if needed > 0 {
            system.backend.mem_info().ok().flatten().map(|d| d.free)
        } else {
            None
        };
        Box::new(Self {
            error,
            needed,
            device_free,
            budget_free: stats.budget.saturating_sub(stats.total.committed),
            woken,
            still_asleep: system.asleep().into_iter().map(|(k, _)| k).collect(),
        })
    }

    fn outcome(&self) -> String {
        if self.needed == 0 {
            return " (nothing changed)".to_string();
        }
        let device = match self.device_free {
            Some(free) => format!("the device had {} free", human_bytes(free)),
            None => "the device's free memory could not be read".to_string(),
        };
        let woken = if self.woken.is_empty() {
            String::new()
        } else {
            format!("; woken before the failure: {}", self.woken.join(", "))
        };
        format!(
            "; the tiers not woken need {} ({device}; the budget allows {} more); still \
             asleep, their host copies kept: {}{woken}; free device memory (a trainer's \
             cache: torch.cuda.empty_cache()) and call wake again",
            human_bytes(self.needed),
            human_bytes(self.budget_free),
            self.still_asleep.join(", ")
        )
    }
}

fn committed_of(slot: &Slot) -> u64 {
    match &slot.handle {
        Handle::Arena(a) => a.stats().committed as u64,
        Handle::Pool(p) => p.stats().committed_bytes,
        Handle::Activations(p) => p.committed(),
        Handle::Scratch(s) => s.stats().capacity as u64,
    }
}

impl MemorySystem {
    /// Puts tiers to sleep at `level` (1: T1's bytes kept in pinned memory
    /// from `host`; 2: dropped). `tiers` names tier keys or tags
    /// (`model_resident` / `weights`, `kv_pool` / `kv_cache`, `swa_pool`,
    /// `state`); `None` sleeps T1 and the KV pool, those the plan has. See
    /// the module documentation for what is refused.
    pub fn sleep(
        &self,
        level: u8,
        tiers: Option<&[&str]>,
        host: Option<&PinnedHost>,
    ) -> Result<SleepReport, MemError> {
        let chosen = self.sleep_checked(level, tiers, host.is_some())?;
        // Pools first: they are idle, so waking one back on a later
        // refusal loses nothing; T1 (whose level-2 sleep drops its bytes)
        // sleeps last, when nothing after it can refuse for a reason it
        // could check first.
        let mut order: Vec<&Slot> = chosen.iter().copied().filter(|s| !is_arena(s)).collect();
        order.extend(chosen.iter().copied().filter(|s| is_arena(s)));
        let mut done: Vec<SleptTier> = Vec::new();
        for slot in order {
            let released = committed_of(slot);
            let result = match &slot.handle {
                Handle::Arena(a) => a.sleep(level, host),
                Handle::Pool(p) => p.sleep(level).map(|_| 0),
                Handle::Activations(p) => p.sleep(level).map(|_| 0),
                Handle::Scratch(_) => Err(MemError::invalid("scratch does not sleep")),
            };
            match result {
                Ok(host_bytes) => {
                    self.backend.set_asleep(slot.tag, Some(level));
                    done.push(SleptTier {
                        key: slot.key.clone(),
                        tag: slot.tag,
                        released,
                        host_bytes,
                    });
                }
                Err(err) => {
                    // All or nothing: wake what already slept, newest first.
                    for slept in done.iter().rev() {
                        if let Some(s) = self.slot(&slept.key) {
                            let _ = wake_slot(self, s);
                        }
                    }
                    return Err(err);
                }
            }
        }
        done.sort_by_key(|t| self.slots.iter().position(|s| s.key == t.key));
        Ok(SleepReport { level, tiers: done })
    }

    /// Whether [`MemorySystem::sleep`] with these arguments would get past
    /// its checks (the level, the backend, the names, a tier already
    /// asleep), without sleeping anything: a caller with work to drain
    /// first (an engine's running requests) asks before it drains. `has_host`:
    /// whether the sleep will be given a [`PinnedHost`]. The tiers' own
    /// refusals (a busy pool) are theirs, at the sleep.
    pub fn check_sleep(
        &self,
        level: u8,
        tiers: Option<&[&str]>,
        has_host: bool,
    ) -> Result<(), MemError> {
        self.sleep_checked(level, tiers, has_host).map(|_| ())
    }

    /// The tiers a sleep at `level` applies to, once every check before
    /// the first tier sleeps has passed.
    fn sleep_checked(
        &self,
        level: u8,
        tiers: Option<&[&str]>,
        has_host: bool,
    ) -> Result<Vec<&Slot>, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let level = sleep_level(Some(i64::from(level)), &level)?;
        if !self.backend.info().growable {
            return Err(MemError::BackendUnavailable(format!(
                "the {} backend has no growable regions, so its tiers cannot give their memory \
                 back and take it again at the same addresses; sleep needs a VMM backend",
                self.backend.info().name
            )));
        }
        let chosen = self.sleep_selection(tiers)?;
        if let Some(slot) = chosen.iter().find(|s| slot_level(s) > 0) {
            return Err(MemError::invalid(format!(
                "tier {} already sleeps (level {}); call wake() first",
                slot.key,
                slot_level(slot)
            )));
        }
        if level == 1 && !has_host && chosen.iter().any(|s| is_arena(s)) {
            return Err(MemError::invalid(
                "sleep level 1 copies T1 to pinned host memory; pass the PinnedHost to copy into",
            ));
        }
        Ok(chosen)
    }

    /// [`SLEEP_GROUPS`] this system has, each with its tier keys in open
    /// order: what a caller sleeps and wakes by group name passes those keys
    /// to [`MemorySystem::sleep`] and [`MemorySystem::wake`].
    pub fn sleep_groups(&self) -> Vec<(&'static str, Vec<String>)> {
        SLEEP_GROUPS
            .iter()
            .filter_map(|(group, tags)| {
                let keys: Vec<String> = self
                    .slots
                    .iter()
                    .filter(|s| tags.contains(&s.tag))
                    .map(|s| s.key.clone())
                    .collect();
                (!keys.is_empty()).then_some((*group, keys))
            })
            .collect()
    }

    /// The tiers a sleep applies to, in open order; a name that is no
    /// tier of this system, or one that cannot sleep, is refused.
    fn sleep_selection(&self, tiers: Option<&[&str]>) -> Result<Vec<&Slot>, MemError> {
        let Some(names) = tiers else {
            return Ok(self
                .slots
                .iter()
                .filter(|s| DEFAULT_SLEEP_TIERS.contains(&s.key.as_str()))
                .collect());
        };
        let mut chosen: Vec<&Slot> = Vec::new();
        for name in names {
            let matching: Vec<&Slot> = self
                .slots
                .iter()
                .filter(|s| s.key == *name || s.tag.name() == *name)
                .collect();
            if matching.is_empty() {
                return Err(MemError::invalid(format!(
                    "tiers: {name:?} is no tier of this system; name one of {:?} (or its tag)",
                    self.tier_keys()
                )));
            }
            for slot in matching {
                match slot.handle {
                    Handle::Arena(_) if slot.key == "engine_persistent" => {
                        return Err(MemError::invalid(
                            "tiers: engine_persistent (T2) does not sleep: it holds the \
                             engine's own buffers, which a sleeping engine keeps",
                        ))
                    }
                    Handle::Scratch(_) => {
                        return Err(MemError::invalid(
                            "tiers: scratch (T4) does not sleep: its region is fixed; it is \
                             what the report names as still committed",
                        ))
                    }
                    _ => {}
                }
                if !chosen.iter().any(|c| c.key == slot.key) {
                    chosen.push(slot);
                }
            }
        }
        chosen.sort_by_key(|c| self.slots.iter().position(|s| s.key == c.key));
        Ok(chosen)
    }

    /// Wakes sleeping tiers, in open order: recommits each at its base and
    /// restores T1's bytes after a level-1 sleep. `tiers` names tier keys
    /// or tags as [`MemorySystem::sleep`] takes them (`weights`,
    /// `kv_cache`, ...); `None` wakes every sleeping tier. A named tier that
    /// is awake is skipped (waking it is a no-op); a name that is no tier,
    /// or a tier that never sleeps (T2, scratch), is refused before anything
    /// changes. Returns the keys woken.
    ///
    /// On failure the tiers not woken still sleep, their host copies kept,
    /// and the [`WakeError`] says what they need; call it again later.
    pub fn wake(&self, tiers: Option<&[&str]>) -> Result<Vec<String>, Box<WakeError>> {
        if self.closed {
            return Err(WakeError::refused(self, self.closed_error()));
        }
        let chosen: Vec<&Slot> = match tiers {
            None => self.slots.iter().collect(),
            Some(_) => self
                .sleep_selection(tiers)
                .map_err(|e| WakeError::refused(self, e))?,
        };
        let pending: Vec<&Slot> = chosen.into_iter().filter(|s| slot_level(s) > 0).collect();
        let mut woken = Vec::new();
        for (i, slot) in pending.iter().enumerate() {
            if let Err(error) = wake_slot(self, slot) {
                let needed = pending[i..].iter().map(|s| sleeping_of(s)).sum();
                return Err(WakeError::failed(self, error, needed, woken));
            }
            woken.push(slot.key.clone());
        }
        Ok(woken)
    }

    /// Device bytes a [`MemorySystem::wake`] of `tiers` would commit now
    /// (the named tiers that sleep; `None`: every sleeping tier), so a
    /// caller can make room first (an engine: empty torch's cache). Names
    /// are checked as `wake` checks them.
    pub fn wake_needs(&self, tiers: Option<&[&str]>) -> Result<u64, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let chosen: Vec<&Slot> = match tiers {
            None => self.slots.iter().collect(),
            Some(_) => self.sleep_selection(tiers)?,
        };
        Ok(chosen
            .into_iter()
            .filter(|s| slot_level(s) > 0)
            .map(sleeping_of)
            .sum())
    }

    /// Checks a request to pin T1's level-1 host buffer ahead of the first
    /// sleep and names what to pin: `bytes`, by default the larger of the
    /// plan's [`sleep_host`](crate::planner::MemoryPlan::sleep_host) (T1's
    /// weights) and what T1 holds now. The pinning itself
    /// ([`SleepHostPin::pin`]) holds no lock of the system's, so a caller
    /// that keeps the system behind a lock of its own releases it first.
    pub fn sleep_host_pin(&self, bytes: Option<u64>) -> Result<SleepHostPin, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let Some(arena) = self.weights_arena() else {
            return Err(MemError::invalid(
                "this system has no T1 (model_resident) tier, so no level-1 sleep copies \
                 anything to host memory; there is nothing to pin",
            ));
        };
        if !arena.is_growable() {
            return Err(MemError::BackendUnavailable(
                "T1 cannot sleep: its region is fixed (open the system on a VMM backend, with \
                 sleepable T1), so a sleep host buffer would never be used"
                    .into(),
            ));
        }
        let stats = arena.stats();
        let bytes = match bytes {
            Some(0) => {
                return Err(MemError::invalid(
                    "nbytes=0: pin at least T1's used bytes, or pass None for the plan's T1 \
                     weights bytes",
                ))
            }
            Some(n) => n,
            None => self.plan.sleep_host.max(stats.used as u64),
        };
        if bytes > stats.capacity as u64 {
            return Err(MemError::invalid(format!(
                "nbytes={bytes} is more than T1 can hold ({} B): a level-1 sleep copies at most \
                 T1's used bytes; pass at most that, or None",
                stats.capacity
            )));
        }
        if bytes == 0 {
            return Err(MemError::invalid(
                "the plan's T1 is empty and T1 holds nothing: there is nothing to pin; pass \
                 nbytes",
            ));
        }
        let bytes = usize::try_from(bytes)
            .map_err(|_| MemError::invalid(format!("nbytes={bytes} does not fit this host")))?;
        Ok(SleepHostPin { arena, bytes })
    }

    /// Pins T1's level-1 host buffer now ([`MemorySystem::sleep_host_pin`]
    /// then [`SleepHostPin::pin`]); returns the bytes held for the sleep.
    pub fn pin_sleep_host(&self, bytes: Option<u64>, host: &PinnedHost) -> Result<u64, MemError> {
        self.sleep_host_pin(bytes)?.pin(host)
    }

    /// Frees the pinned host buffers kept after a wake for the next
    /// level-1 sleep (T5b); returns the bytes freed.
    pub fn release_sleep_host(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| match &s.handle {
                Handle::Arena(a) => a.release_host_copy(),
                _ => 0,
            })
            .sum()
    }

    /// The tiers asleep now, with their levels, in open order.
    pub fn asleep(&self) -> Vec<(String, u8)> {
        self.slots
            .iter()
            .filter(|s| slot_level(s) > 0)
            .map(|s| (s.key.clone(), slot_level(s)))
            .collect()
    }

    /// Bytes the sleeping tiers had committed (given back while they sleep).
    pub(super) fn sleep_released(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| match &s.handle {
                Handle::Arena(a) => a.sleeping_committed() as u64,
                Handle::Pool(p) => p.sleeping_committed() as u64,
                Handle::Activations(p) => p.sleeping_committed() as u64,
                Handle::Scratch(_) => 0,
            })
            .sum()
    }
}

fn slot_level(slot: &Slot) -> u8 {
    super::slot_asleep(slot)
}

/// What a sleeping tier recommits when it wakes.
fn sleeping_of(slot: &Slot) -> u64 {
    match &slot.handle {
        Handle::Arena(a) => a.sleeping_committed() as u64,
        Handle::Pool(p) => p.sleeping_committed() as u64,
        Handle::Activations(p) => p.sleeping_committed() as u64,
        Handle::Scratch(_) => 0,
    }
}

fn is_arena(slot: &Slot) -> bool {
    matches!(slot.handle, Handle::Arena(_))
}

fn wake_slot(system: &MemorySystem, slot: &Slot) -> Result<(), MemError> {
    match &slot.handle {
        Handle::Arena(a) => a.wake()?,
        Handle::Pool(p) => p.wake()?,
        Handle::Activations(p) => p.wake()?,
        Handle::Scratch(_) => {}
    }
    // A tag shared by several tiers (the state pools) stays marked while
    // any of them sleeps.
    let still = system
        .slots
        .iter()
        .filter(|s| s.tag == slot.tag)
        .map(slot_level)
        .max()
        .unwrap_or(0);
    system
        .backend
        .set_asleep(slot.tag, (still > 0).then_some(still));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{fake, full_plan, plan, GIB_TEST};
    use super::super::SystemOptions;
    use super::*;
    use crate::units::MIB;

    #[test]
    fn a_sleep_level_is_one_or_two_and_a_refusal_names_the_value_as_given() {
        assert_eq!(sleep_level(Some(1), &1).unwrap(), 1);
        assert_eq!(sleep_level(Some(2), &2).unwrap(), 2);
        for (level, shown) in [
            (Some(0), "0"),
            (Some(3), "3"),
            (Some(-1), "-1"),
            (None, "True"),
        ] {
            let err = sleep_level(level, &shown).unwrap_err();
            assert!(matches!(err, MemError::InvalidArgument(_)));
            assert!(
                err.to_string().contains(&format!("level={shown}:")),
                "{err}"
            );
        }
    }

    #[test]
    fn check_sleep_refuses_as_sleep_does_and_changes_nothing() {
        let fb = fake(GIB_TEST, true);
        let system = MemorySystem::open(&fb, &plan(256 * MIB), SystemOptions::default()).unwrap();
        assert!(system.check_sleep(3, None, true).is_err());
        assert!(system.check_sleep(1, Some(&["nope"]), true).is_err());
        assert!(system.check_sleep(1, Some(&["weights"]), false).is_err());
        system.check_sleep(2, Some(&["weights"]), false).unwrap();
        system.check_sleep(1, Some(&["kv_cache"]), true).unwrap();
        assert!(system.asleep().is_empty(), "a check sleeps nothing");
        system.sleep(1, Some(&["kv_cache"]), None).unwrap();
        let err = system.check_sleep(1, Some(&["kv_pool"]), true).unwrap_err();
        assert!(err.to_string().contains("already sleeps"), "{err}");
        system.check_sleep(1, Some(&["weights"]), true).unwrap();
        system.wake(None).unwrap();
    }

    #[test]
    fn the_kv_cache_group_covers_both_kv_pools_and_sleeps_through_their_keys() {
        let fb = fake(GIB_TEST, true);
        let system = MemorySystem::open(&fb, &full_plan(), SystemOptions::default()).unwrap();
        let groups = system.sleep_groups();
        let names: Vec<&str> = groups.iter().map(|(g, _)| *g).collect();
        assert_eq!(names, ["weights", "kv_cache", "activations"]);
        assert_eq!(groups[0].1, ["model_resident"]);
        assert_eq!(groups[1].1, ["swa_pool", "kv_pool"]);
        let keys: Vec<&str> = groups[1].1.iter().map(String::as_str).collect();
        system.sleep(1, Some(&keys), None).unwrap();
        let asleep: Vec<String> = system.asleep().into_iter().map(|(k, _)| k).collect();
        assert_eq!(asleep, ["swa_pool", "kv_pool"]);
        system.wake(Some(&keys)).unwrap();
        // Without an activation tier there is no activations group.
        let plain = MemorySystem::open(
            &fake(GIB_TEST, true),
            &plan(256 * MIB),
            SystemOptions::default(),
        )
        .unwrap();
        let names: Vec<&str> = plain.sleep_groups().iter().map(|(g, _)| *g).collect();
        assert_eq!(names, ["weights", "kv_cache"]);
    }
}
