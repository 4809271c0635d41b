"""Layers every model family shares: the KV pools as the model reads them,
RMSNorm and RoPE as transformers computes them (rounding for rounding in
bfloat16). Attention over the pages is `imp_mem.engine.model.attention`.

Nothing here holds state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from imp_mem.engine.config import ModelConfig


@dataclass
class KvViews:
    """The KV pools as the model reads them (layout in the module doc of
    `imp_mem.engine.model.attention`)."""

    full: torch.Tensor | None
    swa: torch.Tensor | None
    block_size: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm, rounding for rounding."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(
    config: ModelConfig, positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, head_dim]`` in `dtype`, computed as
    transformers computes them: the inverse frequencies in float32 on the
    CPU, the angles and their cos/sin in float32 on `device`."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    pos = torch.arange(positions, device=device, dtype=torch.float)
    freqs = torch.outer(pos, inv_freq.to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
