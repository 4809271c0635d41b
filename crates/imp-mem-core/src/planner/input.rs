//! What the planner is asked: the model, the limits it must serve, the
//! features that cost memory, the budget and the two measured charges.

use serde::{Deserialize, Serialize};

use super::dtype::Dtype;
use super::shape::{Attention, ModelShape};
use crate::error::MemError;

/// How the KV pool is sized from the residual.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvPolicy {
    /// The pool must hold `max_batch` sequences of `max_seq_len` tokens;
    /// anything less fails with the report (seed A4.3).
    #[default]
    Full,
    /// The pool takes what the residual leaves, up to that same target, and
    /// fails only below one full sequence (seed D8); admission then bounds
    /// concurrency.
    Fit,
    /// No KV pool: the caller keeps its KV cache itself (a Hugging Face
    /// model's KV lives in torch tensors, on the activations tier). The
    /// plan has no KV or SWA blocks; `max_batch` and `max_seq_len` still
    /// size the scratch and the per-sequence state.
    None,
}

impl KvPolicy {
    /// Parses `full`, `fit` or `none`.
    pub fn parse(text: &str) -> Result<KvPolicy, MemError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "full" => Ok(KvPolicy::Full),
            "fit" => Ok(KvPolicy::Fit),
            "none" => Ok(KvPolicy::None),
            other => Err(MemError::invalid(format!(
                "kv_policy: unknown policy '{other}'; expected full, fit or none"
            ))),
        }
    }
}

/// The concurrency the plan must serve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Sequences served at once.
    pub max_batch: u32,
    /// Tokens per sequence, prompt and generation together.
    pub max_seq_len: u64,
    /// KV element type; `None` means the model's dtype.
    pub kv_dtype: Option<Dtype>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Tokens per forward pass (prefill chunk); `None` means
    /// `min(8192, max_batch * max_seq_len)`.
    pub max_batch_tokens: Option<u64>,
    /// How the KV pool is sized from the residual.
    pub kv_policy: KvPolicy,
}

impl Limits {
    /// Limits with the default block size (16), model-dtype KV and the
    /// `full` policy.
    pub fn new(max_batch: u32, max_seq_len: u64) -> Limits {
        Limits {
            max_batch,
            max_seq_len,
            kv_dtype: None,
            block_size: DEFAULT_BLOCK_SIZE,
            max_batch_tokens: None,
            kv_policy: KvPolicy::Full,
        }
    }
}

/// Tokens per KV block unless told otherwise.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Features that cost memory beyond the model and its KV.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// Speculative decoding: draft tokens verified per step.
    pub spec_depth: u32,
    /// Weights of a separate draft model, if any (T1).
    pub draft_weights_bytes: u64,
    /// Weights of a vision tower (T1).
    pub vision_tower_bytes: u64,
    /// LoRA adapters resident at once (T2).
    pub lora_slots: u32,
    /// Largest LoRA rank a slot holds.
    pub lora_rank: u32,
    /// A measured T4 high-water mark, replacing the estimate.
    pub scratch_bytes: Option<u64>,
    /// A measured T2 size, replacing the estimate.
    pub engine_persistent_bytes: Option<u64>,
    /// Pinned host memory for the KV host tier (T5b): evicted prefix blocks
    /// kept on the host. Its own budget — host memory, not in the device
    /// plan's total.
    #[serde(default)]
    pub kv_host_bytes: u64,
    /// The measured warm-up high-water of a framework's own allocations in
    /// one step (torch's activations, seed A3.3): the T4a activation pool.
    /// `None`: no pool and no plan line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_bytes: Option<u64>,
    /// KV blocks an engine holds for itself beyond `max_batch` sequences
    /// (the padding rows' block of a captured decode, a prefill's scratch
    /// ring): added to the KV pool's target, so the engine plans one block
    /// instead of a whole sequence for its padding.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub engine_kv_blocks: u64,
    /// The same for the sliding-window pool.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub engine_swa_blocks: u64,
    /// What a warm-up leaves on the device outside every imp-mem tier,
    /// measured (issue 25): torch's graph pools and working set when torch's
    /// own allocator serves the forward pass, and the kernel modules the
    /// warm-up loads. A plan line (`warmup`) the system does not acquire;
    /// the engine claims it with its measurement (`set_charge("warmup")`).
    pub warmup_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Everything `plan_memory` reads. Seed A4.2 plus D7's two measured charges.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanInput {
    /// The model.
    pub model: ModelShape,
    /// The concurrency to serve.
    pub limits: Limits,
    /// Features that cost memory.
    pub features: Features,
    /// Tensor-parallel degree; the plan is per rank.
    pub tp: u32,
    /// Device bytes this rank may use, all charges included.
    pub budget: u64,
    /// The CUDA context and driver, measured: gone before anything is
    /// allocated (D7).
    pub context_bytes: u64,
    /// What libraries (cuBLAS, ...) claim on their first call, measured (D7).
    pub library_reserve_bytes: u64,
}

/// The CUDA context measured on the H200 (SPEC facts, 2026-11-30).
pub const H200_CONTEXT_BYTES: u64 = 527 << 20;
/// cuBLAS's reserve on the first bf16 matmul, measured on the H200.
pub const H200_LIBRARY_RESERVE_BYTES: u64 = 66 << 20;

/// Largest value any single input or charge may take: keeps every sum
/// far from `u64` overflow (256 PiB).
pub const MAX_BYTES: u64 = crate::units::MAX_SIZE;

impl PlanInput {
    /// The input as pretty JSON (what `plan_memory` reads).
    pub fn to_json(&self) -> Result<String, MemError> {
        super::to_json(self, "plan input")
    }

    /// Checks every field; the error names the field and says what to change.
    pub fn validate(&self) -> Result<(), MemError> {
        let l = &self.limits;
        positive("max_batch", u64::from(l.max_batch))?;
        at_most("max_batch", u64::from(l.max_batch), 1 << 24)?;
        positive("max_seq_len", l.max_seq_len)?;
        positive("block_size", u64::from(l.block_size))?;
        at_most("block_size", u64::from(l.block_size), 1 << 16)?;
        at_most("max_seq_len", l.max_seq_len, 1 << 34)?;
        if let Some(t) = l.max_batch_tokens {
            positive("max_batch_tokens", t)?;
            at_most("max_batch_tokens", t, 1 << 34)?;
        }
        positive("tp", u64::from(self.tp))?;
        at_most("tp", u64::from(self.tp), 4096)?;
        check_tp(&self.model, self.tp)?;
        positive("budget", self.budget)?;
        at_most("budget", self.budget, MAX_BYTES)?;
        at_most("context", self.context_bytes, MAX_BYTES)?;
        at_most("library_reserve", self.library_reserve_bytes, MAX_BYTES)?;
        let f = &self.features;
        at_most("spec_depth", u64::from(f.spec_depth), 1 << 16)?;
        at_most("warmup_bytes", f.warmup_bytes, MAX_BYTES)?;
        at_most("draft_weights_bytes", f.draft_weights_bytes, MAX_BYTES)?;
        at_most("vision_tower_bytes", f.vision_tower_bytes, MAX_BYTES)?;
        at_most("lora_slots", u64::from(f.lora_slots), 1 << 16)?;
        at_most("lora_rank", u64::from(f.lora_rank), 1 << 16)?;
        if f.lora_slots > 0 {
            positive("lora_rank", u64::from(f.lora_rank))?;
        }
        at_most("scratch_bytes", f.scratch_bytes.unwrap_or(0), MAX_BYTES)?;
        at_most("kv_host_bytes", f.kv_host_bytes, MAX_BYTES)?;
        at_most(
            "activation_bytes",
            f.activation_bytes.unwrap_or(0),
            MAX_BYTES,
        )?;
        at_most(
            "engine_persistent_bytes",
            f.engine_persistent_bytes.unwrap_or(0),
            MAX_BYTES,
        )?;
        at_most("engine_kv_blocks", f.engine_kv_blocks, 1 << 32)?;
        at_most("engine_swa_blocks", f.engine_swa_blocks, 1 << 32)?;
        let m = &self.model;
        positive("model.num_layers", u64::from(m.num_layers))?;
        positive("model.hidden_size", m.hidden_size)?;
        positive("model.vocab_size", m.vocab_size)?;
        positive("model.num_attention_heads", m.num_attention_heads)?;
        for (name, value) in [
            ("model.hidden_size", m.hidden_size),
            ("model.vocab_size", m.vocab_size),
            ("model.intermediate_size", m.intermediate_size),
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.state_bytes_per_layer", m.state_bytes_per_layer),
        ] {
            at_most(name, value, 1 << 32)?;
        }
        let geometry: [(&str, u64); 3] = match m.attention {
            Attention::Gqa {
                num_kv_heads,
                head_dim,
                v_head_dim,
            } => [
                ("model.num_kv_heads", num_kv_heads),
                ("model.head_dim", head_dim),
                ("model.v_head_dim", v_head_dim),
            ],
            Attention::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
                qk_nope_head_dim,
                ..
            } => [
                ("model.kv_lora_rank", kv_lora_rank),
                ("model.qk_rope_head_dim", qk_rope_head_dim),
                ("model.qk_nope_head_dim", qk_nope_head_dim),
            ],
        };
        for (name, value) in geometry {
            at_most(name, value, 1 << 32)?;
        }
        if let Some(moe) = &m.moe {
            at_most(
                "model.moe.experts_per_token",
                moe.experts_per_token,
                1 << 32,
            )?;
            at_most(
                "model.moe.expert_intermediate_size",
                moe.expert_intermediate_size,
                1 << 32,
            )?;
            at_most(
                "model.moe.shared_intermediate_size",
                moe.shared_intermediate_size,
                1 << 32,
            )?;
        }
        at_most("model.weights", m.weights_bytes(), MAX_BYTES)?;
        let attention_layers = u64::from(m.full_attention_layers) + u64::from(m.sliding_layers);
        at_most(
            "model.full_attention_layers + sliding_layers",
            attention_layers,
            u64::from(m.num_layers),
        )?;
        at_most(
            "model.state_layers",
            u64::from(m.state_layers),
            u64::from(m.num_layers),
        )?;
        if m.sliding_layers > 0 {
            positive("model.sliding_window", m.sliding_window.unwrap_or(0))?;
        }
        Ok(())
    }

    /// The KV dtype after resolving `auto` to the model's dtype.
    pub fn kv_dtype(&self) -> Dtype {
        self.limits.kv_dtype.unwrap_or(self.model.dtype)
    }
}

fn positive(field: &str, value: u64) -> Result<(), MemError> {
    if value == 0 {
        return Err(MemError::invalid(format!(
            "{field}: must be at least 1, got 0"
        )));
    }
    Ok(())
}

fn at_most(field: &str, value: u64, max: u64) -> Result<(), MemError> {
    if value > max {
        return Err(MemError::invalid(format!(
            "{field}: {value} is larger than the supported {max}"
        )));
    }
    Ok(())
}

/// Parses a size as people write budgets (`80GiB`, `80 GB`, `81920MiB`, a
/// byte count; the spellings of [`crate::units::parse_bytes`]) and checks it
/// is positive and plausible. `field` names the input in the error.
pub fn parse_size(text: &str, field: &str) -> Result<u64, MemError> {
    let value = crate::units::parse_bytes(text)
        .map_err(|err| MemError::invalid(format!("{field}: {err}")))?;
    if value == 0 {
        return Err(MemError::invalid(format!(
            "{field}: '{text}' is zero; a size must be positive"
        )));
    }
    debug_assert!(
        value <= MAX_BYTES,
        "parse_bytes caps sizes at MAX_SIZE = MAX_BYTES"
    );
    Ok(value)
}

/// Refuses a tensor-parallel degree the attention heads do not split over
/// evenly: every rank must get the same number of query heads, and the KV
/// heads must split evenly (`tp` divides them) or be replicated (they
/// divide `tp`). Names the nearest degrees that do.
pub(super) fn check_tp(m: &ModelShape, tp: u32) -> Result<(), MemError> {
    let heads = m.num_attention_heads;
    let kv = match m.attention {
        Attention::Gqa { num_kv_heads, .. } => Some(num_kv_heads),
        Attention::Mla { .. } => None,
    };
    let ok =
        |t: u64| t > 0 && heads % t == 0 && kv.is_none_or(|k| k > 0 && (k % t == 0 || t % k == 0));
    let tp = u64::from(tp);
    if heads == 0 || ok(tp) {
        return Ok(());
    }
    let below = (1..tp).rev().find(|&t| ok(t));
    let above = (tp + 1..=4096).find(|&t| ok(t));
    let nearest = match (below, above) {
        (Some(b), Some(a)) => format!("tp {b} or {a}"),
        (Some(b), None) => format!("tp {b}"),
        (None, Some(a)) => format!("tp {a}"),
        (None, None) => "tp 1".to_string(),
    };
    let kv_text = kv.map_or(String::new(), |k| format!(" and {k} KV heads"));
    Err(MemError::invalid(format!(
        "tp={tp} does not split the model's {heads} attention heads{kv_text} evenly over the \
         ranks (each rank needs the same heads; KV heads split evenly or are replicated); use \
         {nearest}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_in_every_spelling() {
        assert_eq!(parse_size("80GiB", "budget").unwrap(), 80 << 30);
        assert_eq!(parse_size("80 GB", "budget").unwrap(), 80 << 30);
        assert_eq!(parse_size("81920MiB", "budget").unwrap(), 80 << 30);
        assert_eq!(parse_size("1.5 GiB", "budget").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096B", "budget").unwrap(), 4096);
        assert_eq!(parse_size(" 2g ", "budget").unwrap(), 2 << 30);
        for bad in [
            "",
            "GiB",
            "80 GiBs",
            "eighty",
            "-80GiB",
            "0GiB",
            "4096",
            "1e3",
            "99999999999999TiB",
        ] {
            let err = parse_size(bad, "budget").unwrap_err().to_string();
            assert!(err.starts_with("budget:"), "{bad:?} -> {err}");
        }
    }
}
