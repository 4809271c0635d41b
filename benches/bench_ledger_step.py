"""What the device ledger costs an engine's step (issue 27), on the CPU.

Two engines of one tiny model in one process, on fake backends: one plain,
one on a device ledger (``Engine(shared=...)``) planned for the same budget.
They serve the same saturating passes of fresh prompts, alternately (so the
host's noise falls on both alike), after a first pass that grows the shared
engine's KV pool. Printed per engine: the median and best wall time of a
step, and for the shared one the time spent in its tenancy (`Tenancy.tick`,
the admission gate and `check_submit`) a step and the ledger calls a step;
then the ledger's own operations one by one (µs a call). What it shows: in
the steady state the shared engine does no more per step than one pressure
read every ``pressure_interval_s`` and an occasional KV-live record.

Usage: ``python benches/bench_ledger_step.py [--passes 10] [--batch 8]
[--json out.json]``. CPU only; a few seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_json import write_json


def timed_calls(f, n: int) -> float:
    """Best of five: µs a call of `f`."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from bench_shared_gpu import shapes

    import imp_mem
    from imp_mem.engine import Engine
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.shared import SharedGPU, Tenancy

    budget = 512 << 20
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-ledger-step-") as tmp:
        name, cfg = shapes(False, smoke=True)[0]
        d = write_random_checkpoint(Path(tmp) / name, cfg, device=None)
        spent = {"tick": 0.0, "gate": 0.0, "check_submit": 0.0}

        def clocked(attr, f):
            def run(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return f(*a, **kw)
                finally:
                    spent[attr] += time.perf_counter() - t0

            return run

        for attr in spent:
            setattr(Tenancy, attr, clocked(attr, getattr(Tenancy, attr)))

        def engine(shared):
            kw = dict(
                backend=imp_mem.FakeBackend(capacity=budget),
                max_batch=args.batch,
                max_seq_len=16 + args.new_tokens + 16,
                keep_logits=False,
                budget=budget // 3,
            )
            if shared:
                kw["shared"] = SharedGPU(
                    cap=budget // 3,
                    device_budget=budget,
                    key=f"step-{os.getpid()}",
                    dir=str(Path(tmp) / "ledger"),
                    name="alone",
                )
            return Engine(str(d), **kw)

        engines = {"plain": engine(False), "ledger": engine(True)}
        rng = random.Random(5)

        def one_pass(e) -> tuple[float, int]:
            prompts = [[rng.randrange(512) for _ in range(16)] for _ in range(args.batch)]
            e.kv.reset_prefix_cache()
            s0 = e.stats.steps
            t0 = time.perf_counter()
            e.generate(prompts, args.new_tokens)
            return time.perf_counter() - t0, e.stats.steps - s0

        for e in engines.values():
            one_pass(e)  # the shared pool grows here
        t = engines["ledger"].tenancy
        calls0 = t.ledger_reads + t.ledger_writes
        committed0 = t.tenant.record()["committed"]
        spent.update(dict.fromkeys(spent, 0.0))
        step_s: dict[str, list[float]] = {k: [] for k in engines}
        steps = 0
        for _ in range(args.passes):
            for k, e in engines.items():
                dt, n = one_pass(e)
                step_s[k].append(dt / n)
                if k == "ledger":
                    steps += n
        calls = t.ledger_reads + t.ledger_writes - calls0
        grown = t.tenant.record()["committed"] - committed0
        med = {k: statistics.median(v) for k, v in step_s.items()}
        print(f"{args.passes} passes of {args.batch} x (16 + {args.new_tokens}) tokens each:")
        for k in engines:
            print(
                f"  {k:6s} step median {med[k] * 1e6:8.1f} us, best {min(step_s[k]) * 1e6:8.1f} us"
            )
        per_step = sum(spent.values()) / steps * 1e6
        split = ", ".join(f"{k} {v / steps * 1e6:.2f}" for k, v in spent.items())
        print(
            f"  ledger/plain step median {med['ledger'] / med['plain']:.3f}x, best "
            f"{min(step_s['ledger']) / min(step_s['plain']):.3f}x; in the tenancy "
            f"{per_step:.2f} us a step ({split}; {per_step / (med['ledger'] * 1e6) * 100:.2f} % "
            "of it); "
            f"{calls / steps:.3f} ledger calls a step; {grown} B grown in the steady state"
        )
        rows.append(
            {
                "step_us_plain": med["plain"] * 1e6,
                "step_us_ledger": med["ledger"] * 1e6,
                "tenancy_us_per_step": per_step,
                "ledger_calls_per_step": calls / steps,
                "grown_steady": grown,
            }
        )
        for e in engines.values():
            e.close()

        led = imp_mem.DeviceLedger("ops", budget, str(Path(tmp) / "ledger"))
        me = led.join("a", 1 << 20, budget)
        others = [led.join(f"o{i}", 1 << 20, budget) for i in range(2)]
        print("ledger operations (3 tenants):")

        def grow_shrink():
            me.grow(1 << 20)
            me.shrink(1 << 20)

        for label, f, n in (
            ("pressure", me.pressure, 5000),
            ("headroom", me.headroom, 5000),
            ("set_kv_live", lambda: me.set_kv_live(4096), 5000),
            ("grow + shrink", grow_shrink, 2500),
            ("tenants (reaps)", led.tenants, 1000),
        ):
            us = timed_calls(f, n)
            print(f"  {label:16s} {us:8.2f} us")
            rows.append({"op": label, "us": us})
        assert len(others) == 2
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
