"""A memory plan drawn as one stacked bar: each charge, the budget line,
the headroom under it or the overflow above it, and for a plan that does
not fit its levers. ``imp-mem plan --plot`` saves this figure;
`plot_plan` returns it (``pip install imp-mem[plot]`` for matplotlib).

    fig = imp_mem.plot_plan(imp_mem.plan_memory(plan_input), title="qwen3-8b")
    fig.savefig("plan.png")
"""

from __future__ import annotations

from typing import Any


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or the install hint."""
    import imp_mem

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise imp_mem.InvalidArgument(
            "plotting a plan needs matplotlib, which is not installed: pip install 'imp-mem[plot]'"
        ) from exc
    return plt


def figure(
    charges: list[dict[str, Any]],
    budget: int,
    title: str = "",
    levers: list[dict[str, Any]] | None = None,
) -> Any:
    """Draws the budget as one stacked bar of charges (the legend lists them
    top to bottom as they are stacked), with the budget line, the headroom
    left under it, the overflow above it, and for a failed plan its levers.
    A charge too small to see at the bar's scale is drawn at a visible
    minimum height; its label keeps the true MiB. Returns the matplotlib
    figure (on the Agg backend; the caller saves or shows it)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 7))
    colors = plt.get_cmap("tab20").colors
    total = sum(c["bytes"] for c in charges)
    top = max(total, budget) / (1 << 20)
    smallest = top * 0.008
    bottom = 0.0
    handles = []
    for i, charge in enumerate(charges):
        size = charge["bytes"] / (1 << 20)
        height = max(size, smallest) if size > 0 else 0.0
        bar = ax.bar(
            0,
            height,
            bottom=bottom,
            width=0.6,
            color=colors[i % len(colors)],
            label=f"{charge['label']} ({size:,.0f} MiB)",
        )
        handles.append(bar)
        bottom += height
    budget_mib = budget / (1 << 20)
    if bottom < budget_mib:
        handles.append(
            ax.bar(
                0,
                budget_mib - bottom,
                bottom=bottom,
                width=0.6,
                color="none",
                edgecolor="grey",
                hatch="//",
                label=f"headroom ({(budget - total) / (1 << 20):,.0f} MiB)",
            )
        )
    elif total > budget:
        handles.append(
            ax.bar(
                0,
                bottom - budget_mib,
                bottom=budget_mib,
                width=0.7,
                color="none",
                edgecolor="red",
                hatch="xx",
                label=f"over budget by {(total - budget) / (1 << 20):,.0f} MiB",
            )
        )
    line = ax.axhline(
        budget_mib,
        color="black",
        linestyle="--",
        linewidth=1.5,
        label=f"budget ({budget_mib:,.0f} MiB)",
    )
    ax.set_xticks([])
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=10)
    if levers:
        text = "levers:\n" + "\n".join(
            f"{lv['setting']} {lv['from']} -> {lv['to']}: frees {lv['frees'] / (1 << 20):,.0f} MiB"
            + (" (enough alone)" if lv.get("sufficient") else "")
            for lv in levers
        )
        ax.text(1.04, 0.0, text, transform=ax.transAxes, fontsize=8, va="bottom")
    # Top of the legend = top of the stack.
    ordered = [line, *reversed(handles)]
    ax.legend(
        handles=ordered,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
        frameon=False,
    )
    return fig


def plot_plan(plan: Any, title: str = "") -> Any:
    """`plan` (a `MemoryPlan`, or the `PlanFailure` a plan that does not
    fit raises) as a matplotlib figure: `figure` of its charges and budget,
    with a failure's levers."""
    charges = getattr(plan, "charges", None)
    budget = getattr(plan, "budget", None)
    if charges is None or budget is None:
        import imp_mem

        raise imp_mem.InvalidArgument(
            f"plan: expected a MemoryPlan or a PlanFailure, got {type(plan).__name__}"
        )
    return figure(charges, budget, title, levers=getattr(plan, "levers", None))
