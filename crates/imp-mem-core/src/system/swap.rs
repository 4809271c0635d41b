//! Model swap (issue 19, seed A2 and A3.2): T1 replaced in place, T2 kept.
//!
//! [`MemorySystem::swap_model`] moves the system from its plan to a new
//! model's plan without a restart. It first checks, changing nothing:
//!
//! * what survives a swap — the budget, T2, the context and the library
//!   reserve — is what the new plan assumes (an itemised refusal otherwise);
//! * no export of T1's memory is alive (a view would read the next model);
//! * every tier that holds model data is idle: no live block in any pool (a
//!   KV manager's prefix cache holds blocks, and its bytes belong to the old
//!   model), no open scratch; a pool that is re-laid has no handle outside
//!   the system (a KV manager on it must be dropped and rebuilt);
//! * the new layout fits the budget once the old tiers it replaces are gone.
//!
//! Then, inside the backend's replanning bracket (the phase reads PLANNING
//! and returns to SERVING when it closes), it releases the tiers whose
//! layout changes (they are idle), opens them with the new layout, and
//! resets T1 and resizes it to the new plan. On a growable backend T1 was
//! reserved for the largest T1 a compatible plan can give, so the resize is
//! a commit or a decommit at the same base: T1's address does not move, and
//! T2's never does (it is not touched).
//!
//! Failure: every acquisition is ordered before T1 is reset when the budget
//! allows it (always when the new T1 is at least the old one's size), so a
//! refused acquisition or commit rolls back — the released tiers are
//! reopened with the old layout — and the old model serves on, with its
//! weights, nothing leaked ([`SwapError::old_model_kept`]). Where the new
//! tiers fit only once T1 has shrunk, T1 is reset first; a failure after
//! that restores the old layout with T1 reset (its weights must be
//! reloaded), and says so.
//!
//! Thread safety: `&mut self`; the tiers' own locks guard each step.

use crate::arena::SharedArena;
use crate::backend::ReplanGuard;
use crate::error::MemError;
use crate::phase::Phase;
use crate::planner::MemoryPlan;
use crate::units::human_bytes;

use super::open::Step;
use super::{Handle, MemorySystem, Slot};

const T1: &str = "model_resident";
const T2: &str = "engine_persistent";

/// What a model swap did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SwapReport {
    /// Tiers whose layout the new plan keeps (T2 always), untouched.
    pub kept: Vec<String>,
    /// Tiers released and opened again with the new plan's layout.
    pub relaid: Vec<String>,
    /// Tiers the new plan adds.
    pub opened: Vec<String>,
    /// Tiers the new plan drops.
    pub released: Vec<String>,
    /// T1 was reset and resized inside its reservation: same base.
    pub t1_in_place: bool,
    /// T1's base before and after.
    pub t1_base: Option<(usize, usize)>,
    /// The KV pool was re-laid (its geometry changed): a KV manager must be
    /// built on the new pool, and its prefix cache starts empty.
    pub prefix_cache_dropped: bool,
}

/// A refused or failed swap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model swap failed: {error}{}", self.outcome())]
pub struct SwapError {
    /// The underlying error, whose kind the caller sees.
    pub error: MemError,
    /// True when the old model still serves with its weights (every check
    /// and refusal, and a failure rolled back before T1 was reset).
    pub old_model_kept: bool,
    /// Tiers of the old layout that could not be reopened (empty unless a
    /// rollback itself failed).
    pub missing: Vec<String>,
}

impl SwapError {
    fn refused(error: MemError) -> Self {
        Self {
            error,
            old_model_kept: true,
            missing: Vec::new(),
        }
    }

    fn outcome(&self) -> String {
        let mut out = if self.old_model_kept {
            " (nothing changed: the old model serves on)".to_string()
        } else {
            " (the old layout was restored, but T1 was reset: reload the old model's weights)"
                .to_string()
        };
        if !self.missing.is_empty() {
            out.push_str(&format!(
                "; these tiers could not be reopened: {}",
                self.missing.join(", ")
            ));
        }
        out
    }
}

/// How T1 changes.
enum T1Change {
    /// Neither plan has a T1.
    None,
    /// Reset and resized inside its reservation.
    InPlace {
        arena: SharedArena,
        old_limit: usize,
        new_limit: usize,
    },
    /// Released, and the new one (if any) opened as a new region.
    Replace { new: Option<Step> },
}

/// Opens `steps` in order, or none of them.
fn open_all(system: &MemorySystem, steps: Vec<Step>) -> Result<Vec<Slot>, MemError> {
    let mut slots = Vec::with_capacity(steps.len());
    for step in steps {
        let handle = (step.open)(&system.backend)?;
        slots.push(Slot {
            key: step.key,
            label: step.label,
            tier: step.tier,
            tag: step.tag,
            planned: step.planned,
            cost: step.cost,
            layout: step.layout,
            handle,
        });
    }
    Ok(slots)
}

fn committed(slot: &Slot) -> u64 {
    match &slot.handle {
        Handle::Arena(a) => a.stats().committed as u64,
        Handle::Pool(p) => p.stats().committed_bytes,
        Handle::Activations(p) => p.committed(),
        Handle::Scratch(s) => s.stats().capacity as u64,
    }
}

impl MemorySystem {
    /// Swaps the model: see the module documentation. On success the
    /// system serves the new plan, its T1 empty and ready for the new
    /// weights.
    pub fn swap_model(&mut self, plan: &MemoryPlan) -> Result<SwapReport, SwapError> {
        if self.closed {
            return Err(SwapError::refused(self.closed_error()));
        }
        self.swap_checks(plan).map_err(SwapError::refused)?;
        let mut report = SwapReport::default();
        let mut new_steps =
            Self::steps(&self.backend, plan, &self.options).map_err(SwapError::refused)?;
        let order: Vec<String> = new_steps.iter().map(|s| s.key.clone()).collect();
        let old_order: Vec<String> = self.slots.iter().map(|s| s.key.clone()).collect();
        let new_t1 = new_steps
            .iter()
            .position(|s| s.key == T1)
            .map(|i| new_steps.remove(i));
        new_steps.retain(|step| match self.slot(&step.key) {
            Some(slot) if slot.layout == step.layout => {
                report.kept.push(step.key.clone());
                false
            }
            Some(_) => {
                report.relaid.push(step.key.clone());
                true
            }
            None => {
                report.opened.push(step.key.clone());
                true
            }
        });
        for slot in &self.slots {
            if slot.key != T1 && !order.contains(&slot.key) {
                report.released.push(slot.key.clone());
            }
        }
        report.prefix_cache_dropped = report.relaid.iter().any(|k| k == "kv_pool")
            || report.released.iter().any(|k| k == "kv_pool");
        let goes = |key: &str| {
            report.relaid.iter().any(|k| k == key) || report.released.iter().any(|k| k == key)
        };
        let old_t1 = self.weights_arena();
        let t1 = match (&old_t1, new_t1) {
            (Some(a), Some(step)) if a.is_growable() && step.planned as usize <= a.reserved() => {
                T1Change::InPlace {
                    arena: a.clone(),
                    old_limit: a.stats().capacity,
                    new_limit: step.planned as usize,
                }
            }
            (None, None) => T1Change::None,
            (_, new) => T1Change::Replace { new },
        };
        let t1_before = old_t1.as_ref().map(SharedArena::base);
        // Our own clone must not count as a handle below.
        drop(old_t1);
        // The idle checks that depend on the classification.
        for slot in &self.slots {
            if let Handle::Pool(p) = &slot.handle {
                if goes(&slot.key) && p.handles() > 1 {
                    return Err(SwapError::refused(MemError::invalid(format!(
                        "swap_model refused: the {} is re-laid by the new plan but {} other \
                         handle(s) to it are alive (a KV manager, a BlockPool object); drop \
                         them first and build a new manager after the swap",
                        slot.label,
                        p.handles() - 1
                    ))));
                }
            }
            if let Handle::Activations(p) = &slot.handle {
                let live = p.stats().live;
                if goes(&slot.key) && live > 0 {
                    return Err(SwapError::refused(MemError::invalid(format!(
                        "swap_model refused: the new plan re-lays the activation pool but {live} \
                         allocation(s) in it are live (torch's cached segments among them); \
                         free them and call torch.cuda.empty_cache() first"
                    ))));
                }
            }
            if let (Handle::Arena(a), T1Change::Replace { .. }) = (&slot.handle, &t1) {
                if slot.key == T1 && a.handles() > 1 {
                    return Err(SwapError::refused(MemError::invalid(format!(
                        "swap_model refused: T1 is replaced by a new region but {} other \
                         handle(s) to the old one are alive; drop them first",
                        a.handles() - 1
                    ))));
                }
            }
        }
        // The budget, once the tiers it replaces are gone.
        let stats = self.backend.stats();
        let freed: u64 = self
            .slots
            .iter()
            .filter(|s| goes(&s.key) || (s.key == T1 && matches!(t1, T1Change::Replace { .. })))
            .map(committed)
            .sum();
        let granule = self.backend.info().granularity.max(1) as u64;
        let others: u64 = new_steps.iter().map(|s| s.cost).sum();
        let (t1_now, t1_new) = match &t1 {
            T1Change::InPlace {
                arena, new_limit, ..
            } => (
                arena.stats().committed as u64,
                (*new_limit as u64).div_ceil(granule) * granule,
            ),
            T1Change::Replace { new } => (0, new.as_ref().map_or(0, |s| s.cost)),
            T1Change::None => (0, 0),
        };
        let base = stats.total.committed.saturating_sub(freed + t1_now);
        let after = base + others + t1_new;
        if after > stats.budget {
            return Err(SwapError::refused(MemError::invalid(format!(
                "swap_model refused: the new layout needs {} committed ({} kept, {} for the \
                 re-laid and new tiers, {} for T1) but the budget is {}; plan the new model \
                 with this system's budget",
                human_bytes(after),
                human_bytes(base),
                human_bytes(others),
                human_bytes(t1_new),
                human_bytes(stats.budget)
            ))));
        }
        let old_steps: Vec<Step> = Self::steps(&self.backend, &self.plan, &self.options)
            .map_err(SwapError::refused)?
            .into_iter()
            .filter(|s| goes(&s.key) || (s.key == T1 && matches!(t1, T1Change::Replace { .. })))
            .collect();
        report.t1_in_place = matches!(t1, T1Change::InPlace { .. });
        let bracket = self.swap_bracket().map_err(SwapError::refused)?;
        let result = self.swap_execute(t1, new_steps, old_steps, &goes_list(&report), others);
        drop(bracket);
        match result {
            Ok(()) => {
                self.sort_slots(&order);
                if let Some(slot) = self.slots.iter_mut().find(|s| s.key == T1) {
                    slot.planned = plan.model_resident;
                    slot.layout = format!("arena {}", plan.model_resident);
                }
                self.plan = plan.clone();
                report.t1_base = t1_before.zip(self.weights_arena().map(|a| a.base()));
                Ok(report)
            }
            Err(err) => {
                self.sort_slots(&old_order);
                Err(err)
            }
        }
    }

    /// Everything that refuses a swap before the layout is even compared.
    fn swap_checks(&self, plan: &MemoryPlan) -> Result<(), MemError> {
        let asleep = self.asleep();
        if !asleep.is_empty() {
            return Err(MemError::invalid(format!(
                "swap_model refused: {} sleep; call wake() first",
                asleep
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let old = &self.plan;
        let mut items: Vec<String> = Vec::new();
        let mut compare = |what: &str, new: u64, now: u64| {
            if new != now {
                items.push(format!(
                    "{what}: the new plan has {} ({new} B), this system {} ({now} B)",
                    human_bytes(new),
                    human_bytes(now)
                ));
            }
        };
        compare("budget", plan.budget, old.budget);
        compare(
            "T2 engine-persistent",
            plan.engine_persistent,
            old.engine_persistent,
        );
        compare("CUDA context", plan.context, old.context);
        compare("library reserve", plan.library_reserve, old.library_reserve);
        if !items.is_empty() {
            return Err(MemError::invalid(format!(
                "swap_model refused: the new plan changes what survives a swap; plan the new \
                 model with this system's budget, T2, context and library reserve:\n  - {}",
                items.join("\n  - ")
            )));
        }
        if let Some(t1) = self.weights_arena() {
            let exports = t1.live_exports();
            if exports > 0 {
                return Err(MemError::invalid(format!(
                    "swap_model refused: {exports} export(s) of T1's memory (DLPack capsules, or \
                     the tensors and arrays made from them) are alive, and after the swap they \
                     would read the next model's bytes; drop them first"
                )));
            }
        }
        let mut busy: Vec<String> = Vec::new();
        for slot in self.slots.iter().filter(|s| s.key != T2 && s.key != T1) {
            match &slot.handle {
                Handle::Pool(p) => {
                    let live = p.stats().live;
                    if live > 0 {
                        busy.push(format!(
                            "{} has {live} live block(s) (sequences, or prefix-cache entries)",
                            slot.label
                        ));
                    }
                }
                Handle::Scratch(s) => {
                    let used = s.stats().used;
                    if used > 0 {
                        busy.push(format!("{} has {used} B open", slot.label));
                    }
                }
                // Kept as it is unless the new plan re-lays it (below).
                Handle::Arena(_) | Handle::Activations(_) => {}
            }
        }
        if !busy.is_empty() {
            return Err(MemError::invalid(format!(
                "swap_model refused: the tiers hold the old model's data:\n  - {}\nfree or abort \
                 every sequence and evict the prefix cache (or drop the KV manager), and close \
                 scratch scopes, first",
                busy.join("\n  - ")
            )));
        }
        Ok(())
    }

    fn swap_bracket(&self) -> Result<Option<ReplanGuard>, MemError> {
        if self.backend.phase() == Phase::Serving {
            self.backend.replanning("model swap").map(Some)
        } else {
            Ok(None)
        }
    }

    fn sort_slots(&mut self, order: &[String]) {
        self.slots
            .sort_by_key(|s| order.iter().position(|k| *k == s.key).unwrap_or(usize::MAX));
    }

    /// The acquisitions, in the order of the module documentation.
    fn swap_execute(
        &mut self,
        t1: T1Change,
        new_steps: Vec<Step>,
        old_steps: Vec<Step>,
        goes: &[String],
        others_cost: u64,
    ) -> Result<(), SwapError> {
        // The replaced tiers are idle: releasing them loses nothing.
        let (gone, keep): (Vec<Slot>, Vec<Slot>) = std::mem::take(&mut self.slots)
            .into_iter()
            .partition(|s| goes.contains(&s.key));
        self.slots = keep;
        drop(gone);
        let stats = self.backend.stats();
        let room = stats.budget.saturating_sub(stats.total.committed);
        match t1 {
            T1Change::InPlace {
                arena,
                old_limit,
                new_limit,
            } => {
                let generation = arena.stats().generation;
                if new_limit >= old_limit || others_cost <= room {
                    let opened = match open_all(self, new_steps) {
                        Ok(opened) => opened,
                        Err(e) => return Err(self.roll_back(e, old_steps, None, true)),
                    };
                    self.slots.extend(opened);
                    if let Err(e) = arena.resize_for_swap(new_limit) {
                        // A refused commit comes before the reset: T1 is as it was.
                        let kept = arena.stats().generation == generation;
                        self.drop_new(goes);
                        let t1 = (!kept).then_some((&arena, old_limit));
                        return Err(self.roll_back(e, old_steps, t1, kept));
                    }
                } else {
                    if let Err(e) = arena.resize_for_swap(new_limit) {
                        let kept = arena.stats().generation == generation;
                        let t1 = (!kept).then_some((&arena, old_limit));
                        return Err(self.roll_back(e, old_steps, t1, kept));
                    }
                    match open_all(self, new_steps) {
                        Ok(opened) => self.slots.extend(opened),
                        Err(e) => {
                            return Err(self.roll_back(
                                e,
                                old_steps,
                                Some((&arena, old_limit)),
                                false,
                            ))
                        }
                    }
                }
                Ok(())
            }
            T1Change::Replace { new } => {
                let new_cost = new.as_ref().map_or(0, |s| s.cost);
                let mut steps = new_steps;
                steps.extend(new);
                let beside = others_cost + new_cost <= room;
                if !beside {
                    self.release_t1();
                }
                match open_all(self, steps) {
                    Ok(opened) => {
                        self.release_t1();
                        self.slots.extend(opened);
                        Ok(())
                    }
                    Err(e) => Err(self.roll_back(e, old_steps, None, beside)),
                }
            }
            T1Change::None => match open_all(self, new_steps) {
                Ok(opened) => {
                    self.slots.extend(opened);
                    Ok(())
                }
                Err(e) => Err(self.roll_back(e, old_steps, None, true)),
            },
        }
    }

    fn release_t1(&mut self) {
        if let Some(t1) = self.weights_arena() {
            t1.reset();
        }
        self.slots.retain(|s| s.key != T1);
    }

    /// Drops the tiers this swap opened (those named in `goes` and not yet
    /// part of the old layout again).
    fn drop_new(&mut self, goes: &[String]) {
        self.slots.retain(|s| !goes.contains(&s.key));
    }

    /// Restores the old layout after `error`: the old tiers reopened from
    /// `old_steps`, T1 back to its old limit. `kept`: T1 was never reset.
    fn roll_back(
        &mut self,
        error: MemError,
        old_steps: Vec<Step>,
        t1: Option<(&SharedArena, usize)>,
        kept: bool,
    ) -> SwapError {
        let mut missing = Vec::new();
        if let Some((arena, limit)) = t1 {
            if arena.resize_for_swap(limit).is_err() {
                missing.push(T1.to_string());
            }
        }
        for step in old_steps {
            if self.slot(&step.key).is_some() {
                continue;
            }
            let key = step.key.clone();
            match open_all(self, vec![step]) {
                Ok(slots) => self.slots.extend(slots),
                Err(_) => missing.push(key),
            }
        }
        SwapError {
            error,
            old_model_kept: kept && missing.is_empty(),
            missing,
        }
    }
}

fn goes_list(report: &SwapReport) -> Vec<String> {
    report
        .relaid
        .iter()
        .chain(&report.released)
        .chain(&report.opened)
        .cloned()
        .collect()
}
