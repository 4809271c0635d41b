"""``imp-mem plan``: plan a model's memory from its config and print the charges.

    imp-mem plan llama-3-8b --max-batch 32 --max-seq-len 8192 --budget 80GiB
    imp-mem plan path/to/config.json --tp 4 --kv-dtype fp8 --json
    imp-mem plan qwen3-8b --budget 24GiB --plot plan.png

``CONFIG`` is a ``config.json`` path, a checkpoint directory, or a preset
name (``--list-presets``). A plan that does not fit prints the itemised
report with its levers and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from imp_mem._format import mib, table

EXIT_PLAN_FAILURE = 2
DEFAULT_SEQ_LEN_CAP = 8192


def register(subparsers: Any) -> None:
    """Adds ``plan`` to the ``imp-mem`` command line."""
    p = subparsers.add_parser(
        "plan",
        help="plan a model's memory for a budget (or print why it cannot fit)",
        description=__doc__,
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
    p.add_argument("--kv-dtype", default="auto", help="KV dtype: auto, bf16, f16, fp8, f32")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--budget", default="80GiB", help="device bytes per rank (default 80GiB)")
    p.add_argument(
        "--context", default=None, help="measured CUDA context (default: the H200's 527 MiB)"
    )
    p.add_argument(
        "--library-reserve",
        default=None,
        help="measured library reserve (default: the H200's 66 MiB for cuBLAS)",
    )
    p.add_argument(
        "--kv-policy",
        choices=["full", "fit"],
        default="full",
        help="full: KV must hold max-batch full sequences; fit: KV takes the residual (>= 1)",
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
    from imp_mem._presets import PRESETS, preset

    if config.lower() in PRESETS:
        shape = imp_mem.ModelShape.from_hf_config(preset(config))
    elif os.path.exists(config):
        shape = imp_mem.ModelShape.from_hf_config(config)
    else:
        names = ", ".join(sorted(PRESETS))
        raise imp_mem.InvalidArgument(
            f"CONFIG: {config!r} is neither a config.json path nor a preset ({names})"
        )
    if weights_bytes is not None:
        shape = shape.with_weights_bytes(weights_bytes)
    return shape


def build_input(args: argparse.Namespace):
    """The PlanInput the arguments describe."""
    import imp_mem

    shape = load_shape(args.config, args.weights_bytes)
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
    features = imp_mem.Features(spec_depth=args.spec_depth)
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


def plot(path: str, charges: list[dict[str, Any]], budget: int, title: str) -> None:
    """Draws the budget as one stacked bar of charges, with the budget line."""
    import imp_mem

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise imp_mem.InvalidArgument(
            "--plot needs matplotlib, which is not installed: pip install 'imp-mem[plot]'"
        ) from exc
    fig, ax = plt.subplots(figsize=(5, 7))
    bottom = 0.0
    colors = plt.get_cmap("tab20").colors
    for i, charge in enumerate(charges):
        height = charge["bytes"] / (1 << 20)
        ax.bar(
            0,
            height,
            bottom=bottom,
            width=0.6,
            color=colors[i % len(colors)],
            label=f"{charge['label']} ({height:,.0f} MiB)",
        )
        bottom += height
    ax.axhline(
        budget / (1 << 20),
        color="black",
        linestyle="--",
        linewidth=1.5,
        label=f"budget ({budget / (1 << 20):,.0f} MiB)",
    )
    ax.set_xticks([])
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


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
    plan_input = build_input(args)
    shape, limits = plan_input.model, plan_input.limits
    title = (
        f"{args.config}: {limits.max_batch} x {limits.max_seq_len} tok, "
        f"tp {plan_input.tp}, KV {limits.kv_dtype or shape.dtype}"
    )
    try:
        plan = imp_mem.plan_memory(plan_input)
    except imp_mem.PlanFailure as failure:
        if args.json:
            print(
                json.dumps(
                    {
                        "error": "plan_failure",
                        "kind": failure.kind,
                        "budget": failure.budget,
                        "total": failure.total,
                        "over_by": failure.over_by,
                        "charges": failure.charges,
                        "levers": failure.levers,
                    },
                    indent=2,
                )
            )
        else:
            print(title)
            print(failure.report, end="")
        if args.plot:
            plot(args.plot, failure.charges, failure.budget, title + " (does not fit)")
        return EXIT_PLAN_FAILURE
    if args.json:
        print(plan.to_json())
    else:
        kv = plan.kv
        print(title)
        print(_charge_table(plan.charges, plan.total(), plan.budget))
        print(
            f"\nKV: {kv['blocks']} blocks of {kv['block_size']} tokens "
            f"({kv['bytes_per_token']} B/token) = {kv['full_sequences']} full sequences; "
            f"headroom {mib(plan.headroom)} MiB"
        )
    if args.plot:
        plot(args.plot, plan.charges, plan.budget, title)
        if not args.json:
            print(f"plot: {args.plot}", file=sys.stderr)
    return 0
