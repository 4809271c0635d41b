"""One ``MemorySystem`` per rank under ``torch.distributed``, and the fleet's
memory report gathered on one rank.

Each process of a tensor-parallel group plans its own share (``plan_memory``
with ``tp`` set to the group's size computes the per-rank KV heads, weights
and activations) and opens its system on its own device. Opening is
collective: every rank opens, then all of them learn whether every rank
succeeded, and if one failed, every rank closes what it opened and raises
the same :class:`RankFailure`, so no rank is left serving beside a dead
peer and nothing is held::

    import torch.distributed as dist
    from imp_mem import VmmBackend, plan_memory
    from imp_mem.distributed import gather_reports, open_rank_system

    dist.init_process_group("nccl")            # gloo on the CPU
    plan = plan_memory(plan_input)             # plan_input.tp == dist.get_world_size()
    system = open_rank_system(lambda rank: VmmBackend(device=rank), plan)
    ...
    fleet = gather_reports(system)             # a FleetReport on rank 0, None elsewhere
    if fleet is not None:
        print(fleet.text())

``FleetReport`` needs no torch: it is built from the report dicts
(``MemorySystem.mem_report()``) of every rank, however they were gathered.
torch is imported only by the collective functions. With NCCL, keep NVLink
multicast off (``NCCL_NVLS_ENABLE=0``) where the machine requires it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from imp_mem._core import Backend, MemoryPlan, MemorySystem
from imp_mem._format import human_bytes
from imp_mem.errors import ImpMemError, InvalidArgument

__all__ = ["FleetReport", "RankFailure", "agree", "gather_reports", "open_rank_system"]


class RankFailure(ImpMemError):
    """A collective step failed on one or more ranks; every rank raised it.

    ``failures`` maps each failed rank to its error's text (its class name
    first); ``rank`` is the rank that raised this copy.
    """

    failures: dict[int, str]
    rank: int

    def __init__(self, rank: int, failures: dict[int, str], step: str) -> None:
        lines = "; ".join(f"rank {r}: {text}" for r, text in sorted(failures.items()))
        super().__init__(
            f"{step} failed on {len(failures)} of the ranks ({lines}); every rank "
            "closed what it had opened"
        )
        self.failures = dict(failures)
        self.rank = rank


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "imp_mem.distributed's collective functions need torch "
            "(pip install torch); FleetReport does not"
        ) from e
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgument(
            "group: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    return dist


def agree(step: str, error: BaseException | None, *, group: Any = None) -> None:
    """Every rank learns whether every rank got through `step`: returns when
    none failed, else raises :class:`RankFailure` on every rank (chained to
    this rank's own `error`, if any). Every rank must call it, after its
    attempt and before its next collective; the caller closes what it
    opened."""
    dist = _dist()
    world = dist.get_world_size(group)
    text = "" if error is None else f"{type(error).__name__}: {error}"
    outcomes: list[str] = [""] * world
    dist.all_gather_object(outcomes, text, group=group)
    failures = {r: t for r, t in enumerate(outcomes) if t}
    if failures:
        raise RankFailure(dist.get_rank(group), failures, step) from error


def open_rank_system(
    make_backend: Callable[[int], Backend],
    plan: MemoryPlan,
    *,
    group: Any = None,
    local_rank: int | None = None,
    **system_kwargs: Any,
) -> MemorySystem:
    """Opens this rank's ``MemorySystem`` for ``plan``, collectively.

    ``make_backend(local_rank)`` builds the rank's backend (its device);
    ``local_rank`` defaults to the rank in ``group`` (one process per
    device). ``plan.tp`` must equal the group's size: each rank opens its
    own share. Every rank must call this; it returns once every rank has
    opened, or raises :class:`RankFailure` on every rank when any failed,
    after closing what this rank opened. ``system_kwargs`` go to
    ``MemorySystem`` (``context=``, ``strict=``, ...).
    """
    dist = _dist()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if plan.tp != world:
        raise InvalidArgument(
            f"plan: planned for tp={plan.tp} but the group has {world} ranks; "
            f"plan with PlanInput(..., tp={world})"
        )
    device = rank if local_rank is None else local_rank
    system: MemorySystem | None = None
    error: Exception | None = None
    try:
        system = MemorySystem(make_backend(device), plan, **system_kwargs)
    except Exception as e:  # every rank must reach the agreement below
        error = e
    try:
        agree("opening the memory system", error, group=group)
    except RankFailure:
        if system is not None:
            system.close()
        raise
    assert system is not None
    return system


def gather_reports(
    system: MemorySystem,
    *,
    group: Any = None,
    dst: int = 0,
    device: tuple[int, int] | bool | None = None,
    other_processes: int | None = None,
) -> FleetReport | None:
    """Every rank's ``mem_report()`` gathered on rank ``dst`` (of
    ``group``) as a :class:`FleetReport`; ``None`` on the other ranks.
    Every rank must call it. ``device`` and ``other_processes`` are passed
    to each rank's own ``mem_report``."""
    dist = _dist()
    world = dist.get_world_size(group)
    if not 0 <= dst < world:
        raise InvalidArgument(f"dst: rank {dst} is not in a group of {world} ranks")
    report = system.mem_report(device=device, other_processes=other_processes)
    report["rank"] = dist.get_rank(group)
    gathered: list[Any] = [None] * world
    # all_gather_object rather than gather_object: the latter needs the
    # NCCL device to be set per rank, and the reports are small.
    dist.all_gather_object(gathered, report, group=group)
    if dist.get_rank(group) != dst:
        return None
    return FleetReport(gathered)


@dataclass(frozen=True)
class RankRow:
    """One rank's line of a :class:`FleetReport`."""

    rank: int
    device_ordinal: int
    backend: str
    phase: str
    plan_total: int
    committed: int
    attributed: int
    charges: int
    headroom: int
    headroom_from: str
    steady_state_allocations: int
    tiers: dict[str, int]


def _row(rank: int, report: dict[str, Any]) -> RankRow:
    charges = sum(int(c["bytes"]) for c in report.get("charges", []))
    device = report.get("device")
    if device:
        headroom, source = int(device["free"]), "device free"
    else:
        headroom, source = int(report["plan_headroom"]), "plan headroom"
    tiers = {t["key"]: int(t["committed"]) for t in report.get("tiers", [])}
    return RankRow(
        rank=int(report.get("rank", rank)),
        device_ordinal=int(report["device_ordinal"]),
        backend=str(report["backend"]),
        phase=str(report["phase"]),
        plan_total=int(report["plan_total"]),
        committed=int(report["backend_committed"]),
        attributed=int(report["attributed"]),
        charges=charges,
        headroom=headroom,
        headroom_from=source,
        steady_state_allocations=int(report["steady_state_allocations_total"]),
        tiers=tiers,
    )


# The RankRow fields a fleet adds up.
_TOTALS = ("plan_total", "committed", "attributed", "charges", "steady_state_allocations")


class FleetReport:
    """The memory reports of every rank, as one table.

    Built from the dicts ``MemorySystem.mem_report()`` returns, one a rank,
    in rank order (``gather_reports`` does that; any other transport may
    too). ``rows`` holds a :class:`RankRow` a rank; the totals add the
    ranks up; ``worst`` is the rank with the least headroom (device free
    memory where the reports read the device, else the plan's headroom).
    """

    def __init__(self, reports: Sequence[dict[str, Any]]) -> None:
        if not reports:
            raise InvalidArgument("reports: a fleet report needs at least one rank's report")
        try:
            self.rows = [_row(i, r) for i, r in enumerate(reports)]
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(
                f"reports: each item must be a MemorySystem.mem_report() dict ({e!r} missing "
                "or malformed)"
            ) from e
        ranks = [row.rank for row in self.rows]
        if len(set(ranks)) != len(ranks):
            raise InvalidArgument(f"reports: ranks repeat ({ranks}); give one report a rank")
        self.reports = list(reports)

    @property
    def world_size(self) -> int:
        return len(self.rows)

    def total(self, field: str) -> int:
        """The sum over the ranks of one :class:`RankRow` byte field
        (``committed``, ``attributed``, ``plan_total``, ``charges``,
        ``steady_state_allocations``)."""
        return sum(int(getattr(row, field)) for row in self.rows)

    @property
    def worst(self) -> RankRow:
        """The rank with the least headroom."""
        return min(self.rows, key=lambda row: (row.headroom, row.rank))

    def tier_keys(self) -> list[str]:
        keys: list[str] = []
        for row in self.rows:
            keys += [k for k in row.tiers if k not in keys]
        return keys

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "ranks": [row.__dict__ for row in self.rows],
            "totals": {
                f: self.total(f)
                for f in (
                    "plan_total",
                    "committed",
                    "attributed",
                    "charges",
                    "steady_state_allocations",
                )
            },
            "worst_rank": self.worst.rank,
            "worst_headroom": self.worst.headroom,
        }

    def text(self) -> str:
        """The fleet as one table: a rank a row, per-tier committed bytes,
        the charges outside the tiers, totals, and the worst rank's headroom."""
        mib = 1 << 20
        keys = self.tier_keys()
        head = ["rank", "device", "phase", *keys, "charges", "attributed", "headroom", "allocs"]
        lines = [
            [str(r.rank), f"{r.backend}:{r.device_ordinal}", r.phase]
            + [f"{r.tiers.get(k, 0) / mib:.1f}" for k in keys]
            + [
                f"{r.charges / mib:.1f}",
                f"{r.attributed / mib:.1f}",
                f"{r.headroom / mib:.1f}",
                str(r.steady_state_allocations),
            ]
            for r in self.rows
        ]
        totals = (
            ["all", "", ""]
            + [f"{sum(r.tiers.get(k, 0) for r in self.rows) / mib:.1f}" for k in keys]
            + [
                f"{self.total('charges') / mib:.1f}",
                f"{self.total('attributed') / mib:.1f}",
                "",
                str(self.total("steady_state_allocations")),
            ]
        )
        widths = [max(len(row[i]) for row in [head, *lines, totals]) for i in range(len(head))]

        def fmt(cells: Iterable[str]) -> str:
            return "  ".join(
                c.ljust(w) if i < 3 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )

        rule = "  ".join("-" * w for w in widths)
        worst = self.worst
        out = [
            f"imp-mem fleet memory report: {self.world_size} ranks (MiB)",
            "",
            fmt(head),
            rule,
            *(fmt(line) for line in lines),
            rule,
            fmt(totals),
            "",
            f"worst headroom: rank {worst.rank}, {human_bytes(worst.headroom)} "
            f"({worst.headroom_from})",
            f"steady-state allocations while serving, all ranks: "
            f"{self.total('steady_state_allocations')}",
        ]
        return "\n".join(out)
