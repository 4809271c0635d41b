"""Times the paged decode kernel's launch configurations at one shape
(batch, context, Qwen3-8B's heads) and prints them best first, as
fractions of the HBM peak: the data behind `_paged_kernel`'s defaults.

Usage: ``python benches/sweep_paged_kernel.py [--batch 64] [--ctx 1024]``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics


def main(argv=None) -> int:
    import torch

    from imp_mem.engine.model import _paged_kernel as pk

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--splits", default="4,8,16,32", help="split_blocks values swept")
    ap.add_argument("--tiles", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--early-v", default="0,1", help="0: V loaded after the scores, 1: with K")
    ap.add_argument(
        "--head-fast", default="0,1", help="1: a sequence's KV heads in consecutive programs"
    )
    ap.add_argument(
        "--heads-per-program",
        default="1,2,4,8",
        help="KV heads one program reads side by side (contiguous rows), each value swept",
    )
    args = ap.parse_args(argv)
    batch, ctx, bs = args.batch, args.ctx, args.block_size
    kv_heads, heads, d = 8, 32, 128
    width = -(-(ctx + 1) // bs)
    n = batch * width + 1
    pool = torch.randn(n, 1, 2, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    order = list(range(1, n))
    random.Random(1).shuffle(order)
    tables = torch.tensor(
        [order[r * width : (r + 1) * width] for r in range(batch)], dtype=torch.int32, device="cuda"
    )
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    pos = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    nbytes = batch * (ctx + 1) * kv_heads * d * 2 * 2
    ref = pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=d**-0.5)
    rows = []

    def ints(arg: str) -> list[int]:
        return [int(x) for x in arg.split(",") if x]

    a = args
    axes = (a.splits, a.tiles, a.warps, a.stages, a.early_v, a.head_fast, a.heads_per_program)

    configs = [
        dict(
            split_blocks=split,
            tile=tile,
            num_warps=warps,
            num_stages=stages,
            early_v=bool(early),
            head_fast=bool(fast),
            heads_per_program=per,
        )
        for split, tile, warps, stages, early, fast, per in itertools.product(*map(ints, axes))
        # A multi-head program loads V with K and has no grid order to choose.
        if tile <= split * bs and not (per > 1 and (fast or not early))
    ]
    for kw in configs:
        try:
            out = pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=d**-0.5, **kw)
            torch.cuda.synchronize()
        except Exception as e:  # a configuration that does not compile
            print("skip", kw, type(e).__name__)
            continue
        assert (out.float() - ref.float()).abs().max().item() < 2e-2
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=d**-0.5, **kw)
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / 10)
        t = statistics.median(times)
        rows.append((nbytes / t / (args.peak_tbs * 1e12), t, kw))
        del g
    rows.sort(key=lambda r: -r[0])
    print(f"batch {batch} ctx {ctx}: {nbytes / 1e6:.1f} MB a call")
    for frac, t, kw in rows[: args.top]:
        print(f"{frac * 100:5.1f} %  {t * 1e6:7.1f} us  {kw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
