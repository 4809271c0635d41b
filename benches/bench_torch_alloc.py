"""``torch.empty`` + ``del`` through imp-mem against torch's caching allocator
(issue 12; GPU), side by side in one run, as ratios (goal: <= 1.0x).

Three ways, each in a fresh process so that the process-wide mode can be
installed before torch's first CUDA allocation:

* ``default``: torch's caching allocator, warm;
* ``scope``: inside ``imp_mem.torch.Pool.scope()`` (a ``torch.cuda.MemPool``
  over the activations tier; torch's cache runs on top);
* ``process``: ``imp_mem.torch.install`` (the tier is torch's only
  allocator; every ``empty`` reaches imp-mem's C entry point).

The kinds alternate (``--repeats`` children each, default 3), every child
pinned to the same core, and each figure is the median of its kind's
children: unpinned, one kind's time varied 2.2-4.5 us between processes on
the H200 host, more than the difference measured.

    python benches/bench_torch_alloc.py [--quick] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_json import write_json

SIZES = [4096, 1 << 20, 16 << 20]


def _time(fn, n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def child(kind: str, n: int, rounds: int) -> dict:
    # Every child on the same core: the host's cores differ in speed by up
    # to 2x from process to process (measured), more than what is compared.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    system = None
    if kind != "default":
        import imp_mem
        import imp_mem.torch as imt

        shape = imp_mem.ModelShape.from_hf_config(
            {
                "model_type": "qwen3",
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "intermediate_size": 512,
                "vocab_size": 1024,
            }
        )
        features = imp_mem.Features(
            activation_bytes=1 << 30, scratch_bytes=2 << 20, engine_persistent_bytes=2 << 20
        )
        plan = imp_mem.plan_memory(
            imp_mem.PlanInput(shape, imp_mem.Limits(1, 16), features, budget="16GiB")
        )
        system = imp_mem.MemorySystem(imp_mem.VmmBackend(0), plan)
        if kind == "process":
            imt.install(system)
        system.begin_serving()
    results = {}
    for size in SIZES:

        def one(size=size):
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            del x

        if kind == "scope":
            pool = imt.pool(system)
            with pool.scope():
                for _ in range(100):
                    one()
                results[size] = _time(one, n, rounds)
        else:
            for _ in range(100):
                one()
            results[size] = _time(one, n, rounds)
    torch.cuda.synchronize()
    if system is not None:
        results["steady_state_allocations"] = system.backend.stats()[
            "steady_state_allocations_total"
        ]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["default", "scope", "process"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=3, help="children of each kind, alternating")
    args = ap.parse_args(argv)
    n, rounds = (2000, 3) if args.quick else (20000, 7)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, n, rounds)), flush=True)
        return 0
    # The three kinds alternate, `repeats` children each, pinned to one
    # core; each kind's figure is the median of its children's.
    runs: dict[str, list[dict]] = {"default": [], "scope": [], "process": []}
    for _ in range(args.repeats):
        for kind in runs:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", kind] + (["--quick"] if args.quick else []),
                capture_output=True,
                text=True,
                timeout=600,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{kind}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                return 1
            runs[kind].append({str(k): v for k, v in json.loads(line[7:]).items()})
    out = {
        kind: {
            **{str(size): statistics.median(r[str(size)] for r in rs) for size in SIZES},
            "steady_state_allocations": rs[-1].get("steady_state_allocations"),
        }
        for kind, rs in runs.items()
    }
    rows = []
    for size in SIZES:
        d = out["default"][str(size)]
        for kind in ("scope", "process"):
            ours = out[kind][str(size)]
            rows.append(
                {
                    "benchmark": f"torch.empty({size} B) + del, imp-mem {kind}",
                    "peer": "torch caching allocator",
                    "ours_us": round(ours, 3),
                    "peer_us": round(d, 3),
                    "ratio": round(ours / d, 3),
                    "goal": "<= 1.0x",
                }
            )
    for r in rows:
        print(
            f"{r['benchmark']:<48} {r['ours_us']:>8.3f} us vs {r['peer_us']:>8.3f} us"
            f" = {r['ratio']:.3f}x"
        )
    for kind in ("scope", "process"):
        print(f"{kind}: steady-state allocations {out[kind].get('steady_state_allocations')}")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
