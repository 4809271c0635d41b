//! [`KVCacheManager`]: sequences, admission, eviction, pins and stats. The
//! module docs of [`crate::kv`] state the ownership rules this file follows.
//!
//! Files: `config.rs` (building a manager), `admission.rs`, `sequence.rs`
//! (block tables, append, free), `pins.rs`, `eviction.rs` (the prefix cache
//! from here), `offload.rs` (the host and disk tiers), `persist.rs` (save
//! and load over `kv::persist`'s format), `stats.rs` (counters and events),
//! `invariants.rs`. This file holds the manager's state.

mod admission;
mod config;
mod eviction;
mod invariants;
mod offload;
mod persist;
mod pins;
mod sequence;
mod stats;

pub use admission::{Admission, IdSource};
pub use config::KvConfig;
pub use stats::KvStats;

use std::sync::Arc;

use self::pins::Pins;
use self::sequence::{Sequence, Slot, Spare};
use crate::block_pool::{PoolClaim, SharedBlockPool};
use crate::error::MemError;
use crate::kv::events::EventLog;
use crate::kv::hash::BlockHasher;
use crate::kv::host_tier::HostTier;
use crate::kv::persist::{BlockIo, Lent};
use crate::kv::prefix::{FastMap, PrefixCache};

/// A sequence's id, chosen by the caller.
pub type SeqId = u64;

/// The paged KV cache manager. Single-threaded (`&mut self`); the Python
/// binding puts it behind a mutex.
#[derive(Debug)]
pub struct KVCacheManager {
    config: KvConfig,
    hasher: BlockHasher,
    pool: SharedBlockPool,
    swa_pool: Option<SharedBlockPool>,
    pub(crate) cache: PrefixCache,
    seqs: FastMap<SeqId, Box<Sequence>>,
    pins: Pins,
    pub(crate) io: Option<Arc<dyn BlockIo>>,
    stats: KvStats,
    spare: Spare,
    pub(crate) events: EventLog,
    pub(crate) host: Option<HostTier>,
    /// The manager's claims on its pools: no second manager, and no
    /// allocation through the pools' own API, while it lives.
    _claims: (PoolClaim, Option<PoolClaim>),
    /// Refs a save or a load holds outside the binding's lock.
    pub(crate) lent: Arc<Lent>,
}

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// A block count as `u32`, saturated: a count past `u32::MAX` cannot fit
/// any pool (they hold at most `u32::MAX - 1` blocks), so it is refused as
/// `u32::MAX` would be, never truncated into one that fits.
fn sat_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn to_u32(n: usize, what: &str) -> Result<u32, MemError> {
    u32::try_from(n).map_err(|_| MemError::invalid(format!("{what}: {n} blocks is too many")))
}

impl Drop for KVCacheManager {
    /// Releases every token the manager holds (its sequences' blocks and
    /// the cache's), so pools shared with a [`MemorySystem`] get their blocks
    /// back, as dropping refs did.
    ///
    /// [`MemorySystem`]: crate::system::MemorySystem
    fn drop(&mut self) {
        let seqs = std::mem::take(&mut self.seqs);
        let mut main = self.cache.drain();
        if let Some(host) = self.host.as_mut() {
            // No copy may run on memory released here.
            main.extend(host.wait_and_take_all());
        }
        let mut swa = Vec::new();
        for (_, seq) in seqs {
            main.extend(seq.blocks.into_iter().filter_map(|s| match s {
                Slot::Own(t) => Some(t),
                _ => None,
            }));
            swa.extend(seq.swa);
        }
        let _ = self.pool.release_tokens(main);
        self.release_swa(swa);
    }
}
