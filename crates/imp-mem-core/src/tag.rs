//! Region tags: what a piece of memory is for.
//!
//! The set is closed on purpose. Tags are Prometheus label values and the
//! keys of every per-tag counter, so a small fixed vocabulary keeps the
//! metrics' cardinality bounded and makes a typo an error instead of a new
//! series.

use std::fmt;
use std::str::FromStr;

use crate::error::MemError;

/// What a region is for. Accounting, the journal and the metrics are keyed by
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tag {
    /// Model weights (T1).
    Weights,
    /// Derived weight caches: dequantised or repacked copies (T1).
    WeightCache,
    /// The paged KV block pool (T3).
    KvCache,
    /// The sliding-window KV block pool, its own id space (T3).
    SwaCache,
    /// Fixed per-sequence state: SSM / linear-attention state, residual rings (T3).
    State,
    /// Engine-persistent workspaces: GEMM workspaces, graph buffers (T2).
    Workspace,
    /// Forward-pass scratch (T4).
    Scratch,
    /// A framework's own allocations (torch / CuPy activations, temporaries,
    /// library workspaces) through the activation pool (T4a).
    Activations,
    /// Pinned host staging (T5b).
    PinnedHost,
    /// Anything else.
    Other,
}

impl Tag {
    /// Every tag, in report order.
    pub const ALL: [Tag; 10] = [
        Tag::Weights,
        Tag::WeightCache,
        Tag::KvCache,
        Tag::SwaCache,
        Tag::State,
        Tag::Workspace,
        Tag::Scratch,
        Tag::Activations,
        Tag::PinnedHost,
        Tag::Other,
    ];

    /// The tag's stable name, used in Python, the journal and the metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Tag::Weights => "weights",
            Tag::WeightCache => "weight_cache",
            Tag::KvCache => "kv_cache",
            Tag::SwaCache => "swa_cache",
            Tag::State => "state",
            Tag::Workspace => "workspace",
            Tag::Scratch => "scratch",
            Tag::Activations => "activations",
            Tag::PinnedHost => "pinned_host",
            Tag::Other => "other",
        }
    }

    /// Dense index in `0..Tag::ALL.len()`, for per-tag arrays.
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tag {
    type Err = MemError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Tag::ALL
            .iter()
            .copied()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Tag::ALL.iter().map(|t| t.name()).collect();
                MemError::InvalidArgument(format!(
                    "unknown tag {s:?}; use one of: {}",
                    names.join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_index_is_dense() {
        for (i, tag) in Tag::ALL.iter().enumerate() {
            assert_eq!(tag.index(), i);
            assert_eq!(tag.name().parse::<Tag>(), Ok(*tag));
        }
        let err = "kv".parse::<Tag>().unwrap_err();
        assert!(err.to_string().contains("kv_cache"));
    }
}
