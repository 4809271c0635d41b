"""RoPE's inverse frequencies as transformers computes them for the RoPE
types the families use (``default``, ``linear``, ``llama3``, ``yarn``), the
factor YaRN scales cos/sin by (`attention_factor`), and the cos/sin tables.

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
    if kind == "yarn":
        factor = float(rope["factor"])
        old = float(rope["original_max_position_embeddings"])
        fast = rope.get("beta_fast") or 32
        slow = rope.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(fast), correction_dim(slow)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (freq / factor) * (1 - extrapolation) + freq * extrapolation
    raise InvalidArgument(f"rope type {kind!r} is not supported here")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (1 for the other types)."""
    rope = rope or {}
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope["factor"])
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    return _yarn_mscale(factor)


def softmax_mscale(rope: dict[str, Any] | None) -> float:
    """DeepSeek's softmax scale multiplier under a scaled RoPE:
    ``mscale(factor, mscale_all_dim) ** 2`` (1 without ``mscale_all_dim``)."""
    rope = rope or {}
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return 1.0
    all_dim = rope.get("mscale_all_dim", 0)
    if not all_dim:
        return 1.0
    return _yarn_mscale(float(rope["factor"]), all_dim) ** 2


def cos_sin(
    freq: torch.Tensor, positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, 2 * len(freq)]`` in `dtype`."""
    pos = torch.arange(positions, device=device, dtype=torch.float)
    angles = torch.outer(pos, freq.to(device))
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
