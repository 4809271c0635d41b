"""Attention over paged KV: the store of new K/V by slot, decode attention
(one query token per sequence) and prefill attention (one sequence, with a
prefix already in the pages).

KV layout (docs/ENGINE_INTERFACE): a pool is one tensor
``kv[num_blocks, n_layers_in_pool, 2, block_size, kv_heads, head_dim]``;
``kv[:, i, 0]`` is layer i's K and ``kv[:, i, 1]`` its V. Block tables are
int32 and indexed by logical block (position // block_size); -1 is no block
(a hole, a block slid out of the window, or past the end), and its tokens are
not attended to.

Attention semantics are those of transformers' Qwen3: a query at position
``p`` attends to the keys at positions ``j <= p`` and, in a sliding-window
layer of window ``W``, also ``j > p - W`` (W tokens including itself).
Query head ``h`` reads KV head ``h // (heads / kv_heads)``.

Decode attention has two implementations with one signature:

* ``backend="triton"``: the split-K kernel of `imp_mem.engine.kernels.paged`,
  reading the pages in place (the GPU path);
* ``backend="torch"``: a gather of every table entry into a contiguous
  ``[B, M * block_size]`` key range, masked, softmax in float32 (the CPU path
  and the reference the kernel is tested against).

Both are free of host syncs and data-dependent shapes, so a decode step that
uses them can be captured in a CUDA graph. Prefill of one request's chunk
uses SDPA over the gathered pages (`prefill_attention`); a batched prefill
(several requests' chunks in one forward, `varlen_prefill_attention`)
runs the Triton varlen kernel of `kernels.prefill` on a GPU, and
`prefill_attention` chunk by chunk on the torch path.

Nothing here holds state; the functions are safe to call from any thread
that owns the tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slots(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_ids, offsets)`` of the tokens at `positions`: with a table of
    one sequence (``[M]``) for any number of positions, or with one table row
    per position (``[N, M]``, decode). Index math on the device."""
    logical = torch.div(positions, block_size, rounding_mode="floor")
    if block_table.dim() == 1:
        blocks = block_table[logical]
    else:
        blocks = torch.gather(block_table, 1, logical.unsqueeze(1)).squeeze(1)
    return blocks.long(), positions - logical * block_size


def batch_slots(
    block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_ids, offsets)`` of a batched prefill's tokens: token ``i`` at
    ``positions[i]`` of the sequence whose table is ``block_tables[rows[i]]``
    (``[R, M]``). Index math on the device."""
    logical = torch.div(positions, block_size, rounding_mode="floor")
    return block_tables[rows, logical].long(), positions - logical * block_size


def store_kv(
    kv: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Writes `k`, `v` (``[N, kv_heads, head_dim]``) into layer `layer` of the
    pool `kv` at the slots ``(block_ids[i], offsets[i])``. The slots must be
    real blocks (the engine gives padding rows a scratch block)."""
    kv[:, layer, 0].index_put_((block_ids, offsets), k.to(kv.dtype))
    kv[:, layer, 1].index_put_((block_ids, offsets), v.to(kv.dtype))


def _gather_keys(
    kv: torch.Tensor, layer: int, block_tables: torch.Tensor, key_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V at `key_pos` (any shape ``S``) through `block_tables` (``[M]``
    or ``[B, M]`` with ``S = [B, L]``), and whether each has a block."""
    block_size = kv.shape[3]
    logical = torch.div(key_pos, block_size, rounding_mode="floor")
    width = block_tables.shape[-1]
    in_table = logical < width
    logical = logical.clamp(max=width - 1)
    if block_tables.dim() == 1:
        blocks = block_tables[logical]
    else:
        blocks = torch.gather(block_tables, 1, logical)
    present = in_table & (blocks >= 0)
    blocks = blocks.clamp(min=0).long()
    offsets = key_pos - logical * block_size
    keys = kv[:, layer, 0][blocks, offsets]
    values = kv[:, layer, 1][blocks, offsets]
    return keys, values, present


def _zero_where_not(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    # Pages outside a context hold whatever was there before (NaN bit
    # patterns included); a zero probability times NaN is still NaN.
    return torch.where(keep[..., None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention by gathering: `q` is ``[B, heads, head_dim]``, the
    context of row b is positions ``[max(0, p + 1 - window), p]`` with
    ``p = positions[b]``. Returns ``[B, heads, head_dim]`` in q's dtype."""
    batch, heads, head_dim = q.shape
    kv_heads = kv.shape[4]
    block_size = kv.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    key_pos = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    key_pos = key_pos.unsqueeze(0).expand(batch, -1)
    keys, values, present = _gather_keys(kv, layer, block_tables, key_pos)
    pos = positions.unsqueeze(1)
    allowed = present & (key_pos <= pos)
    if window is not None:
        allowed &= key_pos > pos - window
    keys = _zero_where_not(keys, allowed)
    values = _zero_where_not(values, allowed)
    group = heads // kv_heads
    qg = q.float().view(batch, kv_heads, group, head_dim)
    # scores[b, kvh, g, j]
    scores = torch.einsum("bhgd,bjhd->bhgj", qg, keys.float()) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgj,bjhd->bhgd", probs, values.float())
    return out.reshape(batch, heads, head_dim).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "triton",
    splits: int | None = None,
) -> torch.Tensor:
    """Decode attention over the pages in place (see the module doc).
    `backend` is ``"triton"`` or ``"torch"``; `splits` (Triton only) is
    how many parts each sequence's live key range is cut into (None: the
    kernel's default for the batch and the GPU)."""
    if backend == "torch":
        return paged_decode_attention_reference(
            q, kv, layer, block_tables, positions, window=window, scale=scale
        )
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    from imp_mem.engine.kernels import paged as paged_kernel

    return paged_kernel.paged_decode(
        q,
        kv,
        layer,
        block_tables,
        positions,
        window=window,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        splits=splits,
    )


def prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    start_pos: int,
    *,
    window: int | None = None,
    scale: float | None = None,
    bidirectional: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of the queries at positions ``[start_pos, start_pos +
    T)`` (`q` is ``[T, heads, head_dim]``) over the keys in the pages, which
    already hold those tokens and everything before them (a prefix hit).
    `bidirectional` ``(s, e)``: the positions ``[s, e)`` (an image's tokens)
    also attend to each other ahead of themselves, as transformers' Gemma-3
    masks them (OR with the causal mask, then AND with the window); every
    key of the span must be in the pages (``e <= start_pos + T``).
    Returns ``[T, heads, head_dim]`` in q's dtype."""
    tokens, heads, head_dim = q.shape
    kv_heads = kv.shape[4]
    end = start_pos + tokens
    first = 0 if window is None else max(0, start_pos + 1 - window)
    key_pos = torch.arange(first, end, device=q.device)
    keys, values, present = _gather_keys(kv, layer, block_table, key_pos)
    q_pos = torch.arange(start_pos, end, device=q.device).unsqueeze(1)
    seen = key_pos.unsqueeze(0) <= q_pos
    if bidirectional is not None:
        lo, hi = bidirectional
        k_in = (key_pos >= lo) & (key_pos < hi)
        q_in = (q_pos >= lo) & (q_pos < hi)
        seen = seen | (q_in & k_in.unsqueeze(0))
    allowed = present.unsqueeze(0) & seen
    if window is not None:
        allowed &= key_pos.unsqueeze(0) > q_pos - window
    # Query head h reads KV head h // group, as transformers' repeat_kv; the
    # expansion (rather than enable_gqa) keeps SDPA on its fused kernels
    # when a mask is given.
    group = heads // kv_heads
    keys = _zero_where_not(keys, present).to(q.dtype).repeat_interleave(group, dim=1)
    values = _zero_where_not(values, present).to(q.dtype).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=allowed,
        scale=head_dim**-0.5 if scale is None else scale,
    )
    return out.squeeze(0).transpose(0, 1)


def varlen_prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    spans: list[tuple[int, int]],
    *,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "triton",
) -> torch.Tensor:
    """Causal attention of several sequences' chunks at once (a batched
    prefill): chunk ``r``'s queries are rows ``[cu_seqlens[r],
    cu_seqlens[r + 1])`` of `q` (``[T, heads, head_dim]``) at positions
    ``[starts[r], starts[r] + len)`` of its sequence, reading that
    sequence's keys through ``block_tables[r]`` (its own K/V stored first,
    a prefix hit's before it). `spans`: the same ``(start, len)`` on the
    host (the torch path's loop, the kernel's grid). ``backend="triton"``:
    one kernel over every chunk (`kernels.prefill`); ``"torch"``:
    `prefill_attention` chunk by chunk (the reference). Returns ``[T,
    heads, head_dim]`` in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if backend == "torch":
        outs, at = [], 0
        for r, (start, n) in enumerate(spans):
            outs.append(
                prefill_attention(
                    q[at : at + n], kv, layer, block_tables[r], start, window=window, scale=scale
                )
            )
            at += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    from imp_mem.engine.kernels import prefill as prefill_kernel

    return prefill_kernel.varlen_prefill(
        q,
        kv,
        layer,
        block_tables,
        cu_seqlens,
        starts,
        max(n for _, n in spans),
        window=window,
        scale=scale,
    )


def contiguous_decode_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """SDPA of one query per sequence over a contiguous cache
    (``keys``/``values`` ``[B, kv_heads, L, head_dim]``): the peer the paged
    kernel is benchmarked against. Returns ``[B, heads, head_dim]``."""
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, enable_gqa=q.shape[1] != keys.shape[1]
    )
    return out.squeeze(2)


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)
