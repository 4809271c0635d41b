"""A/B of KV churn between builds of ``imp_mem._core``, in one process.

    python tools/ab_kv.py base=/tmp/base/imp_mem/_core.abi3.so \\
        new=/tmp/new/imp_mem/_core.abi3.so [--slices 8] [--size 600] \\
        [--tokens int32|int64|list|array] [--admission admit|scheduler] \\
        [--clock wall|cpu]

Each ``name=path`` is an extension module built from some revision
(``maturin build --release`` and ``pip install --target DIR`` the wheel; the
module is ``DIR/imp_mem/_core.abi3.so``). All of them are loaded side by
side, each gets its own ``KVCacheManager``, and they take turns on slices of
``bench_kv.py``'s churn, every slice on fresh prompts, in alternating order.
A change is then measured against its base with the machine's drift shared
between them, which separate runs of ``bench_kv.py`` cannot do: on a 2-core
VM whose speed wanders by several percent over minutes, a 5 % change needs
this. An A/A run (one build under two names) agrees within about 1 %.

Each slice first runs a third of its requests untimed, so that the manager's
structures are back in the cache after the other builds' turns, then times
the rest. ``--tokens`` gives the prompts as int32 NumPy arrays (the
default), int64 arrays, Python lists or ``array('i')`` (``bench_kv.FORMATS``).
``--admission scheduler`` admits each prompt as the engine's scheduler
does with that build: ``try_admit``, one call, where the build has it, else
``can_admit`` then ``admit`` (two calls, the prompt read and hashed twice).
``--clock cpu`` times each slice by the thread's CPU time
(``time.thread_time``) instead of the wall clock: on a machine shared with
other work, time spent preempted is left out, which narrows the spread of
the per-turn ratios several-fold (the cache's share of the interference
stays).
Prints the fastest and the median slice per build, and each build's median
per-turn ratio to the first (the steadier figure on a loaded machine). A
diagnostic:
the ratios the project claims come from ``bench_kv.py``, against its
reference in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

# The benchmarks this tool borrows from live in benches/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import bench_kv


def load(name: str, path: str) -> ModuleType:
    """Loads one build's ``_core`` under a name of its own."""
    if not Path(path).is_file():
        raise SystemExit(f"{name}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"{name}._core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{name}: {path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_builds(specs: list[str]) -> dict[str, ModuleType]:
    """Each ``NAME=PATH`` build's ``_core``, loaded under its name."""
    builds: dict[str, str] = {}
    for build in specs:
        name, sep, path = build.partition("=")
        if not (name and sep and path) or name in builds:
            raise SystemExit(f"{build!r}: give each build as NAME=PATH, with distinct names")
        builds[name] = path
    return {name: load(name, path) for name, path in builds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--slices", type=int, default=8, help="turns per build")
    parser.add_argument("--size", type=int, default=600, help="requests per turn")
    parser.add_argument(
        "--tokens", choices=["int32", "int64", "list", "array"], default="int32", help="prompt type"
    )
    parser.add_argument(
        "--admission",
        choices=["admit", "scheduler"],
        default="admit",
        help="admit, or admit as the scheduler does (try_admit, else can_admit + admit)",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time slices by the wall clock or by the thread's CPU time",
    )
    args = parser.parse_args()
    modules = load_builds(args.builds)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    warm = args.size // 3
    reqs = bench_kv.churn_requests(16 + args.slices * args.size * len(modules), 1)
    make = bench_kv.FORMATS["array('i')" if args.tokens == "array" else args.tokens]
    reqs = [make(r) for r in reqs]
    managers = {n: m.KVCacheManager(bench_kv.BLOCKS, bench_kv.BS) for n, m in modules.items()}
    admits = {n: admission(kv, args.admission) for n, kv in managers.items()}
    next_id = {}
    for name, kv in managers.items():
        for i, toks in enumerate(reqs[:16]):
            kv.admit(i, toks)
            kv.free(i)
        next_id[name] = 16

    times: dict[str, list[float]] = {n: [] for n in modules}
    at = 16
    order = list(modules)
    for turn in range(args.slices):
        for name in order if turn % 2 == 0 else order[::-1]:
            kv, admit, first = managers[name], admits[name], next_id[name]
            chunk = reqs[at : at + args.size]
            at += args.size
            next_id[name] += args.size
            for i, toks in enumerate(chunk[:warm], first):
                admit(i, toks)
                kv.free(i)
            t0 = clock()
            for i, toks in enumerate(chunk[warm:], first + warm):
                admit(i, toks)
                kv.free(i)
            times[name].append((clock() - t0) / (args.size - warm))
    for name, t in times.items():
        print(
            f"{name}: fastest {min(t) * 1e6:.3f} µs, median {statistics.median(t) * 1e6:.3f} µs "
            f"a request ({len(t)} turns of {args.size - warm})"
        )
    first = order[0]
    for name in order[1:]:
        print(f"{name}/{first}: {paired(times[name], times[first])}")
    return 0


def admission(kv, how: str):
    """How a prompt is admitted: ``kv.admit``, or as the scheduler does."""
    if how == "admit":
        return kv.admit
    if hasattr(kv, "try_admit"):
        try_admit = kv.try_admit

        def one(i, toks):
            if try_admit(i, toks) is None:
                raise SystemExit("the churn's prompts should always fit")

        return one

    def two(i, toks):
        if not kv.can_admit(toks):
            raise SystemExit("the churn's prompts should always fit")
        kv.admit(i, toks)

    return two


def paired(t: list[float], base: list[float]) -> str:
    """The median of the per-turn ratios of ``t`` to ``base``: the two turns
    of a pair run back to back, so a drift slower than a turn cancels, where
    the fastest turns of a loaded machine can be minutes apart."""
    r = sorted(a / b for a, b in zip(t, base, strict=True))
    q = len(r) // 4
    mid = statistics.median(r)
    return f"median per-turn ratio {mid:.3f} (middle half {r[q]:.3f}-{r[-q - 1]:.3f})"


if __name__ == "__main__":
    sys.exit(main())
