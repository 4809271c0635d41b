"""Random-weight checkpoints in Hugging Face form, for tests and demos
without hub access.

`write_random_checkpoint` writes ``config.json`` and ``model.safetensors``
(HF tensor names, the config's ``torch_dtype``, bfloat16 by default) so that
``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads exactly
the tensors the engine loads. A tied output head is not written (as
``save_pretrained`` does); transformers ties it on load.

The values. The engine's ``load_format="dummy"`` draws the same values in
T1 (`imp_mem.engine.dummy`): both follow `imp_mem.engine.weight_draw`,
which says the rule and why `DEFAULT_SCALE` is 0.02.

Pure function of (config, seed, scale): the same arguments write the same
bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.weight_draw import DEFAULT_SCALE, draw, norm_center

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
