"""A paged decode kernel that balances its finish: persistent programs take
chunks of work from a queue and the last chunk of a sequence's head merges
(issue 25; GPU)

Session 23's timeline showed the engine's kernel at batch 64 x 1 k losing
its last ~7 us to the drain: 512 programs of equal work, whose loops took
53-66 us, the last ending 12.6 us after the first. Static cuts cannot even
that out (two splits drained less, but the merge launch cost more). Here
the work is cut finer than the programs: each (sequence, KV head) pair's
live range is cut into ``chunks`` parts of whole tiles; ``resident`` x SMs
programs each take the next chunk from an atomic counter until none is
left, so a program that streams fast takes more; each chunk writes its
partial output and log-sum-exp, and the program that finishes a pair's last
chunk (an atomic arrival count) merges its partials in the same launch. The
counters reset themselves (the last program out zeroes the queue), so a
call is CUDA-graph capturable with no memset.

The probe times it beside the engine's kernel on the same pages and checks
its output against the engine's.

    python benches/probe_paged_dynamic.py [--batch 64] [--ctx 1024]
        [--configs CHUNKS:RESIDENT:TILE:WARPS:STAGES,...] [--json out.json]

``RESIDENT`` 0: one program per chunk (no queue; the fused merge alone).
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
from imp_mem.engine.model._paged_kernel import fold_tile


@triton.jit
def _dynamic_kernel(
    Q,
    KV,
    TABLES,
    POS,
    O_PART,
    LSE_PART,
    OUT,
    COUNTERS,
    stride_qb,
    stride_qh,
    stride_kvb,
    stride_kvkv,
    stride_kvt,
    stride_kvh,
    stride_tb,
    stride_outb,
    stride_outh,
    qk_scale,
    kv_heads,
    n_items,
    CHUNKS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    QUEUE: tl.constexpr,
    EVICT: tl.constexpr,
):
    pairs = n_items // CHUNKS
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, TILE)
    gmask = g < GROUP
    if QUEUE:
        item = tl.atomic_add(COUNTERS, 1)
    else:
        item = tl.program_id(0)
    while item < n_items:
        # Chunk-major: the first items are every pair's first chunk.
        chunk = item // pairs
        pair = item % pairs
        b = pair // kv_heads
        kvh = pair % kv_heads
        ctx = tl.load(POS + b).to(tl.int64) + 1
        per = tl.cdiv(tl.cdiv(ctx, CHUNKS), TILE) * TILE
        start = chunk * per
        end = tl.minimum(start + per, ctx)
        n_tiles = tl.cdiv(tl.maximum(end - start, 0), TILE)
        heads = kvh * GROUP + g
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        head_base = kvh.to(tl.int64) * stride_kvh
        table = TABLES + b * stride_tb
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
            m_i, l_i, acc = fold_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, False)
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        # Partials: [pairs, CHUNKS, BLOCK_G, HEAD_DIM] and [pairs, CHUNKS, BLOCK_G].
        slot = pair.to(tl.int64) * CHUNKS + chunk
        tl.store(O_PART + (slot * BLOCK_G + g[:, None]) * HEAD_DIM + d[None, :], out)
        tl.store(LSE_PART + slot * BLOCK_G + g, lse)
        # Every thread's stores before the arrival (release), and the merge's
        # loads after it (acquire), past L1.
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNTERS + 2 + pair, 1)
        if arrived == CHUNKS - 1:
            tl.debug_barrier()
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            tot = tl.zeros([BLOCK_G], tl.float32)
            merged = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
            for s in range(CHUNKS):
                row = pair.to(tl.int64) * CHUNKS + s
                lse_s = tl.load(LSE_PART + row * BLOCK_G + g, cache_modifier=".cg")
                o_s = tl.load(
                    O_PART + (row * BLOCK_G + g[:, None]) * HEAD_DIM + d[None, :],
                    cache_modifier=".cg",
                )
                m_new = tl.maximum(m, lse_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)
                w = tl.exp2(lse_s - m_safe)
                tot = tot * alpha + w
                merged = merged * alpha[:, None] + w[:, None] * o_s
                m = m_new
            final = merged / tl.where(tot == 0.0, 1.0, tot)[:, None]
            tl.store(
                OUT + b * stride_outb + heads[:, None] * stride_outh + d[None, :],
                final.to(OUT.dtype.element_ty),
                mask=gmask[:, None],
            )
            tl.store(COUNTERS + 2 + pair, 0)
        if QUEUE:
            item = tl.atomic_add(COUNTERS, 1)
        else:
            item = n_items
    if QUEUE:
        # The last program out resets the queue for the next call.
        gone = tl.atomic_add(COUNTERS + 1, 1)
        if gone == tl.num_programs(0) - 1:
            tl.store(COUNTERS, 0)
            tl.store(COUNTERS + 1, 0)


class Dynamic:
    """The queue kernel's buffers for one shape, and its launch."""

    def __init__(self, q, pool, chunks, resident, tile, warps, stages):
        batch, heads, d = q.shape
        kv_heads = pool.shape[4]
        self.group = heads // kv_heads
        self.block_g = max(16, triton.next_power_of_2(self.group))
        pairs = batch * kv_heads
        self.items = pairs * chunks
        sms = pk._sm_count(0)
        self.programs = self.items if resident == 0 else min(self.items, resident * sms)
        self.o_part = torch.empty(
            pairs, chunks, self.block_g, d, dtype=torch.float32, device="cuda"
        )
        self.lse = torch.empty(pairs, chunks, self.block_g, dtype=torch.float32, device="cuda")
        self.counters = torch.zeros(2 + pairs, dtype=torch.int32, device="cuda")
        self.chunks, self.resident = chunks, resident
        self.launch = (tile, warps, stages)
        self.kv_heads = kv_heads

    def __call__(self, q, pool, tables, pos, scale, out):
        tile, warps, stages = self.launch
        pages = pool[:, 0]
        _dynamic_kernel[(self.programs,)](
            q,
            pages,
            tables,
            pos,
            self.o_part,
            self.lse,
            out,
            self.counters,
            q.stride(0),
            q.stride(1),
            pages.stride(0),
            pages.stride(1),
            pages.stride(2),
            pages.stride(3),
            tables.stride(0),
            out.stride(0),
            out.stride(1),
            scale * pk.LOG2E,
            self.kv_heads,
            self.items,
            CHUNKS=self.chunks,
            GROUP=self.group,
            BLOCK_G=self.block_g,
            HEAD_DIM=q.shape[2],
            BLOCK_SIZE=pool.shape[3],
            TILE=tile,
            QUEUE=self.resident > 0,
            EVICT=pk.EVICTION,
            num_warps=warps,
            num_stages=stages,
        )
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument(
        "--configs",
        default="2:4:32:2:5,4:4:32:2:5,4:5:32:2:5,8:4:32:2:5,8:5:32:2:5,2:0:32:2:5,4:4:16:2:4",
        help="CHUNKS:RESIDENT:TILE:WARPS:STAGES, comma separated",
    )
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    batch, ctx, d = args.batch, args.ctx, 128
    pool, tables, q, pos = paged_case(batch, ctx)
    kv_heads = pool.shape[4]
    nbytes = batch * (ctx + 1) * kv_heads * d * 2 * 2
    scale = d**-0.5

    def engine():
        return pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=scale)

    ref = engine().float()

    def frac(us):
        return nbytes / (us * 1e-6) / (args.peak_tbs * 1e12)

    rows = []
    base = graph_time_us(engine, 10, 20)
    rows.append({"config": "engine", "us": round(base, 2), "fraction": round(frac(base), 4)})
    print(f"batch {batch} ctx {ctx}: engine {base:.1f} us ({frac(base) * 100:.1f} %)")
    for spec in args.configs.split(","):
        chunks, resident, tile, warps, stages = map(int, spec.split(":"))
        kernel = Dynamic(q, pool, chunks, resident, tile, warps, stages)
        out = torch.empty_like(q)
        err = float("nan")
        try:
            for _ in range(3):  # the counters must come back to zero each call
                out.zero_()
                kernel(q, pool, tables, pos, scale, out)
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
                if err > 2e-2:
                    break
            us = graph_time_us(lambda k=kernel, o=out: k(q, pool, tables, pos, scale, o), 10, 20)
            left = kernel.counters.abs().sum().item()
        except Exception as exc:  # a config that does not compile or launch
            print(f"  {spec}: failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        row = {
            "config": spec,
            "programs": kernel.programs,
            "items": kernel.items,
            "us": round(us, 2),
            "fraction": round(frac(us), 4),
            "vs_engine": round(base / us, 4),
            "max_err": err,
            "counters_left": left,
        }
        rows.append(row)
        print(
            f"  {spec:14s} {kernel.programs:5d} programs {kernel.items:5d} items: {us:6.1f} us "
            f"({frac(us) * 100:.1f} %, {base / us:.3f}x the engine's) err {err:.1e} "
            f"counters left {left}"
        )
    base2 = graph_time_us(engine, 10, 20)
    print(f"engine again {base2:.1f} us ({frac(base2) * 100:.1f} %)")
    rows.append(
        {"config": "engine_again", "us": round(base2, 2), "fraction": round(frac(base2), 4)}
    )
    write_json(args.json, {"batch": batch, "ctx": ctx, "bytes": nbytes, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
