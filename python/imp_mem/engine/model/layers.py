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


def fused_rows(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``[sum of rows, cols]`` matrix viewing `parts` (2-D, same dtype
    and columns, contiguous) when they lie back to back in one storage, as
    the loader places a fused group in T1 (`imp_mem._safetensors.FUSED_ROWS`);
    None otherwise. Nothing is copied."""
    first = parts[0]
    if any(
        p.dim() != 2
        or p.dtype != first.dtype
        or p.device != first.device
        or p.shape[1] != first.shape[1]
        or not p.is_contiguous()
        for p in parts
    ):
        return None
    storage = first.untyped_storage()
    at = first.storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != at:
            return None
        at += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, first.shape[1]))
