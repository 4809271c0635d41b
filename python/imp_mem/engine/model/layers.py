"""Layers every model family shares: the KV pools as the model reads them,
RMSNorm and RoPE as transformers computes them (rounding for rounding in
bfloat16). Attention over the pages is `imp_mem.engine.model.attention`.

Nothing here holds state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from imp_mem.engine.config import ModelConfig
from imp_mem.errors import InvalidArgument


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


# -- the argument checks every family's two entry points make ---------------


def check_prefill_args(input_ids: torch.Tensor, start_pos: int, max_positions: int) -> int:
    """A prefill's ids (non-empty, 1-D) and positions (inside the RoPE
    tables); returns the end position. Host-side checks: prefill is never
    captured."""
    if input_ids.dim() != 1 or input_ids.shape[0] == 0:
        raise InvalidArgument(
            f"prefill: input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}"
        )
    end = start_pos + input_ids.shape[0]
    if start_pos < 0 or end > max_positions:
        raise InvalidArgument(
            f"prefill: positions [{start_pos}, {end}) must lie in [0, {max_positions})"
        )
    return end


def check_decode_args(
    pools: set[str],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    swa_block_tables: torch.Tensor | None,
    kv: KvViews,
) -> dict[str, torch.Tensor | None]:
    """A decode's shapes (metadata only, no device sync: capturable), and
    that every pool the model's layers read (`pools`) has its pages and
    tables. Returns the tables by pool."""
    batch = input_ids.shape[0]
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise InvalidArgument(
            f"decode: input_ids and positions must both be [B]; got "
            f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    for name, table in (("block_tables", block_tables), ("swa_block_tables", swa_block_tables)):
        if table is not None and (table.dim() != 2 or table.shape[0] != batch):
            raise InvalidArgument(
                f"decode: {name} must be [B={batch}, M]; got {tuple(table.shape)}"
            )
    tables = {"full": block_tables, "swa": swa_block_tables}
    for pool in pools:
        if tables[pool] is None or getattr(kv, pool) is None:
            raise InvalidArgument(
                f"decode: the model has {pool} layers; pass kv.{pool} and its block tables"
            )
    return tables


def check_tables(
    config: ModelConfig,
    kv: KvViews,
    table: torch.Tensor | None,
    swa_table: torch.Tensor | None,
    end: int,
    block_shape: Callable[[int, int], tuple[int, ...]],
    where: str,
) -> None:
    """A prefill's pages and tables: each pool the model has is passed, its
    pages have `block_shape(layers, block_size)` per block, and its table
    reaches position `end`."""
    for pool, t, tname in (("full", table, "block_table"), ("swa", swa_table, "swa_block_table")):
        layers = config.full_layers if pool == "full" else config.sliding_layers
        pages = kv.full if pool == "full" else kv.swa
        if not layers:
            continue
        if pages is None or t is None:
            raise InvalidArgument(
                f"{where}: the model has {len(layers)} {pool} layers; pass kv.{pool} and {tname}"
            )
        want = block_shape(len(layers), kv.block_size)
        if tuple(pages.shape[1:]) != want:
            raise InvalidArgument(
                f"{where}: kv.{pool} has shape {tuple(pages.shape)}; expected "
                f"[blocks, {', '.join(map(str, want))}]"
            )
        if t.shape[-1] * kv.block_size < end:
            raise InvalidArgument(
                f"{where}: {tname} has {t.shape[-1]} blocks of {kv.block_size} tokens, "
                f"fewer than the {end} positions asked for"
            )


def check_prefill_batch_args(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    spans: list[tuple[int, int]],
    max_positions: int,
) -> int:
    """A batched prefill's shapes against its host `spans` (``(start,
    len)`` per chunk: every length at least 1, their sum the ids', every
    position inside the RoPE tables). Returns the furthest end position.
    Host-side: prefill is never captured."""
    rows = len(spans)
    if rows == 0 or input_ids.dim() != 1:
        raise InvalidArgument(
            f"prefill_batch: pass at least one chunk and 1-D input_ids; got {rows} spans and "
            f"ids of shape {tuple(input_ids.shape)}"
        )
    if tuple(cu_seqlens.shape) != (rows + 1,) or tuple(starts.shape) != (rows,):
        raise InvalidArgument(
            f"prefill_batch: cu_seqlens must be [{rows + 1}] and starts [{rows}] for "
            f"{rows} spans; got {tuple(cu_seqlens.shape)} and {tuple(starts.shape)}"
        )
    total = sum(n for _, n in spans)
    if total != input_ids.shape[0] or min(n for _, n in spans) < 1:
        raise InvalidArgument(
            f"prefill_batch: the spans' lengths (each at least 1) must sum to the "
            f"{input_ids.shape[0]} ids; got {[n for _, n in spans]}"
        )
    end = max(s + n for s, n in spans)
    if min(s for s, _ in spans) < 0 or end > max_positions:
        raise InvalidArgument(
            f"prefill_batch: positions up to {end} must lie in [0, {max_positions})"
        )
    return end


def batch_positions(
    cu_seqlens: torch.Tensor, starts: torch.Tensor, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, rows)`` of a batched prefill's `tokens` tokens: each
    token's position in its own sequence and its chunk's index, from the
    chunks' ``cu_seqlens`` and ``starts``. Index math on the device (no
    host sync)."""
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    rows = torch.searchsorted(cu_seqlens[1:], index, right=True)
    positions = starts[rows] + (index - cu_seqlens[rows]).long()
    return positions, rows


def prefill_batch_inputs(
    model: Any,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    swa_block_tables: torch.Tensor | None,
    kv: KvViews,
    spans: list[tuple[int, int]],
) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
    """A batched prefill's arguments checked against `model` (its
    ``config``, ``max_positions`` and ``kv_block_shape``), and what every
    family derives from them: each token's position, the tables by pool,
    and each token's slot in its own sequence's pages, by pool."""
    from imp_mem.engine.model.attention import batch_slots

    end = check_prefill_batch_args(input_ids, cu_seqlens, starts, spans, model.max_positions)
    check_tables(
        model.config, kv, block_tables, swa_block_tables, end, model.kv_block_shape, "prefill"
    )
    positions, rows = batch_positions(cu_seqlens, starts, input_ids.shape[0])
    tables = {"full": block_tables, "swa": swa_block_tables}
    slot = {
        name: batch_slots(table, rows, positions, kv.block_size)
        for name, table in tables.items()
        if table is not None
    }
    return positions, tables, slot
