"""What the H200 reads at best, beside what the paged decode kernel reads
(issue 25; GPU).

The issue's goal for paged attention is a fraction of the HBM peak
(4.8 TB/s). This probe measures, in one process and on the same bytes
(the KV of Qwen3-8B's heads, ``batch`` sequences of ``ctx`` tokens in
16-token pages, bf16):

* the best a plain streaming read reaches: a Triton kernel that sums the
  pool's bytes in order (a few launch shapes, the best kept), and torch's
  own ``sum`` and ``copy_`` (a copy moves each byte twice);
* the paged kernel whole (split + merge, in a CUDA graph, as the engine
  replays it), with its pages shuffled and in order;
* its two kernels apart (torch's profiler, eager launches): the split pass
  and the merge of the partials.

Each time is a call's mean over 20 replays of a graph of 10 calls. Printed: µs
and TB/s for each, as a fraction of the peak and of the best plain read.

    python benches/probe_paged_bandwidth.py [--batch 64] [--ctx 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics

from bench_json import write_json


def graph_time(fn, calls: int = 10, replays: int = 20) -> float:
    """Seconds a call, from ``bench_paged_attention``'s graph timer (the
    session-21 log's figures took the median of 10 replays instead of the
    mean of 20)."""
    from bench_paged_attention import graph_time_us

    return graph_time_us(fn, calls, replays) * 1e-6


def main(argv=None) -> int:
    import torch
    import triton
    import triton.language as tl

    from imp_mem.engine.kernels import paged as pk

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    @triton.jit
    def _read_kernel(X, OUT, n, BLOCK: tl.constexpr, PER: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.float32)
        base = pid.to(tl.int64) * BLOCK * PER
        for i in range(PER):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(OUT + pid, tl.sum(acc, 0))

    batch, ctx, bs, kv_heads, heads, d = args.batch, args.ctx, 16, 8, 32, 128
    width = -(-(ctx + 1) // bs)
    n_blocks = batch * width + 1
    pool = torch.randn(n_blocks, 1, 2, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    flat = pool.view(-1)
    nbytes_pool = flat.numel() * 2
    order = list(range(1, n_blocks))
    shuffled = order[:]
    random.Random(1).shuffle(shuffled)

    def tables_of(ids):
        rows = [ids[r * width : (r + 1) * width] for r in range(batch)]
        return torch.tensor(rows, dtype=torch.int32, device="cuda")

    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    pos = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    nbytes = batch * (ctx + 1) * kv_heads * d * 2 * 2
    peak = args.peak_tbs * 1e12
    rows: dict[str, dict] = {}

    def decode(tables):
        return pk.paged_decode(q, pool, 0, tables, pos, window=None, scale=d**-0.5)

    def row(name, seconds, moved):
        rows[name] = {"us": seconds * 1e6, "tbs": moved / seconds / 1e12}
        print(f"{name:44s} {seconds * 1e6:8.1f} us  {moved / seconds / 1e12:5.2f} TB/s  "
              f"{moved / seconds / peak * 100:5.1f} % of the peak")  # fmt: skip

    mb = nbytes / 1e6
    print(f"batch {batch} ctx {ctx}: {mb:.1f} MB of KV a call; pool {nbytes_pool / 1e6:.1f} MB")
    best = 0.0
    for block, per, warps in (
        (1024, 8, 4),
        (2048, 8, 8),
        (4096, 4, 8),
        (8192, 2, 8),
        (2048, 16, 4),
    ):
        programs = -(-flat.numel() // (block * per))
        out = torch.empty(programs, dtype=torch.float32, device="cuda")

        def read(block=block, per=per, warps=warps, programs=programs, out=out):
            _read_kernel[(programs,)](
                flat, out, flat.numel(), BLOCK=block, PER=per, num_warps=warps
            )

        t = graph_time(read)
        row(f"plain read (Triton {block}x{per}, {warps} warps)", t, nbytes_pool)
        best = max(best, nbytes_pool / t)
    row(
        "torch sum (fp32 accumulate)",
        graph_time(lambda: flat.sum(dtype=torch.float32)),
        nbytes_pool,
    )
    dst = torch.empty_like(flat)
    row("torch copy_ (read + write)", graph_time(lambda dst=dst: dst.copy_(flat)), 2 * nbytes_pool)
    dst = None
    for name, ids in (("shuffled", shuffled), ("in order", order)):
        tables = tables_of(ids)
        t = graph_time(lambda tables=tables: decode(tables))
        row(f"paged_decode, pages {name} (split + merge)", t, nbytes)
    # The two kernels apart, from the profiler's device times (eager).
    tables = tables_of(shuffled)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        decode(tables)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            decode(tables)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and (
            "_split_kernel" in ev.name or "_merge_kernel" in ev.name
        ):
            per_kernel.setdefault(ev.name, []).append(ev.device_time_total)
    for name, us in sorted(per_kernel.items()):
        med = statistics.median(us) * 1e-6
        moved = nbytes if "_split" in name else 0
        rows[name] = {"us": med * 1e6}
        extra = f"  {moved / med / 1e12:5.2f} TB/s" if moved else ""
        print(f"{name:44s} {med * 1e6:8.1f} us (eager, device time){extra}")
    whole = rows["paged_decode, pages shuffled (split + merge)"]["tbs"] * 1e12
    print(f"SUMMARY best plain read {best / 1e12:.2f} TB/s = {best / peak * 100:.1f} % of the "
          f"peak; paged_decode {whole / peak * 100:.1f} % of the peak = "
          f"{whole / best * 100:.1f} % of the best plain read")  # fmt: skip
    write_json(args.json, {"rows": rows, "best_read_tbs": best / 1e12, "peak_tbs": args.peak_tbs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
