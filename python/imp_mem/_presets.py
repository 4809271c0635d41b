"""Config numbers of a handful of popular open models, for ``imp-mem plan``.

Each entry is the subset of the model's Hugging Face ``config.json`` that
memory depends on, copied from the repository named in ``source``; fields a
config leaves out take the transformers defaults, as
``ModelShape.from_hf_config`` does. These are data, not code.
"""

from __future__ import annotations

from typing import Any

# Gemma-3's SigLIP tower (4B, 12B and 27B share it): 27 layers of 1152 on
# 896-pixel images in patches of 14, no pooling head.
_GEMMA3_SIGLIP: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 1152,
    "image_size": 896,
    "intermediate_size": 4304,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "vision_use_head": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "source": "meta-llama/Meta-Llama-3-8B",
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-70b": {
        "source": "meta-llama/Llama-3.1-70B",
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "source": "Qwen/Qwen3-8B",
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "source": "Qwen/Qwen3-30B-A3B",
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "source": "mistralai/Mixtral-8x7B-v0.1",
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mistral-7b-v0.1": {
        "source": "mistralai/Mistral-7B-v0.1",
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "gemma-3-4b": {
        "source": "google/gemma-3-4b-it",
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "image_token_index": 262144,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "sliding_window": 1024,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
        },
        "vision_config": _GEMMA3_SIGLIP,
        "torch_dtype": "bfloat16",
    },
    "gemma-3-27b": {
        "source": "google/gemma-3-27b-it",
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "image_token_index": 262144,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "sliding_window": 1024,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
        },
        "vision_config": _GEMMA3_SIGLIP,
        "torch_dtype": "bfloat16",
    },
    "gpt-oss-20b": {
        "source": "openai/gpt-oss-20b",
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"},
    },
    "deepseek-v3": {
        "source": "deepseek-ai/DeepSeek-V3",
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    },
    "qwen3-next-80b-a3b": {
        "source": "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


def find(name: str) -> str | None:
    """The preset `name` means: its own name or its Hugging Face id, any
    case, ``_`` for ``-`` (``Qwen/Qwen3-8B``, ``qwen3_8b``); None if none."""
    if not isinstance(name, str):
        raise TypeError(f"preset: expected a preset's name (a str), got {type(name).__name__}")
    key = name.strip().lower()
    for candidate in (key, key.replace("_", "-")):
        if candidate in PRESETS:
            return candidate
    for preset_name, entry in PRESETS.items():
        if str(entry.get("source", "")).lower() == key:
            return preset_name
    return None


def resolve(name: str, what: str = "preset") -> str:
    """`find`, or `InvalidArgument` naming `what`, the nearest presets
    ("did you mean"), and where the list is."""
    import difflib

    from imp_mem.errors import InvalidArgument

    found = find(name)
    if found is not None:
        return found
    near = difflib.get_close_matches(name.strip().lower(), list(PRESETS), n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise InvalidArgument(
        f"{what}: {name!r} is not a preset; {hint}the presets: {', '.join(sorted(PRESETS))} "
        "(imp-mem plan --list-presets; a Hugging Face id such as meta-llama/Meta-Llama-3-8B "
        "names its preset too)"
    )


def preset(name: str) -> dict[str, Any]:
    """The config dict of a preset, by its name or its Hugging Face id
    (without its ``source``); `InvalidArgument` with the nearest names if
    unknown."""
    config = dict(PRESETS[resolve(name)])
    config.pop("source", None)
    return config


def presets() -> dict[str, str]:
    """The presets: each name with the Hugging Face repository its numbers
    come from. ``imp_mem.ModelShape.from_hf_config(imp_mem.preset_config(name))``
    plans one."""
    return {name: str(PRESETS[name]["source"]) for name in sorted(PRESETS)}
