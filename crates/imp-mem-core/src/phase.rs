//! The phase guard (seed A3.2, invariant V2).
//!
//! A backend moves `LOADING → PLANNING → SERVING`, one step at a time and
//! never back, except for one bracketed re-entry to planning (a model swap)
//! which returns to serving when it closes. While serving, an acquisition is a
//! bug: the memory should have been planned. In strict mode it is refused with
//! [`MemError::PhaseViolation`]; in production mode it proceeds, is counted in
//! `steady_state_allocations_total{tag}` and warned about once per tag, so an
//! accounting bug never takes a server down.

use std::fmt;

use crate::error::MemError;
use crate::tag::Tag;

/// Where the engine is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Weights are loading; acquisitions are expected.
    Loading,
    /// The plan is being applied; acquisitions are expected.
    Planning,
    /// Serving requests; every byte should already be held.
    Serving,
}

impl Phase {
    /// The phase's name as Python and the journal spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Loading => "LOADING",
            Phase::Planning => "PLANNING",
            Phase::Serving => "SERVING",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an acquisition while serving does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhaseMode {
    /// Refuse it with [`MemError::PhaseViolation`] (tests, debug builds).
    Strict,
    /// Let it proceed, count it and warn once per tag (production servers).
    Production,
}

/// What the guard decided about one acquisition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Not serving: go ahead.
    Allowed,
    /// Serving in production mode: go ahead, and count it. `first` is true
    /// the first time this tag is counted, which is when to warn.
    Counted {
        /// First steady-state acquisition for this tag.
        first: bool,
    },
}

/// The per-backend phase state machine.
#[derive(Debug, Clone)]
pub struct PhaseGuard {
    phase: Phase,
    mode: PhaseMode,
    /// Depth of open re-entries to planning; while > 0 the phase reads
    /// `Planning` and returns to `Serving` when the last one closes.
    replanning: u32,
    steady_state: [u64; Tag::ALL.len()],
    /// Per tag: 0 awake, else the sleep level its tier was put to.
    asleep: [u8; Tag::ALL.len()],
}

impl PhaseGuard {
    /// A guard in `LOADING`.
    pub fn new(mode: PhaseMode) -> Self {
        Self {
            phase: Phase::Loading,
            mode,
            replanning: 0,
            steady_state: [0; Tag::ALL.len()],
            asleep: [0; Tag::ALL.len()],
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The guard's mode.
    pub fn mode(&self) -> PhaseMode {
        self.mode
    }

    /// Steady-state acquisitions counted for `tag` (production mode).
    pub fn steady_state_allocations(&self, tag: Tag) -> u64 {
        self.steady_state[tag.index()]
    }

    /// Moves one step forward. Any other transition is a
    /// [`MemError::PhaseViolation`] whose message names the call to make.
    pub fn advance(&mut self, to: Phase) -> Result<(), MemError> {
        let expected = match self.phase {
            Phase::Loading => Some(Phase::Planning),
            Phase::Planning if self.replanning == 0 => Some(Phase::Serving),
            Phase::Planning => None,
            Phase::Serving => None,
        };
        if expected == Some(to) {
            self.phase = to;
            return Ok(());
        }
        let advice = match (self.phase, to) {
            (Phase::Loading, Phase::Serving) => {
                "call begin_planning() first: the plan is applied before serving".to_string()
            }
            (Phase::Planning, Phase::Serving) => {
                "a re-entry to planning is open; close it and the phase returns to SERVING"
                    .to_string()
            }
            (Phase::Serving, Phase::Planning) => {
                "the phase is monotonic; to swap a model, use the bracketed re-entry \
                 (replanning()) which returns to SERVING when it closes"
                    .to_string()
            }
            (from, to) if from == to => format!("the backend is already in {to}"),
            (from, to) => format!("{from} cannot go back to {to}: the phase is monotonic"),
        };
        Err(MemError::PhaseViolation {
            phase: self.phase,
            message: format!("phase transition {} -> {to} refused: {advice}", self.phase),
        })
    }

    /// Opens a bracketed re-entry to planning (model swap). Only legal while
    /// serving, or nested inside another re-entry.
    pub fn enter_replanning(&mut self) -> Result<(), MemError> {
        match self.phase {
            Phase::Serving => {
                self.phase = Phase::Planning;
                self.replanning = 1;
                Ok(())
            }
            Phase::Planning if self.replanning > 0 => {
                self.replanning += 1;
                Ok(())
            }
            phase => Err(MemError::PhaseViolation {
                phase,
                message: format!(
                    "a re-entry to planning is only for a serving backend (model swap); this one \
                     is in {phase}, where acquisitions are already allowed"
                ),
            }),
        }
    }

    /// Closes one re-entry; the last one returns the phase to `SERVING`.
    pub fn exit_replanning(&mut self) -> Result<(), MemError> {
        if self.replanning == 0 {
            return Err(MemError::Invariant(
                "replanning closed more often than opened".into(),
            ));
        }
        self.replanning -= 1;
        if self.replanning == 0 {
            self.phase = Phase::Serving;
        }
        Ok(())
    }

    /// Marks `tag` asleep at `level`, or awake with `None` (or level 0).
    pub fn set_asleep(&mut self, tag: Tag, level: Option<u8>) {
        self.asleep[tag.index()] = level.unwrap_or(0);
    }

    /// The tags asleep now, with their levels, in [`Tag::ALL`] order.
    pub fn asleep(&self) -> Vec<(Tag, u8)> {
        Tag::ALL
            .iter()
            .filter(|t| self.asleep[t.index()] > 0)
            .map(|&t| (t, self.asleep[t.index()]))
            .collect()
    }

    /// True while a re-entry to planning is open.
    pub fn is_replanning(&self) -> bool {
        self.replanning > 0
    }

    /// Decides whether an acquisition of `bytes` for `tag` may proceed now.
    pub fn admit(&mut self, tag: Tag, bytes: u64) -> Result<Admission, MemError> {
        let level = self.asleep[tag.index()];
        if level > 0 {
            return Err(MemError::Asleep(format!(
                "acquisition of {bytes} B for tag '{tag}' while its tier sleeps (level {level}); \
                 call wake() first"
            )));
        }
        if self.phase != Phase::Serving {
            return Ok(Admission::Allowed);
        }
        match self.mode {
            PhaseMode::Strict => Err(MemError::PhaseViolation {
                phase: self.phase,
                message: format!(
                    "acquisition of {bytes} B for tag '{tag}' while SERVING; every byte is \
                     acquired before serving: take it from a tier planned at load (scratch, \
                     a block pool), or open a replanning() bracket for a model swap"
                ),
            }),
            PhaseMode::Production => {
                let count = &mut self.steady_state[tag.index()];
                *count += 1;
                Ok(Admission::Counted { first: *count == 1 })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_one_step_only() {
        let mut g = PhaseGuard::new(PhaseMode::Strict);
        assert!(matches!(
            g.advance(Phase::Serving),
            Err(MemError::PhaseViolation { .. })
        ));
        g.advance(Phase::Planning).unwrap();
        g.advance(Phase::Serving).unwrap();
        let err = g.advance(Phase::Planning).unwrap_err();
        assert!(err.to_string().contains("replanning()"), "{err}");
        assert_eq!(g.phase(), Phase::Serving);
    }

    #[test]
    fn strict_refuses_production_counts_once_per_tag() {
        let mut strict = PhaseGuard::new(PhaseMode::Strict);
        strict.advance(Phase::Planning).unwrap();
        assert_eq!(strict.admit(Tag::Scratch, 8), Ok(Admission::Allowed));
        strict.advance(Phase::Serving).unwrap();
        assert!(strict.admit(Tag::Scratch, 8).is_err());

        let mut prod = PhaseGuard::new(PhaseMode::Production);
        prod.advance(Phase::Planning).unwrap();
        prod.advance(Phase::Serving).unwrap();
        assert_eq!(
            prod.admit(Tag::Scratch, 8),
            Ok(Admission::Counted { first: true })
        );
        assert_eq!(
            prod.admit(Tag::Scratch, 8),
            Ok(Admission::Counted { first: false })
        );
        assert_eq!(
            prod.admit(Tag::Other, 8),
            Ok(Admission::Counted { first: true })
        );
        assert_eq!(prod.steady_state_allocations(Tag::Scratch), 2);
    }

    #[test]
    fn replanning_brackets_nest_and_return_to_serving() {
        let mut g = PhaseGuard::new(PhaseMode::Strict);
        assert!(g.enter_replanning().is_err());
        g.advance(Phase::Planning).unwrap();
        g.advance(Phase::Serving).unwrap();
        g.enter_replanning().unwrap();
        g.enter_replanning().unwrap();
        assert_eq!(g.phase(), Phase::Planning);
        assert!(g.advance(Phase::Serving).is_err());
        g.exit_replanning().unwrap();
        assert_eq!(g.phase(), Phase::Planning);
        g.exit_replanning().unwrap();
        assert_eq!(g.phase(), Phase::Serving);
    }
}
