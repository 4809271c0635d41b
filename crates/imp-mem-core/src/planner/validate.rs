//! Checks a model's shape where it is made: the attention geometry a
//! config declares must be one a transformer can have, and the fields a
//! caller names one by one (`ModelShape(num_key_value_heads=8, ...)` in
//! Python) must be fields the parser reads, so that a typo is refused
//! with the field it meant instead of silently taking a default (issue
//! 55: `num_key_value_head=8` planned a KV cache 4x too big).
//!
//! The rules: the KV heads divide the attention heads (each KV head
//! serves the same number of query heads); without an explicit
//! `head_dim`, `hidden_size` is a multiple of `num_attention_heads` (the
//! head width transformers derives would otherwise be truncated). An
//! explicit `head_dim` stands as given: Gemma's and Qwen3's heads are
//! wider or narrower than `hidden_size / num_attention_heads` by design.

use crate::error::MemError;

/// The top-level `config.json` fields the shape parser reads (any of its
/// spellings); a field a caller passes by name must be one of them.
pub const FIELDS: &[&str] = &[
    "attention_head_dim",
    "attn_layer_indices",
    "attn_layer_offset",
    "attn_layer_period",
    "conv_kernel",
    "d_conv",
    "d_model",
    "d_state",
    "decoder_sparse_step",
    "dim",
    "dtype",
    "expand",
    "expert_intermediate_size",
    "expert_layer_offset",
    "expert_layer_period",
    "ffn_hidden_size",
    "first_k_dense_replace",
    "full_attention_interval",
    "head_dim",
    "hidden_size",
    "hybrid_override_pattern",
    "intermediate_size",
    "kv_lora_rank",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_value_head_dim",
    "mamba_conv_kernel",
    "mamba_d_conv",
    "mamba_d_head",
    "mamba_d_ssm",
    "mamba_d_state",
    "mamba_expand",
    "mamba_head_dim",
    "mamba_n_groups",
    "mamba_n_heads",
    "mamba_num_heads",
    "max_position_embeddings",
    "max_seq_len",
    "max_window_layers",
    "mlp_only_layers",
    "model_type",
    "moe_intermediate_size",
    "moe_layer_freq",
    "moe_num_experts",
    "moe_top_k",
    "multi_query",
    "n_embd",
    "n_groups",
    "n_head",
    "n_head_kv",
    "n_heads",
    "n_inner",
    "n_layer",
    "n_layers",
    "n_positions",
    "n_routed_experts",
    "n_shared_experts",
    "num_attention_heads",
    "num_experts",
    "num_experts_per_tok",
    "num_experts_per_token",
    "num_hidden_layers",
    "num_key_value_heads",
    "num_kv_heads",
    "num_layers",
    "num_local_experts",
    "num_shared_experts",
    "padded_vocab_size",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "quantization_config",
    "shared_expert_intermediate_size",
    "sliding_window",
    "sliding_window_pattern",
    "ssm_state_size",
    "state_size",
    "text_config",
    "tie_word_embeddings",
    "top_k",
    "torch_dtype",
    "use_sliding_window",
    "v_head_dim",
    "vocab_size",
];

/// Fields transformers' defaults carry (`hf_defaults`, the one table) that
/// the planner does not read and the reference engine does (its activation,
/// norm epsilon, RoPE bases, biases, MoE routing scalars, Gemma-3's scalars
/// and image tokens, the SigLIP tower): not fields a `ModelShape(...)`
/// takes, yet named here so that every default is one or the other.
#[cfg(test)]
const ENGINE_ONLY_FIELDS: &[&str] = &[
    "attention_bias",
    "hidden_act",
    "hidden_activation",
    "image_size",
    "image_token_index",
    "layer_norm_eps",
    "mlp_bias",
    "mm_tokens_per_image",
    "norm_topk_prob",
    "num_channels",
    "patch_size",
    "query_pre_attn_scalar",
    "rms_norm_eps",
    "rope_local_base_freq",
    "rope_theta",
    "routed_scaling_factor",
    "topk_method",
    "vision_use_head",
];

/// The `model_type`s whose configs the parser knows (transformers'
/// defaults for the fields they leave out, or a layer pattern of their
/// own); `hf_defaults` covers each but `cohere2`.
pub const KNOWN_MODEL_TYPES: &[&str] = &[
    "cohere2",
    "deepseek_v2",
    "deepseek_v3",
    "falcon_h1",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gpt_oss",
    "jamba",
    "llama",
    "mistral",
    "mixtral",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
];

/// A warning for a shape read from a config whose `model_type` (the
/// shape's name) the parser does not know, or `None`. Such a config is
/// planned, not refused: new model types appear every month and most are
/// decoders the generic fields describe, so a refusal would block them;
/// the warning says the figures rest on those fields alone.
pub fn unknown_model_type(model_type: &str) -> Option<String> {
    // "model": the parser's name for a config without model_type, which
    // names no model to know (fields given one by one, on purpose).
    if model_type == "model" || KNOWN_MODEL_TYPES.contains(&model_type) {
        return None;
    }
    Some(format!(
        "ModelShape: model_type {model_type:?} is not one the planner knows ({}); it is planned from the \
         config's generic fields (layers, heads, KV heads, head_dim, experts, sliding windows): \
         check the plan's weights and KV lines against the model",
        KNOWN_MODEL_TYPES.join(", ")
    ))
}

/// Refuses a field `FIELDS` does not hold, naming the nearest that it does.
pub fn check_fields<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), MemError> {
    for name in names {
        if FIELDS.contains(&name) {
            continue;
        }
        let hint = match nearest(name) {
            Some(near) => format!("; did you mean {near}?"),
            None => "; the fields it reads are config.json's (num_hidden_layers, hidden_size, \
                     num_attention_heads, num_key_value_heads, vocab_size, ...)"
                .to_string(),
        };
        return Err(MemError::invalid(format!(
            "ModelShape: {name} is not a config.json field the planner reads{hint} (a whole \
             config.json, whose other fields are ignored, goes to \
             ModelShape.from_hf_config)"
        )));
    }
    Ok(())
}

/// The field of `FIELDS` nearest `name` (edit distance at most a third
/// of its length, at least 2), if any.
fn nearest(name: &str) -> Option<&'static str> {
    let limit = (name.len() / 3).max(2);
    FIELDS
        .iter()
        .map(|f| (edit_distance(name, f), *f))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, f)| f)
}

/// Levenshtein distance over bytes (field names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// The attention geometry's rules (module doc): `head_dim_given` says
/// whether the config (or transformers' default for its type) names the
/// head width.
pub(crate) fn check_heads(
    heads: u64,
    num_kv_heads: u64,
    hidden: u64,
    head_dim_given: bool,
) -> Result<(), MemError> {
    if num_kv_heads > heads || heads % num_kv_heads != 0 {
        let divisors: Vec<u64> = (1..=heads).filter(|d| heads % d == 0).collect();
        let below = divisors.iter().rev().find(|&&d| d < num_kv_heads);
        let above = divisors.iter().find(|&&d| d > num_kv_heads);
        let nearest = match (below, above) {
            (Some(b), Some(a)) => format!("{b} or {a}"),
            (Some(b), None) => b.to_string(),
            (None, Some(a)) => a.to_string(),
            (None, None) => "1".to_string(),
        };
        return Err(MemError::invalid(format!(
            "config.json: num_key_value_heads ({num_kv_heads}) must divide \
             num_attention_heads ({heads}): each KV head serves the same number of query \
             heads; the nearest that do are {nearest}"
        )));
    }
    if !head_dim_given && hidden % heads != 0 {
        return Err(MemError::invalid(format!(
            "config.json: hidden_size ({hidden}) is not a multiple of num_attention_heads \
             ({heads}), so the head width hidden_size / num_attention_heads is not whole; fix \
             hidden_size (e.g. {}) or give head_dim",
            hidden / heads * heads
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_must_divide_the_attention_heads() {
        assert!(check_heads(32, 8, 4096, false).is_ok());
        assert!(check_heads(32, 32, 4096, false).is_ok());
        let e = check_heads(32, 5, 4096, false).unwrap_err().to_string();
        assert!(e.contains("(5) must divide") && e.contains("4 or 8"), "{e}");
        let e = check_heads(32, 64, 4096, false).unwrap_err().to_string();
        assert!(
            e.contains("(64) must divide") && e.contains("are 32"),
            "{e}"
        );
    }

    #[test]
    fn without_head_dim_the_hidden_size_splits_evenly() {
        let e = check_heads(32, 8, 4095, false).unwrap_err().to_string();
        assert!(
            e.contains("hidden_size (4095)") && e.contains("4064"),
            "{e}"
        );
        // Gemma-3 4B: 2560 wide, 8 heads of 256 (head_dim given).
        assert!(check_heads(8, 4, 2560, true).is_ok());
        assert!(check_heads(32, 8, 4095, true).is_ok());
    }

    #[test]
    fn an_unknown_model_type_is_planned_with_a_warning() {
        assert_eq!(unknown_model_type("llama"), None);
        let w = unknown_model_type("llamma").unwrap();
        assert!(
            w.contains("\"llamma\"") && w.contains("generic fields"),
            "{w}"
        );
        assert_eq!(unknown_model_type("model"), None);
        for known in KNOWN_MODEL_TYPES {
            assert!(!super::super::hf_defaults::defaults(known).is_empty() || *known == "cohere2");
        }
    }

    #[test]
    fn a_misspelt_field_names_the_one_meant() {
        assert!(check_fields(["num_key_value_heads", "hidden_size"]).is_ok());
        let e = check_fields(["num_key_value_head"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean num_key_value_heads?"), "{e}");
        let e = check_fields(["hiden_size"]).unwrap_err().to_string();
        assert!(e.contains("did you mean hidden_size?"), "{e}");
        let e = check_fields(["colour"]).unwrap_err().to_string();
        assert!(
            e.contains("colour is not") && !e.contains("did you mean"),
            "{e}"
        );
    }

    #[test]
    fn every_field_a_default_is_given_for_is_listed() {
        // transformers' defaults name fields the parser reads, each of
        // which must pass ModelShape(...)'s check, or fields the engine
        // alone reads; none is both, none is neither.
        for model_type in KNOWN_MODEL_TYPES {
            for (key, _) in super::super::hf_defaults::defaults(model_type) {
                let planner = FIELDS.contains(key);
                let engine = ENGINE_ONLY_FIELDS.contains(key);
                assert!(planner != engine, "{model_type}: {key}");
            }
        }
    }
}
