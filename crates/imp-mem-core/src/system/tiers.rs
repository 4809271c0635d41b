//! What an open system hands out and the engine's calls on it: the tiers
//! (arenas, pools, scratch, activations, a KV manager over its pool), the
//! phase changes, the per-step shrink, the named charges, and the check of
//! the whole system's invariants.

use std::sync::Arc;

use super::open::{to_usize, SystemOptions};
use super::report::{ChargeLine, ReportInput};
use super::{Handle, MemorySystem, Slot};
use crate::activations::ActivationPool;
use crate::backend::Backend;
use crate::block_pool::SharedBlockPool;
use crate::decommit::FenceLike;
use crate::error::MemError;
use crate::kv::{host_tier_io, KVCacheManager, KvConfig};
use crate::phase::Phase;
use crate::planner::MemoryPlan;
use crate::scratch::SharedScratchStack;
use crate::tag::Tag;
use crate::units::round_up;
use crate::SharedArena;

impl MemorySystem {
    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The plan it was opened from.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// The options it was opened with.
    pub fn options(&self) -> &SystemOptions {
        &self.options
    }

    /// Whether [`MemorySystem::close`] ran.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    pub(super) fn closed_error(&self) -> MemError {
        MemError::invalid("the memory system is closed; open a new one")
    }

    pub(super) fn slot(&self, key: &str) -> Option<&Slot> {
        self.slots.iter().find(|s| s.key == key)
    }

    fn arena(&self, key: &str) -> Option<SharedArena> {
        match self.slot(key).map(|s| &s.handle) {
            Some(Handle::Arena(a)) => Some(a.clone()),
            _ => None,
        }
    }

    fn pool(&self, key: &str) -> Option<SharedBlockPool> {
        match self.slot(key).map(|s| &s.handle) {
            Some(Handle::Pool(p)) => Some(p.clone()),
            _ => None,
        }
    }

    /// T1: the model-resident arena the caller loads the weights into.
    pub fn weights_arena(&self) -> Option<SharedArena> {
        self.arena("model_resident")
    }

    /// T2: the engine-persistent arena.
    pub fn engine_arena(&self) -> Option<SharedArena> {
        self.arena("engine_persistent")
    }

    /// T3: the paged KV pool.
    pub fn kv_pool(&self) -> Option<SharedBlockPool> {
        self.pool("kv_pool")
    }

    /// T3: the sliding-window KV pool, if the plan has one.
    pub fn swa_pool(&self) -> Option<SharedBlockPool> {
        self.pool("swa_pool")
    }

    /// T3: the per-sequence state pools (linear attention / SSM), if any.
    pub fn state_pools(&self) -> Vec<SharedBlockPool> {
        self.slots
            .iter()
            .filter(|s| s.tag == Tag::State)
            .filter_map(|s| match &s.handle {
                Handle::Pool(p) => Some(p.clone()),
                _ => None,
            })
            .collect()
    }

    /// The pools that can shrink (they grew, or can grow, past the blocks
    /// they opened with): today the KV pool on a growable backend.
    pub fn growable_pools(&self) -> Vec<SharedBlockPool> {
        self.slots
            .iter()
            .filter_map(|s| match &s.handle {
                Handle::Pool(p) => Some(p.clone()),
                _ => None,
            })
            .filter(|p| {
                let st = p.stats();
                st.max_blocks > st.min_blocks
            })
            .collect()
    }

    /// One engine step for every growable pool ([`SharedBlockPool::step`]:
    /// the KV pool's hysteretic, fenced shrink). Call it once per engine
    /// step with a fence recorded after the step's work was enqueued
    /// ([`NothingInFlight`](crate::decommit::NothingInFlight) when none can
    /// touch the pools). Every pool is stepped even if one fails; the first
    /// error is returned. Returns the bytes decommitted during this call.
    pub fn step<F: FenceLike + Send + Sync + 'static>(&self, fence: F) -> Result<u64, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let fence = Arc::new(fence);
        let mut bytes = 0u64;
        let mut first_error = None;
        for pool in self.growable_pools() {
            match pool.step(fence.clone()) {
                Ok(n) => bytes += n,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(bytes), Err)
    }

    /// Waits for every growable pool's pending decommit (its fence) and
    /// decommits ([`SharedBlockPool::flush_decommit`]); stops at the first
    /// pool that fails. Returns the bytes decommitted.
    pub fn flush_decommit(&self) -> Result<u64, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let mut bytes = 0u64;
        for pool in self.growable_pools() {
            bytes += pool.flush_decommit()?;
        }
        Ok(bytes)
    }

    /// The [`KvConfig`] the plan implies for [`MemorySystem::kv_manager`]:
    /// the plan's tokens per block, its KV dtype, and the sliding window
    /// when the plan has an SWA pool; everything else at its default.
    pub fn kv_config(&self) -> Result<KvConfig, MemError> {
        let pool = self.full_kv_ids()?;
        let kv = &self.plan.kv;
        let block_size = to_usize(kv.block_size.into(), "block size")?;
        let mut config = KvConfig::new(block_size, pool.stats().max_blocks);
        config.dtype = kv.dtype.name().to_string();
        if self.swa_pool().is_some() {
            let window = self.plan.swa.as_ref().and_then(|s| s.window).unwrap_or(0);
            config.swa_window = to_usize(window, "sliding window")?;
        }
        Ok(config)
    }

    /// The pool whose ids the manager's full block tables hold: the KV
    /// pool, or, for a model whose every layer is sliding-window (its plan
    /// gives full attention no bytes and the SWA pool all of its KV), an id
    /// space with no memory sized for the plan's sequences at full length,
    /// so that admission, the block tables and the prefix cache work as
    /// for any model while the SWA pool holds the bytes.
    fn full_kv_ids(&self) -> Result<SharedBlockPool, MemError> {
        if let Some(pool) = self.kv_pool() {
            return Ok(pool);
        }
        let kv = &self.plan.kv;
        if self.closed || self.swa_pool().is_none() || kv.bytes_per_token > 0 {
            return Err(self.no_kv_pool());
        }
        let ids = kv.blocks_per_sequence.saturating_mul(kv.full_sequences);
        let ids = u32::try_from(ids).map_err(|_| {
            MemError::invalid(format!(
                "the plan's {ids} sliding-window-only KV block ids are more than a pool's {} \
                 ids; plan fewer or shorter sequences",
                u32::MAX
            ))
        })?;
        SharedBlockPool::slots(ids)
    }

    fn no_kv_pool(&self) -> MemError {
        if self.closed {
            self.closed_error()
        } else {
            MemError::invalid("this system has no KV pool: its plan gives the KV cache no blocks")
        }
    }

    /// The blocks the plan gives the KV host tier (`kv_host`), 0 where it
    /// has none.
    pub fn planned_host_blocks(&self) -> u32 {
        self.plan
            .kv_host
            .as_ref()
            .map_or(0, |h| u32::try_from(h.blocks).unwrap_or(u32::MAX))
    }

    /// [`MemorySystem::kv_manager`] with its KV host tier: `host_blocks`
    /// blocks (default: the plan's, [`MemorySystem::planned_host_blocks`]),
    /// copied by the engine the backend's source gives
    /// ([`host_tier_io`]); no host tier at 0.
    pub fn kv_manager_with_host_tier(
        &self,
        config: KvConfig,
        host_blocks: Option<u32>,
    ) -> Result<KVCacheManager, MemError> {
        let host_blocks = host_blocks.unwrap_or_else(|| self.planned_host_blocks());
        let mut m = self.kv_manager(config)?;
        if host_blocks > 0 {
            let io = host_tier_io(Some(&self.backend), m.config().block_bytes, host_blocks)?;
            m.set_host_tier(io)?;
        }
        Ok(m)
    }

    /// A [`KVCacheManager`] over this system's KV pool (and SWA pool, if the
    /// plan has one): [`KVCacheManager::with_pools`], so its blocks are the
    /// system's, attributed to `kv_cache` / `swa_cache` in the report. Start
    /// from [`MemorySystem::kv_config`]. `block_size` must be the plan's (the
    /// pool's blocks hold that many tokens), and `swa_window` is set exactly
    /// when the system has an SWA pool. The manager holds the pools alive:
    /// drop it before [`MemorySystem::close`], or the close reports the
    /// blocks as still held.
    pub fn kv_manager(&self, config: KvConfig) -> Result<KVCacheManager, MemError> {
        let pool = self.full_kv_ids()?;
        let planned = self.plan.kv.block_size as usize;
        if config.block_size != planned {
            return Err(MemError::invalid(format!(
                "block_size={} but the plan's KV blocks hold {planned} tokens each; build the \
                 manager with the plan's block size (or plan with block_size={})",
                config.block_size, config.block_size
            )));
        }
        let swa = self.swa_pool();
        if let (Some(_), Some(plan)) = (&swa, &self.plan.swa) {
            if plan.block_size as usize != planned {
                return Err(MemError::invalid(format!(
                    "the plan's SWA blocks hold {} tokens but its KV blocks {planned}; one \
                     manager needs one block size",
                    plan.block_size
                )));
            }
        }
        match (&swa, config.swa_window) {
            (Some(_), 0) => {
                return Err(MemError::invalid(format!(
                    "this system has an SWA pool; set swa_window (the plan's is {} tokens)",
                    self.plan.swa.as_ref().and_then(|s| s.window).unwrap_or(0)
                )))
            }
            (None, w) if w > 0 => {
                return Err(MemError::invalid(format!(
                    "swa_window={w} but this system has no SWA pool (the plan has no sliding \
                     window layers)"
                )))
            }
            _ => {}
        }
        KVCacheManager::with_pools(config, pool, swa)
    }

    /// T4: the scratch stack.
    pub fn scratch(&self) -> Option<SharedScratchStack> {
        match self.slot("scratch").map(|s| &s.handle) {
            Some(Handle::Scratch(s)) => Some(s.clone()),
            _ => None,
        }
    }

    /// T4a: the activation pool, if the plan has one.
    pub fn activations(&self) -> Option<ActivationPool> {
        match self.slot("activations").map(|s| &s.handle) {
            Some(Handle::Activations(p)) => Some(p.clone()),
            _ => None,
        }
    }

    /// The keys of the opened tiers, in open order.
    pub fn tier_keys(&self) -> Vec<&str> {
        self.slots.iter().map(|s| s.key.as_str()).collect()
    }

    /// `LOADING → PLANNING` (a no-op if already planning).
    pub fn begin_planning(&self) -> Result<(), MemError> {
        match self.backend.phase() {
            Phase::Loading => self.backend.begin_planning(),
            Phase::Planning => Ok(()),
            Phase::Serving => self.backend.advance(Phase::Planning),
        }
    }

    /// Through `PLANNING` to `SERVING` (a no-op if already serving). From
    /// here on the tiers are fixed: an acquisition is a phase violation
    /// (strict) or counted in `steady_state_allocations_total` (production).
    pub fn begin_serving(&self) -> Result<(), MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        if self.backend.phase() != Phase::Serving {
            // A measured tier is fixed at its high-water plus the margin
            // before the phase changes: nothing commits while serving.
            if let Some(p) = self.activations().filter(|p| p.measuring()) {
                p.freeze(self.options.activation_margin)?;
            }
        }
        match self.backend.phase() {
            Phase::Serving => Ok(()),
            Phase::Loading => {
                self.backend.begin_planning()?;
                self.backend.begin_serving()
            }
            Phase::Planning => self.backend.begin_serving(),
        }
    }

    /// The measured tiers (an activation pool opened with
    /// [`SystemOptions::activation_measure`]): each one's high-water and,
    /// once `begin_serving` froze it, the size it was fixed at. A later
    /// start plans the tier at `high_water + margin` without measuring.
    ///
    /// [`SystemOptions::activation_measure`]: super::SystemOptions::activation_measure
    pub fn measured(&self) -> Vec<super::MeasuredLine> {
        let Some(p) = self.activations() else {
            return Vec::new();
        };
        let stats = p.stats();
        match stats.frozen {
            Some(f) => vec![super::MeasuredLine {
                tier: "activations".into(),
                state: "frozen",
                high_water: f.high_water,
                margin: f.margin,
                size: f.size,
                committed: p.committed(),
                decommitted: f.decommitted,
            }],
            None if stats.measuring => vec![super::MeasuredLine {
                tier: "activations".into(),
                state: "measuring",
                high_water: stats.high_water,
                margin: 0,
                size: stats.capacity,
                committed: p.committed(),
                decommitted: 0,
            }],
            None => Vec::new(),
        }
    }

    /// Names a charge outside the backend (another allocator's pool, a
    /// library's workspace), so that it is attributed; `bytes = 0` removes
    /// it. `context` and `library_reserve` replace the measured figures.
    pub fn set_charge(&mut self, key: &str, label: &str, bytes: u64) -> Result<(), MemError> {
        if key.is_empty() {
            return Err(MemError::invalid("a charge needs a key"));
        }
        if let Some(line) = self.charges.iter_mut().find(|c| c.key == key) {
            line.bytes = bytes;
            line.measured = true;
            if !label.is_empty() && line.planned.is_none() {
                line.label = label.to_string();
            }
            if bytes == 0 && line.planned.is_none() {
                self.charges.retain(|c| c.key != key);
            }
            return Ok(());
        }
        if bytes > 0 {
            self.charges.push(ChargeLine {
                key: key.to_string(),
                label: if label.is_empty() { key } else { label }.to_string(),
                bytes,
                planned: None,
                measured: true,
            });
        }
        Ok(())
    }

    /// Checks the invariants of the whole system: the backend's (V1, tag
    /// sums, budget), every pool's (V4, refcounts), and the system's own —
    /// no tier holds more than its tag has committed, and none has grown
    /// past what the plan gave it (V8, to the backend's granularity).
    pub fn check(&self) -> Result<(), MemError> {
        self.backend.check_invariants()?;
        let granule = self.backend.info().granularity.max(1);
        let report = self.report(&ReportInput::default());
        for (slot, line) in self.slots.iter().zip(&report.tiers) {
            match &slot.handle {
                Handle::Pool(pool) => pool.check_invariants()?,
                Handle::Activations(pool) => pool.check_invariants()?,
                _ => {}
            }
            // A sleeping tier has given its memory back, its takes kept.
            if line.asleep == 0 && line.in_use > line.committed {
                return Err(MemError::Invariant(format!(
                    "{} {}: {} B in use but {} B committed",
                    slot.tier.label(),
                    slot.label,
                    line.in_use,
                    line.committed
                )));
            }
            let allowed = round_up(to_usize(slot.planned, "planned bytes")?, granule)
                .map(|v| v as u64)
                .unwrap_or(u64::MAX);
            if line.committed > allowed {
                return Err(MemError::Invariant(format!(
                    "V8: {} {} has {} B committed, past the {} B its plan gave it",
                    slot.tier.label(),
                    slot.label,
                    line.committed,
                    slot.planned
                )));
            }
        }
        let in_tiers: u64 = report.tiers.iter().map(|t| t.committed).sum();
        if in_tiers > report.backend_committed {
            return Err(MemError::Invariant(format!(
                "the tiers hold {in_tiers} B but the backend has only {} B committed",
                report.backend_committed
            )));
        }
        Ok(())
    }
}
