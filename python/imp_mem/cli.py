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

_SUBCOMMAND_MODULES: tuple[str, ...] = ("imp_mem._cli_plan", "imp_mem._cli_ledger")


def check_at_least_one(args: argparse.Namespace, *names: str) -> None:
    """One rule, one message: each count option must be at least 1."""
    import imp_mem

    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise imp_mem.InvalidArgument(f"{flag} must be at least 1, got {value}")


def check_byte_options(args: argparse.Namespace, *names: str) -> None:
    """A byte option given as a bare number is refused: ``--budget 80``
    would otherwise plan against 80 bytes."""
    import imp_mem

    for name in names:
        value = getattr(args, name)
        if value is None or not str(value).strip().replace(".", "", 1).isdigit():
            continue
        flag = "--" + name.replace("_", "-")
        number = str(value).strip()
        raise imp_mem.InvalidArgument(
            f"{flag} {number} has no unit; write it with one, e.g. {flag} {number}GiB "
            f"(or {number}MiB; {number}B for bytes)"
        )


def _pick_backend(kind: str, capacity: str):
    import imp_mem

    if kind == "auto":
        kind = "vmm" if imp_mem.cuda_available() else "fake"
    if kind == "fake":
        # Unbacked: the demo walks an 80 GiB-class device without touching
        # 80 GiB of host memory.
        return imp_mem.FakeBackend(capacity=capacity, backed=False, strict=True)
    cls = {"cuda": imp_mem.CudaBackend, "vmm": imp_mem.VmmBackend}[kind]
    try:
        return cls(device=0, strict=True)
    except imp_mem.BackendUnavailable as exc:
        # The API's message names the API's classes; a CLI user needs the option.
        reason = str(exc).split("; ")[0]
        raise imp_mem.BackendUnavailable(
            f"--backend {kind}: {reason}; run with --backend fake to use the CPU fake"
        ) from None


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _demo(args: argparse.Namespace) -> int:
    import json

    import imp_mem
    from imp_mem._presets import PRESETS
    from imp_mem.system import run_demo

    if args.model.lower() not in PRESETS:
        raise imp_mem.InvalidArgument(
            f"--model: {args.model!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}"
        )
    check_at_least_one(args, "max_batch", "max_seq_len", "steps")
    check_byte_options(args, "capacity")
    from imp_mem._cli_plan import _warn_past_trained_context
    from imp_mem._presets import preset

    shape = imp_mem.ModelShape.from_hf_config(preset(args.model))
    _warn_past_trained_context(shape, args.max_seq_len)
    others = None
    if args.backend != "fake" and imp_mem.cuda_available():
        from imp_mem.reserve import device_used_by_all_processes

        # Before this process opens a context: what the others hold.
        others = device_used_by_all_processes()
    backend = _pick_backend(args.backend, args.capacity)
    if backend.kind != "fake" and _torch_cuda() and not args.json:
        # On a GPU with torch, the demo is the reference engine serving
        # (--json keeps the planned demo, whose report is the document).
        from imp_mem.engine.demo import run_engine_demo

        config = None
        if args.engine_config is not None:
            from imp_mem.engine.config import read_config_json

            config = read_config_json(args.engine_config, "--engine-config")
        return run_engine_demo(
            backend,
            other_processes=others,
            seconds=args.seconds,
            max_batch=args.max_batch,
            max_seq_len=min(args.max_seq_len, 1024),
            config=config,
            load_format=args.load_format,
            seed=args.seed,
        )
    report: dict = {}
    lines: list[str] = []
    out = lines.append if args.json else print
    try:
        status = run_demo(
            backend,
            out,
            model=args.model,
            max_batch=args.max_batch,
            max_seq_len=args.max_seq_len,
            steps=args.steps,
            report=report,
        )
    except imp_mem.PlanFailure as failure:
        if args.json:
            print(json.dumps(_failure_json(failure, _demo_inputs(args)), indent=2))
        else:
            print(failure)
        return 2
    if args.json:
        report = {"schema_version": SCHEMA_VERSION, "inputs": _demo_inputs(args), **report}
        print(json.dumps(report, indent=2, default=str))
    return status


SCHEMA_VERSION = 1
"""The version of the ``--json`` documents (``plan`` and ``demo``); it
changes when a key changes meaning or goes away."""


def _demo_inputs(args: argparse.Namespace) -> dict:
    return {
        "command": "demo",
        "model": args.model,
        "backend": args.backend,
        "capacity": args.capacity,
        "max_batch": args.max_batch,
        "max_seq_len": args.max_seq_len,
        "steps": args.steps,
    }


def _failure_json(failure, inputs: dict) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "inputs": inputs,
        "error": "plan_failure",
        "kind": failure.kind,
        "budget": failure.budget,
        "total": failure.total,
        "over_by": failure.over_by,
        "charges": failure.charges,
        "levers": failure.levers,
    }


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
    demo.add_argument(
        "--json", action="store_true", help="print the plan and the memory report as JSON"
    )
    demo.add_argument(
        "--engine-config",
        default=None,
        help="on a GPU with torch: the config.json (or its directory) the engine serves "
        "(a family the engine serves; default Qwen3-0.6B's)",
    )
    demo.add_argument(
        "--load-format",
        choices=["safetensors", "dummy"],
        default="safetensors",
        help="on a GPU with torch: 'dummy' draws random weights in T1 from --seed "
        "(no checkpoint written); 'safetensors' writes a random checkpoint and loads it",
    )
    demo.add_argument("--seed", type=int, default=0, help="the random weights' seed (0)")
    demo.set_defaults(func=_demo)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


EXIT_ERROR = 2


def _error(message: str) -> int:
    """One line on stderr; the exit status of every CLI error."""
    print(f"imp-mem: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status: 0, or 2 for any
    error (one line on stderr, never a traceback; argparse's own usage
    errors also exit with 2)."""
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
        return _error(f"{type(exc).__name__}: {exc}")
    except OSError as exc:
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        return _error(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        return _error("interrupted")
    except Exception as exc:
        return _error(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
