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
//! * **L2 — tier allocators**, one per lifetime tier ([`tier`]): [`Arena`]
//!   (T1, T2), [`BlockPool`] (T3), [`ScratchStack`] (T4), [`ActivationPool`]
//!   (T4a, a framework's own allocations), [`PinnedHost`] (T5b).
//! * **L3 — handles** ([`span`]): [`StableSpan`] (minted only by the tier
//!   allocators), [`DeviceSpan`], [`BlockRef`] (move-only; `share()` is the
//!   only alias), [`PinnedBuffer`], [`HostRegistration`].
//!
//! Each allocator has a borrowed API, where the borrow checker enforces the
//! lifetimes (a span cannot outlive its arena or survive its reset), and a
//! `Shared*` API over the same core that enforces the same rules at run time
//! (generations, allocator identity) for callers that cannot borrow — the
//! Python binding.
//!
//! Nothing reachable from a caller panics: failures are [`MemError`] values.
#![deny(missing_docs)]

pub mod accounting;
pub mod activations;
pub mod arena;
pub mod backend;
pub mod block_pool;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod decommit;
pub mod error;
pub mod fake;
pub mod kv;
pub mod ledger;
pub mod phase;
pub mod pinned;
pub mod pinned_hosts;
pub mod planner;
pub mod scratch;
pub mod source;
pub mod span;
pub mod system;
pub mod tag;
#[cfg(test)]
mod test_source;
pub mod tier;
pub mod units;

pub use accounting::{BackendStats, JournalEntry, JournalOp, TagStats};
pub use activations::{
    ActivationConfig, ActivationPool, ActivationStats, FakeStreamOrder, NoStreams, StreamOrder,
};
pub use backend::{Backend, Region};
pub use error::{MemError, OomReport};
pub use fake::{FakeBackend, FakeConfig};
pub use phase::{Phase, PhaseMode};
pub use tag::Tag;

pub use arena::{Arena, ArenaExport, ArenaSpan, ArenaStats, SharedArena};
pub use block_pool::{
    BlockId, BlockPool, BlockRef, PoolConfig, PoolStats, SharedBlockPool, SharedBlockRef,
    SharedBlockRefs,
};
pub use error::KvCapacityReport;
pub use kv::{Admission, BlockHash, ExtraKeys, KVCacheManager, KvConfig, KvStats};
pub use pinned::{FakePinnedHost, HostRegistration, PinnedBuffer, PinnedHost, PinnedStats};
pub use pinned_hosts::{fake_pinned_host, pinned_host_for, process_pinned_stats};
pub use scratch::{Mark, ScratchSpan, ScratchStack, ScratchStats, SharedMark, SharedScratchStack};
pub use source::Placement;
pub use source::{
    DeviceReading, MemoryKind, MemorySource, PinnedHostOps, SourceCharge, SourceError, SourceInfo,
};
pub use span::{DeviceSpan, StableSpan};
pub use tier::Tier;
