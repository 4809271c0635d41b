"""Triton paged decode attention (flash-decoding over KV pages, in place).

Algorithm. One query token per sequence. The key range of sequence ``b``
(``[max(0, p + 1 - window), p]`` with ``p = positions[b]``) is cut into
``splits`` equal parts, each a whole number of ``tile``-token tiles, from the
live range itself (not from the table's width), so the work of a step is
spread evenly whatever the context. One program per (sequence, KV head,
split) handles every query head of that KV head's group at once, so K and V
are read once per group. It walks its part tile by tile in a loop whose trip
count is the live length (Triton pipelines its loads ``num_stages`` deep):
each token's block id comes from the block table (-1: skipped), K and V are
loaded straight from the pool at ``kv[block, layer, 0|1, offset, head]``,
and an online softmax (base 2, float32) accumulates ``P @ V``. With one
split the program writes the output itself; otherwise it writes its
normalised partial output and log-sum-exp and a second kernel, one program
per (sequence, query head), merges them. The grid depends only on the batch,
the heads and ``splits``, which are static: the launch is CUDA-graph
capturable.

Shapes: ``q[B, heads, head_dim]`` (contiguous last dim), the pool
``kv[num_blocks, n_layers, 2, block_size, kv_heads, head_dim]`` (any
strides, last dim contiguous), ``block_tables[B, M]`` int32,
``positions[B]`` int64. Block offsets are computed in int64: a pool can
exceed 2^31 elements.

No state; each call allocates its output (and, split, its partials) from
whatever allocator is current: the engine routes them through imp-mem.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from imp_mem.errors import InvalidArgument

LOG2E = 1.4426950408889634

# Upper bound on splits per sequence: bounds the partials' memory (B x heads
# x MAX_SPLITS x head_dim floats) and the merge's width.
MAX_SPLITS = 32
# No split is cut shorter than this many tokens of the table's width.
MIN_SPLIT_TOKENS = 64
# The default cuts a sequence until the programs number at least this many
# per SM (batch x KV heads x splits): at batch 64 x 8 KV heads one split
# (3.9 programs an SM) read at 81.5 % of the H200's HBM peak and two at
# 76.7 %; batch 32 needed two or four (2026-12-03, issue 25).
PROGRAMS_PER_SM = 3
# Launch defaults, by programs per SM (tools/sweep_paged_kernel.py times
# them; 2026-12-03, issue 25): few programs want long tiles and deep pipelines (32-token
# tiles, 2 warps, 5 stages: 68.7 us at batch 64 x 1 025 against 71.4 for
# 16-token tiles); many want small programs, more of them resident
# (16-token tiles, 1 warp, 4 stages: 129.4 us at batch 128 against 135.6).
FEW_PROGRAMS = (32, 2, 5)  # tile, warps, stages
MANY_PROGRAMS = (16, 1, 4)
MANY_PROGRAMS_PER_SM = 5
# The SMs the defaults assume off a GPU (under the interpreter): an H200's.
INTERPRETER_SMS = 132
# K and V are read once a call: first out of L2.
EVICTION = "evict_first"

# Triton 3.6's interpreter multiplies bfloat16 tiles wrongly in tl.dot; under
# it the kernel rounds P to the input dtype as on the GPU, then multiplies
# in float32.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _stamp(STAMPS, program, k: tl.constexpr):
    """Writes the global timer (ns) to ``STAMPS[program, k]`` and, with the
    first, the SM this program runs on to ``STAMPS[program, 4]``."""
    now = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(STAMPS + program * 5 + k, now)
    if k == 0:
        sm = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
        )
        tl.store(STAMPS + program * 5 + 4, sm.to(tl.int64))


@triton.jit
def fold_tile(q, k, v, keep, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    """Folds one tile of keys `k` and values `v` (rows of tokens) into an
    online softmax over base 2 in float32: running max `m_i`, sum `l_i` and
    output `acc` for the query rows of `q`. `keep` (broadcast to [rows,
    columns]) masks the scores. P is rounded to the values' dtype before
    P @ V, as on the GPU also under the interpreter (`DOT_FP32`: there bf16
    tiles multiply wrongly, so both dots run in float32). The decode and
    prefill kernels share it."""
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _start_group(
    Q, b, kvh, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """A program's query rows (the KV head's group, padded to `BLOCK_G`)
    and its empty online-softmax state."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    return q, heads, gmask, d, m_i, l_i, acc


@triton.jit
def _write_split(
    acc, m_i, l_i, b, split, heads, gmask, d, O_PART, LSE_PART, OUT, stride_ob, stride_oh,
    stride_os, stride_lb, stride_lh, stride_outb, stride_outh, ONE_SPLIT: tl.constexpr,
):  # fmt: skip
    """A split's end: with one split the output itself; otherwise its
    normalised partial and its log-sum-exp (-inf when it saw nothing, so
    the merge needs no range of its own)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if ONE_SPLIT:
        tl.store(
            OUT + b * stride_outb + heads[:, None] * stride_outh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=gmask[:, None],
        )
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(
            O_PART + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
            out,
            mask=gmask[:, None],
        )
        tl.store(LSE_PART + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)


# `splits` is a value, not a constant, and never specialised, so that every
# batch bucket of an engine (each its own split count) runs one compiled
# kernel: a cold boot compiled seven before (2026-12-03, issue 25).
@triton.jit(do_not_specialize=["splits"])
def _split_kernel(
    Q,
    KV,
    TABLES,
    POS,
    O_PART,
    LSE_PART,
    OUT,
    STAMPS,
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
    stride_outb,
    stride_outh,
    window,
    qk_scale,
    splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVICT: tl.constexpr,
    STAMP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    program = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
    if STAMP:
        _stamp(STAMPS, program, 0)
    ctx = tl.load(POS + b).to(tl.int64) + 1
    lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    # This split's part of the live range, whole tiles; the last may be short
    # and trailing ones empty.
    per = tl.cdiv(tl.cdiv(ctx - lo, splits), TILE) * TILE
    start = lo + split * per
    end = tl.minimum(start + per, ctx)
    n_tiles = tl.cdiv(tl.maximum(end - start, 0), TILE)
    c = tl.arange(0, TILE)
    q, heads, gmask, d, m_i, l_i, acc = _start_group(
        Q, b, kvh, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM
    )
    head_base = kvh.to(tl.int64) * stride_kvh
    table = TABLES + b * stride_tb
    if STAMP:
        _stamp(STAMPS, program, 1)
    for i in range(0, n_tiles):
        t = start + i * TILE + c
        valid = t < end
        block = tl.load(table + t // BLOCK_SIZE, mask=valid, other=-1)
        valid = valid & (block >= 0)
        offs = block.to(tl.int64) * stride_kvb + head_base + (t % BLOCK_SIZE) * stride_kvt
        k = tl.load(
            KV + offs[:, None] + d[None, :],
            mask=valid[:, None],
            other=0.0,
            eviction_policy=EVICT,
        )
        v = tl.load(
            KV + stride_kvkv + offs[:, None] + d[None, :],
            mask=valid[:, None],
            other=0.0,
            eviction_policy=EVICT,
        )
        m_i, l_i, acc = fold_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32)
    if STAMP:
        _stamp(STAMPS, program, 2)
    _write_split(
        acc, m_i, l_i, b, split, heads, gmask, d, O_PART, LSE_PART, OUT, stride_ob, stride_oh,
        stride_os, stride_lb, stride_lh, stride_outb, stride_outh, ONE_SPLIT,
    )  # fmt: skip
    if STAMP:
        _stamp(STAMPS, program, 3)


@triton.jit(do_not_specialize=["splits"])
def _tma_split_kernel(
    Q,
    KV_DESC,
    TABLES,
    POS,
    O_PART,
    LSE_PART,
    OUT,
    stride_qb,
    stride_qh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    layer,
    n_layers,
    window,
    qk_scale,
    splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGES: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """`_split_kernel` with K and V read by the tensor memory accelerator:
    one descriptor over the pool as rows of ``kv_heads x head_dim`` (a row a
    (block, layer, K|V, token)), each page of a KV head one ``[BLOCK_SIZE,
    HEAD_DIM]`` box at row ``((block x n_layers + layer) x 2 + K|V) x
    BLOCK_SIZE``. A split is whole pages (``PAGES`` an iteration); tokens
    outside the live range or in a hole are masked, their V zeroed."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(POS + b).to(tl.int32) + 1
    lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    first = lo // BLOCK_SIZE
    total = (ctx - 1) // BLOCK_SIZE + 1 - first
    per = tl.cdiv(tl.cdiv(total, splits), PAGES) * PAGES
    start = first + split * per
    end = tl.minimum(start + per, first + total)
    n_iter = tl.cdiv(tl.maximum(end - start, 0), PAGES)
    c = tl.arange(0, BLOCK_SIZE)
    q, heads, gmask, d, m_i, l_i, acc = _start_group(
        Q, b, kvh, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM
    )
    table = TABLES + b * stride_tb
    column = kvh * HEAD_DIM
    for i in range(0, n_iter):
        for j in tl.static_range(PAGES):
            page = start + i * PAGES + j
            inside = page < end
            block = tl.load(table + page, mask=inside, other=-1)
            row = ((tl.maximum(block, 0) * n_layers + layer) * 2) * BLOCK_SIZE
            t = page * BLOCK_SIZE + c
            valid = inside & (block >= 0) & (t >= lo) & (t < ctx)
            k = KV_DESC.load([row, column])
            v = KV_DESC.load([row + BLOCK_SIZE, column])
            v = tl.where(valid[:, None], v, tl.zeros_like(v))
            m_i, l_i, acc = fold_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32)
    _write_split(
        acc, m_i, l_i, b, split, heads, gmask, d, O_PART, LSE_PART, OUT, stride_ob, stride_oh,
        stride_os, stride_lb, stride_lh, stride_outb, stride_outh, ONE_SPLIT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(
    O_PART,
    LSE_PART,
    OUT,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        LSE_PART + b * stride_lb + h * stride_lh + s, mask=s < splits, other=float("-inf")
    )
    live = lse > float("-inf")
    w = tl.where(live, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(
        O_PART + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    total = tl.sum(w, 0)
    # A sequence with nothing to attend to (every block a hole) reads 0, as
    # with one split.
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + b * stride_outb + h * stride_outh + d, out.to(OUT.dtype.element_ty))


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(batch: int, kv_heads: int, width: int, block_size: int, sms: int) -> int:
    """Splits a sequence is cut into by default: the fewest that give at least
    `PROGRAMS_PER_SM` programs an SM over `sms` SMs, at most `MAX_SPLITS`, and
    none so many that a split of the table's full width (`width` blocks of
    `block_size` tokens) is under `MIN_SPLIT_TOKENS`."""
    pairs = max(1, batch * kv_heads)
    wanted = -(-(PROGRAMS_PER_SM * sms) // pairs)
    longest = max(1, (width * block_size) // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, MAX_SPLITS, longest))


def launch_defaults(programs: int, sms: int) -> tuple[int, int, int]:
    """(tile, warps, stages) for a grid of `programs` over `sms` SMs."""
    return MANY_PROGRAMS if programs >= MANY_PROGRAMS_PER_SM * sms else FEW_PROGRAMS


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    splits: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    stamps: torch.Tensor | None = None,
    loads: str = "pointer",
) -> torch.Tensor:
    """Paged decode attention; see the module doc. Returns ``[B, heads,
    head_dim]`` in q's dtype. ``splits``: parts each sequence's live key
    range is cut into (`choose_splits` by default); ``tile``, ``num_warps``,
    ``num_stages``: the launch (`launch_defaults` by default). ``stamps``
    (GPU only, for probes): an int64 ``[programs, 5]`` tensor that each
    program of the split kernel fills with the global timer (ns) at its
    start, before its loop, after it and at its end, then its SM.
    ``loads="tma"`` (a probe, issue 25): K and V read by the tensor memory
    accelerator, a page a box (`_tma_split_kernel`); the pool must be
    contiguous, ``tile`` is then a whole number of pages, and ``stamps``
    is not taken. On the H200 it is the slower (69.4 against the pointer
    loads' 68.7 µs at batch 64 x 1 k, 2026-12-05, issue 25): the engine never asks
    for it."""
    batch, heads, head_dim = q.shape
    _, _, _, block_size, kv_heads, kv_dim = kv.shape
    width = block_tables.shape[1]
    if kv_dim != head_dim or heads % kv_heads or q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)} and kv {tuple(kv.shape)} do not fit "
            "(head_dim equal, heads a multiple of kv_heads, last dims contiguous)"
        )
    for name, value in (("splits", splits), ("tile", tile)):
        if value is not None and value < 1:
            raise InvalidArgument(
                f"paged_decode: {name} must be at least 1 (got {value}); leave it None for "
                "the default"
            )
    if splits is not None and splits > MAX_SPLITS:
        raise InvalidArgument(
            f"paged_decode: splits must be at most MAX_SPLITS = {MAX_SPLITS} (got {splits})"
        )
    group = heads // kv_heads
    sms = _sm_count(q.device.index or 0) if q.is_cuda else INTERPRETER_SMS
    splits = splits or choose_splits(batch, kv_heads, width, block_size, sms)
    d_tile, d_warps, d_stages = launch_defaults(batch * kv_heads * splits, sms)
    tile = max(16, triton.next_power_of_2(tile or d_tile))
    out = torch.empty_like(q)
    if splits > 1:
        o_part = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        # Room for MAX_SPLITS a row whatever `splits`: the strides, which
        # Triton specialises on, stay the same across batch buckets.
        lse_part = torch.empty(batch, heads, MAX_SPLITS, dtype=torch.float32, device=q.device)
    else:
        # Not written: the program stores the output itself.
        o_part = lse_part = out
    # Where the programs write: the partials' and the output's strides.
    results = (*o_part.stride()[:3], *lse_part.stride()[:2], *out.stride()[:2])
    programs = batch * kv_heads * splits
    if stamps is not None and (stamps.shape != (programs, 5) or stamps.dtype != torch.int64):
        raise InvalidArgument(
            f"paged_decode: stamps must be an int64 tensor of shape ({programs}, 5), one row a "
            f"program (got {stamps.dtype} {tuple(stamps.shape)})"
        )
    has_window = window is not None
    if loads not in ("pointer", "tma"):
        raise InvalidArgument(f'paged_decode: loads must be "pointer" or "tma" (got {loads!r})')
    # What both split kernels take: the group's shape, the split count's
    # form, the launch.
    launch = dict(
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        ONE_SPLIT=splits == 1,
        HAS_WINDOW=has_window,
        DOT_FP32=_INTERPRETING,
        num_warps=num_warps or d_warps,
        num_stages=num_stages or d_stages,
    )
    if loads == "tma":
        if not kv.is_contiguous() or stamps is not None:
            raise InvalidArgument(
                "paged_decode: loads='tma' reads a contiguous pool (one descriptor over it) "
                "and takes no stamps; use loads='pointer' here"
            )
        from triton.tools.tensor_descriptor import TensorDescriptor

        rows = kv.shape[0] * kv.shape[1] * 2 * block_size
        desc = TensorDescriptor.from_tensor(
            kv.view(rows, kv_heads * head_dim), [block_size, head_dim]
        )
        _tma_split_kernel[(batch, kv_heads, splits)](
            q,
            desc,
            block_tables,
            positions,
            o_part,
            lse_part,
            out,
            q.stride(0),
            q.stride(1),
            block_tables.stride(0),
            *results,
            layer,
            kv.shape[1],
            window if has_window else 0,
            scale * LOG2E,
            splits,
            PAGES=max(1, tile // block_size),
            **launch,
        )
    else:
        pages = kv[:, layer]  # [num_blocks, 2, block_size, kv_heads, head_dim], a view
        _split_kernel[(batch, kv_heads, splits)](
            q,
            pages,
            block_tables,
            positions,
            o_part,
            lse_part,
            out,
            out if stamps is None else stamps,
            q.stride(0),
            q.stride(1),
            pages.stride(0),
            pages.stride(1),
            pages.stride(2),
            pages.stride(3),
            block_tables.stride(0),
            *results,
            window if has_window else 0,
            scale * LOG2E,
            splits,
            TILE=tile,
            EVICT=EVICTION,
            STAMP=stamps is not None,
            **launch,
        )
    if splits > 1:
        _merge_kernel[(batch, heads)](
            o_part,
            lse_part,
            out,
            *results,
            splits,
            HEAD_DIM=head_dim,
            BLOCK_S=MAX_SPLITS,
            num_warps=4,
        )
    return out
