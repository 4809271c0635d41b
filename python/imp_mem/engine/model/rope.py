"""RoPE's inverse frequencies as transformers computes them for the RoPE
types the families use (``default``, ``linear``, ``llama3``), and the
cos/sin tables over them.

transformers computes the inverse frequencies in float32 on the CPU, the
angles and their cos/sin in float32 on the model's device, then casts the
tables to the model dtype; so do these, so that bfloat16 rounds alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from imp_mem.errors import InvalidArgument


def inv_freq(dim: int, theta: float, rope: dict[str, Any] | None = None) -> torch.Tensor:
    """``[dim / 2]`` float32 inverse frequencies of RoPE over `dim`
    channels, base `theta`, scaled as `rope` (a config's ``rope_scaling`` /
    ``rope_parameters``) says."""
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return freq
    if kind == "linear":
        return freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise InvalidArgument(f"rope type {kind!r} is not supported here")


def cos_sin(
    freq: torch.Tensor, positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, 2 * len(freq)]`` in `dtype`."""
    pos = torch.arange(positions, device=device, dtype=torch.float)
    angles = torch.outer(pos, freq.to(device))
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
