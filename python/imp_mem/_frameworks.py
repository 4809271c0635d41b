"""What :mod:`imp_mem.torch` and :mod:`imp_mem.cupy` share (no torch, no CuPy)."""

from __future__ import annotations

from typing import Any

from imp_mem import _core
from imp_mem.errors import InvalidArgument


def activations_of(target: Any) -> Any:
    """The ActivationPool of a MemorySystem, or ``target`` itself if it is one."""
    if isinstance(target, _core.ActivationPool):
        return target
    pool = getattr(target, "activations", None)
    if pool is None:
        raise InvalidArgument(
            "target: the memory system has no activations tier; plan one with "
            "Features(activation_bytes=...) (imp_mem.torch.measure_step_high_water "
            "measures it), or pass an ActivationPool"
        )
    return pool
