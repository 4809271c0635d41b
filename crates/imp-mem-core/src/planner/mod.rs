//! The planner (seed A4): `plan_memory(&PlanInput)` decides every tier's size
//! before anything is allocated, or refuses with the arithmetic.
//!
//! * [`ModelShape`] — what a model costs, read from a Hugging Face
//!   `config.json` ([`ModelShape::from_hf_config`]): dense GQA/MHA, MLA,
//!   sliding-window layers, hybrid linear-attention / Mamba layers, MoE, and
//!   quantized weight formats; real weight bytes from safetensors if given.
//! * [`PlanInput`] — the shape, [`Limits`], [`Features`], the tensor-parallel
//!   degree, the budget, and the two measured charges of D7 (CUDA context,
//!   library reserve).
//! * [`plan_memory`] — pure and deterministic: no device query, no clock, no
//!   hash-map order. The KV pool is sized last, from the residual, with the
//!   full configuration (`max_batch` sequences of `max_seq_len`) as its
//!   target, never a multiple of it (B1). A configuration that does not fit,
//!   or whose KV pool cannot hold one full sequence (D8), is a
//!   [`PlanFailure`] whose report lists every charge in MiB and the three
//!   largest levers, each recomputed exactly.
//!
//! Every figure is per rank: GQA KV heads are divided between ranks, MLA's
//! latent is replicated, weights and linear-layer state are divided.

mod activations_only;
mod dtype;
mod failure;
mod hf_config;
mod hf_defaults;
mod input;
mod plan;
mod safetensors;
mod shape;
mod validate;

#[cfg(test)]
mod tests;

use crate::error::MemError;

pub use dtype::{Dtype, WeightFormat};
pub use failure::{Charge, FailureKind, Lever, PlanError, PlanFailure};
pub use hf_defaults::transformers_defaults;
pub use input::{
    parse_size, Features, KvPolicy, Limits, PlanInput, DEFAULT_BLOCK_SIZE, H200_CONTEXT_BYTES,
    H200_LIBRARY_RESERVE_BYTES, MAX_BYTES,
};
pub use plan::{
    plan_memory, HostKvPlan, KvPlan, MemoryPlan, PoolPlan, DEFAULT_MAX_BATCH_TOKENS,
    GEMM_WORKSPACE_BYTES,
};
pub use safetensors::{
    safetensors_bytes_in_dir, safetensors_file_bytes, weights_bytes_from_safetensors_header,
    weights_bytes_from_safetensors_index,
};
pub use shape::{Attention, KvBytesPerToken, ModelShape, Moe, WeightSpec};
pub use validate::{check_fields, unknown_model_type, FIELDS as SHAPE_FIELDS};

/// A planner value as pretty JSON, fields in declaration order; `what` names
/// it in the (unexpected) error.
fn to_json<T: serde::Serialize>(value: &T, what: &str) -> Result<String, MemError> {
    serde_json::to_string_pretty(value)
        .map_err(|err| MemError::Invariant(format!("{what} does not serialise: {err}")))
}
