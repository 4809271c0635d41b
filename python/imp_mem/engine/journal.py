"""V8 on a recorded load: replay a backend journal against the plan.

A journal is the backend's list of `(seq, phase, tag, bytes, op)` rows
(`Backend.journal()`, on a device backend after `enable_journal()`). The
replay keeps a running total per tag (acquire and commit add, release and
decommit subtract) and checks, after every row, that no tag holds more
than the plan gave its tier — rounded up to the backend's granularity, the
unit a region is acquired in — and that the total stays within the budget
less the context and library reserve. It also checks that nothing was
acquired while SERVING. Pure Python (no torch), so CI replays journals
recorded on a GPU.

The file format (`save` / `load`): JSON with `journal` (the rows), `plan`
(`MemoryPlan.to_json()`), `granularity`, and free-form `about`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The tag of each tier's regions -> the plan's line for it.
_LINES = {
    "workspace": lambda p: p.engine_persistent,
    "weights": lambda p: p.model_resident,
    "scratch": lambda p: p.scratch,
    "kv_cache": lambda p: p.kv["bytes"],
    "swa_cache": lambda p: (p.swa or {}).get("bytes", 0),
    "state": lambda p: sum(pool["bytes"] for pool in p.pools),
}


@dataclass
class Replay:
    """What a replay found: per tag the peak and the plan's limit, and every
    row that broke a rule (empty when V8 holds)."""

    peaks: dict[str, int] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    peak_total: int = 0
    total_limit: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def plan_limits(plan: Any, granularity: int) -> dict[str, int]:
    """Each tag's limit: its plan line rounded up to `granularity`."""
    g = max(1, granularity)
    return {tag: -(-int(line(plan)) // g) * g for tag, line in _LINES.items()}


def replay(rows: list[Any], plan: Any, granularity: int) -> Replay:
    """Replays `rows` against `plan` (V8); see the module doc."""
    out = Replay(limits=plan_limits(plan, granularity))
    out.total_limit = int(plan.budget) - int(plan.context) - int(plan.library_reserve)
    running: dict[str, int] = {}
    total = 0
    for row in rows:
        seq, phase, tag, nbytes, op = row
        sign = {"acquire": 1, "commit": 1, "release": -1, "decommit": -1}.get(op)
        if sign is None:
            out.violations.append(f"row {seq}: unknown op {op!r}")
            continue
        if sign > 0 and phase == "SERVING":
            out.violations.append(f"row {seq}: {op} of {nbytes} B for {tag} while SERVING")
        running[tag] = running.get(tag, 0) + sign * int(nbytes)
        total += sign * int(nbytes)
        out.peaks[tag] = max(out.peaks.get(tag, 0), running[tag])
        out.peak_total = max(out.peak_total, total)
        limit = out.limits.get(tag, 0)
        if running[tag] > limit:
            out.violations.append(
                f"row {seq}: {tag} holds {running[tag]} B, above the plan's {limit} B"
            )
        if total > out.total_limit:
            out.violations.append(f"row {seq}: {total} B in all, above {out.total_limit} B")
    return out


def save(path: str | Path, rows: list[Any], plan: Any, granularity: int, about: str) -> None:
    """Writes a journal file (see the module doc)."""
    doc = {
        "about": about,
        "granularity": int(granularity),
        "plan": json.loads(plan.to_json()),
        "journal": [list(r) for r in rows],
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load(path: str | Path) -> tuple[list[Any], Any, int, str]:
    """`(rows, plan, granularity, about)` of a journal file."""
    from imp_mem import MemoryPlan

    doc = json.loads(Path(path).read_text())
    plan = MemoryPlan.from_json(json.dumps(doc["plan"]))
    return [tuple(r) for r in doc["journal"]], plan, int(doc["granularity"]), doc["about"]


def record_engine_load(backend: Any, directory: str | Path, **engine_kw: Any) -> tuple:
    """Opens an `Engine` over `directory` on `backend` with the journal on,
    serves two short requests, and returns `(rows, plan, granularity)`: the
    journal of the whole load (plan, tiers, weights, warm-up, capture) and of
    serving, taken before the engine closes. Needs torch."""
    from imp_mem.engine.llm_engine import Engine

    backend.enable_journal()
    with Engine(directory, backend=backend, **engine_kw) as engine:
        engine.generate([[1, 2, 3], [4, 5, 6, 7]], 4)
        rows = list(backend.journal() or [])
        plan = engine.plan
    return rows, plan, int(backend.granularity)
