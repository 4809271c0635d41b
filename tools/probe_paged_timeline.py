"""Where a paged decode call's time goes, program by program (issue 25; GPU)

At batch 64 x 1 k the engine's kernel streams at the plain read's rate but
loses ~7 us a call that longer calls do not (83 % of the HBM peak; shapes
with twice the bytes reach 87-88 %). A variant of 2026-12-03 tried to shorten the
ramp inside the kernel; on 2026-12-04 a run hid the launch behind the kernel before
(programmatic dependent launch): neither helped. This probe looks instead:
each program of the engine's kernel stamps the global timer at its start,
before its loop, after it and at its end, with its SM (``paged_decode``'s
``stamps``), and the probe reports, over one call:

* the span (first start to last end) beside the call's graph-timed length;
* the ramp (start to loop), loop and epilogue lengths, as percentiles;
* the spread of the starts and of the ends (the drain), and how long fewer
  than 90 % / 50 % of the programs were still in their loop;
* programs per SM, and the end of the busiest SMs against the others'.

    python tools/probe_paged_timeline.py [--batch 64] [--ctx 1024]
        [--splits N] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The benchmarks this tool borrows from live in benches/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import torch
from bench_json import write_json
from bench_paged_attention import graph_time_us
from sweep_paged_kernel import paged_case

from imp_mem.engine.kernels import paged as pk


def _pct(x: torch.Tensor, qs=(0.0, 0.5, 0.9, 1.0)) -> list[float]:
    return [round(float(torch.quantile(x, q)), 2) for q in qs]


def timeline(stamps: torch.Tensor) -> dict:
    """The summary of one call's `stamps` (``[programs, 5]``, ns), times in us
    from the first start."""
    t = (stamps[:, :4] - stamps[:, 0].min()).double() / 1e3
    start, ready, looped, end = t.unbind(1)
    sm = stamps[:, 4]
    span = float(end.max())
    # How long the loop phase had fewer than 90 % / 50 % of the programs in it
    # after the first had entered it.
    edges = torch.linspace(float(ready.min()), span, 2001, dtype=torch.float64)
    inside = ((ready[None, :] <= edges[:, None]) & (looped[None, :] > edges[:, None])).sum(1)
    step = float(edges[1] - edges[0])
    n = stamps.shape[0]
    below = {f"below_{p}": round(float((inside < p / 100 * n).sum()) * step, 2) for p in (90, 50)}
    per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)
    # Is a slow program slow for its SM (the same SM's programs alike) or for
    # itself? The spread of the SMs' mean loop against the spread within SMs.
    loop = looped - ready
    sm_mean = torch.zeros(len(per_sm), dtype=torch.float64).index_add_(0, sm, loop)
    sm_mean = sm_mean / per_sm.clamp(min=1)
    within = loop - sm_mean[sm]
    counts = sorted({int(c) for c in per_sm[per_sm > 0]})
    ends = {
        c: round(
            float(torch.stack([end[sm == s].max() for s in torch.nonzero(per_sm == c)]).max()), 2
        )
        for c in counts
    }
    return {
        "span_us": round(span, 2),
        "start_us": _pct(start),
        "ramp_us": _pct(ready - start),
        "loop_us": _pct(looped - ready),
        "epilogue_us": _pct(end - looped),
        "end_us": _pct(end),
        **below,
        "loop_sd_across_sms_us": round(float(sm_mean[per_sm > 0].std()), 2),
        "loop_sd_within_sms_us": round(float(within.std()), 2),
        "sms_used": int((per_sm > 0).sum()),
        "sms_by_programs": {c: int((per_sm == c).sum()) for c in counts},
        "last_end_by_programs": ends,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--splits", type=int, help="the engine's default if not given")
    ap.add_argument("--launch", help="TILE:WARPS:STAGES (the engine's default if not given)")
    ap.add_argument("--evict", help="the K/V loads' eviction policy (the engine's if not given)")
    ap.add_argument(
        "--layout",
        choices=("nhd", "hnd"),
        default="nhd",
        help="the pool's memory order: the engine's (nhd) or each block's heads apart (hnd)",
    )
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--calls", type=int, default=5, help="stamped calls; the median span is kept")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--raw", help="save the last call's stamps (torch.save) here")
    args = ap.parse_args(argv)
    batch, ctx, d = args.batch, args.ctx, 128
    if args.evict is not None:
        pk.EVICTION = args.evict
    pool, tables, q, pos = paged_case(batch, ctx, layout=args.layout)
    kv_heads = pool.shape[4]
    nbytes = batch * (ctx + 1) * kv_heads * d * 2 * 2
    scale = d**-0.5
    sms = pk._sm_count(0)
    splits = args.splits or pk.choose_splits(batch, kv_heads, tables.shape[1], pool.shape[3], sms)
    programs = batch * kv_heads * splits

    launch = {}
    if args.launch:
        values = map(int, args.launch.split(":"))
        launch = dict(zip(("tile", "num_warps", "num_stages"), values, strict=True))

    def attend(stamps=None):
        return pk.paged_decode(
            q,
            pool,
            0,
            tables,
            pos,
            window=None,
            scale=scale,
            splits=splits,
            stamps=stamps,
            **launch,
        )

    stamps = torch.zeros(programs, 5, dtype=torch.int64, device="cuda")
    ref = attend()
    err = (attend(stamps).float() - ref.float()).abs().max().item()
    plain_us = graph_time_us(attend, 10, 20)
    stamped_us = graph_time_us(lambda: attend(stamps), 10, 20)
    calls = []
    for _ in range(args.calls):
        attend(stamps)
        torch.cuda.synchronize()
        calls.append(timeline(stamps.cpu()))
    raw = stamps.cpu()
    calls.sort(key=lambda c: c["span_us"])
    summary = {
        "batch": batch,
        "ctx": ctx,
        "splits": splits,
        "launch": args.launch or "default",
        "layout": args.layout,
        "evict": pk.EVICTION,
        "programs": programs,
        "sms": sms,
        "bytes": nbytes,
        "graph_us": round(plain_us, 2),
        "graph_us_stamped": round(stamped_us, 2),
        "fraction_of_peak": round(nbytes / (plain_us * 1e-6) / (args.peak_tbs * 1e12), 4),
        "stamped_vs_plain_max_err": err,
        **calls[len(calls) // 2],
    }
    print(
        f"batch {batch} ctx {ctx}: {splits} split(s), {args.layout}, "
        f"launch {args.launch or 'default'} {pk.EVICTION or '-'}, "
        f"{programs} programs on {sms} SMs; "
        f"{plain_us:.1f} us a call graph-timed ({summary['fraction_of_peak'] * 100:.1f} % of "
        f"the peak), {stamped_us:.1f} stamped; stamped output differs by {err:.1e}"
    )
    for key, value in summary.items():
        if key.endswith("_us") or key.startswith(("below", "sms", "last", "loop")):
            print(f"  {key:22s} {value}")
    print(f"  spans of the {args.calls} calls: {[c['span_us'] for c in calls]}")
    if args.raw:
        torch.save(raw, args.raw)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
