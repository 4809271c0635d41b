"""torch_memory_saver's pause/resume, three ways side by side (issue 51):
torch_memory_saver 0.0.10 itself (where importable), imp-mem's drop-in
(``imp_mem.torch_memory_saver``, the same API), and a raw pinned copy of the
same bytes (the line rate: what a pause and a resume cannot beat).

Each runs in a process of its own: ``--size`` GiB (default 16) made in a
region with a CPU backup (``hook_mode="torch"``), then pause and resume
``--rounds`` times (default 2). Printed per round: each pause and resume in
seconds and as a ratio to the raw copy (>= 1 is at least as fast), the
device memory the process still holds while paused, and the host memory it
holds (RSS growth; imp-mem's pinned figure beside it). ``retain_cpu_backup``
is on for both savers by default (the raw copy keeps its buffer too);
``--no-retain`` runs their default, where every pause pins again.
``--quick``: 256 MiB, the smoke test's size. Without a CUDA device it says so
and exits 0.

    python benches/bench_tms_dropin.py                 # 16 GiB, 2 rounds
    python benches/bench_tms_dropin.py --size 4 --no-retain
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

GIB = 1 << 30
IMPLS = ("raw", "tms-0.0.10", "imp-mem")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _used(torch: Any) -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _child(impl: str, nbytes: int, rounds: int, retain: bool) -> dict[str, Any]:
    """One implementation's run; a dict of its figures."""
    import torch

    torch.cuda.init()
    torch.cuda.synchronize()
    base_used, base_rss = _used(torch), _rss()
    out: dict[str, Any] = {"impl": impl, "bytes": nbytes, "rounds": []}
    if impl == "raw":
        dev = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out["rounds"].append(
                {
                    "pause": t1 - t0,
                    "resume": t2 - t1,
                    "device_held_paused": None,
                    "host_held_paused": _rss() - base_rss,
                }
            )
        out["ok"] = bool((dev == 7).all().item())
        return out
    if impl == "tms-0.0.10":
        import torch_memory_saver as mod

        if mod.__name__ != "torch_memory_saver" or "imp_mem" in (mod.__file__ or ""):
            raise RuntimeError(
                "torch_memory_saver resolves to imp-mem here: run without the switch"
            )
    else:
        import imp_mem.torch_memory_saver as mod
    saver = mod.torch_memory_saver
    saver.hook_mode = "torch"
    with saver.region(tag="bench", enable_cpu_backup=True):
        dev = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    if impl == "imp-mem":
        t0 = time.perf_counter()
        saver.wait_pinned()
        out["pin_ahead_wait"] = time.perf_counter() - t0
    saver.retain_cpu_backup = retain
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        saver.pause("bench")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        row = {
            "pause": t1 - t0,
            "device_held_paused": _used(torch) - base_used,
            "host_held_paused": _rss() - base_rss,
        }
        if impl == "imp-mem":
            row["pinned_paused"] = saver.mem_report()["tags"]["bench"]["host_bytes"]
        t1 = time.perf_counter()
        saver.resume("bench")
        torch.cuda.synchronize()
        row["resume"] = time.perf_counter() - t1
        row["host_held_awake"] = _rss() - base_rss
        out["rounds"].append(row)
    out["ok"] = bool((dev == 7).all().item())
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The side-by-side table of the children's figures."""
    raw = next((r for r in results if r["impl"] == "raw" and "error" not in r), None)
    lines = []
    head = (
        f"{'implementation':<12} {'round':>5} {'pause s':>9} {'x raw':>7} {'resume s':>9} "
        f"{'x raw':>7} {'dev held paused GiB':>20} {'host held paused GiB':>21} ok"
    )
    lines.append(head)
    for r in results:
        if "error" in r:
            lines.append(f"{r['impl']:<12} skipped: {r['error']}")
            continue
        for i, row in enumerate(r["rounds"]):
            ratios = []
            for op in ("pause", "resume"):
                if raw is None or i >= len(raw["rounds"]):
                    ratios.append("-")
                else:
                    ratios.append(f"{raw['rounds'][i][op] / max(row[op], 1e-9):.2f}")
            dev = row["device_held_paused"]
            dev_text = "-" if dev is None else f"{dev / GIB:.2f}"
            host = f"{row['host_held_paused'] / GIB:.2f}"
            if "pinned_paused" in row:
                host += f" (pinned {row['pinned_paused'] / GIB:.2f})"
            lines.append(
                f"{r['impl']:<12} {i + 1:>5} {row['pause']:>9.3f} {ratios[0]:>7} "
                f"{row['resume']:>9.3f} {ratios[1]:>7} {dev_text:>20} {host:>21} {r['ok']}"
            )
        if "pin_ahead_wait" in r:
            lines.append(
                f"{r['impl']:<12} pin ahead (background, before the first pause): waited "
                f"{r['pin_ahead_wait']:.3f} s"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=16.0, help="GiB in the region (default 16)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="256 MiB: the smoke test's size")
    p.add_argument("--no-retain", action="store_true", help="retain_cpu_backup off")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    nbytes = (256 << 20) if args.quick else int(args.size * GIB)
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, nbytes, args.rounds, not args.no_retain)))
        return 0
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("bench_tms_dropin: no CUDA device here; skipped")
        return 0
    impls = [i for i in args.impls.split(",") if i]
    for impl in impls:
        if impl not in IMPLS:
            p.error(f"--impls: {impl!r} is none of {IMPLS}")
    print(
        f"bench_tms_dropin: {nbytes / GIB:.2f} GiB, {args.rounds} rounds, retain_cpu_backup="
        f"{not args.no_retain}, device {torch.cuda.get_device_name()}"
    )
    results = []
    env = dict(os.environ)
    env.pop("IMP_MEM_TORCH_MEMORY_SAVER", None)  # the original must stay the original
    for impl in impls:
        cmd = [sys.executable, __file__, "--child", impl, "--rounds", str(args.rounds)]
        cmd += ["--quick"] if args.quick else ["--size", str(args.size)]
        cmd += ["--no-retain"] if args.no_retain else []
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        found = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            results.append({"impl": impl, "error": tail[0][:160]})
        else:
            results.append(json.loads(found[-1][len("RESULT ") :]))
        # Each child's figures as soon as it ends (a run cut short keeps them).
        print("RESULT " + json.dumps(results[-1]), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
