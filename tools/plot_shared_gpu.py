"""Draws ``bench_shared_gpu.py --json``'s bursts: one panel per model, each
request's time to first token against its arrival, the static third and the
shared GPU side by side, the model's burst window shaded. The H200 has no
matplotlib: run the bench there with ``--json``, draw here.

    python tools/plot_shared_gpu.py shared.json shared.png
"""

from __future__ import annotations

import argparse
import json
import sys


def plot(rows: list[dict], path: str) -> int:
    """Writes the figure to `path`; returns the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = next((r["trace"] for r in rows if "trace" in r), None)
    series = [r for r in rows if "ttft_at" in r and "setup" in r]
    if trace is None or not series:
        raise ValueError("no bursts in this JSON: write it with bench_shared_gpu.py --json")
    models = trace["models"]
    fig, axes = plt.subplots(
        len(models), 1, figsize=(9, 2.6 * len(models)), squeeze=False, sharex=True
    )
    ratios = {r["model"]: r["ttft_p99_ratio"] for r in rows if "ttft_p99_ratio" in r}
    for k, (model, ax) in enumerate(zip(models, axes[:, 0], strict=True)):
        start = trace["lead_s"] + k * trace["window_s"]
        ax.axvspan(start, start + trace["burst_s"], color="0.9", label="its burst")
        for r in series:
            if r["model"] != model or not r["ttft_at"]:
                continue
            at, ttft = zip(*r["ttft_at"], strict=True)
            style = {"shared": ("tab:blue", "o"), "static": ("tab:red", "x")}[r["setup"]]
            label = f"{r['setup']}: p99 {r['ttft_p99']:.3f} s"
            ax.scatter(at, ttft, s=9, color=style[0], marker=style[1], label=label)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ratio = f", p99 static / shared {ratios[model]:.2f}x" if model in ratios else ""
        ax.set_title(f"{model}{ratio}", fontsize=10)
        # The legend on the side away from the burst, so no point is hidden.
        end = trace["lead_s"] + len(models) * trace["window_s"]
        side = "upper left" if start > end / 2 else "upper right"
        ax.legend(fontsize=8, loc=side)
    axes[-1, 0].set_xlabel("arrival (s from the trace's start)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return len(models)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="bench_shared_gpu.py --json's output")
    ap.add_argument("png", help="the figure to write")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_shared_gpu: needs matplotlib (pip install 'imp-mem[plot]')", file=sys.stderr)
        return 2
    with open(args.json) as f:
        rows = json.load(f)
    try:
        n = plot(rows, args.png)
    except ValueError as exc:
        print(f"plot_shared_gpu: {exc}", file=sys.stderr)
        return 2
    print(f"{n} panels -> {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
