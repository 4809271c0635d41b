//! A plan of the activations tier alone: no model, no KV pool, no scratch,
//! only the tier (T4a) and the CUDA context charged as measured. It is the
//! plan of a caller that routes a framework's allocations through imp-mem
//! and keeps everything else (`imp_mem.torch.serve`): the model is the
//! framework's tensors inside the tier, so there is no shape to plan.
//!
//! The figures round as `plan_memory`'s do: every charge up to a whole MiB,
//! the budget down to one, so the tier [`MemoryPlan::activations_room`]
//! offers is exactly the one [`MemoryPlan::activations_only`] accepts.

use super::dtype::Dtype;
use super::failure::{Charge, FailureKind, PlanError, PlanFailure};
use super::input::DEFAULT_BLOCK_SIZE;
use super::plan::{floor_mib, mib, KvPlan, MemoryPlan};
use crate::error::MemError;

impl MemoryPlan {
    /// The largest activations tier, a whole number of MiB, that fits in
    /// `budget` beside a CUDA context of `context` bytes: the budget in
    /// whole MiB down, less the context in whole MiB up. 0 when none fits.
    pub fn activations_room(budget: u64, context: u64) -> u64 {
        floor_mib(budget).saturating_sub(mib(context))
    }

    /// A plan of one tier: `activations` bytes (rounded up to a MiB) of
    /// the activations tier and the `context` charged as measured, within
    /// `budget`. An empty tier is an invalid input; one that does not fit
    /// beside the context is a [`PlanFailure`] with the arithmetic, as
    /// `plan_memory`'s (no lever: only the budget or the tier can change).
    pub fn activations_only(
        budget: u64,
        context: u64,
        activations: u64,
    ) -> Result<MemoryPlan, PlanError> {
        if activations == 0 {
            return Err(PlanError::Invalid(MemError::invalid(
                "activations: the tier is empty; give it at least one byte",
            )));
        }
        let tier = mib(activations);
        let context = mib(context);
        let charge = |key: &str, label: &str, bytes: u64| Charge {
            key: key.into(),
            label: label.into(),
            bytes,
        };
        // The lines plan_memory prints for a model of no weights and no KV
        // pool, so both kinds of plan read alike.
        let charges = vec![
            charge("weights", "model weights", 0),
            charge("kv_pool", "KV pool (none: the caller keeps its KV)", 0),
            charge(
                "activations",
                "torch activations (measured high-water)",
                tier,
            ),
            charge("context", "CUDA context + driver", context),
            charge("library_reserve", "library reserve", 0),
        ];
        let total = tier + context;
        if total > floor_mib(budget) {
            return Err(PlanError::DoesNotFit(Box::new(PlanFailure {
                kind: FailureKind::OverBudget,
                budget,
                charges,
                total,
                over_by: total - floor_mib(budget),
                levers: Vec::new(),
                max_batch_fits: None,
            })));
        }
        Ok(MemoryPlan {
            budget,
            tp: 1,
            model_resident: 0,
            weights: 0,
            vision_tower: 0,
            draft_weights: 0,
            engine_persistent: 0,
            lora: 0,
            scratch: 0,
            activations: tier,
            kv: KvPlan {
                dtype: Dtype::Bf16,
                block_size: DEFAULT_BLOCK_SIZE,
                bytes_per_token: 0,
                block_bytes: 0,
                blocks_per_sequence: 0,
                target_blocks: 0,
                blocks: 0,
                full_sequences: 0,
                window: None,
                bytes: 0,
            },
            swa: None,
            pools: Vec::new(),
            library_reserve: 0,
            context,
            warmup: 0,
            total,
            headroom: budget - total,
            charges,
            sleep_host: 0,
            kv_host: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::planner::{MemoryPlan, PlanError};
    use crate::units::MIB;

    #[test]
    fn the_room_counts_the_budget_down_and_the_context_up() {
        // A device's free bytes are rarely whole MiB: 3 MiB + 1 of context
        // in 120 MiB + 5 leaves 116 MiB, not 117.
        assert_eq!(
            MemoryPlan::activations_room(120 * MIB + 5, 3 * MIB + 1),
            116 * MIB
        );
        assert_eq!(MemoryPlan::activations_room(MIB, 2 * MIB), 0);
    }

    #[test]
    fn a_plan_of_the_tier_alone_charges_the_tier_and_the_context() {
        let plan = MemoryPlan::activations_only(120 * MIB, 3 * MIB, 100 * MIB).unwrap();
        assert_eq!(plan.activations, 100 * MIB);
        assert_eq!(plan.context, 3 * MIB);
        assert_eq!((plan.weights, plan.scratch, plan.kv.blocks), (0, 0, 0));
        assert_eq!(plan.total, 103 * MIB);
        assert_eq!(plan.headroom, 17 * MIB);
        let keys: Vec<&str> = plan.charges.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "weights",
                "kv_pool",
                "activations",
                "context",
                "library_reserve"
            ]
        );
        let back = MemoryPlan::from_json(&plan.to_json().unwrap()).unwrap();
        assert_eq!(back, plan);
    }

    #[test]
    fn an_empty_tier_is_invalid_and_an_oversized_one_a_failure_with_its_arithmetic() {
        let err = MemoryPlan::activations_only(120 * MIB, 3 * MIB, 0).unwrap_err();
        assert!(matches!(err, PlanError::Invalid(_)), "{err}");
        assert!(err.to_string().contains("activations"), "{err}");
        let err = MemoryPlan::activations_only(120 * MIB, 3 * MIB, 118 * MIB).unwrap_err();
        let PlanError::DoesNotFit(failure) = err else {
            panic!("{err}");
        };
        assert_eq!((failure.total, failure.over_by), (121 * MIB, MIB));
        let report = failure.report();
        assert!(report.contains("torch activations"), "{report}");
    }

    proptest! {
        #[test]
        fn the_room_is_exactly_what_the_plan_accepts(
            budget in 0u64..(1 << 40),
            context in 0u64..(1 << 36),
        ) {
            let room = MemoryPlan::activations_room(budget, context);
            prop_assert_eq!(room % MIB, 0);
            if room > 0 {
                let plan = MemoryPlan::activations_only(budget, context, room).unwrap();
                prop_assert!(plan.total <= budget);
                prop_assert_eq!(plan.total, plan.charges.iter().map(|c| c.bytes).sum::<u64>());
                prop_assert!(MemoryPlan::activations_only(budget, context, room + 1).is_err());
            } else {
                prop_assert!(MemoryPlan::activations_only(budget, context, 1).is_err());
            }
        }
    }
}
