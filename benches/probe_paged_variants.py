"""Variants of the paged decode kernel against the engine's (issue 25; GPU)

At batch 64 x 1 k the engine's kernel (one split a sequence, 32-token tiles
pipelined 5 deep, 2 warps: 38.4 KiB of shared memory and 128 registers, so
its 512 programs are one wave) streams at the plain read's rate but loses
~8.5 us a call to its ramp and drain (83 % of the HBM peak; shapes with
twice the bytes reach 87-88 %). This probe times, in one process and on the
same pages, the engine's kernel beside three variants:

* ``early``: one KV head a program, as the engine's, its first tile's loads
  issued before the position is known (bounded by the table's width, V past
  the context zeroed), so the ramp waits on the table alone;

and two with half the programs, each covering two KV heads, twice as long:

* ``side``: the two heads' rows side by side in every tile (a token's two
  heads are adjacent in the pool: one 512-byte run), each query row scoring
  every column and keeping its own head's; one straight pipelined loop;
* ``seq``: the two heads one after another in one flat loop, the softmax
  restarted at the second head's first tile and the output stored under a
  mask every iteration (no branch in the loop: session 22's first try, a
  store inside an ``if``, took 116 us).

One split, no window: what the probe needs, not what the engine would.

    python benches/probe_paged_variants.py [--batch 64] [--ctx 1024]
        [--configs TILE:WARPS:STAGES,...] [--json out.json]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_json import write_json
from bench_paged_attention import graph_time_us
from sweep_paged_kernel import paged_case

from imp_mem.engine.model import _paged_kernel as pk


@triton.jit
def _tile_kv(KV, table, t, in_range, head_base, d, stride_kvb, stride_kvkv, stride_kvt,
             BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """K and V of tokens `t` (where `in_range` and not in a hole; 0 elsewhere)
    and that mask; `head_base` may differ by token."""
    block = tl.load(table + t // BLOCK_SIZE, mask=in_range, other=-1)
    valid = in_range & (block >= 0)
    offs = block.to(tl.int64) * stride_kvb + head_base + (t % BLOCK_SIZE) * stride_kvt
    k = tl.load(KV + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    v = tl.load(KV + stride_kvkv + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    return k, v, valid


@triton.jit
def _side_kernel(
    Q, KV, TABLES, POS, OUT,
    stride_qb, stride_qh, stride_kvb, stride_kvkv, stride_kvt, stride_kvh, stride_tb,
    stride_outb, stride_outh, qk_scale, width,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    # Rows: GROUP query heads of KV head kvh0, then GROUP of kvh0 + 1, then
    # padding. Columns: TILE tokens x 2 heads, a token's two heads adjacent.
    b = tl.program_id(0)
    kvh0 = tl.program_id(1) * 2
    ctx = tl.load(POS + b).to(tl.int64) + 1
    n_tiles = tl.cdiv(ctx, TILE)
    r = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, 2 * TILE)
    rmask = r < 2 * GROUP
    heads = kvh0 * GROUP + r
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=rmask[:, None], other=0.0
    )
    col_head = c % 2
    mine = (r // GROUP)[:, None] == col_head[None, :]
    head_base = (kvh0 + col_head).to(tl.int64) * stride_kvh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = TABLES + b * stride_tb
    for i in range(0, n_tiles):
        t = i * TILE + c // 2
        k, v, valid = _tile_kv(KV, table, t, t < ctx, head_base, d, stride_kvb, stride_kvkv,
                               stride_kvt, BLOCK_SIZE)  # fmt: skip
        m_i, l_i, acc = pk.fold_tile(
            q, k, v, mine & valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        OUT + b * stride_outb + heads[:, None] * stride_outh + d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=rmask[:, None],
    )


@triton.jit
def _seq_kernel(
    Q, KV, TABLES, POS, OUT,
    stride_qb, stride_qh, stride_kvb, stride_kvkv, stride_kvt, stride_kvh, stride_tb,
    stride_outb, stride_outh, qk_scale, width,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh0 = tl.program_id(1) * 2
    ctx = tl.load(POS + b).to(tl.int64) + 1
    n_tiles = tl.cdiv(ctx, TILE)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, TILE)
    gmask = g < GROUP
    q0 = tl.load(Q + b * stride_qb + (kvh0 * GROUP + g)[:, None] * stride_qh + d[None, :],
                 mask=gmask[:, None], other=0.0)  # fmt: skip
    q1 = tl.load(Q + b * stride_qb + ((kvh0 + 1) * GROUP + g)[:, None] * stride_qh + d[None, :],
                 mask=gmask[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = TABLES + b * stride_tb
    for i in range(0, 2 * n_tiles):
        second = i >= n_tiles
        j = tl.where(second, i - n_tiles, i)
        fresh = j == 0
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        q = tl.where(second, q1, q0)
        kvh = kvh0 + second.to(tl.int32)
        t = j * TILE + c
        k, v, valid = _tile_kv(KV, table, t, t < ctx, kvh.to(tl.int64) * stride_kvh, d,
                               stride_kvb, stride_kvkv, stride_kvt, BLOCK_SIZE)  # fmt: skip
        m_i, l_i, acc = pk.fold_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32)
        # The head's last tile: its output, under a mask (no branch).
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            OUT + b * stride_outb + (kvh * GROUP + g)[:, None] * stride_outh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=(gmask & (g * 0 + j == n_tiles - 1))[:, None],
        )


@triton.jit
def _early_kernel(
    Q, KV, TABLES, POS, OUT,
    stride_qb, stride_qh, stride_kvb, stride_kvkv, stride_kvt, stride_kvh, stride_tb,
    stride_outb, stride_outh, qk_scale, width,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    # One KV head a program, as the engine's kernel, but the first tile's
    # loads go out before the position is known: bounded by the table's
    # width, not the context, so they wait on the table alone; V past the
    # context (a block's unwritten slots: any bits) is zeroed before P @ V.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, TILE)
    gmask = g < GROUP
    table = TABLES + b * stride_tb
    head_base = kvh.to(tl.int64) * stride_kvh
    k, v, loaded = _tile_kv(KV, table, c, c // BLOCK_SIZE < width, head_base, d, stride_kvb,
                            stride_kvkv, stride_kvt, BLOCK_SIZE)  # fmt: skip
    heads = kvh * GROUP + g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0
    )
    ctx = tl.load(POS + b).to(tl.int64) + 1
    valid = (c < ctx) & loaded
    v = tl.where(valid[:, None], v, 0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m_i, l_i, acc = pk.fold_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32)
    for i in range(1, tl.cdiv(ctx, TILE)):
        t = i * TILE + c
        k, v, valid = _tile_kv(KV, table, t, t < ctx, head_base, d, stride_kvb, stride_kvkv,
                               stride_kvt, BLOCK_SIZE)  # fmt: skip
        m_i, l_i, acc = pk.fold_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        OUT + b * stride_outb + heads[:, None] * stride_outh + d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=gmask[:, None],
    )


def two_heads(kernel, q, kv, layer, tables, pos, *, scale, tile, warps, stages):
    """`kernel` over ``(batch, kv_heads / 2)`` programs (``_early_kernel``:
    ``kv_heads``); one split, no window."""
    batch, heads, head_dim = q.shape
    kv_heads = kv.shape[4]
    group = heads // kv_heads
    out = torch.empty_like(q)
    pages = kv[:, layer]
    rows = 2 * group if kernel is _side_kernel else group
    per = 1 if kernel is _early_kernel else 2
    kernel[(batch, kv_heads // per)](
        q, pages, tables, pos, out,
        q.stride(0), q.stride(1), pages.stride(0), pages.stride(1), pages.stride(2),
        pages.stride(3), tables.stride(0), out.stride(0), out.stride(1), scale * pk.LOG2E,
        tables.shape[1],
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(rows)), HEAD_DIM=head_dim,
        BLOCK_SIZE=kv.shape[3], TILE=tile, DOT_FP32=pk._INTERPRETING, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument(
        "--configs",
        default="32:2:5,16:2:5,16:4:5,16:2:4,32:4:4,32:2:3,16:1:4",
        help="TILE:WARPS:STAGES for the variants (side's tile is tokens; 2 heads each)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    batch, ctx, d = args.batch, args.ctx, 128
    pool, tables, q, pos = paged_case(batch, ctx)
    nbytes = batch * (ctx + 1) * pool.shape[4] * d * 2 * 2
    peak = args.peak_tbs * 1e12
    scale = d**-0.5

    def engine():
        return pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=scale)

    ref = engine()
    rows = [{"variant": "engine", "us": graph_time_us(engine, 10, 20)}]
    print(f"batch {batch} ctx {ctx}: {nbytes / 1e6:.1f} MB a call", flush=True)
    variants = ((_early_kernel, "early"), (_side_kernel, "side"), (_seq_kernel, "seq"))
    for kernel, name in variants:
        for cfg in args.configs.split(","):
            tile, warps, stages = (int(x) for x in cfg.split(":"))
            kw = dict(scale=scale, tile=tile, warps=warps, stages=stages)

            def fn(kernel=kernel, kw=kw):
                return two_heads(kernel, q, pool, 0, tables, pos, **kw)

            try:
                err = (fn().float() - ref.float()).abs().max().item()
                us = graph_time_us(fn, 10, 20)
            except Exception as e:  # a configuration that does not compile or fit
                print(f"skip {name} {cfg}: {type(e).__name__} {str(e)[:160]}", flush=True)
                continue
            rows.append({"variant": name, "config": cfg, "us": us, "max_err": err})
            print(f"{name:6s} {cfg:8s} {us:7.1f} us  err {err:.1e}", flush=True)
    for r in rows:
        r["fraction"] = nbytes / (r["us"] * 1e-6) / peak
    rows.sort(key=lambda r: r["us"])
    for r in rows:
        print(f"{r['fraction'] * 100:5.1f} %  {r['us']:7.1f} us  {r['variant']} "
              f"{r.get('config', '')}")  # fmt: skip
    engine_row = next(r for r in rows if r["variant"] == "engine")
    print(f"SUMMARY engine {engine_row['us']:.1f} us ({engine_row['fraction'] * 100:.1f} %); "
          f"best {rows[0]['variant']} {rows[0].get('config', '')} {rows[0]['us']:.1f} us "
          f"({rows[0]['fraction'] * 100:.1f} %)")  # fmt: skip
    write_json(args.json, {"rows": rows, "bytes": nbytes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
