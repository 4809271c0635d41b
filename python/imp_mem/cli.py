"""The ``imp-mem`` command line.

Subcommands live in their own modules, each exposing ``register(subparsers)``
which adds its parser and sets ``func``; adding one is a line in
``_SUBCOMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from imp_mem._format import human_bytes, table

_SUBCOMMAND_MODULES: tuple[str, ...] = ("imp_mem._cli_plan",)


def _pick_backend(kind: str, capacity: str):
    import imp_mem

    if kind == "auto":
        kind = "cuda" if imp_mem.cuda_available() and hasattr(imp_mem, "CudaBackend") else "fake"
    if kind == "fake":
        # Unbacked: the demo walks an 80 GiB-class device without touching
        # 80 GiB of host memory.
        return imp_mem.FakeBackend(capacity=capacity, backed=False, strict=True)
    cls = {"cuda": "CudaBackend", "vmm": "VmmBackend"}[kind]
    backend_type = getattr(imp_mem, cls, None)
    if backend_type is None:
        raise imp_mem.BackendUnavailable(f"{cls} is not built into this wheel")
    return backend_type(device=0, strict=True)


def _stats_table(stats: dict) -> str:
    rows = []
    for tag, t in stats["tags"].items():
        rows.append(
            [
                tag,
                human_bytes(t["reserved"]),
                human_bytes(t["live"]),
                human_bytes(t["peak"]),
                t["acquisitions"],
                t["releases"],
            ]
        )
    rows.append(
        [
            "total",
            human_bytes(stats["reserved"]),
            human_bytes(stats["live"]),
            human_bytes(stats["peak"]),
            stats["acquisitions"],
            stats["releases"],
        ]
    )
    return table(["tag", "reserved", "live", "peak", "acquired", "released"], rows)


def _demo(args: argparse.Namespace) -> int:
    import imp_mem

    backend = _pick_backend(args.backend, args.capacity)
    # The script is written for an 80 GiB device; smaller devices run it scaled.
    gib = min(1 << 30, backend.capacity // 80)
    print(f"backend: {backend!r}")
    print(f"budget:  {human_bytes(backend.budget)} of {human_bytes(backend.capacity)}\n")

    held = []
    print(f"[{backend.phase}] loading weights")
    held.append(backend.acquire(15 * gib, tag="weights"))
    held.append(backend.acquire(2 * gib, tag="weight_cache"))

    backend.begin_planning()
    print(f"[{backend.phase}] applying the plan: workspaces, scratch, KV pool")
    held.append(backend.acquire(gib // 2, tag="workspace"))
    held.append(backend.acquire(gib // 4, tag="scratch"))
    if backend.growable:
        kv = backend.acquire_growable(40 * gib, 8 * gib, tag="kv_cache")
    else:
        kv = backend.acquire(24 * gib, tag="kv_cache")
    held.append(kv)

    backend.begin_serving()
    print(f"[{backend.phase}] serving: the KV pool grows inside its reservation")
    if kv.growable:
        base = kv.address
        kv.commit(24 * gib)
        kv.decommit(16 * gib)
        assert kv.address == base, "a growable region's base never moves"
    try:
        backend.acquire(1 << 20, tag="other")
    except imp_mem.PhaseViolation as exc:
        print(f"  refused while serving, as planned: {str(exc).split(';')[0]}")

    stats = backend.stats()
    print()
    print(_stats_table(stats))
    steady = sum(stats["steady_state_allocations_total"].values())
    print(f"\nsteady-state allocations while serving: {steady}")
    for region in held:
        region.release()
    backend.check_invariants()
    print(f"released everything: live = {backend.live} B")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imp-mem", description="Planned, tiered, accounted GPU memory for LLM engines."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="drive a backend through load -> plan -> serve")
    demo.add_argument(
        "--backend",
        choices=["auto", "fake", "cuda", "vmm"],
        default="auto",
        help="auto: the GPU when there is one, else the CPU fake (default)",
    )
    demo.add_argument("--capacity", default="80GiB", help="fake device capacity (default 80GiB)")
    demo.set_defaults(func=_demo)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    import imp_mem

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(imp_mem.__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except imp_mem.ImpMemError as exc:
        print(f"imp-mem: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
