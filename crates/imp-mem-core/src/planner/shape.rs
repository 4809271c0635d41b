//! `ModelShape`: what a model costs, read from a Hugging Face `config.json`.
//!
//! The shape keeps only what memory depends on: layer counts by kind (full
//! attention, sliding-window attention, fixed-state linear / Mamba layers),
//! the attention geometry (GQA/MHA heads, or MLA's compressed latent), the
//! per-sequence state of the linear layers, the MoE layout and the weight
//! formats. Weights are counted from the shape (an estimate good to a few
//! per cent) unless real tensor sizes from safetensors are attached, in which
//! case those win.

use serde::{Deserialize, Serialize};

use super::dtype::{Dtype, WeightFormat};
use crate::error::MemError;

/// Attention geometry of the attention layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Attention {
    /// Grouped-query (or multi-head, or multi-query) attention: a K and a V
    /// vector per KV head per token.
    Gqa {
        /// KV heads (equal to the query heads for MHA, 1 for MQA).
        num_kv_heads: u64,
        /// Width of one K head.
        head_dim: u64,
        /// Width of one V head (equal to `head_dim` except in a few models).
        v_head_dim: u64,
    },
    /// Multi-head latent attention (DeepSeek-V2/V3): one compressed latent
    /// plus a decoupled RoPE key per token, shared by every head.
    Mla {
        /// Width of the compressed KV latent.
        kv_lora_rank: u64,
        /// Width of the decoupled RoPE key.
        qk_rope_head_dim: u64,
        /// Non-RoPE part of a query/key head.
        qk_nope_head_dim: u64,
        /// Width of one V head.
        v_head_dim: u64,
        /// Rank of the query compression, if the queries are compressed.
        q_lora_rank: Option<u64>,
    },
}

/// Mixture-of-experts layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    /// Routed experts per MoE layer.
    pub num_experts: u64,
    /// Experts each token is routed to.
    pub experts_per_token: u64,
    /// Intermediate width of one routed expert.
    pub expert_intermediate_size: u64,
    /// Intermediate width of the shared expert(s), 0 if none.
    pub shared_intermediate_size: u64,
    /// Layers whose MLP is a MoE block.
    pub moe_layers: u32,
}

/// Where the weight bytes come from and how they are stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSpec {
    /// Embedding and output-head parameters (kept unquantized).
    pub embedding_params: u64,
    /// Every other non-expert parameter.
    pub dense_params: u64,
    /// Routed-expert parameters.
    pub expert_params: u64,
    /// Storage of the embeddings.
    pub embedding_format: WeightFormat,
    /// Storage of the dense parameters.
    pub dense_format: WeightFormat,
    /// Storage of the routed experts.
    pub expert_format: WeightFormat,
    /// Real bytes from a safetensors index or headers; wins over the estimate.
    pub measured_bytes: Option<u64>,
}

impl WeightSpec {
    /// Parameters counted from the shape.
    pub fn params(&self) -> u64 {
        self.embedding_params
            .saturating_add(self.dense_params)
            .saturating_add(self.expert_params)
    }

    /// Bytes of the whole model (all ranks): measured if known, else estimated.
    pub fn bytes(&self) -> u64 {
        if let Some(bytes) = self.measured_bytes {
            return bytes;
        }
        self.embedding_format
            .bytes_for(self.embedding_params)
            .saturating_add(self.dense_format.bytes_for(self.dense_params))
            .saturating_add(self.expert_format.bytes_for(self.expert_params))
    }
}

/// Everything about a model the memory plan depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// `model_type` of the config, or a preset's name.
    pub name: String,
    /// Decoder layers.
    pub num_layers: u32,
    /// Model width.
    pub hidden_size: u64,
    /// Vocabulary size.
    pub vocab_size: u64,
    /// Query heads.
    pub num_attention_heads: u64,
    /// Dense MLP intermediate width.
    pub intermediate_size: u64,
    /// Geometry of the attention layers.
    pub attention: Attention,
    /// Layers with full (global) attention: KV grows with the sequence.
    pub full_attention_layers: u32,
    /// Layers with sliding-window attention: KV bounded by the window.
    pub sliding_layers: u32,
    /// The sliding window in tokens, when there are sliding layers.
    pub sliding_window: Option<u64>,
    /// Linear-attention / Mamba layers: a fixed state per sequence.
    pub state_layers: u32,
    /// Bytes of one such layer's state for one sequence (all ranks).
    pub state_bytes_per_layer: u64,
    /// MoE layout, if the model has experts.
    pub moe: Option<Moe>,
    /// Activation dtype (`torch_dtype`).
    pub dtype: Dtype,
    /// Weight parameters and their formats.
    pub weights: WeightSpec,
    /// The context length the model was trained for, if the config says.
    pub max_position_embeddings: Option<u64>,
}

/// KV bytes one token costs, per rank, split by pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBytesPerToken {
    /// Over all full-attention layers.
    pub full: u64,
    /// Over all sliding-window layers.
    pub sliding: u64,
}

impl KvBytesPerToken {
    /// Both pools together.
    pub fn total(self) -> u64 {
        self.full.saturating_add(self.sliding)
    }
}

impl ModelShape {
    /// The shape as pretty JSON.
    pub fn to_json(&self) -> Result<String, MemError> {
        super::to_json(self, "shape")
    }

    /// KV bytes one token costs in one attention layer on one of `tp` ranks:
    /// GQA divides the KV heads between ranks (a rank keeps at least one,
    /// replicated when there are fewer heads than ranks); MLA's latent is
    /// replicated on every rank.
    pub fn kv_bytes_per_token_per_layer(&self, kv_dtype: Dtype, tp: u32) -> u64 {
        let elems = match self.attention {
            Attention::Gqa {
                num_kv_heads,
                head_dim,
                v_head_dim,
            } => num_kv_heads
                .div_ceil(u64::from(tp.max(1)))
                .saturating_mul(head_dim.saturating_add(v_head_dim)),
            Attention::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
                ..
            } => kv_lora_rank.saturating_add(qk_rope_head_dim),
        };
        elems.saturating_mul(kv_dtype.bytes())
    }

    /// KV bytes one token costs on one rank, by pool.
    pub fn kv_bytes_per_token(&self, kv_dtype: Dtype, tp: u32) -> KvBytesPerToken {
        let per_layer = self.kv_bytes_per_token_per_layer(kv_dtype, tp);
        KvBytesPerToken {
            full: per_layer.saturating_mul(u64::from(self.full_attention_layers)),
            sliding: per_layer.saturating_mul(u64::from(self.sliding_layers)),
        }
    }

    /// Bytes of all weights (all ranks).
    pub fn weights_bytes(&self) -> u64 {
        self.weights.bytes()
    }

    /// Width of all query heads.
    pub fn q_dim(&self) -> u64 {
        let per_head = match self.attention {
            Attention::Gqa { head_dim, .. } => head_dim,
            Attention::Mla {
                qk_rope_head_dim,
                qk_nope_head_dim,
                ..
            } => qk_rope_head_dim.saturating_add(qk_nope_head_dim),
        };
        self.num_attention_heads.saturating_mul(per_head)
    }

    /// Attaches real weight bytes (from safetensors), replacing the estimate.
    pub fn with_measured_weights(mut self, bytes: u64) -> Self {
        self.weights.measured_bytes = Some(bytes);
        self
    }

    /// The planner's weights line for one of `tp` ranks: an even share of
    /// the weights, `ceil(weights / tp)`, rounded up to a MiB.
    pub fn rank_weights_line(&self, tp: u32) -> u64 {
        let share = self.weights_bytes().div_ceil(u64::from(tp.max(1)));
        share.div_ceil(1 << 20).saturating_mul(1 << 20)
    }

    /// The shape `tp` ranks plan with when the largest rank's load lays out
    /// `largest_rank` bytes of T1 (its slices, replicated tensors and
    /// alignment): this shape while its even per-rank line covers that,
    /// else one whose weights are `tp` times `largest_rank`, so that every
    /// rank's load fits its line.
    pub fn for_rank_layout(self, tp: u32, largest_rank: u64) -> Self {
        if tp <= 1 || self.rank_weights_line(tp) >= largest_rank {
            return self;
        }
        self.with_measured_weights(u64::from(tp).saturating_mul(largest_rank))
    }

    /// Refuses a tensor-parallel degree this model's attention heads do not
    /// split over evenly; the error names the nearest degrees that do.
    pub fn check_tp(&self, tp: u32) -> Result<(), MemError> {
        super::input::check_tp(self, tp)
    }
}
