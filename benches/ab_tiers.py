"""A/B of the tier hot paths between builds of ``imp_mem._core``, in one process.

    python benches/ab_tiers.py base=/tmp/base/imp_mem/_core.abi3.so \\
        new=/tmp/new/imp_mem/_core.abi3.so [--turns 8] [--calls 200000]

The builds are given and loaded as for ``ab_kv.py`` (``name=path``, each
module side by side under a name of its own). Every build gets its own
pools, arena and scratch stack; then, case by case, the builds take turns
on the loops of ``bench_tiers.py`` (block allocate + release single and 16 at
a time, from a slot pool and a region pool; arena take; scratch take;
scratch mark + take + rewind), in alternating order, so that the machine's
drift is shared between them. Each turn runs a quarter of its calls untimed
first. Prints, per case, the fastest turn per build in ns an operation, and
each build's median per-turn ratio to the first. A
diagnostic, like ``ab_kv.py``: the ratios the project claims come from
``bench_tiers.py``, against its peers in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_kv import load_builds, paired

BLOCKS = 10_000


def cases(core: ModuleType) -> dict[str, tuple[Callable[[int], None], int]]:
    """Each case's loop (run for ``k`` calls) and its operations per call."""
    slots = core.BlockPool.slots(BLOCKS)
    # Unbacked, as in bench_tiers.py: no debugging poison on release.
    unbacked = core.FakeBackend(capacity=1 << 40, backed=False)
    region = core.BlockPool(unbacked, 4096, BLOCKS)
    fake = core.FakeBackend(capacity=1 << 30)
    arena = core.Arena(fake, 256 << 20, tier=core.Tier.ENGINE_PERSISTENT)
    stack = core.ScratchStack(fake, 256 << 20)

    def single(pool):
        def run(k: int) -> None:
            alloc = pool.allocate
            for _ in range(k):
                alloc().release()

        return run

    def batch(pool):
        def run(k: int) -> None:
            alloc = pool.allocate_many
            for _ in range(k):
                alloc(16).release()

        return run

    def arena_take(k: int) -> None:
        take = arena.take
        for _ in range(k):
            take(64)
        arena.reset()

    def scratch_take(k: int) -> None:
        with stack.mark() as m:
            take = m.take
            for _ in range(k):
                take(64)

    def mark_take_rewind(k: int) -> None:
        mark = stack.mark
        for _ in range(k):
            with mark() as m:
                m.take(64)

    return {
        "block alloc+release, single (slots)": (single(slots), 1),
        "block alloc+release, single (region)": (single(region), 1),
        "block alloc+release, x16 (slots)": (batch(slots), 16),
        "block alloc+release, x16 (region)": (batch(region), 16),
        "arena take 64 B": (arena_take, 1),
        "scratch take 64 B": (scratch_take, 1),
        "scratch mark+take+rewind": (mark_take_rewind, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--turns", type=int, default=8, help="turns per build and case")
    parser.add_argument("--calls", type=int, default=200_000, help="calls per turn")
    args = parser.parse_args()
    modules = load_builds(args.builds)
    per_build = {name: cases(m) for name, m in modules.items()}
    order = list(modules)
    first = order[0]
    for case in per_build[first]:
        times: dict[str, list[float]] = {n: [] for n in order}
        for turn in range(args.turns):
            for name in order if turn % 2 == 0 else order[::-1]:
                run, ops = per_build[name][case]
                calls = args.calls // ops
                run(calls // 4)
                t0 = time.perf_counter_ns()
                run(calls)
                times[name].append((time.perf_counter_ns() - t0) / (calls * ops))
        shown = ", ".join(f"{n} {min(t):.1f}" for n, t in times.items())
        ratios = "; ".join(f"{n}/{first} {paired(times[n], times[first])}" for n in order[1:])
        print(f"{case:38} fastest ns/op: {shown}; {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
