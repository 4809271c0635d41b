"""The allocator hooks, as torch reaches them: imp-mem's extension module
exports two C entry points (``imp_mem_torch_malloc`` / ``imp_mem_torch_free``)
that torch loads as one ``CUDAPluggableAllocator`` per process, and this
module says which tier they serve. One tier at a time is *installed* (every
MemPool scope without a tier of its own reaches it); another tier is a hook
*region*, which a thread selects for a block (:func:`_hook_region`, a stack
per thread). Beside them: the device helpers, the chores a tier's close
needs from torch (dropped MemPools released, cuBLAS workspaces cleared), and
the tier's counters under torch's key names.

Thread safety: ``_lock`` guards the installed tier and the set of open
Pools; ``_made_lock`` (re-entrant, taken before ``_lock``, never inside)
guards finding or making a Pool or a region and releasing a region.

The other modules call :func:`pluggable_allocator` and
:func:`_clear_cublas_workspaces` as ``_hooks.<name>``, so that a stand-in set
on this module (the CPU tests' torch, ``tests/_torch_standins.py``) reaches
every caller.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from imp_mem import _core
from imp_mem._frameworks import activations_of as _activations_of
from imp_mem.errors import InvalidArgument, PhaseViolation

if TYPE_CHECKING:
    from imp_mem.torch._pools import Pool


MALLOC_SYMBOL = "imp_mem_torch_malloc"
FREE_SYMBOL = "imp_mem_torch_free"

_lock = threading.Lock()
# Held while a Pool or a region is found or made (``pool()``, ``region()``)
# or a region released; re-entrant, and taken before ``_lock``, never inside.
_made_lock = threading.RLock()
_installed: dict[str, Any] = {"activations": None, "device": None, "process_wide": False}
_open: weakref.WeakSet[Pool] = weakref.WeakSet()
"""The open Pools (:mod:`imp_mem.torch._pools`): while one over the installed
tier is open, another tier becomes a hook region (:func:`_install_hooks`);
the last one of a tier closed takes the tier out of the hooks (one dropped
unclosed no longer counts)."""


def library_path() -> str:
    """The shared object that exports the allocator entry points (imp-mem's own
    extension module)."""
    return _core.hook_library_path()


@functools.lru_cache(maxsize=1)
def pluggable_allocator() -> torch.cuda.memory.CUDAPluggableAllocator:
    """torch's view of the entry points; one per process (the entry points route
    to whichever tier is installed)."""
    return torch.cuda.memory.CUDAPluggableAllocator(library_path(), MALLOC_SYMBOL, FREE_SYMBOL)


def _current_device() -> int:
    """torch's current device, without initialising torch's CUDA state
    where nothing has yet (device 0 then): `install()` must still be able to
    swap torch's allocator after this."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def _device_index(device: Any) -> int:
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"device: expected a CUDA device index or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise InvalidArgument(f"device: expected a CUDA device index (0 or more), got {device}")
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise InvalidArgument(f"device: expected a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else _current_device()


def _same_tier(a: Any, b: Any) -> bool:
    """Whether two ActivationPool handles are the same tier. A MemorySystem
    hands out a new wrapper at each ``system.activations``, so identity of
    the Python objects says nothing; the tier's id does."""
    return a is not None and b is not None and a.id == b.id


def _install_hooks(activations: Any, device: int, weights_arena: Any = None) -> bool:
    """Routes the hooks to ``activations``: installed (the tier every
    MemPool scope without a tier of its own reaches) where none is, or
    where the installed one is this tier or one no open Pool holds; else a
    hook *region* (``_core.add_hook_region``), which a scope of its Pool
    selects for its thread, so that two Pools over two tiers (two engines
    with ``torch_pool="imp_mem"`` in one process) each get their own
    tier's memory. Returns True where installed, False for a region."""
    with _lock:
        current = _installed["activations"]
        if current is not None and not _same_tier(current, activations):
            if _installed["process_wide"]:
                raise PhaseViolation(
                    "imp_mem.torch: another activations tier is installed process-wide; "
                    "torch has one allocator per process"
                )
            if any(p._tier == current.id and not p._region for p in _open):
                _core.add_hook_region(activations, device=device)
                return False
        if weights_arena is not None:
            activations.install(device=device, weights_arena=weights_arena)
        else:
            activations.install(device=device)
        _installed["activations"] = activations
        _installed["device"] = device
        return True


def _uninstall_hooks(activations: Any) -> None:
    """Takes ``activations`` out of the hooks if it is the tier installed for
    scopes (never a process-wide one: torch keeps calling its allocator). A
    block still live there (a tensor someone kept) keeps the tier: the core
    retires it, and its free still reaches it."""
    with _lock:
        if _installed["process_wide"] or not _same_tier(_installed["activations"], activations):
            return
        _core.uninstall_hooks()
        _installed["activations"] = None
        _installed["device"] = None


def _clear_cublas_workspaces() -> None:
    """torch keeps a cuBLAS workspace per handle and stream, allocated at the
    first GEMM from whatever pool was current then, for the process's life.
    Cleared before a tier closes so that no workspace lies in it (torch makes
    a new one at the next GEMM)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def installed() -> Any:
    """The ActivationPool the entry points route to now, or None."""
    return _installed["activations"]


def _renew_mempool(holder: Any) -> None:
    """Gives `holder` (a `Pool` or a `Region`) a fresh MemPool over the same
    tier and lets the old one go: once its tensors are gone, torch's free
    segments in it go back to the tier (``empty_cache`` does not release a
    live private pool's segments)."""
    holder.mempool = torch.cuda.MemPool(pluggable_allocator().allocator())
    _release_dropped_pools(holder.device)


def _release_dropped_pools(device: int) -> None:
    """Once a MemPool is dropped: its last tensors collected, the device
    synchronised, and torch's free segments of dropped pools given back
    (through the hooks, to their tier)."""
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def hook_stats() -> dict[str, int]:
    """The entry points' counters: calls, refusals by kind, caught panics."""
    return {k: v for k, v in _core.hook_stats().items() if isinstance(v, int)}


_TORCH_KEYS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "allocated_bytes.all.allocated": "total_allocated_bytes",
    "allocated_bytes.all.freed": "total_freed_bytes",
    "allocation.all.current": "allocations",
    "allocation.all.peak": "peak_allocations",
    "allocation.all.allocated": "total_allocations",
    "allocation.all.freed": "total_frees",
}


def memory_stats(target: Any = None) -> dict[str, int]:
    """The activations tier's counters in the shape of ``torch.cuda.memory_stats``
    (``allocated_bytes.all.current``, ``reserved_bytes.all.current``, ...), plus
    imp-mem's own under ``imp_mem.*``."""
    activations = _activations_of(target) if target is not None else installed()
    if activations is None:
        raise InvalidArgument("target: no activations tier is installed; pass a MemorySystem")
    out = {k: int(v) for k, v in activations.memory_stats().items()}
    for key, value in activations.stats().items():
        if isinstance(value, (int, bool)):
            out[f"imp_mem.{key}"] = int(value)
    return out


_thread_regions = threading.local()


def _region_stack() -> list[Any]:
    stack = getattr(_thread_regions, "stack", None)
    if stack is None:
        stack = _thread_regions.stack = []
    return stack


@contextlib.contextmanager
def _hook_region(route: Any) -> Iterator[None]:
    """This thread's hook mallocs go to ``route`` (an ActivationPool added as
    a hook region; None: the installed pool) for the block, nested blocks
    restoring the one outside them."""
    stack = _region_stack()
    stack.append(route)
    _core.set_hook_region(route)
    try:
        yield
    finally:
        stack.pop()
        _core.set_hook_region(stack[-1] if stack else None)
