"""The planner reads a config as transformers does (issue 14): for every
model type the presets and tests cover, a field left out of config.json
takes transformers' own default. Each case parses a sparse config with
`ModelShape.from_hf_config` and compares the result with transformers'
config class built from the same fields (`AutoConfig.for_model`), which
needs no torch. Skipped where transformers is not installed."""

from __future__ import annotations

import pytest

from imp_mem import ModelShape

transformers = pytest.importorskip("transformers")

# The model types the presets and the tests use, with the few fields a
# sparse config.json might keep.
SPARSE = {
    "llama": {"hidden_size": 2048, "num_attention_heads": 16},
    "mistral": {"hidden_size": 2048},
    "mixtral": {"num_hidden_layers": 4},
    # Qwen3-0.6B's numbers: transformers' default of 32 KV heads would not
    # divide its 16 attention heads (a config no model can be built from,
    # which the planner refuses).
    "qwen3": {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8},
    "qwen3_moe": {"num_hidden_layers": 4},
    "qwen3_next": {"num_hidden_layers": 8},
    "gemma2": {"hidden_size": 2560, "num_attention_heads": 8},
    "gemma3_text": {"hidden_size": 2560, "num_attention_heads": 8, "num_hidden_layers": 34},
    "gpt_oss": {"num_hidden_layers": 4},
    "deepseek_v2": {"num_hidden_layers": 4},
    "deepseek_v3": {"num_hidden_layers": 5},
    "jamba": {"num_hidden_layers": 8},
    "falcon_h1": {"num_hidden_layers": 4},
}


def _theirs(model_type: str, fields: dict):
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@pytest.mark.parametrize("model_type", sorted(SPARSE))
@pytest.mark.parametrize("sparse", [False, True], ids=["empty", "sparse"])
def test_a_left_out_field_means_what_it_means_to_transformers(model_type, sparse):
    fields = SPARSE[model_type] if sparse else {}
    theirs = _theirs(model_type, fields)
    ours = ModelShape.from_hf_config({"model_type": model_type, **fields})
    assert ours.num_layers == theirs.num_hidden_layers
    assert ours.hidden_size == theirs.hidden_size
    assert ours.num_attention_heads == theirs.num_attention_heads
    assert ours.vocab_size == theirs.vocab_size
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    attention = ours.attention
    if ours.attention_kind == "gqa":
        head_dim = getattr(theirs, "head_dim", None) or (
            theirs.hidden_size // theirs.num_attention_heads
        )
        kv_heads = getattr(theirs, "num_key_value_heads", None) or theirs.num_attention_heads
        assert attention["head_dim"] == head_dim
        assert attention["num_kv_heads"] == kv_heads
    else:
        assert attention["kv_lora_rank"] == theirs.kv_lora_rank
        assert attention["qk_rope_head_dim"] == theirs.qk_rope_head_dim
    window = getattr(theirs, "sliding_window", None)
    if ours.sliding_layers:
        assert ours.sliding_window == window
    moe = ours.moe
    experts = next(
        (
            getattr(theirs, k)
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if getattr(theirs, k, None)
        ),
        0,
    )
    if experts > 1:
        assert moe is not None and moe["num_experts"] == experts


def test_gemma3_without_head_dim_is_planned_with_transformers_256():
    fields = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    }
    ours = ModelShape.from_hf_config({"model_type": "gemma3_text", **fields})
    assert ours.attention["head_dim"] == _theirs("gemma3_text", fields).head_dim == 256
