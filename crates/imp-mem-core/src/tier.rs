//! The lifetime tiers (seed A2). Each tier has exactly one allocator whose
//! discipline makes that tier's failure mode impossible:
//!
//! | tier | allocator | failure mode made impossible |
//! |---|---|---|
//! | T1 model-resident | [`Arena`](crate::arena::Arena) | per-object leak |
//! | T2 engine-persistent | [`Arena`](crate::arena::Arena) (a separate one) | per-object leak |
//! | T3 pooled fixed-block | [`BlockPool`](crate::block_pool::BlockPool) | external fragmentation |
//! | T4 forward scratch | [`ScratchStack`](crate::scratch::ScratchStack) | fragmentation, leak |
//! | T4a framework activations | [`ActivationPool`](crate::activations::ActivationPool) | unplanned acquisition while serving |
//! | T5b pinned host | [`PinnedBuffer`](crate::pinned::PinnedBuffer) | per-object leak, asymmetric unregister |
//!
//! T5a (transient host staging during load) is ordinary host memory and has
//! no allocator here.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::MemError;
use crate::tag::Tag;

/// A lifetime tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// T1: model load to unload; reset wholesale at a model swap.
    ModelResident,
    /// T2: the life of the process (survives a model swap).
    EnginePersistent,
    /// T3: request-scoped, refcounted fixed-size blocks.
    Pooled,
    /// T4: one forward pass, LIFO.
    Scratch,
    /// T4a: a framework's own allocations (torch, CuPy), any order, any
    /// size, sub-allocated from one planned region.
    Activations,
    /// T5b: engine-persistent pinned host memory.
    PinnedHost,
}

impl Tier {
    /// Every tier, in A2's order.
    pub const ALL: [Tier; 6] = [
        Tier::ModelResident,
        Tier::EnginePersistent,
        Tier::Pooled,
        Tier::Scratch,
        Tier::Activations,
        Tier::PinnedHost,
    ];

    /// The stable name, as Python and the reports spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Tier::ModelResident => "MODEL_RESIDENT",
            Tier::EnginePersistent => "ENGINE_PERSISTENT",
            Tier::Pooled => "POOLED",
            Tier::Scratch => "SCRATCH",
            Tier::Activations => "ACTIVATIONS",
            Tier::PinnedHost => "PINNED_HOST",
        }
    }

    /// The seed's short label (`T1` … `T5b`).
    pub const fn label(self) -> &'static str {
        match self {
            Tier::ModelResident => "T1",
            Tier::EnginePersistent => "T2",
            Tier::Pooled => "T3",
            Tier::Scratch => "T4",
            Tier::Activations => "T4a",
            Tier::PinnedHost => "T5b",
        }
    }

    /// The tag a tier's region is charged to when the caller names none.
    pub const fn default_tag(self) -> Tag {
        match self {
            Tier::ModelResident => Tag::Weights,
            Tier::EnginePersistent => Tag::Workspace,
            Tier::Pooled => Tag::KvCache,
            Tier::Scratch => Tag::Scratch,
            Tier::Activations => Tag::Activations,
            Tier::PinnedHost => Tag::PinnedHost,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tier {
    type Err = MemError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.to_ascii_uppercase();
        Tier::ALL
            .iter()
            .copied()
            .find(|t| t.name() == wanted || t.label().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = Tier::ALL.iter().map(|t| t.name()).collect();
                MemError::invalid(format!(
                    "unknown tier {s:?}; use one of: {}",
                    names.join(", ")
                ))
            })
    }
}

static NEXT_TIER_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique id for one tier allocator: the identity a handle carries
/// so that it is never accepted by another allocator.
pub(crate) fn next_tier_id() -> u64 {
    NEXT_TIER_ID.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_parse() {
        for tier in Tier::ALL {
            assert_eq!(tier.name().parse::<Tier>(), Ok(tier));
            assert_eq!(tier.label().parse::<Tier>(), Ok(tier));
        }
        let err = "T6".parse::<Tier>().unwrap_err().to_string();
        assert!(err.contains("MODEL_RESIDENT"), "{err}");
    }
}
