"""Times the paged decode kernel's launch configurations at one shape
(batch, context, Qwen3-8B's heads) and prints them best first, as
fractions of the HBM peak, beside the default: the data behind
`engine/kernels/paged.py`'s defaults (`choose_splits`, `launch_defaults`).

Usage: ``python tools/sweep_paged_kernel.py [--batch 64] [--ctx 1024]
[--splits 1,2] [--tiles 16,32] [--warps 1,2,4] [--stages 3,4,5]`` or
``--configs SPLITS:TILE:WARPS:STAGES,...`` for a list. ``--no-merge`` times
the split pass alone (its output is then wrong: not checked).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

# The benchmarks this tool borrows from live in benches/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

from bench_json import write_json
from bench_paged_attention import graph_time_us


def paged_case(
    batch: int,
    ctx: int,
    block_size: int = 16,
    kv_heads: int = 8,
    heads: int = 32,
    layout: str = "nhd",
    device: str = "cuda",
):
    """Qwen3-8B's heads over `batch` sequences of `ctx` + 1 tokens in
    shuffled pages (one layer, bf16, random): ``(pool, tables, q,
    positions)`` on `device`. The pool has the engine's shape ``[blocks, 1,
    2, block_size, kv_heads, head_dim]``; with ``layout="hnd"`` its memory
    holds each block's heads one after another (``[..., kv_heads,
    block_size, head_dim]``, FlashInfer's HND: a head's 16 tokens one 4 KiB
    run) and the pool is a transposed view of it, which the kernel reads
    through its strides."""
    import torch

    d = 128
    width = -(-(ctx + 1) // block_size)
    n = batch * width + 1
    if layout == "nhd":
        pool = torch.randn(n, 1, 2, block_size, kv_heads, d, dtype=torch.bfloat16, device=device)
    elif layout == "hnd":
        pool = torch.randn(n, 1, 2, kv_heads, block_size, d, dtype=torch.bfloat16, device=device)
        pool = pool.transpose(3, 4)
    else:
        raise ValueError(f"layout: 'nhd' or 'hnd', not {layout!r}")
    order = list(range(1, n))
    random.Random(1).shuffle(order)
    tables = torch.tensor(
        [order[r * width : (r + 1) * width] for r in range(batch)], dtype=torch.int32, device=device
    )
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device=device)
    pos = torch.full((batch,), ctx, dtype=torch.int64, device=device)
    return pool, tables, q, pos


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv=None) -> int:
    import torch

    from imp_mem.engine.kernels import paged as pk

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--tiles", default="16,32,64")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--stages", default="3,4,5")
    ap.add_argument("--configs", help="SPLITS:TILE:WARPS:STAGES,... instead of the product")
    ap.add_argument("--no-merge", action="store_true", help="time the split pass alone")
    ap.add_argument(
        "--loads",
        default="pointer",
        help="K/V loads to time, side by side: pointer (the engine's), tma (a page a "
        "descriptor box; issue 25's probe), or both: pointer,tma",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    batch, ctx, bs = args.batch, args.ctx, args.block_size
    kv_heads, d = 8, 128
    pool, tables, q, pos = paged_case(batch, ctx, bs)
    nbytes = batch * (ctx + 1) * kv_heads * d * 2 * 2
    peak = args.peak_tbs * 1e12
    ref = pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=d**-0.5)

    def ints(arg: str) -> list[int]:
        return [int(x) for x in arg.split(",") if x]

    if args.configs:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    else:
        axes = (args.splits, args.tiles, args.warps, args.stages)
        configs = list(itertools.product(*map(ints, axes)))
    if args.no_merge:
        merge, pk._merge_kernel = pk._merge_kernel, _NoLaunch()

    def decode(**kw):
        return pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=d**-0.5, **kw)

    rows = []
    base = graph_time_us(decode, 10, 20)
    kinds = [k for k in args.loads.split(",") if k]
    for (splits, tile, warps, stages), loads in itertools.product(configs, kinds):
        kw = dict(splits=splits, tile=tile, num_warps=warps, num_stages=stages, loads=loads)
        try:
            out = decode(**kw)
            torch.cuda.synchronize()
            t = graph_time_us(lambda kw=kw: decode(**kw), 10, 20)
        except Exception as e:  # a configuration that does not compile or fit
            print("skip", kw, type(e).__name__, str(e)[:160], flush=True)
            continue
        if not args.no_merge:
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 2e-2, (kw, err)
        rows.append({"us": t, "fraction": nbytes / (t * 1e-6) / peak, **kw})
    if args.no_merge:
        pk._merge_kernel = merge
    rows.sort(key=lambda r: r["us"])
    print(f"batch {batch} ctx {ctx}: {nbytes / 1e6:.1f} MB a call")
    for r in rows[: args.top]:
        print(f"{r['fraction'] * 100:5.1f} %  {r['us']:7.1f} us  splits={r['splits']} "
              f"tile={r['tile']} warps={r['num_warps']} stages={r['num_stages']} "
              f"loads={r['loads']}")  # fmt: skip
    print(f"SUMMARY default {base:.1f} us = {nbytes / (base * 1e-6) / peak * 100:.1f} % of the "
          f"peak" + (f"; best {rows[0]['us']:.1f} us" if rows else ""))  # fmt: skip
    write_json(args.json, {"rows": rows, "default_us": base, "bytes": nbytes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
