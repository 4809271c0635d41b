//! A re-plan adopted by an open system (issue 25's inline warm-up, issue 53):
//! the plan made again, with the same inputs against the same budget, once
//! the warm-up line was measured.
//!
//! An engine that boots without a remembered warm-up figure plans that line
//! at 0 (the largest KV pool any figure gives), opens on that provisional
//! plan with a growable KV pool, measures its warm-up, and plans again with
//! the figure. [`MemorySystem::adopt_replan`] then brings the open system to
//! what opening on the re-plan would have made of it, without moving a tier:
//! the KV pool's growth is capped at the re-planned blocks (its reservation
//! and base stay, so captured graphs stay valid), and the backend's budget
//! is lowered to what the re-plan gives the tiers ([`tiers_budget`], the
//! rule the open applies). Only a re-plan whose KV pool fits the open one
//! is adopted: the same block bytes, no more blocks. The system keeps the
//! plan it opened with as its own (its report's planned lines).
//!
//! Thread safety: as the system's other `&self` methods; the pool limits
//! itself under its own lock and the backend under its ledger's.

use super::open::{tiers_budget, to_u32};
use super::MemorySystem;
use crate::error::MemError;
use crate::planner::MemoryPlan;
use crate::units::human_bytes;

impl MemorySystem {
    /// Adopts `plan`, the system's plan made again with a measured warm-up
    /// line (module documentation): caps the KV pool at `plan`'s blocks and
    /// lowers the backend's budget to what `plan` gives the tiers, where
    /// that is less than the budget now. Returns the KV blocks of `plan`,
    /// which the caller commits (its KV manager's `reserve_free`) when the
    /// pool serves whole. Refused, changing nothing, when the KV pool of
    /// `plan` has other block bytes or more blocks than the open one.
    pub fn adopt_replan(&self, plan: &MemoryPlan) -> Result<u64, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let (open, new) = (&self.plan.kv, &plan.kv);
        if new.block_bytes != open.block_bytes || new.blocks > open.blocks {
            return Err(MemError::invalid(format!(
                "the re-planned KV pool ({} blocks of {} B) does not fit the provisional one ({} \
                 of {} B); a re-plan keeps the opened plan's inputs and budget",
                new.blocks, new.block_bytes, open.blocks, open.block_bytes
            )));
        }
        let budget = tiers_budget(plan);
        let stats = self.backend.stats();
        if budget < stats.budget && budget < stats.total.committed {
            return Err(MemError::invalid(format!(
                "the re-plan gives the tiers {} but they have committed {}; the warm-up line \
                 ({}) took what the tiers already hold",
                human_bytes(budget),
                human_bytes(stats.total.committed),
                human_bytes(plan.warmup)
            )));
        }
        if new.blocks < open.blocks {
            if let Some(pool) = self.kv_pool() {
                pool.limit_blocks(to_u32(new.blocks, "the re-planned KV pool")?)?;
            }
        }
        if budget < stats.budget {
            self.backend.set_budget(budget)?;
        }
        Ok(new.blocks)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::tests::{fake, plan, GIB_TEST};
    use super::super::SystemOptions;
    use super::*;
    use crate::units::MIB;

    fn growable() -> SystemOptions {
        SystemOptions {
            kv_growable: Some(true),
            ..SystemOptions::default()
        }
    }

    #[test]
    fn a_replan_with_a_warmup_line_caps_the_pool_and_lowers_the_budget_as_an_open_would() {
        let fb = fake(GIB_TEST, true);
        let provisional = plan(256 * MIB);
        let system = MemorySystem::open(&fb, &provisional, growable()).unwrap();
        let pool = system.kv_pool().unwrap();
        assert_eq!(u64::from(pool.stats().max_blocks), provisional.kv.blocks);
        let mut replanned = provisional.clone();
        replanned.warmup = 16 * MIB;
        let live = u64::from(pool.stats().capacity);
        replanned.kv.blocks = live.max(provisional.kv.blocks / 2);
        assert!(replanned.kv.blocks < provisional.kv.blocks);
        assert_eq!(
            system.adopt_replan(&replanned).unwrap(),
            replanned.kv.blocks
        );
        assert_eq!(u64::from(pool.stats().max_blocks), replanned.kv.blocks);
        assert_eq!(fb.stats().budget, tiers_budget(&replanned));
        // What opening on the re-plan sets the backend's budget to.
        let other = fake(GIB_TEST, true);
        let opened = MemorySystem::open(&other, &replanned, growable()).unwrap();
        assert_eq!(other.stats().budget, fb.stats().budget);
        drop(opened);
    }

    #[test]
    fn a_replan_whose_kv_pool_does_not_fit_the_open_one_changes_nothing() {
        let fb = fake(GIB_TEST, true);
        let provisional = plan(256 * MIB);
        let system = MemorySystem::open(&fb, &provisional, growable()).unwrap();
        let budget = fb.stats().budget;
        let max = system.kv_pool().unwrap().stats().max_blocks;
        let mut more = provisional.clone();
        more.kv.blocks += 1;
        let mut other = provisional.clone();
        other.kv.block_bytes *= 2;
        for bad in [more, other] {
            let err = system.adopt_replan(&bad).unwrap_err();
            assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
            assert!(err.to_string().contains("does not fit the provisional"));
            assert_eq!(fb.stats().budget, budget);
            assert_eq!(system.kv_pool().unwrap().stats().max_blocks, max);
        }
    }

    #[test]
    fn a_replan_without_a_warmup_line_keeps_the_open_budget() {
        let fb = fake(GIB_TEST, true);
        let provisional = plan(256 * MIB);
        let system = MemorySystem::open(&fb, &provisional, growable()).unwrap();
        let budget = fb.stats().budget;
        system.adopt_replan(&provisional.clone()).unwrap();
        assert_eq!(fb.stats().budget, budget);
    }

    proptest! {
        /// Whatever warm-up line a re-plan adds, the backend's budget after
        /// it is what an open on the re-plan sets (never above the one the
        /// system opened with), and the pool never grows past the re-plan.
        #[test]
        fn an_adopted_replan_leaves_the_budget_an_open_on_it_would(
            warmup_mib in 0u64..64,
            fewer in 0u64..64,
        ) {
            let fb = fake(GIB_TEST, true);
            let provisional = plan(256 * MIB);
            let system = MemorySystem::open(&fb, &provisional, growable()).unwrap();
            let opened = fb.stats().budget;
            let mut replanned = provisional.clone();
            replanned.warmup = warmup_mib * MIB;
            replanned.kv.blocks = provisional.kv.blocks.saturating_sub(fewer).max(1);
            let pool = system.kv_pool().unwrap();
            let live = u64::from(pool.stats().capacity);
            match system.adopt_replan(&replanned) {
                Ok(blocks) => {
                    prop_assert_eq!(blocks, replanned.kv.blocks);
                    prop_assert_eq!(fb.stats().budget, tiers_budget(&replanned).min(opened));
                    prop_assert!(u64::from(pool.stats().max_blocks) <= replanned.kv.blocks);
                }
                // Fewer blocks than the pool has committed: refused by the
                // pool, the budget untouched.
                Err(_) => {
                    prop_assert!(replanned.kv.blocks < live);
                    prop_assert_eq!(fb.stats().budget, opened);
                }
            }
        }
    }
}
