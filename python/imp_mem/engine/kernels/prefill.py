"""Triton varlen prefill attention over KV pages (flash-attention style, in
place): one forward over several sequences' chunks at once.

Algorithm. The queries of ``R`` chunks lie back to back in
``q[T, heads, head_dim]``; chunk ``r`` is rows ``[cu[r], cu[r + 1])`` at
positions ``starts[r] + [0, len)`` of its own sequence, whose keys are in
the pages through its table row ``tables[r]`` (the chunk's own K/V already
stored, and, with a prefix hit, everything before ``starts[r]``). One
program per (chunk, query block of ``BLOCK_M`` rows, query head) walks the
keys its block can see, ``[lo, hi)`` with ``hi`` one past its last query's
position and ``lo`` 0 (or, in a sliding-window layer, the window's start
for its first query), in tiles of ``BLOCK_N`` tokens: each key's block id
comes from the table (-1: skipped), K and V are loaded from
``kv[block, layer, 0|1, offset, kv_head]``, the causal (and window) mask is
applied per (query, key), and an online softmax (base 2, float32)
accumulates ``P @ V``. Query head ``h`` reads KV head ``h // group``. The
grid is sized from the longest chunk (a host figure the caller passes);
programs past their chunk's end return at once.

Shapes: ``q[T, heads, head_dim]`` (last dim contiguous), the pool
``kv[num_blocks, n_layers, 2, block_size, kv_heads, head_dim]`` (last dim
contiguous), ``tables[R, M]`` int32, ``cu_seqlens[R + 1]`` int32,
``starts[R]`` int64. Block offsets in int64 (a pool can exceed 2^31
elements). The reference is `model.attention.prefill_attention`, chunk by chunk.

No state; each call allocates its output only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Under Triton's interpreter (`_INTERPRETING`) bf16 tiles multiply wrongly
# in tl.dot; `fold_tile` rounds P to the input dtype as on the GPU, then
# multiplies in float32.
from imp_mem.engine.kernels.paged import _INTERPRETING, LOG2E, fold_tile

BLOCK_M = 16 if _INTERPRETING else 64
BLOCK_N = 16 if _INTERPRETING else 64
WARPS = 4
STAGES = 2


@triton.jit
def _varlen_kernel(
    Q,
    KV,
    TABLES,
    CU,
    STARTS,
    OUT,
    stride_qt,
    stride_qh,
    stride_kvb,
    stride_kvkv,
    stride_kvt,
    stride_kvh,
    stride_tr,
    stride_ot,
    stride_oh,
    width,
    window,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    r = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(CU + r).to(tl.int64)
    n = tl.load(CU + r + 1).to(tl.int64) - q0
    start = tl.load(STARTS + r).to(tl.int64)
    first = mb.to(tl.int64) * BLOCK_M
    if first < n:
        m = first + tl.arange(0, BLOCK_M)
        qmask = m < n
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        qpos = start + m
        q = tl.load(
            Q + (q0 + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=qmask[:, None] & dmask[None, :],
            other=0.0,
        )
        hi = start + tl.minimum(n, first + BLOCK_M)
        lo = hi * 0
        if HAS_WINDOW:
            lo = tl.maximum(start + first + 1 - window, 0)
        head_base = (h // GROUP) * stride_kvh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for k0 in range(lo, hi, BLOCK_N):
            t = k0 + tl.arange(0, BLOCK_N)
            in_range = t < hi
            logical = t // BLOCK_SIZE
            block = tl.load(
                TABLES + r * stride_tr + logical, mask=in_range & (logical < width), other=-1
            )
            valid = in_range & (block >= 0)
            offs = block.to(tl.int64) * stride_kvb + head_base + (t % BLOCK_SIZE) * stride_kvt
            kvmask = valid[:, None] & dmask[None, :]
            k = tl.load(KV + offs[:, None] + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(KV + stride_kvkv + offs[:, None] + d[None, :], mask=kvmask, other=0.0)
            allowed = valid[None, :] & (t[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (t[None, :] > qpos[:, None] - window)
            m_i, l_i, acc = fold_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_FP32)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            OUT + (q0 + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=qmask[:, None] & dmask[None, :],
        )


def varlen_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    max_len: int,
    *,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Varlen paged prefill attention (module doc); `max_len` is the longest
    chunk's length. Returns ``[T, heads, head_dim]`` in q's dtype."""
    _, heads, head_dim = q.shape
    _, _, _, block_size, kv_heads, kv_dim = kv.shape
    if kv_dim != head_dim or heads % kv_heads or q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError(
            f"varlen_prefill: q {tuple(q.shape)} and kv {tuple(kv.shape)} do not fit "
            "(head_dim equal, heads a multiple of kv_heads, last dims contiguous)"
        )
    rows = tables.shape[0]
    out = torch.empty_like(q)
    pages = kv[:, layer]  # [num_blocks, 2, block_size, kv_heads, head_dim], a view
    has_window = window is not None
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Wide heads (Gemma-3's 256) take half the tile: the accumulator and
    # the K/V tiles stay within the registers and shared memory.
    block_m = BLOCK_M if block_d <= 128 or _INTERPRETING else BLOCK_M // 2
    grid = (rows, triton.cdiv(max(max_len, 1), block_m), heads)
    _varlen_kernel[grid](
        q,
        pages,
        tables,
        cu_seqlens,
        starts,
        out,
        q.stride(0),
        q.stride(1),
        pages.stride(0),
        pages.stride(1),
        pages.stride(2),
        pages.stride(3),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        tables.shape[1],
        window if has_window else 0,
        scale * LOG2E,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N if block_d <= 128 or _INTERPRETING else BLOCK_N // 2,
        HAS_WINDOW=has_window,
        DOT_FP32=_INTERPRETING,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    return out
