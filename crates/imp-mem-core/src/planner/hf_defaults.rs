//! The defaults transformers gives a field that `config.json` leaves out,
//! for the model types the presets and tests cover: a missing field must
//! mean what it means to transformers (Gemma-3's `head_dim` is 256, not
//! `hidden_size / num_attention_heads`). Taken from the `__init__` defaults
//! of transformers' config classes (5.17), constant ones only: a default
//! transformers derives from other fields (Llama's `head_dim`, the KV heads
//! equal to the query heads) is derived by the parser the same way. A key
//! present with `null` keeps its meaning ("none"), so only an absent key
//! takes a default. `tests/test_planner_transformers.py` compares the
//! parse with transformers' own config classes where transformers is
//! installed.
//!
//! One table for every reader: the planner's parse (`ModelShape`) and the
//! reference engine's (`imp_mem.engine.config`, through the binding's
//! `transformers_defaults`) both read it, so the two cannot drift. That is
//! why it also holds values the planner does not read (the activation, the
//! norm epsilon, RoPE's base).

use serde_json::{Map, Value};

/// A default value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum D {
    /// An integer.
    Int(u64),
    /// A boolean.
    Bool(bool),
    /// A float (RoPE's base, the norm epsilon).
    Float(f64),
    /// A string (the activation, the top-k method).
    Str(&'static str),
}

impl D {
    fn to_json(self) -> Value {
        match self {
            D::Int(n) => Value::from(n),
            D::Bool(b) => Value::from(b),
            D::Float(f) => Value::from(f),
            D::Str(s) => Value::from(s),
        }
    }
}

/// transformers' defaults of `model_type` as a JSON object, key to value;
/// empty for a type the table does not cover. `gemma3` (the multimodal
/// config) holds its text model's defaults and its own (the image tokens);
/// `siglip_vision_model` is Gemma-3's vision tower.
pub fn transformers_defaults(model_type: &str) -> Map<String, Value> {
    let own: &[(&str, D)] = match model_type {
        "gemma3" => GEMMA3_OWN,
        _ => &[],
    };
    defaults(model_type)
        .iter()
        .chain(own)
        .map(|(key, value)| ((*key).to_string(), value.to_json()))
        .collect()
}

/// Gemma3Config's own fields (transformers 5.24), beside its text model's.
/// `image_token_index` is also read as `image_token_id`.
const GEMMA3_OWN: &[(&str, D)] = &[
    ("mm_tokens_per_image", D::Int(256)),
    ("image_token_index", D::Int(262_144)),
];

/// The defaults of `model_type`, empty for a type not covered.
pub(crate) fn defaults(model_type: &str) -> &'static [(&'static str, D)] {
    match model_type {
        "llama" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(32000)),
            ("intermediate_size", D::Int(11008)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(2048)),
            ("hidden_act", D::Str("silu")),
            ("rms_norm_eps", D::Float(1e-6)),
            ("rope_theta", D::Float(10_000.0)),
            ("attention_bias", D::Bool(false)),
            ("mlp_bias", D::Bool(false)),
        ],
        "mistral" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(32000)),
            ("intermediate_size", D::Int(14336)),
            ("num_key_value_heads", D::Int(8)),
            ("sliding_window", D::Int(4096)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(131072)),
        ],
        "mixtral" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(32000)),
            ("intermediate_size", D::Int(14336)),
            ("num_key_value_heads", D::Int(8)),
            ("num_local_experts", D::Int(8)),
            ("num_experts_per_tok", D::Int(2)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(131072)),
        ],
        "qwen3" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(151936)),
            ("intermediate_size", D::Int(22016)),
            ("num_key_value_heads", D::Int(32)),
            ("head_dim", D::Int(128)),
            ("sliding_window", D::Int(4096)),
            ("use_sliding_window", D::Bool(false)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(32768)),
            ("hidden_act", D::Str("silu")),
            ("rms_norm_eps", D::Float(1e-6)),
            ("rope_theta", D::Float(10_000.0)),
            ("attention_bias", D::Bool(false)),
            ("max_window_layers", D::Int(28)),
        ],
        "qwen3_moe" => &[
            ("num_hidden_layers", D::Int(24)),
            ("hidden_size", D::Int(2048)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(151936)),
            ("intermediate_size", D::Int(6144)),
            ("num_key_value_heads", D::Int(4)),
            ("sliding_window", D::Int(4096)),
            ("use_sliding_window", D::Bool(false)),
            ("num_experts", D::Int(128)),
            ("num_experts_per_tok", D::Int(8)),
            ("moe_intermediate_size", D::Int(768)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(32768)),
            ("decoder_sparse_step", D::Int(1)),
            ("hidden_act", D::Str("silu")),
            ("rms_norm_eps", D::Float(1e-6)),
            ("rope_theta", D::Float(10_000.0)),
            ("attention_bias", D::Bool(false)),
            ("norm_topk_prob", D::Bool(false)),
        ],
        "qwen3_next" => &[
            ("num_hidden_layers", D::Int(48)),
            ("hidden_size", D::Int(2048)),
            ("num_attention_heads", D::Int(16)),
            ("vocab_size", D::Int(151936)),
            ("intermediate_size", D::Int(5632)),
            ("num_key_value_heads", D::Int(2)),
            ("head_dim", D::Int(256)),
            ("num_experts", D::Int(512)),
            ("num_experts_per_tok", D::Int(10)),
            ("moe_intermediate_size", D::Int(512)),
            ("shared_expert_intermediate_size", D::Int(512)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(32768)),
            ("linear_num_value_heads", D::Int(32)),
            ("linear_num_key_heads", D::Int(16)),
            ("linear_key_head_dim", D::Int(128)),
            ("linear_value_head_dim", D::Int(128)),
            ("linear_conv_kernel_dim", D::Int(4)),
            ("decoder_sparse_step", D::Int(1)),
        ],
        "gemma2" => &[
            ("num_hidden_layers", D::Int(26)),
            ("hidden_size", D::Int(2304)),
            ("num_attention_heads", D::Int(8)),
            ("vocab_size", D::Int(256000)),
            ("intermediate_size", D::Int(9216)),
            ("num_key_value_heads", D::Int(4)),
            ("head_dim", D::Int(256)),
            ("sliding_window", D::Int(4096)),
            ("tie_word_embeddings", D::Bool(true)),
            ("max_position_embeddings", D::Int(8192)),
        ],
        "gemma3_text" => &[
            ("num_hidden_layers", D::Int(26)),
            ("hidden_size", D::Int(2304)),
            ("num_attention_heads", D::Int(8)),
            ("vocab_size", D::Int(262208)),
            ("intermediate_size", D::Int(9216)),
            ("num_key_value_heads", D::Int(4)),
            ("head_dim", D::Int(256)),
            ("sliding_window", D::Int(4096)),
            ("tie_word_embeddings", D::Bool(true)),
            ("max_position_embeddings", D::Int(131072)),
            ("hidden_activation", D::Str("gelu_pytorch_tanh")),
            ("rms_norm_eps", D::Float(1e-6)),
            ("rope_theta", D::Float(1_000_000.0)),
            ("rope_local_base_freq", D::Float(10_000.0)),
            ("attention_bias", D::Bool(false)),
            ("query_pre_attn_scalar", D::Int(256)),
            ("sliding_window_pattern", D::Int(6)),
        ],
        "gpt_oss" => &[
            ("num_hidden_layers", D::Int(36)),
            ("hidden_size", D::Int(2880)),
            ("num_attention_heads", D::Int(64)),
            ("vocab_size", D::Int(201088)),
            ("intermediate_size", D::Int(2880)),
            ("num_key_value_heads", D::Int(8)),
            ("head_dim", D::Int(64)),
            ("sliding_window", D::Int(128)),
            ("num_local_experts", D::Int(128)),
            ("num_experts_per_tok", D::Int(4)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(131072)),
        ],
        "deepseek_v2" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(102400)),
            ("intermediate_size", D::Int(11008)),
            ("v_head_dim", D::Int(128)),
            ("kv_lora_rank", D::Int(512)),
            ("qk_rope_head_dim", D::Int(64)),
            ("qk_nope_head_dim", D::Int(128)),
            ("q_lora_rank", D::Int(1536)),
            ("n_routed_experts", D::Int(64)),
            ("moe_intermediate_size", D::Int(1407)),
            ("n_shared_experts", D::Int(2)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(2048)),
            ("first_k_dense_replace", D::Int(0)),
            ("hidden_act", D::Str("silu")),
            ("rms_norm_eps", D::Float(1e-6)),
            ("rope_theta", D::Float(10_000.0)),
            ("attention_bias", D::Bool(false)),
            ("mlp_bias", D::Bool(false)),
            ("routed_scaling_factor", D::Float(1.0)),
            ("topk_method", D::Str("greedy")),
            ("norm_topk_prob", D::Bool(false)),
            // DeepSeek's own config (transformers' class reads every layer
            // past the dense ones as MoE, which is the same).
            ("moe_layer_freq", D::Int(1)),
        ],
        "deepseek_v3" => &[
            ("num_hidden_layers", D::Int(61)),
            ("hidden_size", D::Int(7168)),
            ("num_attention_heads", D::Int(128)),
            ("vocab_size", D::Int(129280)),
            ("intermediate_size", D::Int(18432)),
            ("num_key_value_heads", D::Int(128)),
            ("v_head_dim", D::Int(128)),
            ("kv_lora_rank", D::Int(512)),
            ("qk_rope_head_dim", D::Int(64)),
            ("qk_nope_head_dim", D::Int(128)),
            ("q_lora_rank", D::Int(1536)),
            ("n_routed_experts", D::Int(256)),
            ("num_experts_per_tok", D::Int(8)),
            ("moe_intermediate_size", D::Int(2048)),
            ("n_shared_experts", D::Int(1)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(4096)),
            ("first_k_dense_replace", D::Int(3)),
        ],
        "jamba" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(65536)),
            ("intermediate_size", D::Int(14336)),
            ("num_key_value_heads", D::Int(8)),
            ("num_experts", D::Int(16)),
            ("num_experts_per_tok", D::Int(2)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(262144)),
            ("mamba_d_state", D::Int(16)),
            ("mamba_d_conv", D::Int(4)),
            ("mamba_expand", D::Int(2)),
            ("attn_layer_period", D::Int(8)),
            ("attn_layer_offset", D::Int(4)),
            ("expert_layer_period", D::Int(2)),
            ("expert_layer_offset", D::Int(1)),
        ],
        "falcon_h1" => &[
            ("num_hidden_layers", D::Int(32)),
            ("hidden_size", D::Int(4096)),
            ("num_attention_heads", D::Int(32)),
            ("vocab_size", D::Int(128000)),
            ("intermediate_size", D::Int(14336)),
            ("num_key_value_heads", D::Int(8)),
            ("tie_word_embeddings", D::Bool(false)),
            ("max_position_embeddings", D::Int(8192)),
            ("mamba_d_state", D::Int(256)),
            ("mamba_d_conv", D::Int(4)),
            ("mamba_expand", D::Int(2)),
            ("mamba_n_heads", D::Int(128)),
            ("mamba_d_ssm", D::Int(1024)),
            ("mamba_n_groups", D::Int(1)),
        ],
        // transformers 5.24 SiglipVisionConfig (Gemma-3's vision tower).
        "siglip_vision_model" => &[
            ("hidden_size", D::Int(768)),
            ("intermediate_size", D::Int(3072)),
            ("num_hidden_layers", D::Int(12)),
            ("num_attention_heads", D::Int(12)),
            ("num_channels", D::Int(3)),
            ("image_size", D::Int(224)),
            ("patch_size", D::Int(16)),
            ("hidden_act", D::Str("gelu_pytorch_tanh")),
            ("layer_norm_eps", D::Float(1e-6)),
            ("vision_use_head", D::Bool(true)),
        ],
        "gemma3" => defaults("gemma3_text"),
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::transformers_defaults;
    use crate::planner::ModelShape;

    #[test]
    fn the_table_holds_the_values_the_engine_reads() {
        let qwen3 = transformers_defaults("qwen3");
        assert_eq!(qwen3["max_window_layers"], json!(28));
        assert_eq!(qwen3["hidden_act"], json!("silu"));
        assert_eq!(qwen3["rms_norm_eps"], json!(1e-6));
        assert_eq!(qwen3["rope_theta"], json!(10_000.0));
        let deepseek = transformers_defaults("deepseek_v2");
        assert_eq!(deepseek["topk_method"], json!("greedy"));
        assert_eq!(deepseek["routed_scaling_factor"], json!(1.0));
        assert_eq!(deepseek["mlp_bias"], json!(false));
        let gemma3 = transformers_defaults("gemma3_text");
        assert_eq!(gemma3["hidden_activation"], json!("gelu_pytorch_tanh"));
        assert_eq!(gemma3["rope_theta"], json!(1_000_000.0));
        assert_eq!(gemma3["rope_local_base_freq"], json!(10_000.0));
        assert_eq!(gemma3["query_pre_attn_scalar"], json!(256));
        // Llama derives head_dim and its KV heads; Qwen3-MoE derives head_dim.
        let llama = transformers_defaults("llama");
        assert!(!llama.contains_key("head_dim") && !llama.contains_key("num_key_value_heads"));
        assert!(!transformers_defaults("qwen3_moe").contains_key("head_dim"));
        assert!(transformers_defaults("no_such_model").is_empty());
    }

    #[test]
    fn gemma3_holds_its_text_models_defaults_and_its_own() {
        let text = transformers_defaults("gemma3_text");
        let multimodal = transformers_defaults("gemma3");
        for (key, value) in &text {
            assert_eq!(multimodal.get(key), Some(value), "{key}");
        }
        assert_eq!(multimodal["mm_tokens_per_image"], json!(256));
        assert_eq!(multimodal["image_token_index"], json!(262_144));
        assert!(!text.contains_key("mm_tokens_per_image"));
        let tower = transformers_defaults("siglip_vision_model");
        assert_eq!(tower["image_size"], json!(224));
        assert_eq!(tower["patch_size"], json!(16));
        assert_eq!(tower["vision_use_head"], json!(true));
    }

    #[test]
    fn a_qwen3_window_without_max_window_layers_slides_from_layer_28() {
        // Qwen3Config's max_window_layers default (28): the layers from it
        // up slide, the ones below stay full, as transformers reads it.
        let config = json!({
            "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 8,
            "vocab_size": 151936, "use_sliding_window": true, "sliding_window": 4096,
        });
        let s = ModelShape::from_hf_config(&config).unwrap();
        assert_eq!((s.full_attention_layers, s.sliding_layers), (28, 4));
    }
}
