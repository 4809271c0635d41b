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

_SUBCOMMAND_MODULES: tuple[str, ...] = ("imp_mem._cli_plan",)


def _pick_backend(kind: str, capacity: str):
    import imp_mem

    if kind == "auto":
        kind = "vmm" if imp_mem.cuda_available() else "fake"
    if kind == "fake":
        # Unbacked: the demo walks an 80 GiB-class device without touching
        # 80 GiB of host memory.
        return imp_mem.FakeBackend(capacity=capacity, backed=False, strict=True)
    cls = {"cuda": imp_mem.CudaBackend, "vmm": imp_mem.VmmBackend}[kind]
    return cls(device=0, strict=True)


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _demo(args: argparse.Namespace) -> int:
    import imp_mem
    from imp_mem.system import run_demo

    others = None
    if args.backend != "fake" and imp_mem.cuda_available():
        from imp_mem.reserve import device_used_by_all_processes

        # Before this process opens a context: what the others hold.
        others = device_used_by_all_processes()
    backend = _pick_backend(args.backend, args.capacity)
    if backend.kind != "fake" and _torch_cuda():
        # On a GPU with torch, the demo is the reference engine serving.
        from imp_mem.engine.demo import run_engine_demo

        return run_engine_demo(
            backend,
            other_processes=others,
            seconds=args.seconds,
            max_batch=args.max_batch,
            max_seq_len=min(args.max_seq_len, 1024),
        )
    try:
        return run_demo(
            backend,
            model=args.model,
            max_batch=args.max_batch,
            max_seq_len=args.max_seq_len,
            steps=args.steps,
        )
    except imp_mem.PlanFailure as failure:
        print(failure)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imp-mem", description="Planned, tiered, accounted GPU memory for LLM engines."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser(
        "demo", help="plan a model, open its tiers, load, serve, and report every byte"
    )
    demo.add_argument(
        "--backend",
        choices=["auto", "fake", "cuda", "vmm"],
        default="auto",
        help="auto: the GPU when there is one, else the CPU fake (default)",
    )
    demo.add_argument("--capacity", default="80GiB", help="fake device capacity (default 80GiB)")
    demo.add_argument("--model", default="llama-3-8b", help="preset; imp-mem plan --list-presets")
    demo.add_argument("--max-batch", type=int, default=16, help="concurrent sequences (16)")
    demo.add_argument("--max-seq-len", type=int, default=8192, help="tokens a sequence (8192)")
    demo.add_argument("--steps", type=int, default=8, help="serving steps to simulate (8)")
    demo.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="on a GPU with torch: how long the engine serves (5)",
    )
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
