"""What :mod:`imp_mem.torch`, :mod:`imp_mem.cupy` and the engine share (no torch, no CuPy)."""

from __future__ import annotations

from typing import Any

from imp_mem import _core
from imp_mem.errors import InvalidArgument


def activations_of(target: Any) -> Any:
    """The ActivationPool of a MemorySystem, or ``target`` itself if it is one."""
    if isinstance(target, _core.ActivationPool):
        return target
    if not hasattr(target, "activations"):
        raise TypeError(
            "target: expected a MemorySystem (or anything with an activations tier) or an "
            f"ActivationPool, got {type(target).__name__}"
        )
    pool = getattr(target, "activations", None)
    if pool is None:
        raise InvalidArgument(
            "target: the memory system has no activations tier; plan one with "
            "Features(activation_bytes=...) (imp_mem.torch.measure_step_high_water "
            "measures it), or pass an ActivationPool"
        )
    return pool


def source_held(report: dict[str, Any]) -> int:
    """The bytes a backend's source holds past its ledger, as `report` (a
    ``mem_report()``) charges them on lines of their own: a VMM backend's
    handle cache and chunk rounding (the ``vmm_*`` charges). Device memory
    measured across a warm-up grows by these too, and they are not the
    warm-up's."""
    return sum(
        int(c["bytes"]) for c in report.get("charges", ()) if str(c["key"]).startswith("vmm_")
    )
