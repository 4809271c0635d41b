"""Measuring what torch's work takes: the peak a step allocates on torch's
own allocator (the activations tier's size for the plan,
:func:`measure_step_high_water`) and the device memory a warm-up takes
outside every allocator, charged to the system
(:func:`measure_outside_charge`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from imp_mem import _core
from imp_mem.errors import BackendUnavailable, InvalidArgument
from imp_mem.torch._hooks import _device_index


def measure_step_high_water(step: Callable[[], Any], *, warmup: int = 1, device: Any = None) -> int:
    """The peak bytes torch allocates during ``step()`` (after ``warmup`` calls),
    measured on torch's default allocator: the number to plan the activations
    tier with (``Features(activation_bytes=...)``, seed A3.3)."""
    if not callable(step):
        raise TypeError(f"step: expected a callable, got {type(step).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup: expected an int, got {type(warmup).__name__}")
    if warmup < 0:
        raise InvalidArgument(
            f"warmup: expected 0 or more calls before the measured one, got {warmup}"
        )
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "measure_step_high_water: torch sees no CUDA device; it measures torch's own "
            "allocator on the GPU"
        )
    dev = _device_index(device)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    return int(torch.cuda.max_memory_allocated(dev) - base)


def measure_outside_charge(
    system: Any, warmup: Callable[[], Any], *, device: int | None = None, key: str = "torch_runtime"
) -> int:
    """Measures the device memory ``warmup()`` takes outside every allocator
    (torch's own runtime when it initialises there, kernels loaded lazily into
    the context, library handles) and charges it to ``system`` under ``key``,
    so the report names it.

    The charge is the growth of the device's used memory over the whole warm-up
    (read through the driver, so torch need not be initialised before), less
    the growth of what the backend committed; run the real workload's warm-up
    (the window of lazily loaded kernels is what varies, not the charge)."""
    dev = 0 if device is None else int(device)
    free0, _ = _core.cuda_mem_get_info(dev)
    committed0 = int(system.backend.stats()["committed"])
    warmup()
    torch.cuda.synchronize(dev)
    free1, _ = _core.cuda_mem_get_info(dev)
    committed1 = int(system.backend.stats()["committed"])
    charge = max(0, (free0 - free1) - (committed1 - committed0))
    total = _outside_charges.get((id(system), key), 0) + charge
    _outside_charges[(id(system), key)] = total
    system.set_charge(key, total, "torch kernels + library handles (measured)")
    return charge


_outside_charges: dict[tuple[int, str], int] = {}
