//! The memory system: one [`MemoryPlan`] opened as tiers on one [`Backend`]
//! (seed A4.2, A4.3, I7, criteria 3 and 6).
//!
//! [`MemorySystem::open`] acquires every tier the plan sizes, in the seed's
//! order of allocation (A4.2): the library reserve and the CUDA context are
//! charges that are already gone, then T2 (engine-persistent arena), T1
//! (model-resident arena), the fixed T3 pools (the SWA pool, the per-sequence
//! state pools), T4 (the scratch stack), T4a (the activation pool, when the
//! plan measured one), and the KV pool last, because it is
//! the one sized from the residual. On a growable backend the KV pool
//! reserves the plan's bytes and commits a first part; it grows inside its
//! reservation while serving, which is a commit and not an acquisition (R5).
//! If any step fails, every tier opened before it is released before the
//! error is returned ([`OpenError`] names the step), so a refused open leaves
//! the backend as it found it.
//!
//! The backend's budget is lowered, for the system's life, to the plan's
//! budget minus the two charges no allocator sees (context and library
//! reserve): A4.3's "the plan either fits it or fails, and the backend
//! refuses any acquisition that would exceed it". It is restored on close.
//!
//! Reporting is one snapshot ([`MemorySystem::report`]) rendered three ways:
//! a text table ([`MemReport::text`]), plain data (`serde`), and Prometheus
//! text ([`MemReport::metrics`]). Attribution (criterion 6) counts as
//! attributed every byte the backend has committed (each region has a tag),
//! plus the named charges outside it: the measured context and library
//! reserve, any charge the caller names ([`MemorySystem::set_charge`]), and
//! what the backend's source holds beyond its ledger (a VMM handle cache,
//! chunk rounding: [`MemorySystem::report_input`] asks the source). Against
//! a device reading (`total - free`, less what other processes hold; the
//! source's own by default) the remainder is the unattributed residual.
//!
//! Thread safety: the tiers are the `Shared*` forms (`Arc` + mutex); the
//! system itself is `Send + Sync` and its methods take `&self` except
//! [`MemorySystem::close`]. A report reads the backend's ledger under one
//! lock and each tier under its own, one after the other.
//!
//! Files: `open.rs` (the options, the open order, close), `tiers.rs` (the
//! tiers it hands out, phases, step, charges, check), `report.rs` (the
//! snapshot and its lines), `text.rs` (the table and JSON), `metrics.rs`
//! (Prometheus text), `swap.rs` (model swap), `sleep.rs` (sleep / wake),
//! `replan.rs` (a re-plan adopted by the open system),
//! `tests.rs`. This file holds the system's state: its slots, one per tier.

mod metrics;
mod open;
mod replan;
mod report;
mod sleep;
mod swap;
#[cfg(test)]
mod tests;
mod text;
mod tiers;

pub use open::{ActivationOrder, CloseReport, OpenError, SystemOptions};
pub use report::{
    BlockLine, ChargeLine, DeviceLine, DeviceQuery, DeviceReading, MeasuredLine, MemReport,
    OutsideLine, PassLine, ReportInput, StayLine, TagLine, TierLine,
};
pub use sleep::{
    sleep_level, SleepHostPin, SleepReport, SleptTier, WakeError, DEFAULT_SLEEP_TIERS, SLEEP_GROUPS,
};
pub use swap::{SwapError, SwapReport};

use crate::activations::ActivationPool;
use crate::backend::Backend;
use crate::block_pool::SharedBlockPool;
use crate::planner::MemoryPlan;
use crate::scratch::SharedScratchStack;
use crate::tag::Tag;
use crate::tier::Tier;
use crate::units::MIB;
use crate::SharedArena;

/// Criterion 6: at least this share of the memory in use is attributed.
pub const ATTRIBUTION_TARGET: f64 = 0.95;
/// What a growable KV pool adds per growth step, at least (before rounding
/// to whole blocks): SPEC's VMM figures favour chunks of tens of MiB.
pub const KV_GROW_BYTES: u64 = 64 * MIB;

/// A tier of the system, by what it holds.
#[derive(Debug, Clone)]
enum Handle {
    Arena(SharedArena),
    Pool(SharedBlockPool),
    Scratch(SharedScratchStack),
    Activations(ActivationPool),
}

#[derive(Debug, Clone)]
struct Slot {
    key: String,
    label: String,
    tier: Tier,
    tag: Tag,
    planned: u64,
    /// The most it commits on this backend: `planned` rounded up to whole
    /// granules where the region is growable (decided at open, before any
    /// acquisition).
    cost: u64,
    /// The tier's geometry (sizes and pool configuration): a model swap
    /// keeps a tier whose layout the new plan does not change.
    layout: String,
    handle: Handle,
}

/// The tiers of one plan on one backend.
#[derive(Debug)]
pub struct MemorySystem {
    backend: Backend,
    plan: MemoryPlan,
    options: SystemOptions,
    slots: Vec<Slot>,
    charges: Vec<ChargeLine>,
    previous_budget: Option<u64>,
    closed: bool,
}

/// A slot's sleep level, 0 when awake.
fn slot_asleep(slot: &Slot) -> u8 {
    match &slot.handle {
        Handle::Arena(a) => a.asleep().unwrap_or(0),
        Handle::Pool(p) => p.stats().asleep,
        Handle::Activations(p) => p.asleep().unwrap_or(0),
        Handle::Scratch(_) => 0,
    }
}
