//! Planner tests: closed-form KV bytes for real configs of every attention
//! kind, the plan's contract (B1, D7, D8, A4.3), bad input, and the
//! invariants V7 and V8 as properties.
//!
//! Config numbers are copied from each model's published `config.json` on
//! the Hugging Face Hub (repository named above each); fields a config omits
//! take the transformers defaults, as `from_hf_config` does.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::units::{GIB, MIB};

/// meta-llama/Meta-Llama-3-8B
fn llama3_8b() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

/// Qwen/Qwen3-8B
fn qwen3_8b() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "max_window_layers": 36,
        "sliding_window": null, "use_sliding_window": false,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

/// deepseek-ai/DeepSeek-V3
fn deepseek_v3() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "vocab_size": 129280,
        "max_position_embeddings": 163840, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128]}
    })
}

/// mistralai/Mistral-7B-v0.1
fn mistral_7b_v01() -> Value {
    json!({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
        "vocab_size": 32000, "max_position_embeddings": 32768,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

/// google/gemma-2-9b
fn gemma2_9b() -> Value {
    json!({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "sliding_window": 4096, "cache_implementation": "hybrid", "vocab_size": 256000,
        "max_position_embeddings": 8192, "torch_dtype": "float32"
    })
}

/// google/gemma-3-27b-it (multimodal: the text model is `text_config`)
fn gemma3_27b() -> Value {
    json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
            "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 128, "sliding_window": 1024, "vocab_size": 262208,
            "max_position_embeddings": 131072
        },
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
        "torch_dtype": "bfloat16"
    })
}

/// openai/gpt-oss-20b
fn gpt_oss_20b() -> Value {
    let layer_types: Vec<&str> = (0..24)
        .map(|i| {
            if i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": layer_types, "vocab_size": 201088,
        "max_position_embeddings": 131072, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"]}
    })
}

/// Qwen/Qwen3-Next-80B-A3B-Instruct
fn qwen3_next_80b() -> Value {
    json!({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 262144,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

/// ai21labs/Jamba-v0.1
fn jamba_v01() -> Value {
    json!({
        "architectures": ["JambaForCausalLM"], "model_type": "jamba",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "attn_layer_period": 8, "attn_layer_offset": 4,
        "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 16, "num_experts_per_tok": 2,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
        "vocab_size": 65536, "max_position_embeddings": 262144,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

/// tiiuae/Falcon-H1-7B-Instruct (depth 44, dim 3072, 12 attention heads,
/// 2 KV heads, 24 Mamba heads of 128, d_state 256 — the model card's table)
fn falcon_h1_7b() -> Value {
    json!({
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
        "hidden_size": 3072, "num_hidden_layers": 44, "num_attention_heads": 12,
        "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 12288,
        "mamba_d_ssm": 3072, "mamba_n_heads": 24, "mamba_d_head": 128,
        "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
        "vocab_size": 130049, "max_position_embeddings": 262144, "torch_dtype": "bfloat16"
    })
}

fn shape(config: &Value) -> ModelShape {
    ModelShape::from_hf_config(config).unwrap()
}

fn input(model: ModelShape, batch: u32, seq: u64, budget: u64) -> PlanInput {
    PlanInput {
        model,
        limits: Limits::new(batch, seq),
        features: Features::default(),
        tp: 1,
        budget,
        context_bytes: H200_CONTEXT_BYTES,
        library_reserve_bytes: H200_LIBRARY_RESERVE_BYTES,
    }
}

// ---- closed-form KV bytes per token, all four attention kinds ----------

/// GQA: layers x kv_heads x (k_dim + v_dim) x dtype bytes.
fn gqa(layers: u64, kv_heads: u64, head_dim: u64, bytes: u64) -> u64 {
    layers * kv_heads * 2 * head_dim * bytes
}

#[test]
fn dense_gqa_kv_bytes_per_token() {
    let llama = shape(&llama3_8b());
    let kv = llama.kv_bytes_per_token(Dtype::Bf16, 1);
    assert_eq!(kv.full, gqa(32, 8, 128, 2));
    assert_eq!(kv.full, 131_072, "Llama-3-8B: 128 KiB per token in bf16");
    assert_eq!(kv.sliding, 0);
    assert_eq!(llama.kv_bytes_per_token(Dtype::Fp8, 1).full, 65_536);
    // TP 2 splits 8 KV heads 4 + 4; TP 16 cannot split 8 heads, each rank keeps one.
    assert_eq!(
        llama.kv_bytes_per_token(Dtype::Bf16, 2).full,
        gqa(32, 4, 128, 2)
    );
    assert_eq!(
        llama.kv_bytes_per_token(Dtype::Bf16, 16).full,
        gqa(32, 1, 128, 2)
    );

    let qwen = shape(&qwen3_8b());
    assert_eq!(
        qwen.kv_bytes_per_token(Dtype::Bf16, 1).full,
        gqa(36, 8, 128, 2)
    );
    assert_eq!(qwen.kv_bytes_per_token(Dtype::Bf16, 1).full, 147_456);
    // use_sliding_window: false switches the configured window off.
    assert_eq!(qwen.sliding_layers, 0);
    assert_eq!(qwen.sliding_window, None);
}

#[test]
fn mla_kv_bytes_per_token_is_replicated_across_ranks() {
    let ds = shape(&deepseek_v3());
    assert!(matches!(
        ds.attention,
        Attention::Mla {
            kv_lora_rank: 512,
            qk_rope_head_dim: 64,
            ..
        }
    ));
    // layers x (kv_lora_rank + qk_rope_head_dim) x bytes
    assert_eq!(
        ds.kv_bytes_per_token(Dtype::Bf16, 1).full,
        61 * (512 + 64) * 2
    );
    assert_eq!(ds.kv_bytes_per_token(Dtype::Bf16, 1).full, 70_272);
    assert_eq!(
        ds.kv_bytes_per_token(Dtype::Fp8, 8).full,
        61 * 576,
        "MLA is replicated per rank"
    );
    let moe = ds.moe.as_ref().unwrap();
    assert_eq!(moe.moe_layers, 58, "61 layers, first 3 dense");
    // 671 B parameters without the MTP module (DeepSeek-V3 report).
    let params = ds.weights.params() as f64;
    assert!((params / 671e9 - 1.0).abs() < 0.03, "params {params:e}");
    assert_eq!(ds.weights.dense_format, WeightFormat::Fp8);
}

#[test]
fn sliding_window_kv_bytes_per_token() {
    let mistral = shape(&mistral_7b_v01());
    assert_eq!(
        (mistral.full_attention_layers, mistral.sliding_layers),
        (0, 32)
    );
    assert_eq!(
        mistral.kv_bytes_per_token(Dtype::Bf16, 1).sliding,
        gqa(32, 8, 128, 2)
    );

    let g2 = shape(&gemma2_9b());
    assert_eq!(
        (g2.full_attention_layers, g2.sliding_layers),
        (21, 21),
        "Gemma-2 alternates"
    );
    assert_eq!(g2.dtype, Dtype::F32);
    let kv = g2.kv_bytes_per_token(Dtype::Bf16, 1);
    assert_eq!(kv.full, gqa(21, 8, 256, 2));
    assert_eq!(kv.sliding, gqa(21, 8, 256, 2));

    let g3 = shape(&gemma3_27b());
    assert_eq!(g3.name, "gemma3_text", "read from text_config");
    assert_eq!(
        (g3.full_attention_layers, g3.sliding_layers),
        (10, 52),
        "every 6th layer global"
    );
    assert_eq!(g3.sliding_window, Some(1024));
    let kv = g3.kv_bytes_per_token(Dtype::Bf16, 1);
    assert_eq!(kv.full, gqa(10, 16, 128, 2));
    assert_eq!(kv.sliding, gqa(52, 16, 128, 2));
    assert_eq!(g3.dtype, Dtype::Bf16, "torch_dtype from the top level");

    let oss = shape(&gpt_oss_20b());
    assert_eq!((oss.full_attention_layers, oss.sliding_layers), (12, 12));
    let kv = oss.kv_bytes_per_token(Dtype::Bf16, 1);
    assert_eq!(kv.full, gqa(12, 8, 64, 2));
    assert_eq!(
        kv.full + kv.sliding,
        49_152,
        "seed B6: gpt-oss-20b KV costs 49 152 B/token"
    );
    assert_eq!(oss.weights.expert_format, WeightFormat::Mxfp4);
    assert_eq!(oss.weights.dense_format, WeightFormat::Bf16);
    // The MXFP4 checkpoint is about 13 GB.
    let gb = oss.weights_bytes() as f64 / 1e9;
    assert!((11.0..15.0).contains(&gb), "{gb} GB");
}

#[test]
fn hybrid_kv_and_state_bytes() {
    let next = shape(&qwen3_next_80b());
    assert_eq!((next.full_attention_layers, next.state_layers), (12, 36));
    assert_eq!(
        next.kv_bytes_per_token(Dtype::Bf16, 1).full,
        gqa(12, 2, 256, 2)
    );
    // Gated DeltaNet: (kernel - 1) x (2 nk dk + nv dv) conv + nv x dk x dv recurrent.
    let elems = 3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128;
    assert_eq!(next.state_bytes_per_layer, elems * 2);
    let params = next.weights.params() as f64;
    assert!((params / 80e9 - 1.0).abs() < 0.05, "params {params:e}");

    let jamba = shape(&jamba_v01());
    assert_eq!((jamba.full_attention_layers, jamba.state_layers), (4, 28));
    assert_eq!(
        jamba.kv_bytes_per_token(Dtype::Bf16, 1).full,
        gqa(4, 8, 128, 2)
    );
    // Mamba-1: (d_conv - 1) x d_inner + d_inner x d_state, d_inner = 2 x 4096.
    assert_eq!(jamba.state_bytes_per_layer, (3 * 8192 + 8192 * 16) * 2);
    assert_eq!(jamba.moe.as_ref().unwrap().moe_layers, 16);
    let params = jamba.weights.params() as f64;
    assert!((params / 52e9 - 1.0).abs() < 0.05, "params {params:e}");

    let falcon = shape(&falcon_h1_7b());
    assert_eq!(
        (falcon.full_attention_layers, falcon.state_layers),
        (44, 44),
        "parallel hybrid"
    );
    assert_eq!(
        falcon.kv_bytes_per_token(Dtype::Bf16, 1).full,
        gqa(44, 2, 128, 2)
    );
    // Mamba-2: (d_conv - 1) x (d_ssm + 2 groups d_state) + d_ssm x d_state.
    assert_eq!(
        falcon.state_bytes_per_layer,
        (3 * (3072 + 2 * 256) + 3072 * 256) * 2
    );
}

#[test]
fn dense_weights_match_published_parameter_counts() {
    let llama = shape(&llama3_8b());
    let params = llama.weights.params() as f64;
    assert!(
        (params / 8.03e9 - 1.0).abs() < 0.01,
        "Llama-3-8B params {params:e}"
    );
    assert_eq!(llama.weights_bytes(), llama.weights.params() * 2);
    let qwen = shape(&qwen3_8b());
    let params = qwen.weights.params() as f64;
    assert!(
        (params / 8.19e9 - 1.0).abs() < 0.01,
        "Qwen3-8B params {params:e}"
    );
}

#[test]
fn quantized_formats_from_quantization_config() {
    let mut cfg = llama3_8b();
    cfg["quantization_config"] = json!({"quant_method": "awq", "bits": 4, "group_size": 128});
    let awq = shape(&cfg);
    assert_eq!(awq.weights.dense_format, WeightFormat::Int4);
    // 4-bit body, bf16 embeddings: about 5.7 GB against 16 GB.
    assert!(awq.weights_bytes() < shape(&llama3_8b()).weights_bytes() / 2);
    cfg["quantization_config"] = json!({"quant_method": "modelopt", "quant_algo": "NVFP4"});
    assert_eq!(shape(&cfg).weights.dense_format, WeightFormat::Nvfp4);
    cfg["quantization_config"] = json!({"quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}});
    assert_eq!(shape(&cfg).weights.dense_format, WeightFormat::Fp8);
    cfg["quantization_config"] = json!({"quant_method": "hqq"});
    let err = ModelShape::from_hf_config(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("quantization_config.quant_method") && err.contains("hqq"),
        "{err}"
    );
}

#[test]
fn safetensors_sizes_replace_the_estimate() {
    let header = br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[5],"data_offsets":[12,32]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    assert_eq!(weights_bytes_from_safetensors_header(&bytes).unwrap(), 32);
    assert!(weights_bytes_from_safetensors_header(&bytes[..20]).is_err());
    let index = json!({"metadata": {"total_size": 16060522496u64}, "weight_map": {}});
    assert_eq!(
        weights_bytes_from_safetensors_index(&index).unwrap(),
        16_060_522_496
    );
    let measured = shape(&llama3_8b()).with_measured_weights(16_060_522_496);
    assert_eq!(measured.weights_bytes(), 16_060_522_496);

    let dir = std::env::temp_dir().join(format!("imp-mem-planner-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), llama3_8b().to_string()).unwrap();
    std::fs::write(dir.join("model-00001.safetensors"), &bytes).unwrap();
    let from_dir = ModelShape::from_hf_config_path(&dir.join("config.json")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(from_dir.weights_bytes(), 32);
}

// ---- the plan's contract ----------------------------------------------

#[test]
fn kv_pool_targets_the_configuration_never_a_multiple_b1() {
    // Seed B1: batch 8 x 4096 tokens in 16-token blocks is 2048 blocks, not 4096.
    let plan = plan_memory(&input(shape(&qwen3_8b()), 8, 4096, 80 * GIB)).unwrap();
    assert_eq!(plan.kv.target_blocks, 2048);
    assert_eq!(plan.kv.blocks, 2048);
    assert_eq!(plan.kv.full_sequences, 8);
    assert_eq!(plan.kv.bytes, 2048 * 16 * 147_456);
    assert!(
        plan.headroom > 10 * GIB,
        "the rest stays unplanned, not handed to KV"
    );
    assert_eq!(plan.total + plan.headroom, plan.budget);
    assert_eq!(
        plan.charges.iter().map(|c| c.bytes).sum::<u64>(),
        plan.total
    );
}

#[test]
fn library_reserve_and_context_are_first_class_charges_d7() {
    let mut inp = input(shape(&llama3_8b()), 8, 4096, 80 * GIB);
    inp.library_reserve_bytes = 3900 * MIB;
    inp.context_bytes = 1680 * MIB;
    let plan = plan_memory(&inp).unwrap();
    assert_eq!(plan.library_reserve, 3900 * MIB);
    assert_eq!(plan.context, 1680 * MIB);
    let keys: Vec<&str> = plan.charges.iter().map(|c| c.key.as_str()).collect();
    assert!(
        keys.contains(&"library_reserve") && keys.contains(&"context"),
        "{keys:?}"
    );
    let without = {
        let mut i = inp.clone();
        i.library_reserve_bytes = 0;
        plan_memory(&i).unwrap()
    };
    assert_eq!(plan.total - without.total, 3900 * MIB);
    // A budget the plan fits only without the reserve: charging it fails it.
    inp.budget = without.total + 100 * MIB;
    assert!(matches!(plan_memory(&inp), Err(PlanError::DoesNotFit(_))));
}

#[test]
fn failure_report_has_the_arithmetic_and_three_exact_levers() {
    // Llama-3-8B, 32 x 8192 tokens in 40 GiB: 32 GiB of KV does not fit.
    let inp = input(shape(&llama3_8b()), 32, 8192, 40 * GIB);
    let Err(PlanError::DoesNotFit(failure)) = plan_memory(&inp) else {
        panic!("should not fit")
    };
    assert_eq!(failure.kind, FailureKind::OverBudget);
    assert_eq!(
        failure.total,
        failure.charges.iter().map(|c| c.bytes).sum::<u64>()
    );
    assert_eq!(failure.over_by, failure.total - 40 * GIB);
    let kv = failure.charges.iter().find(|c| c.key == "kv_pool").unwrap();
    assert_eq!(kv.bytes, 32 * 8192 * 131_072);
    assert_eq!(kv.label, "KV pool (32 x 8192 tok, bf16)");
    assert_eq!(failure.levers.len(), 3);
    for pair in failure.levers.windows(2) {
        assert!(pair[0].frees >= pair[1].frees);
    }
    // Halving max_seq_len and fp8 KV each free half the KV pool (16 GiB) and
    // more scratch-free arithmetic; re-plan every lever and check its figure.
    for lever in &failure.levers {
        let mut changed = inp.clone();
        match lever.setting.as_str() {
            "max_seq_len" => changed.limits.max_seq_len = lever.to.parse().unwrap(),
            "kv_dtype" => changed.limits.kv_dtype = Some(Dtype::parse(&lever.to, "x").unwrap()),
            "max_batch" => changed.limits.max_batch = lever.to.parse().unwrap(),
            "tp" => changed.tp = lever.to.parse().unwrap(),
            other => panic!("unknown lever {other}"),
        }
        let new_total = match plan_memory(&changed) {
            Ok(plan) => plan.total,
            Err(PlanError::DoesNotFit(f)) => f.total,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(failure.total - new_total, lever.frees, "{lever:?}");
        assert_eq!(plan_memory(&changed).is_ok(), lever.sufficient, "{lever:?}");
    }
    let batch = failure.levers.iter().find(|l| l.setting == "max_batch");
    if let Some(lever) = batch {
        // Solved exactly: the next batch up would not fit.
        let mut up = inp.clone();
        up.limits.max_batch = lever.to.parse::<u32>().unwrap() + 1;
        assert!(plan_memory(&up).is_err());
    }
    let report = failure.report();
    assert!(
        report.starts_with("Cannot fit this configuration in the 40960 MiB budget."),
        "{report}"
    );
    assert!(
        report.contains(&format!("over by {} MiB", failure.over_by.div_ceil(MIB))),
        "{report}"
    );
    assert!(report.contains("the three largest levers"), "{report}");
    assert!(report.contains("max_seq_len 8192 -> 4096"), "{report}");
    assert!(report.contains("kv_dtype bf16 -> fp8"), "{report}");
    assert!(report.contains("library reserve "), "{report}");
    // The plan does not claim a measurement; the memory report says which.
    assert!(!report.contains("(measured)"), "{report}");
    assert_eq!(report_sum(&report), failure.total / MIB, "{report}");
}

#[test]
fn a_failure_names_the_largest_batch_that_fits_when_its_lever_is_left_out() {
    // Llama-3-8B, 8192 tokens a sequence, a budget a little short of 32
    // sequences: stepping down a few sequences frees less than halving
    // max_seq_len, fp8 KV or TP x 2, so the three levers leave max_batch out.
    let fits_31 = plan_memory(&input(shape(&llama3_8b()), 31, 8192, 64 * GIB)).unwrap();
    let inp = input(shape(&llama3_8b()), 32, 8192, fits_31.total);
    let Err(PlanError::DoesNotFit(failure)) = plan_memory(&inp) else {
        panic!("32 should not fit where 31 just does")
    };
    assert!(failure.levers.iter().all(|l| l.setting != "max_batch"));
    assert_eq!(failure.max_batch_fits, Some(31));
    // Exact: that batch plans, the next one up does not.
    for (batch, fits) in [(31, true), (32, false)] {
        let mut at = inp.clone();
        at.limits.max_batch = batch;
        assert_eq!(plan_memory(&at).is_ok(), fits, "max_batch {batch}");
    }
    // Even one sequence over the budget: none.
    let tiny = input(shape(&llama3_8b()), 4, 8192, 8 * GIB);
    let Err(PlanError::DoesNotFit(failure)) = plan_memory(&tiny) else {
        panic!("8 GiB cannot hold the weights")
    };
    assert_eq!(failure.max_batch_fits, None);
}

#[test]
fn fit_policy_sizes_kv_from_the_residual_with_a_floor_d8() {
    let mut inp = input(shape(&llama3_8b()), 64, 8192, 40 * GIB);
    inp.limits.kv_policy = KvPolicy::Fit;
    let plan = plan_memory(&inp).unwrap();
    assert!(plan.kv.blocks < plan.kv.target_blocks);
    assert!(plan.kv.full_sequences >= 1);
    assert!(plan.total <= plan.budget);
    // The pool is the residual: one more block would not fit.
    assert!(
        plan.headroom < plan.kv.block_bytes + MIB,
        "headroom {}",
        plan.headroom
    );
    // A budget that leaves less than one 8192-token sequence (1 GiB) fails (D8).
    let fixed = plan.total - plan.kv.bytes;
    inp.budget = fixed + 512 * MIB;
    let Err(PlanError::DoesNotFit(failure)) = plan_memory(&inp) else {
        panic!("below the floor")
    };
    assert!(matches!(
        failure.kind,
        FailureKind::BelowAdmissionFloor {
            sequence_tokens: 8192,
            ..
        }
    ));
    assert!(
        failure
            .report()
            .contains("less than one full sequence of 8192"),
        "{}",
        failure.report()
    );
    assert!(failure.over_by > 0);
}

#[test]
fn sliding_window_pool_is_separate_and_window_bounded() {
    let plan = plan_memory(&input(shape(&gemma3_27b()), 4, 32768, 140 * GIB)).unwrap();
    let swa = plan.swa.as_ref().unwrap();
    assert_eq!(swa.window, Some(1024));
    assert_eq!(swa.blocks_per_sequence, 1024 / 16 + 1);
    assert_eq!(plan.kv.blocks_per_sequence, 32768 / 16);
    assert_eq!(swa.bytes_per_token, gqa(52, 16, 128, 2));
    assert!(plan.charges.iter().any(|c| c.key == "swa_pool"));
}

#[test]
fn hybrid_state_is_a_pool_of_per_sequence_slots() {
    let plan = plan_memory(&input(shape(&qwen3_next_80b()), 16, 8192, 200 * GIB)).unwrap();
    let state = &plan.pools[0];
    assert_eq!(state.slots, 16);
    assert_eq!(
        state.bytes_per_slot,
        36 * (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
    );
    let mut tp2 = input(shape(&qwen3_next_80b()), 16, 8192, 200 * GIB);
    tp2.tp = 2;
    let plan2 = plan_memory(&tp2).unwrap();
    assert_eq!(plan2.pools[0].bytes_per_slot * 2, state.bytes_per_slot);
    assert_eq!(
        plan2.kv.bytes_per_token * 2,
        plan.kv.bytes_per_token,
        "2 KV heads split 1 + 1"
    );
}

#[test]
fn bad_input_names_the_field() {
    // Without a model type transformers knows, a missing field is refused
    // (a known type takes transformers' default, see below).
    let mut cfg = llama3_8b();
    cfg.as_object_mut().unwrap().remove("num_hidden_layers");
    cfg.as_object_mut().unwrap().remove("model_type");
    let err = ModelShape::from_hf_config(&cfg).unwrap_err().to_string();
    assert!(err.contains("'num_hidden_layers'"), "{err}");
    let mut cfg = llama3_8b();
    cfg["torch_dtype"] = json!("float13");
    let err = ModelShape::from_hf_config(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("torch_dtype") && err.contains("float13"),
        "{err}"
    );
    let mut cfg = llama3_8b();
    cfg["num_key_value_heads"] = json!(-8);
    let err = ModelShape::from_hf_config(&cfg).unwrap_err().to_string();
    assert!(err.contains("num_key_value_heads"), "{err}");
    let mut cfg = llama3_8b();
    cfg["hidden_size"] = json!(0);
    assert!(ModelShape::from_hf_config(&cfg)
        .unwrap_err()
        .to_string()
        .contains("hidden_size"));
    assert!(ModelShape::from_hf_config(&json!([1, 2])).is_err());

    let ok = input(shape(&llama3_8b()), 8, 4096, 80 * GIB);
    for (field, edit) in [
        (
            "max_batch",
            Box::new(|i: &mut PlanInput| i.limits.max_batch = 0) as Box<dyn Fn(&mut PlanInput)>,
        ),
        (
            "max_seq_len",
            Box::new(|i: &mut PlanInput| i.limits.max_seq_len = 0),
        ),
        (
            "block_size",
            Box::new(|i: &mut PlanInput| i.limits.block_size = 0),
        ),
        ("tp", Box::new(|i: &mut PlanInput| i.tp = 0)),
        ("budget", Box::new(|i: &mut PlanInput| i.budget = 0)),
        (
            "lora_rank",
            Box::new(|i: &mut PlanInput| i.features.lora_slots = 2),
        ),
    ] {
        let mut bad = ok.clone();
        edit(&mut bad);
        match plan_memory(&bad) {
            Err(PlanError::Invalid(err)) => {
                assert!(err.to_string().contains(field), "{field}: {err}")
            }
            other => panic!("{field}: expected invalid input, got {other:?}"),
        }
    }
}

/// Sums the MiB column of a report's requested section.
fn report_sum(report: &str) -> u64 {
    let mut total = 0;
    let mut inside = false;
    for line in report.lines() {
        if line.trim_start().starts_with("requested") {
            inside = true;
            continue;
        }
        if line.trim() == "-----" {
            break;
        }
        if inside {
            total += line
                .split_whitespace()
                .last()
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    total
}

fn report_total(report: &str) -> u64 {
    let line = report
        .lines()
        .find(|l| l.trim_start().starts_with("total "))
        .unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

// ---- V7 and V8 --------------------------------------------------------

/// A random but well-formed config of one of the four attention kinds.
fn arb_config() -> impl Strategy<Value = Value> {
    (
        0u8..5,
        1u64..96,
        prop::sample::select(vec![512u64, 1024, 2048, 3072, 4096, 5120, 7168, 8192]),
        prop::sample::select(vec![4u64, 8, 16, 32, 64, 128]),
        prop::sample::select(vec![1u64, 2, 4, 8]),
        prop::sample::select(vec![32000u64, 128256, 151936, 262144]),
        prop::sample::select(vec!["bfloat16", "float16", "float32"]),
        (
            0u64..3,
            1u64..8,
            prop::sample::select(vec![128u64, 512, 1024, 4096]),
        ),
        prop::sample::select(vec!["none", "fp8", "awq", "mxfp4"]),
    )
        .prop_map(
            |(kind, layers, hidden, heads, kv_div, vocab, dtype, (moe, every, window), quant)| {
                let mut cfg = json!({
                    "model_type": "random", "num_hidden_layers": layers, "hidden_size": hidden,
                    "num_attention_heads": heads, "num_key_value_heads": (heads / kv_div).max(1),
                    "intermediate_size": hidden * 3, "vocab_size": vocab, "torch_dtype": dtype,
                });
                match kind {
                    1 => {
                        cfg["kv_lora_rank"] = json!(512);
                        cfg["qk_rope_head_dim"] = json!(64);
                        cfg["qk_nope_head_dim"] = json!(128);
                        cfg["v_head_dim"] = json!(128);
                    }
                    2 => {
                        cfg["sliding_window"] = json!(window);
                        cfg["sliding_window_pattern"] = json!(every);
                    }
                    3 => {
                        cfg["full_attention_interval"] = json!(every);
                        cfg["linear_num_key_heads"] = json!(16);
                        cfg["linear_num_value_heads"] = json!(32);
                        cfg["linear_key_head_dim"] = json!(128);
                        cfg["linear_value_head_dim"] = json!(128);
                    }
                    4 => {
                        cfg["attn_layer_period"] = json!(every);
                        cfg["attn_layer_offset"] = json!(0);
                        cfg["mamba_d_state"] = json!(16);
                    }
                    _ => {}
                }
                if moe > 0 {
                    cfg["num_experts"] = json!(8 << moe);
                    cfg["num_experts_per_tok"] = json!(2 * moe);
                    cfg["moe_intermediate_size"] = json!(hidden / 2);
                }
                if quant != "none" {
                    cfg["quantization_config"] = json!({"quant_method": quant, "bits": 4});
                }
                cfg
            },
        )
}

fn arb_input() -> impl Strategy<Value = PlanInput> {
    (
        arb_config(),
        (
            1u32..512,
            1u64..262_144,
            prop::sample::select(vec![1u32, 8, 16, 32, 64, 128]),
        ),
        (
            prop::option::of(prop::sample::select(vec![
                Dtype::Fp8,
                Dtype::Bf16,
                Dtype::F16,
                Dtype::F32,
            ])),
            any::<bool>(),
        ),
        (prop::sample::select(vec![1u32, 2, 4, 8]), 1u64..(256 * GIB)),
        (0u64..(2 * GIB), 0u64..(4 * GIB)),
        (
            0u32..8,
            0u64..(2 * GIB),
            0u32..8,
            prop::option::of(1u64..(4 * GIB)),
        ),
    )
        .prop_map(
            |(
                cfg,
                (batch, seq, bs),
                (kv, fit),
                (tp, budget),
                (ctx, lib),
                (spec, vision, lora, scratch),
            )| {
                let model = ModelShape::from_hf_config(&cfg).unwrap();
                // A valid split: no more ranks than query heads (all powers of
                // two here, so the KV heads split or replicate).
                let tp = tp.min(model.num_attention_heads as u32);
                PlanInput {
                    model,
                    limits: Limits {
                        max_batch: batch,
                        max_seq_len: seq,
                        kv_dtype: kv,
                        block_size: bs,
                        max_batch_tokens: None,
                        kv_policy: if fit { KvPolicy::Fit } else { KvPolicy::Full },
                    },
                    features: Features {
                        spec_depth: spec,
                        draft_weights_bytes: 0,
                        vision_tower_bytes: vision,
                        lora_slots: lora,
                        lora_rank: 16,
                        scratch_bytes: scratch,
                        engine_persistent_bytes: None,
                        kv_host_bytes: 0,
                        // The activation line rides on the scratch lever.
                        activation_bytes: scratch.map(|s| s / 3),
                        engine_kv_blocks: u64::from(spec % 3),
                        engine_swa_blocks: u64::from(lora % 2),
                        warmup_bytes: u64::from(spec % 2) * 300 * MIB,
                    },
                    tp,
                    budget,
                    context_bytes: ctx,
                    library_reserve_bytes: lib,
                }
            },
        )
}

fn outcome_json(result: &Result<MemoryPlan, PlanError>) -> String {
    match result {
        Ok(plan) => plan.to_json().unwrap(),
        Err(PlanError::DoesNotFit(failure)) => failure.to_json().unwrap() + &failure.report(),
        Err(PlanError::Invalid(err)) => err.to_string(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// V7: the same input, planned twice, gives byte-identical JSON; a plan
    /// read back from its JSON serialises to the same bytes.
    #[test]
    fn v7_plans_are_deterministic(inp in arb_input()) {
        let first = plan_memory(&inp);
        let again = plan_memory(&inp.clone());
        prop_assert_eq!(outcome_json(&first), outcome_json(&again));
        if let Ok(plan) = first {
            let json = plan.to_json().unwrap();
            prop_assert_eq!(MemoryPlan::from_json(&json).unwrap().to_json().unwrap(), json);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// V8: a successful plan never exceeds its budget and its charges add up
    /// to its total; a failure's charges add up to its total, in bytes and
    /// in the MiB its report prints, and it really is over.
    #[test]
    fn v8_plans_fit_and_failures_add_up(inp in arb_input()) {
        match plan_memory(&inp) {
            Ok(plan) => {
                prop_assert!(plan.total <= inp.budget);
                prop_assert_eq!(plan.total + plan.headroom, inp.budget);
                prop_assert_eq!(plan.charges.iter().map(|c| c.bytes).sum::<u64>(), plan.total);
                prop_assert_eq!(
                    plan.model_resident + plan.engine_persistent + plan.scratch
                        + plan.activations + plan.kv.bytes
                        + plan.swa.as_ref().map_or(0, |s| s.bytes)
                        + plan.pools.iter().map(|p| p.bytes).sum::<u64>()
                        + plan.library_reserve + plan.context + plan.warmup,
                    plan.total
                );
                prop_assert!(plan.kv.blocks <= plan.kv.target_blocks, "never more than the target (B1)");
                prop_assert!(plan.kv.full_sequences >= 1, "D8 floor");
                if inp.limits.kv_policy == KvPolicy::Full {
                    prop_assert_eq!(plan.kv.blocks, plan.kv.target_blocks);
                }
            }
            Err(PlanError::DoesNotFit(failure)) => {
                prop_assert_eq!(failure.charges.iter().map(|c| c.bytes).sum::<u64>(), failure.total);
                prop_assert!(failure.total > failure.budget);
                prop_assert_eq!(failure.over_by, failure.total - failure.budget);
                let report = failure.report();
                prop_assert_eq!(report_sum(&report), failure.total / MIB);
                prop_assert_eq!(report_total(&report), failure.total / MIB);
                prop_assert!(failure.levers.len() <= 3);
                for lever in &failure.levers {
                    prop_assert!(lever.frees > 0 && lever.frees <= failure.total);
                }
            }
            Err(PlanError::Invalid(err)) => {
                // Random inputs are valid by construction, except absurd totals.
                prop_assert!(err.to_string().contains("256 PiB"), "{}", err);
            }
        }
    }
}

/// The random inputs of V7/V8 exercise both outcomes, so neither branch of
/// V8 passes vacuously.
#[test]
fn random_inputs_cover_success_and_failure() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = arb_input();
    let (mut ok, mut over, mut floor) = (0, 0, 0);
    for _ in 0..600 {
        let inp = strategy.new_tree(&mut runner).unwrap().current();
        match plan_memory(&inp) {
            Ok(_) => ok += 1,
            Err(PlanError::DoesNotFit(f)) if f.kind == FailureKind::OverBudget => over += 1,
            Err(PlanError::DoesNotFit(_)) => floor += 1,
            Err(PlanError::Invalid(_)) => {}
        }
    }
    assert!(
        ok >= 60 && over >= 60 && floor >= 5,
        "ok {ok}, over budget {over}, below floor {floor}"
    );
}

/// Layer-kind readers that no real config above exercises, on synthetic
/// configs (shapes made up; only the parsing is under test).
#[test]
fn layer_patterns_and_their_errors() {
    let base = json!({
        "model_type": "synthetic", "num_hidden_layers": 6, "hidden_size": 1024,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
        "mamba_d_state": 64, "mamba_n_heads": 16, "mamba_d_head": 64
    });
    let with = |extra: Value| {
        let mut cfg = base.clone();
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        cfg
    };
    // Nemotron-H style: M = Mamba, * = attention, - = MLP only.
    let s = shape(&with(json!({"hybrid_override_pattern": "M-M*-M"})));
    assert_eq!(
        (s.full_attention_layers, s.state_layers, s.sliding_layers),
        (1, 3, 0)
    );
    // Bamba style: attention at the listed indices, Mamba elsewhere.
    let s = shape(&with(json!({"attn_layer_indices": [2, 5]})));
    assert_eq!((s.full_attention_layers, s.state_layers), (2, 4));
    // Mamba-2 state: (d_conv - 1) x (d_inner + 2 groups d_state) + d_inner x d_state.
    assert_eq!(
        s.state_bytes_per_layer,
        (3 * (1024 + 2 * 64) + 1024 * 64) * 2
    );
    // Qwen2 with the window switched on: layers from max_window_layers slide.
    let s = shape(&with(
        json!({"sliding_window": 4096, "use_sliding_window": true, "max_window_layers": 4}),
    ));
    assert_eq!((s.full_attention_layers, s.sliding_layers), (4, 2));

    for (extra, needle) in [
        (json!({"layer_types": ["full_attention"]}), "has 1 entries"),
        (json!({"layer_types": vec!["full_attention"; 6]}), ""),
        (
            json!({"layer_types": ["sliding_attention", "full_attention", "full_attention",
                                "full_attention", "full_attention", "full_attention"]}),
            "sliding_window",
        ),
        (
            json!({"layer_types": ["cross", "full_attention", "full_attention",
                                "full_attention", "full_attention", "full_attention"]}),
            "unknown layer type",
        ),
        (
            json!({"hybrid_override_pattern": "MM"}),
            "hybrid_override_pattern",
        ),
        (json!({"attn_layer_indices": [9]}), "attn_layer_indices"),
    ] {
        match ModelShape::from_hf_config(&with(extra.clone())) {
            Ok(_) => assert!(needle.is_empty(), "{extra} should fail"),
            Err(err) => assert!(
                !needle.is_empty() && err.to_string().contains(needle),
                "{extra}: {err}"
            ),
        }
    }
    // A linear layer with no state geometry names what is missing.
    let err = ModelShape::from_hf_config(&json!({
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
        "layer_types": ["linear_attention", "full_attention"]
    }))
    .unwrap_err()
    .to_string();
    assert!(err.contains("state geometry"), "{err}");
}

#[test]
fn the_kv_host_tier_is_its_own_host_budget() {
    let base = input(shape(&llama3_8b()), 8, 8192, 80 * GIB);
    let device_only = plan_memory(&base).unwrap();
    assert_eq!(device_only.kv_host, None);
    let mut with_host = base.clone();
    with_host.features.kv_host_bytes = 64 * GIB + 12345;
    let plan = plan_memory(&with_host).unwrap();
    let host = plan.kv_host.clone().unwrap();
    assert_eq!(host.block_bytes, plan.kv.block_bytes);
    assert_eq!(host.blocks, (64 * GIB + 12345) / plan.kv.block_bytes);
    assert_eq!(host.bytes, host.blocks * host.block_bytes);
    assert!(host.bytes <= with_host.features.kv_host_bytes);
    // Host memory: the device plan is the same.
    assert_eq!(
        (plan.total, plan.kv.blocks),
        (device_only.total, device_only.kv.blocks)
    );
    let back = MemoryPlan::from_json(&plan.to_json().unwrap()).unwrap();
    assert_eq!(back, plan);
    with_host.features.kv_host_bytes = 1;
    assert_eq!(plan_memory(&with_host).unwrap().kv_host, None);
    with_host.features.kv_host_bytes = MAX_BYTES + 1;
    assert!(plan_memory(&with_host).is_err());
}

#[test]
fn a_measured_activation_high_water_is_its_own_line_and_none_changes_nothing() {
    let base = input(shape(&llama3_8b()), 8, 4096, 80 * GIB);
    let plain = plan_memory(&base).unwrap();
    assert_eq!(plain.activations, 0);
    assert!(plain.charges.iter().all(|c| c.key != "activations"));
    assert!(!plain.to_json().unwrap().contains("activations"));
    assert!(!base.to_json().unwrap().contains("activation_bytes"));

    let mut with = base.clone();
    with.features.activation_bytes = Some(300 * MIB + 1);
    let plan = plan_memory(&with).unwrap();
    assert_eq!(plan.activations, 301 * MIB);
    let line = plan
        .charges
        .iter()
        .find(|c| c.key == "activations")
        .unwrap();
    assert_eq!(line.bytes, 301 * MIB);
    assert!(line.label.contains("activations"), "{}", line.label);
    // The KV pool is sized from what is left, so it shrinks or stays.
    assert!(plan.kv.bytes <= plain.kv.bytes);
    assert_eq!(
        plan.total,
        plan.charges.iter().map(|c| c.bytes).sum::<u64>()
    );
    let back = MemoryPlan::from_json(&plan.to_json().unwrap()).unwrap();
    assert_eq!(back, plan);
}

#[test]
fn a_field_left_out_takes_the_transformers_default_of_its_model_type() {
    // Gemma-3 without head_dim or vocab_size: transformers' 256 and 262208,
    // not hidden / heads (issue 14: 368 640 instead of 393 216 B per token).
    let gemma3 = json!({
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sliding_window": 1024,
    });
    let s = ModelShape::from_hf_config(&gemma3).unwrap();
    assert_eq!(s.vocab_size, 262208);
    match s.attention {
        Attention::Gqa { head_dim, .. } => assert_eq!(head_dim, 256),
        other => panic!("{other:?}"),
    }
    // The same keys under a multimodal gemma3 config's text_config.
    let wrapped = json!({"model_type": "gemma3", "text_config": gemma3});
    assert_eq!(ModelShape::from_hf_config(&wrapped).unwrap(), s);
    // An explicit null keeps its meaning: no sliding window for Mistral,
    // whose default window is 4096.
    let mistral = json!({"model_type": "mistral", "sliding_window": null});
    let s = ModelShape::from_hf_config(&mistral).unwrap();
    assert_eq!((s.sliding_layers, s.sliding_window), (0, None));
    let s = ModelShape::from_hf_config(&json!({"model_type": "mistral"})).unwrap();
    assert_eq!(s.sliding_window, Some(4096));
}

#[test]
fn a_tp_degree_the_heads_do_not_split_over_is_refused_naming_the_nearest() {
    let mut bad = input(shape(&llama3_8b()), 8, 4096, 80 * GIB);
    bad.tp = 3;
    let err = plan_memory(&bad).unwrap_err().to_string();
    assert!(err.contains("tp=3") && err.contains("8 KV heads"), "{err}");
    assert!(err.contains("use tp 2 or 4"), "{err}");
    // Replicating the KV heads (tp a multiple of them) is a valid split.
    bad.tp = 16;
    assert!(plan_memory(&bad).is_ok());
}

#[test]
fn the_per_rank_weights_line_is_the_plans_and_a_larger_rank_layout_raises_it() {
    let s = shape(&llama3_8b());
    for tp in [1, 2, 4, 8] {
        let mut i = input(s.clone(), 8, 4096, 200 * GIB);
        i.tp = tp;
        let plan = plan_memory(&i).unwrap();
        assert_eq!(plan.weights, s.rank_weights_line(tp), "tp={tp}");
        assert_eq!(s.rank_weights_line(tp) % MIB, 0);
        assert!(s.rank_weights_line(tp) * u64::from(tp) >= s.weights_bytes());
    }
    // A rank layout within the line keeps the shape; one past it raises the
    // weights to tp times that layout, and the new line covers it.
    let line = s.rank_weights_line(4);
    assert_eq!(s.clone().for_rank_layout(4, line), s);
    let raised = s.clone().for_rank_layout(4, line + 1);
    assert_eq!(raised.weights_bytes(), 4 * (line + 1));
    assert!(raised.rank_weights_line(4) > line);
    // TP = 1 never raises: the loader checks the one layout against the line.
    assert_eq!(s.clone().for_rank_layout(1, u64::MAX), s);
    // The shape refuses the same degrees the planner does, with its message.
    let err = s.check_tp(3).unwrap_err().to_string();
    assert!(err.contains("use tp 2 or 4"), "{err}");
    assert!(s.check_tp(16).is_ok() && s.check_tp(4).is_ok());
}

#[test]
fn engine_blocks_add_to_the_kv_targets_and_name_themselves() {
    let base = input(shape(&gemma3_27b()), 8, 4096, 200 * GIB);
    let plain = plan_memory(&base).unwrap();
    let mut with = base.clone();
    with.features.engine_kv_blocks = 3;
    with.features.engine_swa_blocks = 5;
    let plan = plan_memory(&with).unwrap();
    assert_eq!(plan.kv.blocks, plain.kv.blocks + 3);
    assert_eq!(plan.kv.target_blocks, plain.kv.target_blocks + 3);
    let (swa, plain_swa) = (plan.swa.as_ref().unwrap(), plain.swa.as_ref().unwrap());
    assert_eq!(swa.blocks, plain_swa.blocks + 5);
    // Still max_batch whole sequences: the engine's blocks are not one.
    assert_eq!(plan.kv.full_sequences, plain.kv.full_sequences);
    let line = plan.charges.iter().find(|c| c.key == "kv_pool").unwrap();
    assert!(line.label.contains("+ 3 engine blocks"), "{}", line.label);
    // A model without sliding layers gets no SWA pool from engine_swa_blocks.
    let mut dense = input(shape(&llama3_8b()), 8, 4096, 200 * GIB);
    dense.features.engine_swa_blocks = 5;
    assert!(plan_memory(&dense).unwrap().swa.is_none());
    // Out of range is refused, naming the field.
    let mut huge = base.clone();
    huge.features.engine_kv_blocks = u64::MAX;
    let err = plan_memory(&huge).unwrap_err().to_string();
    assert!(err.contains("engine_kv_blocks"), "{err}");
}

#[test]
fn kv_policy_none_plans_no_kv_or_swa_pool() {
    for config in [llama3_8b(), gemma2_9b()] {
        let mut inp = input(shape(&config), 32, 1088, 80 * GIB);
        let with_pool = plan_memory(&inp).unwrap();
        assert!(with_pool.kv.blocks > 0);
        inp.limits.kv_policy = KvPolicy::None;
        let plan = plan_memory(&inp).unwrap();
        assert_eq!(
            (plan.kv.blocks, plan.kv.bytes, plan.kv.target_blocks),
            (0, 0, 0)
        );
        assert!(
            plan.swa.as_ref().is_none_or(|s| s.blocks == 0),
            "{:?}",
            plan.swa
        );
        assert_eq!(
            plan.total,
            with_pool.total - with_pool.kv.bytes - with_pool.swa.as_ref().map_or(0, |s| s.bytes)
        );
        assert!(
            plan.table().contains("none: the caller keeps its KV"),
            "{}",
            plan.table()
        );
        // Nothing is sized from a residual, so an over-budget plan fails
        // as `full` does, never below an admission floor.
        inp.budget = plan.total - 1;
        let Err(PlanError::DoesNotFit(failure)) = plan_memory(&inp) else {
            panic!("over budget")
        };
        assert_eq!(failure.kind, FailureKind::OverBudget);
    }
    assert_eq!(KvPolicy::parse(" None ").unwrap(), KvPolicy::None);
    assert!(KvPolicy::parse("nope")
        .unwrap_err()
        .to_string()
        .contains("full, fit or none"));
}

#[test]
fn the_tp_lever_names_the_fewest_ranks_that_fit() {
    // DeepSeek-V3 on one 80 GiB device is hundreds of GiB over: twice the
    // ranks is not enough, and the lever says how many are (issue 55).
    let inp = input(shape(&deepseek_v3()), 1, 1024, 80 * GIB);
    let Err(PlanError::DoesNotFit(failure)) = plan_memory(&inp) else {
        panic!("deepseek-v3 fits one device?");
    };
    let lever = failure.levers.iter().find(|l| l.setting == "tp").unwrap();
    let tp: u32 = lever.to.parse().unwrap();
    assert!(tp > 2 && lever.sufficient, "{lever:?}");
    let mut at = inp.clone();
    at.tp = tp;
    assert!(plan_memory(&at).is_ok());
    at.tp = tp / 2;
    assert!(plan_memory(&at).is_err());
}
