"""``imp-mem plan``: plan a model's memory from its config and print the charges.

    imp-mem plan llama-3-8b --max-batch 32 --max-seq-len 8192 --budget 80GiB
    imp-mem plan path/to/config.json --tp 4 --kv-dtype fp8 --json
    imp-mem plan qwen3-8b --budget 24GiB --max-batch 4 --plot plan.png

``CONFIG`` is a ``config.json`` path, a checkpoint directory, or a preset
name (``--list-presets``). A plan that does not fit prints the itemised
report with its levers and exits with status 2; so does any other error,
as one line on stderr. ``--json`` documents carry ``schema_version`` and the
``inputs`` they were planned from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from imp_mem._format import mib, table

EXIT_PLAN_FAILURE = 2
DEFAULT_SEQ_LEN_CAP = 8192


def register(subparsers: Any) -> None:
    """Adds ``plan`` to the ``imp-mem`` command line."""
    p = subparsers.add_parser(
        "plan",
        help="plan a model's memory for a budget (or print why it cannot fit)",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", metavar="CONFIG", help="config.json path or preset name")
    p.add_argument("--max-batch", type=int, default=8, help="sequences at once (default 8)")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence (default: the model's context, at most {DEFAULT_SEQ_LEN_CAP})",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        help="KV dtype: auto (the model's), f32, f16, bf16 or fp8 (any case; also float32, "
        "float16, bfloat16, fp8_e4m3, fp8_e5m2)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument(
        "--budget",
        default="80GiB",
        help="device memory per rank, with its unit (default 80GiB; G, GB and GiB are all 2^30)",
    )
    p.add_argument(
        "--context",
        default=None,
        help="measured CUDA context, with its unit (default: the H200's 527MiB)",
    )
    p.add_argument(
        "--library-reserve",
        default=None,
        help="measured library reserve, with its unit (default: the H200's 66MiB for cuBLAS)",
    )
    p.add_argument(
        "--kv-policy",
        choices=["full", "fit"],
        default="full",
        help="full: the KV pool holds max-batch full sequences, or the plan fails; fit: where "
        "they do not fit, the KV pool shrinks to what the budget leaves (at least one full "
        "sequence); neither grows the pool past max-batch sequences",
    )
    p.add_argument("--spec-depth", type=int, default=0, help="speculative tokens per step")
    p.add_argument("--weights-bytes", default=None, help="measured weight bytes (e.g. 15GiB)")
    p.add_argument("--json", action="store_true", help="print the plan (or failure) as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the budget as a stacked bar")
    p.add_argument("--list-presets", action="store_true", help="list the embedded presets")
    p.set_defaults(func=run)


def load_shape(config: str, weights_bytes: str | None = None):
    """A ModelShape from a preset name, a config.json path or a checkpoint directory."""
    import imp_mem
    from imp_mem._presets import find, preset, resolve

    if find(config) is not None and not os.path.exists(config):
        shape = imp_mem.ModelShape.from_hf_config(preset(config))
    elif os.path.exists(config):
        shape = imp_mem.ModelShape.from_hf_config(config)
    else:
        resolve(config, "CONFIG (neither a config.json path nor a preset)")
        raise AssertionError("resolve raises for a name it cannot find")
    if weights_bytes is not None:
        shape = shape.with_weights_bytes(weights_bytes)
    return shape


def _config_dict(config: str) -> dict[str, Any] | None:
    """The config a preset name, a config.json path or a checkpoint
    directory names (None where it cannot be read as JSON)."""
    from imp_mem._presets import find, preset

    if find(config) is not None and not os.path.exists(config):
        return preset(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def vision_tower_bytes(config: str) -> int:
    """The bytes of the vision tower and projector a multimodal config
    declares, as the reference engine lays them out in T1 (its
    ``vision_tower`` line); 0 for a text model. A tower the engine does not
    read (another family's) is refused, naming what it reads."""
    cfg = _config_dict(config)
    if not cfg or "vision_config" not in cfg:
        return 0
    import imp_mem
    from imp_mem._vision import tower_bytes

    try:
        return tower_bytes(cfg)
    except imp_mem.InvalidArgument as e:
        raise imp_mem.InvalidArgument(
            f"CONFIG: {config!r} declares a vision tower the planner cannot size ({e}); "
            "the towers it sizes are Gemma-3's (model_type gemma3); drop vision_config "
            "to plan the text model alone"
        ) from None


def _has_checkpoint(config: str) -> bool:
    """Whether `config` sits beside safetensors (whose sizes the shape reads)."""
    path = Path(config)
    folder = path if path.is_dir() else path.parent
    return path.exists() and any(
        any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.safetensors.index.json")
    )


def build_input(args: argparse.Namespace):
    """The PlanInput the arguments describe. A vision tower is its own line
    (``vision_tower``); measured weight bytes (``--weights-bytes`` or a
    checkpoint's) hold it, so the weights line is the rest."""
    import imp_mem

    tower = vision_tower_bytes(args.config)
    shape = load_shape(args.config, args.weights_bytes)
    if tower and (args.weights_bytes is not None or _has_checkpoint(args.config)):
        if shape.weights_bytes <= tower:
            raise imp_mem.InvalidArgument(
                f"--weights-bytes: {shape.weights_bytes} B does not cover the vision tower's "
                f"{tower} B; give the whole checkpoint's bytes"
            )
        shape = shape.with_weights_bytes(shape.weights_bytes - tower)
    seq = args.max_seq_len
    if seq is None:
        seq = min(shape.max_position_embeddings or DEFAULT_SEQ_LEN_CAP, DEFAULT_SEQ_LEN_CAP)
    limits = imp_mem.Limits(
        args.max_batch,
        seq,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        kv_policy=args.kv_policy,
    )
    features = imp_mem.Features(spec_depth=args.spec_depth, vision_tower_bytes=tower)
    return imp_mem.PlanInput(
        shape,
        limits,
        features,
        budget=args.budget,
        tp=args.tp,
        context=args.context,
        library_reserve=args.library_reserve,
    )


def _charge_table(charges: list[dict[str, Any]], total: int, budget: int) -> str:
    rows = [[c["label"], mib(c["bytes"])] for c in charges]
    rows.append(["total", mib(total)])
    rows.append(["budget", mib(budget)])
    return table(["charge", "MiB"], rows)


def check_plot_path(path: str) -> None:
    """Refuses a plot path whose folder does not exist, or no matplotlib,
    before anything is planned or printed."""
    import imp_mem

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise imp_mem.InvalidArgument(f"--plot: the folder {folder} does not exist")
    from imp_mem.plot import _pyplot

    try:
        _pyplot()
    except imp_mem.InvalidArgument as exc:
        raise imp_mem.InvalidArgument(f"--plot: {exc}") from None


def plot(
    path: str,
    charges: list[dict[str, Any]],
    budget: int,
    title: str,
    levers: list[dict[str, Any]] | None = None,
) -> None:
    """Saves `imp_mem.plot.figure` of the charges to `path`."""
    from imp_mem.plot import _pyplot, figure

    fig = figure(charges, budget, title, levers=levers)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    _pyplot().close(fig)


def kv_line(plan) -> str:
    """The KV summary under the table: the full-attention pool's blocks,
    or, for a model whose every layer slides (no full-attention KV), the
    sliding-window pool's, with its window."""
    kv, swa = plan.kv, plan.swa
    if kv["bytes_per_token"] == 0 and swa:
        return (
            f"KV: sliding window only ({swa['window']} tokens on every layer): "
            f"{swa['blocks']} SWA blocks of {swa['block_size']} tokens "
            f"({swa['bytes_per_token']} B/token) for {swa['full_sequences']} sequences; "
            f"headroom {mib(plan.headroom)} MiB"
        )
    return (
        f"KV: {kv['blocks']} blocks of {kv['block_size']} tokens "
        f"({kv['bytes_per_token']} B/token) = {kv['full_sequences']} full sequences; "
        f"headroom {mib(plan.headroom)} MiB"
    )


def _inputs(args: argparse.Namespace, plan_input) -> dict[str, Any]:
    limits = plan_input.limits
    return {
        "command": "plan",
        "config": args.config,
        "max_batch": limits.max_batch,
        "max_seq_len": limits.max_seq_len,
        "kv_dtype": limits.kv_dtype,
        "block_size": limits.block_size,
        "kv_policy": limits.kv_policy,
        "tp": plan_input.tp,
        "budget": plan_input.budget,
        "context": args.context,
        "library_reserve": args.library_reserve,
        "spec_depth": args.spec_depth,
        "weights_bytes": args.weights_bytes,
    }


def _warn_past_trained_context(shape, seq: int) -> None:
    trained = shape.max_position_embeddings
    if trained and seq > trained:
        print(
            f"imp-mem: warning: --max-seq-len {seq} is past the model's max_position_embeddings "
            f"({trained}); the model was not trained on sequences that long",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand; returns the exit status."""
    import imp_mem
    from imp_mem._presets import PRESETS

    if args.list_presets:
        for name in sorted(PRESETS):
            print(f"{name:<22}{PRESETS[name]['source']}")
        return 0
    if not args.config:
        raise imp_mem.InvalidArgument("CONFIG: give a config.json path or a preset name")
    from imp_mem.cli import check_at_least_one, check_byte_options

    check_at_least_one(args, "max_batch", "max_seq_len", "tp", "block_size")
    check_byte_options(args, "budget", "context", "library_reserve", "weights_bytes")
    if args.plot:
        check_plot_path(args.plot)
    plan_input = build_input(args)
    shape, limits = plan_input.model, plan_input.limits
    _warn_past_trained_context(shape, limits.max_seq_len)
    title = (
        f"{args.config}: {limits.max_batch} x {limits.max_seq_len} tok, "
        f"tp {plan_input.tp}, KV {limits.kv_dtype or shape.dtype}"
    )
    try:
        plan = imp_mem.plan_memory(plan_input)
    except imp_mem.PlanFailure as failure:
        if args.json:
            from imp_mem.cli import _failure_json

            print(json.dumps(_failure_json(failure, _inputs(args, plan_input)), indent=2))
        else:
            print(title)
            print(failure.report, end="")
        if args.plot:
            plot(
                args.plot,
                failure.charges,
                failure.budget,
                title + " (does not fit)",
                levers=failure.levers,
            )
        return EXIT_PLAN_FAILURE
    if args.json:
        from imp_mem.cli import SCHEMA_VERSION

        document = {
            "schema_version": SCHEMA_VERSION,
            "inputs": _inputs(args, plan_input),
            **json.loads(plan.to_json()),
        }
        print(json.dumps(document, indent=2))
    else:
        print(title)
        print(_charge_table(plan.charges, plan.total(), plan.budget))
        print("\n" + kv_line(plan))
    if args.plot:
        plot(args.plot, plan.charges, plan.budget, title)
        if not args.json:
            print(f"plot: {args.plot}", file=sys.stderr)
    return 0
