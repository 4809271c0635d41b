//! imp-mem core: the memory architecture of an LLM inference engine, with no
//! CUDA dependency.
//!
//! The layers follow the seed design (`docs/ARCHITECTURE.md` maps them):
//!
//! * **L1 — backend** ([`backend`]): the only code that acquires memory. A
//!   [`Backend`] wraps a [`MemorySource`] (the physical side: host memory for
//!   [`FakeBackend`], device memory in `imp-mem-cuda`) with the rules that are
//!   the same for every device: the phase guard ([`phase`]), per-tag
//!   accounting ([`accounting`]), the budget cap and the journal.
//! * **L2/L3 — tiers and handles**, the planner and the KV manager build on
//!   the backend and live in their own modules.
//!
//! Nothing reachable from a caller panics: failures are [`MemError`] values.
#![deny(missing_docs)]

pub mod accounting;
pub mod backend;
pub mod decommit;
pub mod error;
pub mod fake;
pub mod phase;
pub mod planner;
pub mod tag;
pub mod units;

pub use accounting::{BackendStats, JournalEntry, JournalOp, TagStats};
pub use backend::{Backend, MemoryKind, MemorySource, Region, SourceError, SourceInfo};
pub use error::{MemError, OomReport};
pub use fake::{FakeBackend, FakeConfig};
pub use phase::{Phase, PhaseMode};
pub use tag::Tag;
