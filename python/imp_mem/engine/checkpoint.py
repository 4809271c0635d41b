"""Random-weight checkpoints in Hugging Face form, for tests and demos
without hub access.

`write_random_checkpoint` writes ``config.json`` and ``model.safetensors``
(HF tensor names, the config's ``torch_dtype``, bfloat16 by default) so that
``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads exactly
the tensors the engine loads. A tied output head is not written (as
``save_pretrained`` does); transformers ties it on load.

The scale. Every matrix and the embedding are drawn from N(0, scale²); the
norm weights from N(1, 0.1²), so a mix-up of two norms shows in the logits.
Transformers' own initialisation (N(0, 0.02²)) gives a Qwen3-0.6B-shaped
model whose next-token logits are a near-Gaussian cloud over 151 936 tokens:
the top two are a few hundredths apart, below bfloat16's rounding of the
logits themselves, so greedy decoding is a coin toss between kernels. Much
smaller scales make each block's output small against the residual
stream, which then carries the input embedding to the head: the top token
stands far above the rest, but it is the input token itself, whatever the
context. `DEFAULT_SCALE` sits between: measured on random prompts (see
`benches/measure_checkpoint_scale.py`), the top-1 / top-2 margin is well
above the bfloat16 tolerance at most positions while the greedy token still
depends on the context (it is not the input token most of the time).

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


def random_weights(
    config_dict: dict[str, Any], *, seed: int = 0, scale: float = DEFAULT_SCALE
) -> dict[str, Any]:
    """The tensors `write_random_checkpoint` writes, on the CPU, in the
    config's dtype."""
    import torch

    from imp_mem.engine.model import weight_names

    config = ModelConfig.from_hf_config(config_dict)
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_names(config).items():
        if name.endswith("norm.weight"):
            t = 1.0 + NORM_JITTER * torch.randn(shape, generator=gen)
        else:
            t = scale * torch.randn(shape, generator=gen)
        out[name] = t.to(dtype)
    return out


def write_random_checkpoint(
    directory: str | Path,
    config_dict: dict[str, Any],
    *,
    seed: int = 0,
    scale: float = DEFAULT_SCALE,
) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` of a random-weight
    model into `directory` (created if needed); returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config_dict = dict(config_dict)
    config_dict.setdefault("torch_dtype", "bfloat16")
    config_dict.setdefault("architectures", ["Qwen3ForCausalLM"])
    weights = random_weights(config_dict, seed=seed, scale=scale)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return directory
