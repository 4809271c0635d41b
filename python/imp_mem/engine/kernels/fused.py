"""Triton kernels that fuse a decoder layer's small operations (issue 25).

An unfused decode step runs about a dozen elementwise kernels a layer
between its GEMMs (RMSNorm in six, RoPE in eight, the residual adds, the
KV store's two scatters, SiLU and the multiply); each reads and writes its
operand through HBM and each costs a launch inside the graph. Three kernels
replace them:

* `add_rms_norm`: ``x += delta`` (when given) and ``h = rms_norm(x) * w``,
  one program a row;
* `qkv_norm_rope_store`: over the fused QKV projection's output, the per-head
  RMSNorm of q and k, RoPE at each token's position (cos/sin read from the
  tables at that position), q written out and k and v written straight into
  the KV pages at the token's slot, one program a (token, head);
* `silu_mul`: ``silu(gate) * up`` over the fused gate/up projection's output.

Rounding. Each kernel computes in float32 but rounds to the model dtype
wherever the unfused torch path (`model.layers`, after transformers)
rounds, operation for operation: the sum ``x + delta``; RMSNorm's
normalised value before the weight multiplies, then the product; in RoPE
each of ``x * cos``, ``rotate_half(x) * sin`` and their sum; SiLU's result
before the multiply. The two paths then differ only where float32
reductions or ``exp`` round differently (summation order, an approximate
exponential), which is below bfloat16's resolution almost always; the tests
compare them.

No state; every call allocates its outputs from the current allocator
(the engine's graph pool while capturing).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter truncates float32 -> bfloat16 where the GPU rounds
# to nearest even; under it the kernels round by hand (`_r`).
_MANUAL = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _r(x, DTYPE: tl.constexpr, MANUAL: tl.constexpr):
    """float32 `x` rounded to DTYPE (to nearest, ties to even), as float32."""
    if MANUAL and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_kernel(
    X,
    DELTA,
    W,
    X_OUT,
    H_OUT,
    stride_x,
    stride_d,
    stride_xo,
    stride_ho,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
    MANUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = H_OUT.dtype.element_ty
    xf = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        xf = _r(xf + d, dtype, MANUAL)
        tl.store(X_OUT + row * stride_xo + cols, xf.to(dtype), mask=mask)
    var = tl.sum(xf * xf, 0) / n
    r = 1.0 / tl.sqrt(var + eps)
    y = _r(xf * r, dtype, MANUAL)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = _r(w + 1.0, dtype, MANUAL)
    tl.store(H_OUT + row * stride_ho + cols, _r(w * y, dtype, MANUAL).to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta) * weight)`` for ``x[N, hidden]``
    (``(x, rms_norm(x) * weight)`` without `delta`). `unit_offset`: the
    weight is applied as ``1 + weight`` (Gemma's norm)."""
    n_rows, n = x.shape
    h = torch.empty_like(x)
    x_out = torch.empty_like(x) if delta is not None else x
    if n_rows:
        block = triton.next_power_of_2(n)
        _add_rms_kernel[(n_rows,)](
            x,
            delta if delta is not None else x,
            weight,
            x_out,
            h,
            x.stride(0),
            delta.stride(0) if delta is not None else 0,
            x_out.stride(0),
            h.stride(0),
            n,
            eps,
            HAS_DELTA=delta is not None,
            UNIT_OFFSET=unit_offset,
            BLOCK=block,
            MANUAL=_MANUAL,
            num_warps=max(1, min(16, block // 256)),
        )
    return x_out, h


@triton.jit
def _rope_half(x1, x2, cos1, cos2, sin1, sin2, DTYPE: tl.constexpr, MANUAL: tl.constexpr):
    # transformers' ``x * cos + rotate_half(x) * sin``, rounding each product
    # and the sum to the model dtype as the torch path does.
    a1 = _r(x1 * cos1, DTYPE, MANUAL)
    a2 = _r(x2 * cos2, DTYPE, MANUAL)
    b1 = _r(-x2 * sin1, DTYPE, MANUAL)
    b2 = _r(x1 * sin2, DTYPE, MANUAL)
    return _r(a1 + b1, DTYPE, MANUAL).to(DTYPE), _r(a2 + b2, DTYPE, MANUAL).to(DTYPE)


@triton.jit
def _head_norm(x1, x2, W, eps, HALF: tl.constexpr, DTYPE: tl.constexpr, MANUAL: tl.constexpr):
    i = tl.arange(0, HALF)
    var = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF)
    r = 1.0 / tl.sqrt(var + eps)
    w1 = tl.load(W + i).to(tl.float32)
    w2 = tl.load(W + HALF + i).to(tl.float32)
    y1 = _r(x1 * r, DTYPE, MANUAL)
    y2 = _r(x2 * r, DTYPE, MANUAL)
    return _r(w1 * y1, DTYPE, MANUAL), _r(w2 * y2, DTYPE, MANUAL)


@triton.jit
def _qkv_kernel(
    QKV,
    Q_NORM,
    K_NORM,
    COS,
    SIN,
    POS,
    PAGES,
    BLOCKS,
    OFFSETS,
    Q_OUT,
    stride_qkv,
    stride_cos,
    stride_pb,
    stride_pkv,
    stride_pt,
    stride_ph,
    stride_qo_t,
    stride_qo_h,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    MANUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, HALF)
    src = QKV + t * stride_qkv + head * (2 * HALF)
    dtype = Q_OUT.dtype.element_ty
    x1 = tl.load(src + i)
    x2 = tl.load(src + HALF + i)
    block = tl.load(BLOCKS + t)
    slot = PAGES + block * stride_pb + tl.load(OFFSETS + t) * stride_pt
    if head >= HEADS + KV_HEADS:
        # v: stored as it is.
        dst = slot + stride_pkv + (head - HEADS - KV_HEADS) * stride_ph
        tl.store(dst + i, x1.to(PAGES.dtype.element_ty))
        tl.store(dst + HALF + i, x2.to(PAGES.dtype.element_ty))
    else:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        pos = tl.load(POS + t).to(tl.int64)
        cos1 = tl.load(COS + pos * stride_cos + i).to(tl.float32)
        cos2 = tl.load(COS + pos * stride_cos + HALF + i).to(tl.float32)
        sin1 = tl.load(SIN + pos * stride_cos + i).to(tl.float32)
        sin2 = tl.load(SIN + pos * stride_cos + HALF + i).to(tl.float32)
        if head < HEADS:
            if HAS_NORM:
                f1, f2 = _head_norm(f1, f2, Q_NORM, eps, HALF, dtype, MANUAL)
            y1, y2 = _rope_half(f1, f2, cos1, cos2, sin1, sin2, dtype, MANUAL)
            dst = Q_OUT + t * stride_qo_t + head * stride_qo_h
            tl.store(dst + i, y1)
            tl.store(dst + HALF + i, y2)
        else:
            if HAS_NORM:
                f1, f2 = _head_norm(f1, f2, K_NORM, eps, HALF, dtype, MANUAL)
            y1, y2 = _rope_half(f1, f2, cos1, cos2, sin1, sin2, dtype, MANUAL)
            dst = slot + (head - HEADS) * stride_ph
            tl.store(dst + i, y1.to(PAGES.dtype.element_ty))
            tl.store(dst + HALF + i, y2.to(PAGES.dtype.element_ty))


def qkv_norm_rope_store(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """From ``qkv[N, (heads + 2 kv_heads) * head_dim]`` (the fused
    projection, heads in that order): q normed (when `q_norm` is given) and
    rotated, returned ``[N, heads, head_dim]``; k normed and rotated and v
    as it is, written into `pages` (one layer's ``[blocks, 2, block_size,
    kv_heads, head_dim]``) at ``(block_ids[t], offsets[t])``. `cos`/`sin`
    are the full ``[max_positions, head_dim]`` tables, read at
    ``positions[t]``."""
    n = qkv.shape[0]
    head_dim = cos.shape[-1]
    if qkv.stride(-1) != 1 or pages.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("qkv_norm_rope_store: last dimensions must be contiguous")
    q = torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n:
        _qkv_kernel[(n, heads + 2 * kv_heads)](
            qkv,
            q_norm if q_norm is not None else cos,
            k_norm if k_norm is not None else cos,
            cos,
            sin,
            positions,
            pages,
            block_ids,
            offsets,
            q,
            qkv.stride(0),
            cos.stride(0),
            pages.stride(0),
            pages.stride(1),
            pages.stride(2),
            pages.stride(3),
            q.stride(0),
            q.stride(1),
            eps,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=head_dim // 2,
            HAS_NORM=q_norm is not None,
            MANUAL=_MANUAL,
            num_warps=1,
        )
    return q


@triton.jit
def _silu_mul_kernel(
    GU, OUT, stride_gu, stride_o, inter, BLOCK: tl.constexpr, MANUAL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    s = _r(g / (1.0 + tl.exp(-g)), dtype, MANUAL)
    tl.store(OUT + row * stride_o + cols, _r(s * u, dtype, MANUAL).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up[N, 2 * inter]`` (gate first)."""
    n, two = gate_up.shape
    inter = two // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            MANUAL=_MANUAL,
            num_warps=4,
        )
    return out
