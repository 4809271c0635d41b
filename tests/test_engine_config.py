"""`imp_mem.engine.config` (issue 13): the presets read the same in the
engine, in imp-mem's planner and in transformers; bad configs are refused
with the field named. Runs without torch; the transformers comparison skips
where transformers is missing."""

from __future__ import annotations

import json

import pytest

import imp_mem
from imp_mem.engine.config import (
    FULL,
    SLIDING,
    ModelConfig,
    qwen3_0_6b_config,
    swa_config,
)


def test_qwen3_0_6b_numbers():
    c = ModelConfig.from_hf_config(qwen3_0_6b_config())
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (151936, 1024, 3072)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (28, 16, 8, 128)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-6, 1e6, 40960)
    assert c.tie_word_embeddings and c.sliding_window is None and c.dtype == "bfloat16"
    assert c.full_layers == list(range(28)) and c.sliding_layers == []


def test_swa_preset_serves_both_pools():
    config = swa_config()
    c = ModelConfig.from_hf_config(config)
    assert c.sliding_window == 256
    assert c.full_layers == [5, 11, 17, 23]
    assert len(c.sliding_layers) == 24
    assert c.pool_slot(11) == ("full", 1) and c.pool_slot(12) == ("swa", 10)
    shape = imp_mem.ModelShape.from_hf_config(config)
    assert (shape.full_attention_layers, shape.sliding_layers) == (4, 24)
    assert shape.sliding_window == 256
    plain = imp_mem.ModelShape.from_hf_config(qwen3_0_6b_config())
    assert (plain.full_attention_layers, plain.sliding_layers) == (28, 0)


@pytest.mark.parametrize("preset", [qwen3_0_6b_config, swa_config])
def test_transformers_reads_the_same(preset):
    transformers = pytest.importorskip("transformers")
    config = preset()
    hf = transformers.Qwen3Config(**config)
    c = ModelConfig.from_hf_config(config)
    assert c.layer_types == tuple(hf.layer_types)
    assert c.sliding_window == (hf.sliding_window if SLIDING in hf.layer_types else None)
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    assert c.head_dim == hf.head_dim and c.num_kv_heads == hf.num_key_value_heads
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert c.rms_norm_eps == hf.rms_norm_eps


def test_defaults_are_transformers_qwen3_defaults():
    """Fields a config.json omits take Qwen3Config's class defaults."""
    c = ModelConfig.from_hf_config({"model_type": "qwen3"})
    assert (c.head_dim, c.rope_theta, c.num_kv_heads, c.tie_word_embeddings) == (
        128,
        10000.0,
        32,
        False,
    )
    # A window that use_sliding_window leaves off, as Qwen3-0.6B's own config.
    off = ModelConfig.from_hf_config(
        {"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False}
    )
    assert off.sliding_window is None and set(off.layer_types) == {FULL}
    # use_sliding_window without layer_types: layers from max_window_layers slide.
    on = ModelConfig.from_hf_config(
        {
            "model_type": "qwen3",
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 2,
        }
    )
    assert on.layer_types == (FULL, FULL, SLIDING, SLIDING) and on.sliding_window == 64


def test_reads_a_directory_or_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(swa_config()))
    assert ModelConfig.from_hf_config(tmp_path) == ModelConfig.from_hf_config(swa_config())
    assert ModelConfig.from_hf_config(str(tmp_path / "config.json")).sliding_window == 256


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"layer_types": [FULL] * 3}, "layer_types"),
        ({"layer_types": ["banana"] * 28}, "layer_types"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"use_sliding_window": False}, "sliding_window"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    config = swa_config() if "use_sliding_window" in change else qwen3_0_6b_config()
    config.update(change)
    with pytest.raises(imp_mem.InvalidArgument, match=field):
        ModelConfig.from_hf_config(config)


def test_bad_inputs():
    with pytest.raises(TypeError, match="config"):
        ModelConfig.from_hf_config(42)  # type: ignore[arg-type]
    with pytest.raises(imp_mem.InvalidArgument, match="window"):
        swa_config(window=0)
    with pytest.raises(imp_mem.InvalidArgument, match="cannot read"):
        ModelConfig.from_hf_config("/nonexistent/config.json")


def test_a_vision_tower_the_engine_does_not_serve_is_refused_not_dropped():
    """A multimodal wrapper other than gemma3 over a served text model: the
    engine would serve the text alone and drop the tower unseen."""
    text = qwen3_0_6b_config()
    wrapped = {"model_type": "llava", "text_config": text, "vision_config": {"hidden_size": 8}}
    with pytest.raises(imp_mem.InvalidArgument, match=r"vision tower.*gemma3"):
        ModelConfig.from_hf_config(wrapped)
    # The same wrapper with no tower reads its text model.
    plain = {"model_type": "llava", "text_config": text}
    assert ModelConfig.from_hf_config(plain).model_type == "qwen3"
