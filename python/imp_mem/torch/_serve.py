"""One call for a process (:func:`serve`): a VMM backend, a plan of one tier
(the activations, *measured*: it grows while the caller's warm-up runs) and
that tier made torch's allocator; :class:`Served` freezes it at
``begin_serving()`` and remembers its figure (:mod:`imp_mem.measured`), so
the next start plans it at that size and does not measure."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from imp_mem import _core, _jsonfile
from imp_mem import measured as _measured
from imp_mem._format import byte_count, human_bytes
from imp_mem._frameworks import source_held
from imp_mem.errors import ImpMemWarning, InvalidArgument, PhaseViolation
from imp_mem.torch._graphs import graph_pool
from imp_mem.torch._hooks import _device_index
from imp_mem.torch._pools import Pool, install

DEFAULT_CHUNK = 2 << 20
"""Bytes a measured tier commits at a time while it grows (:func:`serve`)."""
DEFAULT_MARGIN = 0.002
"""The margin :func:`serve` keeps above the measured high-water: a share of
it. Small, because the same work reaches the same high-water: on the H200,
HF Qwen3-0.6B's generate() (32 x 1 024 + 64) served and started again at
margin 0 with 0 fallbacks, and its allocation sequence recorded there
replays on the fake backend to the byte of the H200's high-water (1.0158 of
the live peak). Work past the frozen tier is not refused in
``mode="process"``: it falls back to the backend and is counted
(``fallbacks_total``). At 1 % the tier came to 1.026 of HF's live peak;
at 0.2 % to 1.018 (H200, both starts, 0 fallbacks)."""
DEFAULT_SCOPE_MARGIN = 64 << 20
"""The margin in ``mode="scope"``, in bytes: torch's caching allocator takes
its MemPool's memory in whole segments (20 MiB for a 1-10 MiB request, the
request rounded to 2 MiB above that) from a strict tier, so the served run
can need a segment or two past the warm-up's arrangement, and a segment past
the tier is torch's OutOfMemoryError, not a fallback. A share of a small
tier is less than a segment. HF's quick generate() (8 x 256 + 16) served
at this margin on the H200 once ``begin_serving`` kept the warm-up's pool
(1.069 of HF's live peak, 2026-12-03, issue 28); its earlier failures, at 0.2 % and
at this margin, came from the fresh pool ``begin_serving`` used to swap
in."""


def _held_by_backend(system: Any) -> int:
    """The device bytes the backend holds: its regions' commits and what its
    source keeps past them (a VMM backend's handle cache and chunk
    rounding, which the report charges on lines of their own). The growth
    of this across the warm-up is not torch's: a warm-up whose fallback
    regions went back to the handle cache had those bytes charged twice,
    as torch's runtime and as the cache (H200, 2026-12-04, issue 28: attribution
    100.06 % on a second start)."""
    return int(system.backend.stats()["committed"]) + source_held(system.mem_report())


class Served:
    """What :func:`serve` returns: the :class:`~imp_mem.MemorySystem` (every
    attribute of it is here too) plus the figures of the start.

    ``begin_serving()`` measures the device memory the warm-up took outside
    every allocator (torch's runtime, kernels loaded into the context,
    library handles) and charges it (``torch_runtime``), then freezes the
    measured tier and remembers its figure under the fingerprint."""

    def __init__(
        self,
        system: Any,
        *,
        device: int,
        mode: str,
        fingerprint: dict[str, Any] | None,
        cache_path: Any,
        recalled: dict[str, int] | None,
        other_processes: int,
        plan_passes: bool = True,
    ) -> None:
        self.system = system
        self.device = device
        self.mode = mode
        self.fingerprint = fingerprint
        self.cache_path = cache_path
        self.recalled = recalled
        self.other_processes = other_processes
        self.remembered: Any = None
        self.outside_charge: int | None = None
        self._free_at_open = _core.cuda_mem_get_info(device)[0] if device >= 0 else 0
        self._held_at_open = _held_by_backend(system)
        self.pool: Pool | None = None
        # A float margin: a share of the high-water, known at the freeze.
        self.margin_share: float | None = None
        self.plan_passes = plan_passes
        # What begin_serving() laid out of the recorded pass
        # (ActivationPool.plan_pass), or None.
        self.pass_plan: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.system, name)

    @property
    def measuring(self) -> bool:
        """Whether this start measures (no figure was remembered)."""
        return self.recalled is None

    def reset_high_water(self) -> None:
        """Forgets the measured peak of what ran so far (a ``torch.compile``,
        a first warm-up): the high-water starts again from the tensors live
        now, and the freeze decommits the chunks only that needed. Call it
        before the last warm-up pass, outside :meth:`scope` (in the scope
        mode it first trims torch's cache inside the pool, which only takes
        effect outside it).

        In ``mode="process"`` it also starts recording that pass
        (``ActivationPool.record_pass``): :meth:`begin_serving` lays it out
        with every lifetime known and, where that needs less than the
        pass's own high-water, freezes the tier at the layout's top and
        places the served passes' blocks where the layout put them
        (:attr:`pass_plan`). So the last warm-up should be one pass of the
        work the server repeats."""
        if self.system.phase == _core.Phase.SERVING:
            raise PhaseViolation(
                "reset_high_water: the tier was frozen at begin_serving(); it is for the "
                "warm-up (after a compile, before the last warm-up pass)"
            )
        if self.device >= 0 and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        if self.pool is not None:
            self.pool.trim()
        act = self.system.activations
        if act is not None:
            act.reset_high_water()
            if self.mode == "process" and self.plan_passes:
                act.record_pass()

    @contextlib.contextmanager
    def scope(self) -> Iterator[Served]:
        """``mode="scope"``: the block's torch allocations go to the tier (a
        MemPool over it), and CUDA graphs torch's compiler captures in it too
        (:func:`graph_pool`); ``mode="process"``: every allocation already
        does, so this is a no-op."""
        if self.pool is None:
            yield self
            return
        with self.pool.scope(), graph_pool(self.pool):
            yield self

    def begin_serving(self) -> None:
        """Charges what the warm-up took outside every allocator, freezes the
        measured tier (high-water + margin; the rest decommitted) and
        remembers its figure under the fingerprint; then SERVING.

        The scope mode's pool is kept as the warm-up left it: its cached
        segments are the served work's (a fresh pool, as :meth:`Pool.trim`
        makes, could not use the free parts of the segments still holding
        the weights, and ran out of a tier measured with them: H200,
        2026-12-03, issue 28). torch's cache in it is in the tier's high-water: torch
        2.11 gives a live ``MemPool``'s cached segments back to a refusing
        allocator only when they are at least ``max_split_size_mb`` (unset,
        none are; ``tools/probe_mempool_release.py``), and setting it
        took the H200's scope run from 1.310 to 1.608 (256 MiB) and 2.667
        (64 MiB) of HF's live peak (``tools/sweep_scope_split.py``), as
        oversize blocks are never split for smaller requests."""
        if self.device >= 0 and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        if self.device >= 0 and self.outside_charge is None:
            free, _ = _core.cuda_mem_get_info(self.device)
            held = _held_by_backend(self.system)
            charge = max(0, (self._free_at_open - free) - (held - self._held_at_open))
            self.system.set_charge(
                "torch_runtime", charge, "torch runtime + kernels + library handles (measured)"
            )
            self.outside_charge = charge
        act = self.system.activations
        if act is not None and act.recording:
            # The recorded pass laid out: a measuring tier's high-water
            # becomes the layout's top where that is lower.
            try:
                self.pass_plan = act.plan_pass()
            except InvalidArgument as exc:  # a pass too long to record
                warnings.warn(
                    f"imp_mem.torch: the warm-up pass was not laid out ({exc}); the tier is "
                    "frozen at its measured high-water",
                    ImpMemWarning,
                    stacklevel=2,
                )
        if self.margin_share is not None and act is not None and act.measuring:
            act.freeze(int(act.high_water * self.margin_share))
        self.system.begin_serving()
        if self.recalled is None and self.fingerprint is not None:
            for line in self.system.measured():
                if line["state"] != "frozen":
                    continue
                try:
                    self.remembered = _measured.remember(
                        self.fingerprint, line, line["tier"], self.cache_path
                    )
                except OSError as exc:
                    _jsonfile.warn_not_remembered(
                        "imp_mem.torch: the measured figure",
                        exc,
                        "IMP_MEM_CACHE_DIR (or cache_path=)",
                    )

    def close(self) -> dict[str, Any]:
        """Closes the scope mode's :class:`Pool` (its MemPools go back to the
        tier, the tier leaves the hooks) and then the system; the system's
        closing report. In ``mode="process"`` the tier stays torch's
        allocator for the process (torch cannot change it back), so its
        memory is released when the process ends."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        return self.system.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def report(self) -> dict[str, Any]:
        """``mem_report`` with the device reading, less what other processes
        held at the start."""
        return self.system.mem_report(device=True, other_processes=self.other_processes)

    def report_text(self) -> str:
        """The text of :meth:`report`."""
        return self.system.mem_report_text(device=True, other_processes=self.other_processes)

    def __repr__(self) -> str:
        state = "measuring" if self.recalled is None else f"recalled {self.recalled['size']} B"
        return f"imp_mem.torch.Served(device={self.device}, mode={self.mode!r}, {state})"


def _check_mode(mode: Any) -> None:
    if mode not in ("process", "scope"):
        raise InvalidArgument(f'mode: expected "process" or "scope", got {mode!r}')


def default_margin(mode: str) -> float | int:
    """:func:`serve`'s margin where none is given: `DEFAULT_SCOPE_MARGIN` in
    ``mode="scope"``, `DEFAULT_MARGIN` in ``mode="process"``."""
    _check_mode(mode)
    return DEFAULT_SCOPE_MARGIN if mode == "scope" else DEFAULT_MARGIN


def _check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise InvalidArgument(
            f"margin: expected a share of the high-water (a float such as 0.01) or bytes "
            f"(an int), non-negative; got {margin!r}"
        )


def serve(
    budget: Any = None,
    *,
    device: Any = None,
    fingerprint: Any = None,
    shapes: Any = None,
    margin: float | int | None = None,
    chunk: Any = DEFAULT_CHUNK,
    mode: str = "process",
    cache_path: Any = None,
    backend: Any = None,
    other_processes: int | None = None,
    plan_passes: bool = True,
) -> Served:
    """One call for a process: a VMM backend on ``device`` (its handles
    ``chunk`` bytes, so the tier's freeze rounds up to one chunk) and a
    :class:`~imp_mem.MemorySystem` for ``budget`` (default: the device's
    memory less what other processes hold) with one tier, the activations
    tier, *measured* (it grows in ``chunk``-byte commits while the warm-up
    runs, addresses never moving) and no KV pool; the tier is then made
    torch's allocator (``mode="process"``: process-wide, so call this before
    torch's first CUDA tensor; ``mode="scope"``: a MemPool over it, entered
    with ``served.scope()``). Returns a :class:`Served`.

    The warm-up is the caller's code between this and
    ``served.begin_serving()``, which freezes the tier at its high-water plus
    ``margin`` (a float: a share of the high-water; an int: bytes; default
    `DEFAULT_MARGIN`, `DEFAULT_SCOPE_MARGIN` in the scope mode), rounded
    up to a chunk, and remembers the figure under ``fingerprint`` (the
    model's identity; with ``shapes`` and the torch / CUDA / driver versions,
    see :mod:`imp_mem.measured`). A later start with the same fingerprint
    plans the tier at the remembered size, committed at open, and does not
    measure (``served.measuring`` is False).

    ``plan_passes`` (``mode="process"``): the pass after
    ``served.reset_high_water()`` is recorded and laid out offline at
    ``begin_serving()``, and the served passes follow that layout
    (:meth:`Served.reset_high_water`); False keeps the ordinary placement.
    The layout is for work that repeats the recorded pass (the same shapes):
    other work is placed by the ordinary search in a tier sized for the
    layout, and what does not fit falls back (counted, ``fallbacks_total``),
    so warm up with the pass the server repeats. A later start must run the
    same warm-up (the same reset) to plan its remembered size the same way."""
    if not isinstance(plan_passes, bool):
        raise TypeError(f"plan_passes: expected a bool, got {type(plan_passes).__name__}")
    if cache_path is not None and not isinstance(cache_path, (str, os.PathLike)):
        raise TypeError(
            f"cache_path: expected a path (str or os.PathLike), got {type(cache_path).__name__}"
        )
    if other_processes is not None:
        if isinstance(other_processes, bool) or not isinstance(other_processes, int):
            raise TypeError(
                f"other_processes: expected bytes as an int, got {type(other_processes).__name__}"
            )
        if other_processes < 0:
            raise InvalidArgument(
                f"other_processes: expected the bytes other processes hold (0 or more), got "
                f"{other_processes}"
            )
    if fingerprint is not None:
        if fingerprint == "":
            raise InvalidArgument(
                "fingerprint: expected the model's identity (its name, or its config dict); "
                "pass None to measure every start"
            )
        _measured.check_plain(fingerprint, "fingerprint")
        _measured.check_plain(shapes, "shapes")
    _check_mode(mode)
    if margin is None:
        margin = default_margin(mode)
    _check_margin(margin)
    from imp_mem import MemorySystem, VmmBackend
    from imp_mem import _core as core

    dev = 0 if device is None else _device_index(device)
    if other_processes is None:
        if backend is None:
            from imp_mem.reserve import device_used_by_all_processes

            other_processes = device_used_by_all_processes(dev) or 0
        else:
            other_processes = 0
    chunk_bytes = byte_count(chunk, "chunk")
    if backend is None:
        # Handles of one chunk, so the freeze rounds the tier up to a chunk,
        # not to the backend's default 64 MiB handle (measured on the H200,
        # HF Qwen3-0.6B 32 x 1 024 + 64: reserved / live peak 1.040 with
        # 64 MiB handles, 1.029 with 2 MiB, tokens/s unchanged).
        backend = VmmBackend(dev, chunk_bytes=chunk_bytes)
    is_device = not isinstance(backend, core.FakeBackend)
    fp = None
    recalled = None
    if fingerprint is not None:
        # The GPU's name from the backend's driver, not torch's: asking torch
        # initialises its allocator, which install() must still swap.
        env = _measured.environment(dev, getattr(backend, "device_name", None))
        fp = _measured.fingerprint(fingerprint, shapes, device=dev, env=env)
        recalled = _measured.recall(fp, "activations", cache_path)
    if is_device:
        free, total = core.cuda_mem_get_info(dev)
        context = max(0, total - free - other_processes)
        capacity = total - other_processes
    else:
        context, capacity = 0, int(backend.stats()["capacity"])
    plan_budget = capacity if budget is None else byte_count(budget, "budget")
    if plan_budget > capacity:
        raise InvalidArgument(
            f"budget: {human_bytes(plan_budget)} is more than the device offers "
            f"({human_bytes(capacity)}, after the {human_bytes(other_processes)} other "
            "processes hold); give at most that, or None for all of it"
        )
    tier = _tier_bytes(plan_budget, context)
    if tier <= 0:
        raise InvalidArgument(
            f"budget: {plan_budget} B leaves nothing for the tier after the CUDA context "
            f"({context} B); give a larger budget"
        )
    if recalled is not None:
        tier = min(tier, recalled["size"])
    plan = _placeholder_plan(tier, plan_budget, context)
    measure = None if recalled is not None else chunk_bytes
    system = MemorySystem(
        backend,
        plan,
        context=context,
        library_reserve=0,
        activation_strict=mode == "scope",
        activation_measure=measure,
        activation_margin=0 if isinstance(margin, float) else int(margin),
    )
    served = Served(
        system,
        device=dev if is_device else -1,
        mode=mode,
        fingerprint=fp,
        cache_path=cache_path,
        recalled=recalled,
        other_processes=other_processes,
        plan_passes=plan_passes,
    )
    if isinstance(margin, float):
        served.margin_share = margin
    try:
        if mode == "process":
            if is_device:
                install(system, device=dev)
        else:
            served.pool = Pool(system, device=dev)
    except BaseException:
        # Nothing of it reached the caller: its memory goes back now.
        system.close()
        raise
    return served


def _tier_bytes(budget: int, context: int) -> int:
    """The most whole MiB the tier can have beside `context` in `budget`,
    as the planner rounds them (the core's ``MemoryPlan.activations_room``)."""
    return _core.MemoryPlan.activations_room(budget, context)


def _placeholder_plan(tier: int, budget: int, context: int) -> Any:
    """A plan of one tier: the activations (``tier`` bytes), no weights, no
    KV pool, no scratch; the context charged as measured (the core's
    ``MemoryPlan.activations_only``)."""
    return _core.MemoryPlan.activations_only(budget, context, tier)
