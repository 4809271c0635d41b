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
    """Each byte option read by the core's one rule for sizes
    (`imp_mem.parse_size`): a number and a unit, never bare bytes
    (``--budget 80`` would otherwise plan against 80 bytes); a negative
    or too large size says so. The message names the option."""
    import imp_mem

    for name in names:
        value = getattr(args, name)
        if value is not None:
            imp_mem.parse_size(str(value), "--" + name.replace("_", "-"))


# The options that take a size: argparse reads ``--budget -1GiB`` as two
# options, so `main` joins such a value to its flag for the core to refuse
# as negative.
SIZE_FLAGS = ("--budget", "--context", "--library-reserve", "--weights-bytes", "--capacity")


def _join_negative_sizes(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg in SIZE_FLAGS and nxt is not None and nxt[:1] == "-" and nxt[1:2].isdigit():
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


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
    from imp_mem._presets import resolve
    from imp_mem.system import run_demo

    args.model = resolve(args.model, "--model")
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
            seconds=5.0 if args.seconds is None else args.seconds,
            max_batch=args.max_batch,
            max_seq_len=min(args.max_seq_len, 1024),
            config=config,
            load_format=args.load_format or "safetensors",
            seed=args.seed,
        )
    ignored = [
        flag
        for flag, value in (
            ("--seconds", args.seconds),
            ("--engine-config", args.engine_config),
            ("--load-format", args.load_format),
        )
        if value is not None
    ]
    if ignored:
        print(
            f"imp-mem: warning: {', '.join(ignored)} apply to the engine on a GPU with torch; "
            "this planned demo on the fake backend does not use them",
            file=sys.stderr,
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
            if any(lever["setting"] == "tp" for lever in failure.levers):
                # The demo serves one device; the lever is plan's to try.
                print(
                    "(the demo runs at tp 1 on one device: try the tp lever with "
                    f"imp-mem plan {args.model} --tp N)"
                )
        return 2
    if args.json:
        report = {"schema_version": SCHEMA_VERSION, "inputs": _demo_inputs(args), **report}
        print(json.dumps(report, indent=2, default=str))
    return status


DEMO_DESCRIPTION = """\
Plans a preset model for the backend's budget, opens its tiers in plan
order, loads the weights into T1, serves a few simulated steps through a
KV cache manager on the system's KV pool, prints the memory report with
every byte named, and releases everything.

On the CPU (or with --backend fake, or --json) the demo is this planned
walk-through on the fake backend, and the options marked "on a GPU with
torch" (--seconds, --engine-config, --load-format) do nothing. On a GPU with
torch it is the reference engine serving random weights for --seconds.
The plan is imp-mem plan's at --max-batch x --max-seq-len (tp 1, the
model's KV dtype): a configuration that does not fit exits with status 2
and the plan's report."""

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
        "demo",
        help="plan a model, open its tiers, load, serve, and report every byte",
        description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--backend",
        choices=["auto", "fake", "cuda", "vmm"],
        default="auto",
        help="auto: the GPU when there is one, else the CPU fake (default)",
    )
    demo.add_argument("--capacity", default="80GiB", help="fake device capacity (default 80GiB)")
    demo.add_argument(
        "--model",
        default="llama-3-8b",
        help="a preset, by name or Hugging Face id (imp-mem plan --list-presets)",
    )
    demo.add_argument(
        "--max-batch", type=int, default=8, help="concurrent sequences (default 8, as plan's)"
    )
    demo.add_argument("--max-seq-len", type=int, default=8192, help="tokens a sequence (8192)")
    demo.add_argument("--steps", type=int, default=8, help="serving steps to simulate (8)")
    demo.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="on a GPU with torch: how long the engine serves (default 5)",
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
        default=None,
        help="on a GPU with torch: 'dummy' draws random weights in T1 from --seed "
        "(no checkpoint written); 'safetensors' (default) writes a random checkpoint and "
        "loads it",
    )
    demo.add_argument("--seed", type=int, default=0, help="the random weights' seed (0)")
    demo.set_defaults(func=_demo)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


EXIT_ERROR = 2


def _error(message: str, as_json: bool = False, kind: str = "error") -> int:
    """One line on stderr; the exit status of every CLI error. Under
    ``--json`` stdout also gets the error as a document (``error``: the
    exception's class, ``message``), so a script reads every outcome as
    JSON."""
    line = " ".join(message.split())
    print(f"imp-mem: error: {line}", file=sys.stderr)
    if as_json:
        import json

        print(json.dumps({"schema_version": SCHEMA_VERSION, "error": kind, "message": line}))
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status: 0, or 2 for any
    error (one line on stderr, never a traceback; argparse's own usage
    errors also exit with 2)."""
    import imp_mem

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_join_negative_sizes(argv))
    if args.version:
        print(imp_mem.__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    as_json = bool(getattr(args, "json", False))
    try:
        return int(args.func(args) or 0)
    except imp_mem.ImpMemError as exc:
        kind = type(exc).__name__
        return _error(f"{kind}: {exc}", as_json, kind)
    except OSError as exc:
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        return _error(f"{exc.strerror or exc}{where}", as_json, type(exc).__name__)
    except KeyboardInterrupt:
        return _error("interrupted", as_json, "interrupted")
    except Exception as exc:
        kind = type(exc).__name__
        return _error(f"{kind}: {exc}", as_json, kind)


if __name__ == "__main__":
    sys.exit(main())
