"""Triton paged decode attention (flash-decoding over KV pages, in place).

Algorithm. One query token per sequence. The key range of sequence ``b``
(``[max(0, p + 1 - window), p]`` with ``p = positions[b]``) is cut into
splits of ``split_blocks`` logical blocks; one program per (sequence, KV
head, split) handles every query head of that KV head's group at once, so K
and V are read once per group. It walks its split in tiles of ``tile``
tokens: each token's block id comes from the block table (-1: skipped), K
and V are loaded straight from the pool at ``kv[block, layer, 0|1, offset,
head]``, and an online softmax (base 2, float32) accumulates ``P @ V``. The
program writes its normalised partial output and log-sum-exp; a second
kernel, one program per (sequence, query head), merges the partials of the
splits that overlap the key range. Splits outside the range do nothing and
are never read, so the grid can be sized from the table width alone, which
is static: the launch is CUDA-graph capturable.

Shapes: ``q[B, heads, head_dim]`` (contiguous last dim), the pool
``kv[num_blocks, n_layers, 2, block_size, kv_heads, head_dim]`` (any
strides, last dim contiguous), ``block_tables[B, M]`` int32,
``positions[B]`` int64. Block offsets are computed in int64: a pool can
exceed 2^31 elements.

No state; each call allocates its partials and output (from whatever
allocator is current: the engine routes them through imp-mem).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from imp_mem.errors import InvalidArgument

LOG2E = 1.4426950408889634

# Upper bound on splits per sequence: bounds the partials' memory whatever
# the table width (B x heads x MAX_SPLITS x head_dim floats); the minimum
# split keeps programs long enough to amortise loading q and writing a
# partial. 32, so that a table of up to 128 blocks keeps 64-token splits:
# at batch 64 and a 65-block table, 17 splits of 64 tokens took 82.3 us on
# the H200 and 9 of 128 (what 16 allowed) 94.8 us (session 21).
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 64
# Launch defaults; benches/bench_paged_attention.py --sweep times the others.
DEFAULT_TILE = 64
DEFAULT_WARPS = 4
DEFAULT_STAGES = 2
DEFAULT_EARLY_V = True
DEFAULT_HEAD_FAST = False
DEFAULT_HEADS_PER_PROGRAM = 1

# Triton 3.6's interpreter multiplies bfloat16 tiles wrongly in tl.dot; under
# it the kernel rounds P to the input dtype as on the GPU, then multiplies
# in float32.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _split_kernel(
    Q,
    KV,
    TABLES,
    POS,
    O_PART,
    LSE_PART,
    stride_qb,
    stride_qh,
    stride_kvb,
    stride_kvkv,
    stride_kvt,
    stride_kvh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    width,
    window,
    qk_scale,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EARLY_V: tl.constexpr,
    HEAD_FAST: tl.constexpr,
    MULTI_HEAD: tl.constexpr,
):
    # MULTI_HEAD: one program a (sequence, BLOCK_KVH KV heads, split). A
    # tile is TILE tokens times BLOCK_KVH heads, each token's heads side by
    # side in the pool, so one load is one contiguous run of BLOCK_KVH rows
    # instead of rows a head's stride apart; every query row scores every
    # column and keeps its own KV head's (BLOCK_KVH times the arithmetic of
    # a memory-bound kernel, though with a group of 4 the 16-row minimum of
    # a dot pads one head's rows to the same work at 4 heads). Otherwise one
    # program a (sequence, KV head, split), BLOCK_KVH 1.
    if MULTI_HEAD:
        b = tl.program_id(0)
        kvh = tl.program_id(1) * BLOCK_KVH
        split = tl.program_id(2)
    elif HEAD_FAST:
        # A sequence's KV heads in consecutive programs: the programs that
        # run together read neighbouring 256-B rows of the same pages.
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
    ctx = tl.load(POS + b).to(tl.int64) + 1
    lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    split_start = split.to(tl.int64) * SPLIT_TOKENS
    start = tl.maximum(split_start, lo)
    end = tl.minimum(split_start + SPLIT_TOKENS, ctx)
    if start < end:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        if MULTI_HEAD:
            gmask = (g < BLOCK_KVH * GROUP) & (heads < KV_HEADS * GROUP)
        else:
            gmask = g < GROUP
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        c = tl.arange(0, TILE * BLOCK_KVH)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        if MULTI_HEAD:
            col_head = c % BLOCK_KVH
            mine = (g // GROUP)[:, None] == col_head[None, :]
            head_base = (kvh + col_head).to(tl.int64) * stride_kvh
        else:
            head_base = kvh * stride_kvh
        # A static trip count (Triton's interpreter cannot loop over tensor
        # bounds); tiles past `end` load nothing, their lanes being masked.
        for tile in range(0, SPLIT_TOKENS, TILE):
            if MULTI_HEAD:
                t = start + tile + c // BLOCK_KVH
                in_range = (t < end) & (kvh + col_head < KV_HEADS)
            else:
                t = start + tile + c
                in_range = t < end
            logical = t // BLOCK_SIZE
            block = tl.load(
                TABLES + b * stride_tb + logical, mask=in_range & (logical < width), other=-1
            )
            valid = in_range & (block >= 0)
            offs = block.to(tl.int64) * stride_kvb + head_base + (t % BLOCK_SIZE) * stride_kvt
            k = tl.load(KV + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            if EARLY_V:
                # V's load issued with K's: twice the bytes in flight.
                v = tl.load(
                    KV + stride_kvkv + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0
                )
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            if MULTI_HEAD:
                s = tl.where(mine & valid[None, :], s, float("-inf"))
            else:
                s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if not EARLY_V:
                v = tl.load(
                    KV + stride_kvkv + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0
                )
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(
            O_PART + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
            out,
            mask=gmask[:, None],
        )
        tl.store(LSE_PART + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _merge_kernel(
    O_PART,
    LSE_PART,
    POS,
    OUT,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    window,
    HEAD_DIM: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(POS + b).to(tl.int64) + 1
    lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    first = lo // SPLIT_TOKENS
    last = (ctx - 1) // SPLIT_TOKENS + 1
    # Only the splits that overlap the key range were written.
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        LSE_PART + b * stride_lb + h * stride_lh + s,
        mask=(s >= first) & (s < last),
        other=float("-inf"),
    )
    live = lse > float("-inf")
    w = tl.where(live, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(
        O_PART + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(OUT + b * stride_outb + h * stride_outh + d, out.to(OUT.dtype.element_ty))


def choose_split_blocks(width: int, block_size: int, tile: int = DEFAULT_TILE) -> int:
    """Logical blocks per split for a table `width` blocks wide: at most
    `MAX_SPLITS` splits, none shorter than `MIN_SPLIT_TOKENS`, and a whole
    number of `tile`-token tiles where the blocks allow (a split of 80
    tokens walked two 64-token tiles, the second three-quarters masked:
    45.7 % of the HBM peak at batch 64 and a 65-block table against 68.7 %
    at 64-token splits, H200, session 21)."""
    min_blocks = max(1, MIN_SPLIT_TOKENS // block_size)
    blocks = max(min_blocks, -(-width // MAX_SPLITS))
    step = max(1, tile // block_size)
    return -(-blocks // step) * step


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    split_blocks: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    early_v: bool | None = None,
    head_fast: bool | None = None,
    all_heads: bool | None = None,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """Paged decode attention; see the module doc. Returns ``[B, heads,
    head_dim]`` in q's dtype. ``heads_per_program``: KV heads one program
    reads side by side (rounded up to a power of two; `_split_kernel`'s
    ``MULTI_HEAD``), contiguous loads of that many rows a token;
    ``all_heads`` is every KV head in one program (its best was 59.4 % of
    the H200's HBM peak against the default path's 68.7 % in one sweep,
    session 20)."""
    batch, heads, head_dim = q.shape
    _, _, _, block_size, kv_heads, kv_dim = kv.shape
    width = block_tables.shape[1]
    if kv_dim != head_dim or heads % kv_heads or q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)} and kv {tuple(kv.shape)} do not fit "
            "(head_dim equal, heads a multiple of kv_heads, last dims contiguous)"
        )
    if heads_per_program is not None and heads_per_program < 1:
        raise InvalidArgument(
            f"paged_decode: heads_per_program must be at least 1 (got {heads_per_program}); "
            "leave it None for the default"
        )
    group = heads // kv_heads
    split_blocks = split_blocks or choose_split_blocks(width, block_size, tile or DEFAULT_TILE)
    split_tokens = split_blocks * block_size
    splits = -(-width // split_blocks)
    tile = max(16, min(tile or DEFAULT_TILE, triton.next_power_of_2(split_tokens)))
    o_part = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    has_window = window is not None
    pages = kv[:, layer]  # [num_blocks, 2, block_size, kv_heads, head_dim], a view
    head_fast = DEFAULT_HEAD_FAST if head_fast is None else head_fast
    per = kv_heads if all_heads else heads_per_program or DEFAULT_HEADS_PER_PROGRAM
    block_kvh = min(triton.next_power_of_2(per), triton.next_power_of_2(kv_heads))
    multi = block_kvh > 1
    if multi:
        grid = (batch, -(-kv_heads // block_kvh), splits)
        # A tile of this many tokens holds `tile` rows of `block_kvh` heads.
        rows, tile, early_v = block_kvh * group, max(1, tile // block_kvh), True
    else:
        grid = (kv_heads, batch, splits) if head_fast else (batch, kv_heads, splits)
        block_kvh, rows = 1, group
    _split_kernel[grid](
        q,
        pages,
        block_tables,
        positions,
        o_part,
        lse_part,
        q.stride(0),
        q.stride(1),
        pages.stride(0),
        pages.stride(1),
        pages.stride(2),
        pages.stride(3),
        block_tables.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        width,
        window if has_window else 0,
        scale * LOG2E,
        GROUP=group,
        KV_HEADS=kv_heads,
        BLOCK_G=max(16, triton.next_power_of_2(rows)),
        BLOCK_KVH=block_kvh,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SPLIT_TOKENS=split_tokens,
        TILE=tile,
        HAS_WINDOW=has_window,
        DOT_FP32=_INTERPRETING,
        EARLY_V=DEFAULT_EARLY_V if early_v is None else early_v,
        HEAD_FAST=head_fast,
        MULTI_HEAD=multi,
        num_warps=num_warps or DEFAULT_WARPS,
        num_stages=num_stages or DEFAULT_STAGES,
    )
    _merge_kernel[(batch, heads)](
        o_part,
        lse_part,
        positions,
        out,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        out.stride(0),
        out.stride(1),
        window if has_window else 0,
        HEAD_DIM=head_dim,
        SPLIT_TOKENS=split_tokens,
        BLOCK_S=triton.next_power_of_2(splits),
        HAS_WINDOW=has_window,
        num_warps=1,
    )
    return out
