"""The engine's families on the GPU (issue 26): for each of llama,
qwen3_moe, deepseek_v2 (MLA) and gemma3_text at a moderate random config
(``load_format="dummy"``: weights drawn in T1 from a seed, no checkpoint):

* greedy tokens against transformers' model of the same type on the same
  weights (`imp_mem.engine.dummy.transformers_model`, drawn from the same
  seed on the same device), bf16 on both sides, wherever transformers'
  top-2 margin is decisive (> 0.2, as `test_engine_gpu` demands), with at
  least a quarter of the tokens decisive; the MoE families on their
  grouped-GEMM path (`torch._grouped_mm` over the experts' stacks in T1);
* in a fresh child process (nothing else of this process on the device),
  at two limits (a roomy KV pool, and a small one): torch's activations
  routed into a planned tier sized from a measured warm-up (as the demo
  does), then the plan's total against the device memory the process
  uses within 1 %, >= 99 % of it attributed by the engine's report, and no
  acquisition while serving; at the issue's models' real numbers too
  (Llama-3.1-8B, Qwen3-30B-A3B, gemma-3-4b, DeepSeek-V2-Lite) where
  ``IMP_MEM_GPU_FULL_SIZES=1`` (minutes each: a device call of their own).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from _device_plan import (  # noqa: E402
    check_peak_thresholds,
    decisive_tokens,
    plan_against_device,
    workload,
)

from imp_mem.engine.llm_engine import Engine  # noqa: E402


def configs() -> dict[str, dict]:
    """Moderate shapes of each family (bf16; 0.3-1.5 GB of weights)."""
    base = {"vocab_size": 32000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    return {
        "llama": {
            **base,
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            "tie_word_embeddings": False,
        },
        "qwen3_moe": {
            **base,
            "model_type": "qwen3_moe",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 6,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "rope_theta": 1000000.0,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
        "deepseek_v2": {
            **base,
            "model_type": "deepseek_v2",
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 6,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
            },
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 32,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            "moe_intermediate_size": 256,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "tie_word_embeddings": False,
        },
        "gemma3_text": {
            **base,
            "model_type": "gemma3_text",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 256,
            "sliding_window": 256,
            "sliding_window_pattern": 6,
            "tie_word_embeddings": True,
        },
    }


FAMILIES = list(configs())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family):
    from imp_mem.engine.dummy import transformers_model

    config = configs()[family]
    backend = imp_mem.VmmBackend(device=0, strict=True)
    with Engine(
        config, load_format="dummy", seed=7, backend=backend, max_batch=16, max_seq_len=1024
    ) as e:
        model = e.model
        for index in e.config.extra.get("moe_layers", ()):
            assert model.use_grouped(index), f"layer {index} is not on the grouped GEMM"
        rng = random.Random(5)
        vocab = e.config.vocab_size
        shared = [rng.randrange(vocab) for _ in range(96)]
        prompts = [
            shared[: 16 * (i % 4)] + [rng.randrange(vocab) for _ in range(300)] for i in range(16)
        ]
        outs = e.generate(prompts, 24)
        del model
    hf = transformers_model(config, seed=7, device="cuda")
    try:

        def rows(hf=hf):
            for p, o in zip(prompts, outs, strict=True):
                with torch.no_grad():
                    logits = hf(torch.tensor([p + o[:-1]], device="cuda")).logits[0].float()
                yield logits[len(p) - 1 :]

        decisive, checked = decisive_tokens(family, rows(), outs)
        assert decisive > checked // 4
    finally:
        del hf
        torch.cuda.empty_cache()


@pytest.mark.parametrize("limits", [(64, 2048), (4, 256)], ids=["roomy", "small-kv"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_matches_the_device_and_is_attributed(family, limits):
    plan_against_device(configs()[family], *limits, label=f"{family} {limits}")


@pytest.mark.parametrize("family", FAMILIES)
def test_peak_memory_within_the_checked_in_thresholds(family):
    """imp-mem's backend peak and torch's peak reserved over a workload of
    32 requests (prefixes shared, cancellations none) within the checked-in
    figures (`engine_peak_thresholds.json`, ``family_<name>``)."""
    limits = {"max_batch": 32, "max_seq_len": 1024}
    backend = imp_mem.VmmBackend(device=0, strict=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # What torch still holds from an earlier test in this process (0 when
    # the file runs alone, as the thresholds were taken; a run of several
    # GPU files in one pytest, on 2026-12-03, read 768 MiB more in all four).
    held = int(torch.cuda.memory_reserved())
    with Engine(configs()[family], load_format="dummy", seed=7, backend=backend, **limits) as e:
        workload(e, 32, seed=6)
        got = {
            "imp_mem_peak": int(backend.stats()["peak"]),
            "torch_peak_reserved": int(torch.cuda.max_memory_reserved()) - held,
        }
    torch.cuda.empty_cache()
    check_peak_thresholds(f"family_{family}", got, dict(limits, model=family))


# The models at their real numbers (random weights drawn in T1),
# planned against the device at a roomy budget and one that leaves the KV
# pool small. Each boots three processes of up to 61 GB of weights (several
# minutes in all), so they run where IMP_MEM_GPU_FULL_SIZES=1 is set: a call
# of the device tool of their own.
FULL_SIZES = os.environ.get("IMP_MEM_GPU_FULL_SIZES") == "1"


def _real_configs() -> dict[str, dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    import bench_engine_families as fam

    return {
        name: make() for name, (_title, make, _layers) in fam.MODELS.items() if name != "gemma3"
    }


@pytest.mark.skipif(not FULL_SIZES, reason="set IMP_MEM_GPU_FULL_SIZES=1 (minutes a model)")
@pytest.mark.parametrize("limits", [(64, 4096), (8, 512)], ids=["roomy", "small-kv"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text", "deepseek_v2"])
def test_plan_matches_the_device_at_the_models_numbers(family, limits):
    plan_against_device(_real_configs()[family], *limits, label=f"{family} full {limits}")
