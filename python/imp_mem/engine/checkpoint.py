"""Random-weight checkpoints in Hugging Face form, for tests and demos
without hub access.

`write_random_checkpoint` writes ``config.json`` and ``model.safetensors``
(HF tensor names, the config's ``torch_dtype``, bfloat16 by default) so that
``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads exactly
the tensors the engine loads. A tied output head is not written (as
``save_pretrained`` does); transformers ties it on load.

The scale. Every matrix and the embedding are drawn from N(0, scale²); the
norm weights from N(1, 0.1²) (N(0, 0.1²) for Gemma's ``1 + w`` norms), so a
mix-up of two norms shows in the logits. The engine's ``load_format="dummy"``
draws the same values in T1 (`imp_mem.engine.dummy`).
`DEFAULT_SCALE` = 0.02, transformers' own ``initializer_range``, chosen by
measurement (`benches/measure_checkpoint_scale.py`: Qwen3-0.6B's shape, 28
layers, random prompts, bf16 against float32 on the same weights, CPU):

| scale | top-2 margin p50 | bf16 flips | margin > bf16 noise p99 | distinct greedy tokens |
|---|---|---|---|---|
| 0.005 | 0.035 | 6 % | 86 % | 7 of 64 positions |
| 0.01 | 0.039 | 11 % | 67 % | 10 of 64 |
| 0.02 | 0.078 | 5.5 % | 62 % | 64 of 256 |
| 0.05 | 0.250 | 12 % | 30 % | 254 of 256 |

Smaller scales make the blocks' outputs tiny and alike, so every position
predicts the same few tokens (margins above the noise, but greedy decoding
says nothing about the context); larger ones raise bf16's rounding noise
faster than the margins, so more greedy tokens flip. At 0.02 the greedy
token depends on the context and 62 % of positions have a margin above
bf16's noise (69 % above the noise of the top-2 gap alone): those are the
positions where a test can demand identical greedy tokens. No scale makes
random logits peaked the way a trained model's are (a near-Gaussian cloud
over 151 936 tokens has top-2 gaps of about a tenth of its spread).

Pure function of (config, seed, scale): the same arguments write the same
bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from imp_mem.engine.config import ModelConfig

DEFAULT_SCALE = 0.02
NORM_JITTER = 0.1

# transformers' causal-LM class of each served family.
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def random_weights(
    config_dict: dict[str, Any],
    *,
    seed: int = 0,
    scale: float = DEFAULT_SCALE,
    device: Any = None,
) -> dict[str, Any]:
    """The tensors `write_random_checkpoint` writes, in the config's dtype,
    made on `device` (default the CPU; a GPU makes an 8B model's in
    seconds where the CPU takes over a minute; the values differ between
    devices, not between runs on one)."""
    import torch

    from imp_mem.engine.dummy import draw, norm_center
    from imp_mem.engine.model import weight_names

    config = ModelConfig.from_hf_config(config_dict)
    dtype = getattr(torch, config.dtype)
    device = torch.device(device or "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    center = norm_center(config)
    out = {}
    for name, shape in weight_names(config).items():
        out[name] = draw(name, shape, gen, device, scale, center).to(dtype)
    return out


def write_random_checkpoint(
    directory: str | Path,
    config_dict: dict[str, Any],
    *,
    seed: int = 0,
    scale: float = DEFAULT_SCALE,
    device: Any = None,
) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` of a random-weight
    model into `directory` (created if needed); returns the directory.
    `device`: where the values are made (`random_weights`)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config_dict = dict(config_dict)
    config_dict.setdefault("torch_dtype", "bfloat16")
    config_dict.setdefault(
        "architectures", [ARCHITECTURES.get(config_dict.get("model_type"), "Qwen3ForCausalLM")]
    )
    weights = random_weights(config_dict, seed=seed, scale=scale, device=device)
    weights = {name: t.cpu() for name, t in weights.items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return directory


def pack_fused(weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` with each fused group (`imp_mem._safetensors.FUSED_ROWS`:
    q/k/v, gate/up) copied into one tensor and returned as views of it, as
    the loader lays them out in T1, so `PagedModel` runs them as one GEMM
    each. For weights made outside an imp-mem arena (tests, benchmarks)."""
    import torch

    from imp_mem._safetensors import FUSED_ROWS

    out = dict(weights)
    for name in weights:
        module, _, leaf = name.rpartition(".")
        prefix, _, part = module.rpartition(".")
        for parts in FUSED_ROWS:
            if leaf != "weight" or part != parts[0]:
                continue
            names = [f"{prefix}.{p}.weight" for p in parts]
            if not all(n in weights for n in names):
                continue
            whole = torch.cat([weights[n] for n in names])
            at = 0
            for n in names:
                rows = weights[n].shape[0]
                out[n] = whole[at : at + rows]
                at += rows
    return out
