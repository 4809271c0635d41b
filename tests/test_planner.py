"""The planner from Python: closed-form KV bytes for real configs, the plan's
contract, PlanFailure's report and attributes, bad input, V8 as a
hypothesis property of what the binding returns (a plan, or a typed
PlanFailure whose attributes add up to its report), and the ``imp-mem plan``
command line. V7 (determinism) is proved in Rust (``src/planner/tests.rs``).

Config dicts are the memory-relevant fields of each model's published
``config.json`` on the Hugging Face Hub; the repository is named beside each.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import (
    Features,
    ImpMemError,
    InvalidArgument,
    Limits,
    MemoryPlan,
    ModelShape,
    PlanFailure,
    PlanInput,
    plan_memory,
)
from imp_mem._presets import PRESETS, preset
from imp_mem.cli import main

MIB = 1 << 20
GIB = 1 << 30

# meta-llama/Meta-Llama-3-8B
LLAMA3_8B = {
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
}

# deepseek-ai/DeepSeek-V2-Lite
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# google/gemma-2-2b
GEMMA2_2B = {
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}

# ai21labs/Jamba-v0.1
JAMBA = {
    "model_type": "jamba",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "vocab_size": 65536,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}


def gqa(layers: int, kv_heads: int, head_dim: int, nbytes: int) -> int:
    """Closed form: K and V per KV head per layer."""
    return layers * kv_heads * 2 * head_dim * nbytes


def plan_input(config=LLAMA3_8B, batch=8, seq=4096, budget="80GiB", **kw) -> PlanInput:
    limits_kw = {k: kw.pop(k) for k in ("kv_dtype", "block_size", "kv_policy") if k in kw}
    return PlanInput(
        ModelShape.from_hf_config(config), Limits(batch, seq, **limits_kw), budget=budget, **kw
    )


# ---- KV bytes per token, four attention kinds ---------------------------


def test_dense_gqa_kv_bytes():
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    assert shape.attention_kind == "gqa"
    assert shape.kv_bytes_per_token()["full"] == gqa(32, 8, 128, 2) == 131072
    assert shape.kv_bytes_per_token("fp8")["full"] == 65536
    assert shape.kv_bytes_per_token(tp=4)["full"] == gqa(32, 2, 128, 2)
    qwen = ModelShape.from_hf_config(preset("qwen3-8b"))
    assert qwen.kv_bytes_per_token() == {"full": 147456, "sliding": 0, "total": 147456}


def test_mla_kv_bytes_replicated_across_ranks():
    shape = ModelShape.from_hf_config(DEEPSEEK_V2_LITE)
    assert shape.attention_kind == "mla"
    per_token = 27 * (512 + 64) * 2
    assert shape.kv_bytes_per_token()["full"] == per_token
    assert shape.kv_bytes_per_token(tp=8)["full"] == per_token
    assert shape.moe["moe_layers"] == 26
    # DeepSeek-V2-Lite has 15.7 B parameters.
    assert abs(shape.params / 15.7e9 - 1) < 0.03


def test_sliding_window_kv_bytes():
    shape = ModelShape.from_hf_config(GEMMA2_2B)
    assert (shape.full_attention_layers, shape.sliding_layers) == (13, 13)
    kv = shape.kv_bytes_per_token("bf16")
    assert kv["full"] == kv["sliding"] == gqa(13, 4, 256, 2)
    g3 = ModelShape.from_hf_config(preset("gemma-3-27b"))
    assert (g3.full_attention_layers, g3.sliding_layers, g3.sliding_window) == (10, 52, 1024)


def test_hybrid_kv_and_state_bytes():
    shape = ModelShape.from_hf_config(JAMBA)
    assert (shape.full_attention_layers, shape.state_layers) == (4, 28)
    assert shape.kv_bytes_per_token()["full"] == gqa(4, 8, 128, 2)
    assert shape.state_bytes_per_layer == (3 * 8192 + 8192 * 16) * 2
    plan = plan_memory(plan_input(JAMBA, batch=4, seq=8192, budget="200GiB"))
    (state,) = plan.pools
    assert state["slots"] == 4
    assert state["bytes_per_slot"] == 28 * shape.state_bytes_per_layer


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_reads_and_plans(name):
    shape = ModelShape.from_hf_config(preset(name))
    assert shape.weights_bytes > 1 * GIB
    inp = PlanInput(shape, Limits(1, 2048), budget="2TiB", tp=8)
    assert plan_memory(inp).total() <= 2 << 40


# ---- reading configs ------------------------------------------------------


def test_from_hf_config_path_uses_safetensors_sizes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    estimated = ModelShape.from_hf_config(tmp_path / "config.json")
    assert estimated == ModelShape.from_hf_config(LLAMA3_8B)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1000], "data_offsets": [0, 2000]}})
    blob = struct.pack("<Q", len(header)) + header.encode() + bytes(2000)
    (tmp_path / "model.safetensors").write_bytes(blob)
    assert ModelShape.from_hf_config(str(tmp_path / "config.json")).weights_bytes == 2000
    assert ModelShape.from_hf_config(tmp_path).weights_bytes == 2000
    index = {"metadata": {"total_size": 16060522496}, "weight_map": {}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert ModelShape.from_hf_config(tmp_path).weights_bytes == 16060522496


def test_model_shape_from_keyword_fields_and_override():
    shape = ModelShape(**LLAMA3_8B)
    assert shape == ModelShape.from_hf_config(LLAMA3_8B)
    assert shape.with_weights_bytes("15GiB").weights_bytes == 15 * GIB
    assert ModelShape.from_hf_config(LLAMA3_8B, weights_bytes=123).weights_bytes == 123


# ---- the plan's contract --------------------------------------------------


def test_plan_targets_the_configuration_b1():
    plan = plan_memory(plan_input(preset("qwen3-8b"), batch=8, seq=4096))
    assert plan.kv_blocks == 8 * 4096 // 16 == plan.kv["target_blocks"]
    assert plan.kv["full_sequences"] == 8
    assert plan.total() <= plan.budget == 80 * GIB
    assert plan.total() + plan.headroom == plan.budget
    assert sum(c["bytes"] for c in plan.charges) == plan.total()
    keys = [c["key"] for c in plan.charges]
    assert keys[0] == "weights" and "library_reserve" in keys and "context" in keys
    assert (
        plan.model_resident
        + plan.engine_persistent
        + plan.scratch
        + plan.kv_bytes
        + (plan.library_reserve + plan.context)
        == plan.total()
    )


def test_plan_json_is_deterministic_and_round_trips():
    inp = plan_input()
    a, b = plan_memory(inp).to_json(), plan_memory(inp).to_json()
    assert a == b
    assert MemoryPlan.from_json(a).to_json() == a
    data = json.loads(a)
    assert data["total"] == plan_memory(inp).total()
    assert plan_memory(inp).to_dict() == data


def test_measured_charges_are_inputs_d7():
    base = plan_memory(plan_input(library_reserve=0, context=0))
    charged = plan_memory(plan_input(library_reserve="3900MiB", context="1680MiB"))
    assert charged.total() - base.total() == (3900 + 1680) * MIB
    assert charged.library_reserve == 3900 * MIB
    default = plan_memory(plan_input())
    assert default.context == imp_mem._core.H200_CONTEXT_BYTES
    assert default.library_reserve == imp_mem._core.H200_LIBRARY_RESERVE_BYTES


def test_features_cost_memory():
    base = plan_memory(plan_input())
    feats = Features(vision_tower_bytes="800MiB", lora_slots=4, lora_rank=16, spec_depth=4)
    inp = PlanInput(ModelShape(**LLAMA3_8B), Limits(8, 4096), feats, budget="80GiB")
    plan = plan_memory(inp)
    assert plan.model_resident - base.model_resident == 800 * MIB
    assert plan.engine_persistent > base.engine_persistent
    assert plan.kv["blocks_per_sequence"] == (4096 + 4 + 15) // 16


def test_engine_blocks_are_planned_as_blocks_and_round_trip():
    base = plan_memory(plan_input())
    feats = Features(engine_kv_blocks=3)
    assert (feats.engine_kv_blocks, feats.engine_swa_blocks) == (3, 0)
    inp = PlanInput(ModelShape(**LLAMA3_8B), Limits(8, 4096), feats, budget="80GiB")
    plan = plan_memory(inp)
    assert plan.kv["blocks"] == base.kv["blocks"] + 3
    assert "+ 3 engine blocks" in plan.table()
    assert json.loads(inp.to_json())["features"]["engine_kv_blocks"] == 3
    assert "engine_kv_blocks" not in json.loads(plan_input().to_json())["features"]
    with pytest.raises(InvalidArgument, match="engine_kv_blocks"):
        Features(engine_kv_blocks=-1)
    with pytest.raises(InvalidArgument, match="engine_swa_blocks"):
        Features(engine_swa_blocks=1 << 40)
    with pytest.raises(InvalidArgument, match="engine_kv_blocks must be an integer"):
        Features(engine_kv_blocks="3")


def test_plan_failure_report_and_attributes():
    inp = plan_input(batch=32, seq=8192, budget="40GiB")
    with pytest.raises(PlanFailure) as info:
        plan_memory(inp)
    exc = info.value
    assert isinstance(exc, ImpMemError)
    assert str(exc) == exc.report.rstrip()
    assert exc.kind == "over_budget"
    assert exc.budget == 40 * GIB
    assert sum(c["bytes"] for c in exc.charges) == exc.total
    assert exc.over_by == exc.total - exc.budget
    assert f"over by {-(-exc.over_by // MIB)} MiB" in str(exc)
    assert "Cannot fit this configuration in the 40960 MiB budget." in str(exc)
    assert "the three largest levers" in str(exc)
    assert len(exc.levers) == 3
    frees = [lever["frees"] for lever in exc.levers]
    assert frees == sorted(frees, reverse=True)
    # Each lever's figure is exact: apply it and the requested total drops by it.
    for lever in exc.levers:
        kw = {"batch": 32, "seq": 8192, "budget": "40GiB"}
        setting, to = lever["setting"], lever["to"]
        if setting == "max_seq_len":
            kw["seq"] = int(to)
        elif setting == "max_batch":
            kw["batch"] = int(to)
        elif setting == "kv_dtype":
            kw["kv_dtype"] = to
        else:
            kw["tp"] = int(to)
        try:
            new_total = plan_memory(plan_input(**kw)).total()
            fits = True
        except PlanFailure as again:
            new_total, fits = again.total, False
        assert exc.total - new_total == lever["frees"], lever
        assert fits == lever["sufficient"], lever


def test_plan_failure_names_the_largest_batch_that_fits():
    # A budget a little short of 32 sequences: the three levers leave
    # max_batch out, the attribute still names 31.
    at_31 = plan_memory(plan_input(batch=31, seq=8192, budget="64GiB")).total()
    with pytest.raises(PlanFailure) as info:
        plan_memory(plan_input(batch=32, seq=8192, budget=at_31))
    exc = info.value
    assert all(lever["setting"] != "max_batch" for lever in exc.levers)
    assert exc.max_batch_fits == 31
    plan_memory(plan_input(batch=exc.max_batch_fits, seq=8192, budget=at_31))
    # Nothing fits an 8 GiB budget for an 8B model: None.
    with pytest.raises(PlanFailure) as info:
        plan_memory(plan_input(batch=4, seq=8192, budget="8GiB"))
    assert info.value.max_batch_fits is None


def test_fit_policy_floor_d8():
    ok = plan_memory(plan_input(batch=64, seq=8192, budget="40GiB", kv_policy="fit"))
    assert 1 <= ok.kv["full_sequences"] < 64
    with pytest.raises(PlanFailure) as info:
        plan_memory(plan_input(batch=64, seq=8192, budget="17GiB", kv_policy="fit"))
    assert info.value.kind == "below_admission_floor"
    assert "less than one full sequence of 8192" in str(info.value)


# ---- bad input: InvalidArgument naming the field ------------------------


def _without(key):
    # No model_type: a type transformers knows would take its default.
    return {k: v for k, v in LLAMA3_8B.items() if k not in (key, "model_type")}


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ModelShape.from_hf_config(_without("num_hidden_layers")), "num_hidden_layers"),
        (lambda: ModelShape.from_hf_config(_without("vocab_size")), "vocab_size"),
        (lambda: ModelShape.from_hf_config({**LLAMA3_8B, "torch_dtype": "f13"}), "torch_dtype"),
        (lambda: ModelShape.from_hf_config({**LLAMA3_8B, "hidden_size": -1}), "hidden_size"),
        (lambda: ModelShape.from_hf_config({**LLAMA3_8B, "hidden_size": "big"}), "hidden_size"),
        (
            lambda: ModelShape.from_hf_config({**LLAMA3_8B, "quantization_config": {}}),
            "quant_method",
        ),
        (lambda: ModelShape.from_hf_config(42), "config"),
        (lambda: ModelShape.from_hf_config("/no/such/config.json"), "config"),
        (lambda: ModelShape(), "ModelShape"),
        (lambda: Limits(0, 4096), "max_batch"),
        (lambda: Limits(-1, 4096), "max_batch"),
        (lambda: Limits(8, 0), "max_seq_len"),
        (lambda: Limits(8, -4096), "max_seq_len"),
        (lambda: Limits("8", 4096), "max_batch"),
        (lambda: Limits(True, 4096), "max_batch"),
        (lambda: Limits(8, 4096, kv_dtype="fp7"), "kv_dtype"),
        (lambda: Limits(8, 4096, block_size=0), "block_size"),
        (lambda: Limits(8, 4096, kv_policy="some"), "kv_policy"),
        (lambda: Limits(2**40, 4096), "max_batch"),
        (lambda: Features(lora_slots=2), "lora_rank"),
        (lambda: Features(spec_depth=-1), "spec_depth"),
        (lambda: plan_input(budget="80 parsecs"), "budget"),
        (lambda: plan_input(budget="80GiBs"), "budget"),
        (lambda: plan_input(budget=""), "budget"),
        (lambda: plan_input(budget="-80GiB"), "budget"),
        (lambda: plan_input(budget=0), "budget"),
        (lambda: plan_input(budget=-1), "budget"),
        (lambda: plan_input(tp=0), "tp"),
        (lambda: plan_input(context="lots"), "context"),
        (lambda: plan_input(library_reserve=-5), "library_reserve"),
    ],
)
def test_bad_input_raises_invalid_argument_naming_the_field(make, field):
    with pytest.raises(InvalidArgument) as info:
        make()
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GIB), ("80 GB", 80 * GIB), ("81920MiB", 80 * GIB), ("1.5 GiB", 3 * GIB // 2)],
)
def test_budget_spellings(text, expected):
    assert plan_input(budget=text).budget == expected
    assert imp_mem.parse_size(text) == expected


# ---- V8 ------------------------------------------------------------------


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["dense", "mla", "swa", "linear", "mamba"]))
    heads = draw(st.sampled_from([4, 8, 16, 32, 64]))
    hidden = draw(st.sampled_from([512, 1024, 2048, 4096, 8192]))
    cfg = {
        "model_type": "random",
        "num_hidden_layers": draw(st.integers(1, 96)),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // draw(st.sampled_from([1, 2, 4, 8]))),
        "intermediate_size": hidden * 3,
        "vocab_size": draw(st.sampled_from([32000, 128256, 151936])),
        "torch_dtype": draw(st.sampled_from(["bfloat16", "float16", "float32"])),
    }
    every = draw(st.integers(1, 8))
    if kind == "mla":
        cfg.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    elif kind == "swa":
        cfg.update(sliding_window=draw(st.sampled_from([128, 1024, 4096])))
        cfg.update(sliding_window_pattern=every)
    elif kind == "linear":
        cfg.update(full_attention_interval=every, linear_num_key_heads=16)
        cfg.update(linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    elif kind == "mamba":
        cfg.update(attn_layer_period=every, attn_layer_offset=0, mamba_d_state=16)
    if draw(st.booleans()):
        cfg.update(num_experts=draw(st.sampled_from([8, 64])), num_experts_per_tok=2)
        cfg.update(moe_intermediate_size=hidden // 2)
    quant = draw(st.sampled_from([None, "fp8", "awq", "mxfp4"]))
    if quant:
        cfg["quantization_config"] = {"quant_method": quant, "bits": 4}
    return cfg


@st.composite
def plan_inputs(draw):
    shape = ModelShape.from_hf_config(draw(configs()))
    limits = Limits(
        draw(st.integers(1, 512)),
        draw(st.integers(1, 262144)),
        kv_dtype=draw(st.sampled_from([None, "fp8", "bf16", "f32"])),
        block_size=draw(st.sampled_from([1, 16, 32, 128])),
        kv_policy=draw(st.sampled_from(["full", "fit"])),
    )
    features = Features(
        spec_depth=draw(st.integers(0, 7)),
        vision_tower_bytes=draw(st.integers(0, 2 * GIB)),
        lora_slots=draw(st.integers(0, 4)),
        lora_rank=16,
    )
    return PlanInput(
        shape,
        limits,
        features,
        budget=draw(st.integers(1, 256 * GIB)),
        # A valid split: no more ranks than query heads (powers of two).
        tp=min(draw(st.sampled_from([1, 2, 4, 8])), shape.num_attention_heads),
        context=draw(st.integers(0, 2 * GIB)),
        library_reserve=draw(st.integers(0, 4 * GIB)),
    )


def report_mib_column(report: str) -> tuple[int, int]:
    """(sum of the requested lines, the printed total) in MiB."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("requested"))
    end = next(i for i, line in enumerate(lines) if line.strip() == "-----")
    column = sum(int(line.split()[-1]) for line in lines[start + 1 : end])
    total = int(lines[end + 1].split()[1])
    return column, total


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_inputs())
def test_v8_plans_fit_and_failures_add_up(inp):
    try:
        plan = plan_memory(inp)
    except PlanFailure as exc:
        assert sum(c["bytes"] for c in exc.charges) == exc.total
        assert exc.total > exc.budget == inp.budget
        assert exc.over_by == exc.total - exc.budget
        column, printed = report_mib_column(exc.report)
        assert column == printed == exc.total // MIB
        assert len(exc.levers) <= 3
    except InvalidArgument as exc:
        assert "256 PiB" in str(exc)
    else:
        assert plan.total() <= inp.budget
        assert sum(c["bytes"] for c in plan.charges) == plan.total()
        assert plan.kv_blocks <= plan.kv["target_blocks"]
        assert plan.kv["full_sequences"] >= 1


# ---- the command line -----------------------------------------------------


def test_cli_plan_preset_table(capsys):
    assert main(["plan", "llama-3-8b", "--max-batch", "8", "--max-seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "KV pool (8 x 4096 tok, bf16)" in out
    assert "4,096" in out  # 8 x 4096 x 128 KiB = 4096 MiB
    assert "library reserve " in out
    assert "(measured)" not in out, "the plan measured nothing; the memory report says which"


def test_cli_plan_json(capsys):
    argv = ["plan", "qwen3-8b", "--budget", "24GiB", "--max-seq-len", "8192", "--json"]
    assert main([*argv, "--kv-dtype", "fp8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"] <= data["budget"] == 24 * GIB
    assert data["kv"]["dtype"] == "fp8"


def test_cli_plan_failure_exits_2_with_report(capsys):
    assert main(["plan", "llama-3.1-70b", "--budget", "80GiB", "--max-seq-len", "8192"]) == 2
    out = capsys.readouterr().out
    assert "Cannot fit this configuration in the 81920 MiB budget." in out
    assert "over by" in out and "frees" in out
    assert main(["plan", "llama-3.1-70b", "--budget", "80GiB", "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["error"] == "plan_failure"
    assert sum(c["bytes"] for c in data["charges"]) == data["total"]


def test_cli_plan_config_path_and_tp(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V2_LITE))
    assert main(["plan", str(path), "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp"] == 2
    assert data["kv"]["bytes_per_token"] == 27 * 576 * 2


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "no-such-model"],
        ["plan", "llama-3-8b", "--budget", "80 parsecs"],
        ["plan", "llama-3-8b", "--max-batch", "0"],
        ["plan", "llama-3-8b", "--kv-dtype", "fp7"],
        ["plan"],
    ],
)
def test_cli_plan_bad_input_exits_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "InvalidArgument" in err and "Traceback" not in err


def test_cli_plan_list_presets(capsys):
    assert main(["plan", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)


def test_cli_plan_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", "gemma-3-27b", "--budget", "80GiB", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    failed = tmp_path / "failed.png"
    argv = ["plan", "gemma-3-27b", "--budget", "40GiB", "--plot", str(failed)]
    assert main(argv) == 2
    assert failed.exists()


def test_cli_plan_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["plan", "llama-3-8b", "--plot", str(tmp_path / "x.png")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    # Refused before anything is planned or printed.
    assert "needs matplotlib" in captured.err and captured.out == ""


def test_python_dash_m_imp_mem_plan():
    result = subprocess.run(
        [sys.executable, "-m", "imp_mem", "plan", "mixtral-8x7b", "--budget", "40GiB"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "the three largest levers" in result.stdout


def _plan_json(argv, capsys) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _line(doc: dict, name: str) -> int:
    return doc[name]


def test_cli_plan_gives_a_vision_tower_its_own_line(tmp_path, capsys):
    """A multimodal config's tower is sized as the engine lays it out in T1
    (`dummy.vision_bytes`) and planned on the ``vision_tower`` line; measured
    weight bytes hold the tower, so the weights line is the rest."""
    from imp_mem._cli_plan import vision_tower_bytes
    from imp_mem.engine import dummy
    from imp_mem.engine.config import ModelConfig

    tower = vision_tower_bytes("gemma-3-4b")
    assert tower == dummy.vision_bytes(ModelConfig.from_hf_config(preset("gemma-3-4b")))
    # SigLIP So400m's 27 layers and the projector, bf16: about 0.8 GiB.
    assert 780 << 20 < tower < 820 << 20
    argv = ["plan", "gemma-3-4b", "--budget", "40GiB", "--max-batch", "4"]
    doc = _plan_json(argv, capsys)
    assert _line(doc, "vision_tower") == -(-tower // (1 << 20)) << 20
    text_only = dict(preset("gemma-3-4b"))
    del text_only["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(text_only))
    assert vision_tower_bytes(str(tmp_path)) == 0
    plain = _plan_json(["plan", str(tmp_path / "config.json"), "--budget", "40GiB",
                        "--max-batch", "4"], capsys)  # fmt: skip
    assert _line(plain, "weights") == _line(doc, "weights"), "the estimate holds no tower"
    assert plain["vision_tower"] == 0
    # Measured bytes: the whole checkpoint's, the tower taken out of them.
    doc = _plan_json([*argv, "--weights-bytes", "8GiB"], capsys)
    assert _line(doc, "weights") == -(-((8 << 30) - tower) // (1 << 20)) << 20


def test_cli_plan_refuses_a_tower_it_cannot_size(tmp_path, capsys):
    cfg = dict(preset("gemma-3-4b"), model_type="llava")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "InvalidArgument" in err and "CONFIG" in err and "gemma3" in err
    argv = ["plan", "gemma-3-4b", "--weights-bytes", "100MiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--weights-bytes" in err and "vision tower" in err
