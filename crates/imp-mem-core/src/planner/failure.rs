//! `PlanFailure`: the itemised arithmetic of a configuration that does not
//! fit, and the report an operator reads (seed A4.3).

use std::fmt::{self, Write as _};

use serde::{Deserialize, Serialize};

use crate::error::MemError;
use crate::units::MIB;

/// One named line of a plan: what the bytes are for and how many.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// Stable identifier (`weights`, `kv_pool`, `context`, ...).
    pub key: String,
    /// What the report prints.
    pub label: String,
    /// Bytes, a whole number of MiB.
    pub bytes: u64,
}

/// A setting an operator can change, and what changing it frees.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lever {
    /// The setting (`max_seq_len`, `kv_dtype`, `max_batch`, `tp`).
    pub setting: String,
    /// Its current value.
    pub from: String,
    /// The value the lever proposes.
    pub to: String,
    /// Bytes of the requested total the change frees, recomputed exactly.
    pub frees: u64,
    /// Whether this change alone makes the plan succeed.
    pub sufficient: bool,
}

/// Why a plan failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FailureKind {
    /// The requested total exceeds the budget.
    OverBudget,
    /// The KV pool the residual leaves cannot hold one full sequence (D8).
    BelowAdmissionFloor {
        /// Tokens the pool could hold.
        kv_tokens: u64,
        /// Tokens one advertised sequence needs.
        sequence_tokens: u64,
    },
}

/// A configuration that cannot be served in its budget, with the arithmetic
/// that says so and the levers that would change it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanFailure {
    /// Why.
    pub kind: FailureKind,
    /// The budget, bytes.
    pub budget: u64,
    /// Every requested charge, the KV pool at its full target.
    pub charges: Vec<Charge>,
    /// The sum of `charges`.
    pub total: u64,
    /// `total - budget`, bytes (0 only if the failure is not about the total).
    pub over_by: u64,
    /// Up to three levers, largest first.
    pub levers: Vec<Lever>,
    /// The largest `max_batch` whose plan fits, every other setting as
    /// asked; `None` when even one sequence does not, or the batch was
    /// already 1. The `max_batch` lever's figure, kept here when the three
    /// largest levers leave it out (a step down a few sequences frees less
    /// than halving `max_seq_len`, yet it is often the change to make).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_fits: Option<u32>,
}

impl PlanFailure {
    /// The operator-facing report: every charge in MiB, the total, how far
    /// over, and the levers.
    pub fn report(&self) -> String {
        let mut out = String::new();
        let budget = mib_text(self.budget);
        match self.kind {
            FailureKind::OverBudget => {
                let _ = writeln!(
                    out,
                    "Cannot fit this configuration in the {budget} MiB budget."
                );
            }
            FailureKind::BelowAdmissionFloor {
                kv_tokens,
                sequence_tokens,
            } => {
                let _ = writeln!(
                    out,
                    "Cannot serve this configuration in the {budget} MiB budget: the KV pool left \
                     over holds {kv_tokens} tokens, less than one full sequence of {sequence_tokens}."
                );
            }
        }
        let _ = writeln!(out);
        let width = write_charges(&mut out, "requested", &self.charges);
        let _ = writeln!(
            out,
            "    {:<width$}{:>8}   over by {} MiB",
            "total",
            self.total / MIB,
            self.over_by.div_ceil(MIB)
        );
        let _ = writeln!(out);
        if self.levers.is_empty() {
            let _ = writeln!(
                out,
                "  no single setting frees memory here: raise the budget"
            );
        } else {
            let heading = match self.levers.len() {
                1 => "the largest lever".to_string(),
                n => format!(
                    "the {} largest levers",
                    ["", "", "two", "three"].get(n).copied().unwrap_or("")
                ),
            };
            let _ = writeln!(out, "  {heading}");
            for lever in &self.levers {
                let change = format!("{} {} -> {}", lever.setting, lever.from, lever.to);
                let enough = if lever.sufficient {
                    "  (enough alone)"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "    {change:<40}frees {} MiB{enough}",
                    lever.frees / MIB
                );
            }
        }
        out
    }

    /// The failure as JSON.
    pub fn to_json(&self) -> Result<String, MemError> {
        super::to_json(self, "plan failure")
    }
}

/// Writes the charge table that a plan and a failure report share: a header
/// naming the column, one line a charge in MiB, and a rule under them.
/// Returns the label column's width, for the lines the caller adds below.
pub(super) fn write_charges(out: &mut String, heading: &str, charges: &[Charge]) -> usize {
    let width = charges
        .iter()
        .map(|c| c.label.chars().count())
        .max()
        .unwrap_or(0)
        .max(28)
        + 4;
    let _ = writeln!(out, "  {:<w$}{:>8}", heading, "MiB", w = width + 2);
    for c in charges {
        let _ = writeln!(out, "    {:<width$}{:>8}", c.label, c.bytes / MIB);
    }
    let _ = writeln!(out, "    {:<width$}{:>8}", "", "-----");
    width
}

fn mib_text(bytes: u64) -> String {
    if bytes % MIB == 0 {
        (bytes / MIB).to_string()
    } else {
        format!("{:.1}", bytes as f64 / MIB as f64)
    }
}

impl fmt::Display for PlanFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.report().trim_end())
    }
}

impl std::error::Error for PlanFailure {}

/// What `plan_memory` can return instead of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The input itself is unusable; the message names the field.
    Invalid(MemError),
    /// The input is fine and does not fit.
    DoesNotFit(Box<PlanFailure>),
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::Invalid(err) => err.fmt(f),
            PlanError::DoesNotFit(failure) => failure.fmt(f),
        }
    }
}

impl std::error::Error for PlanError {}

impl From<MemError> for PlanError {
    fn from(err: MemError) -> Self {
        PlanError::Invalid(err)
    }
}

impl PlanError {
    /// The failure, if the input was valid and did not fit.
    pub fn failure(&self) -> Option<&PlanFailure> {
        match self {
            PlanError::DoesNotFit(failure) => Some(failure),
            PlanError::Invalid(_) => None,
        }
    }
}
