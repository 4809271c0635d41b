"""Stand-ins for torch's CUDA side, for the CPU tests of
``imp_mem.torch``'s Pool bookkeeping (``test_torch_pool_close.py``,
``test_torch_pool_props.py``): torch's MemPool and device calls are stood
in for; the hooks (driven through ctypes, as torch calls them) and the
tiers are the real ones on the fake backend."""

from __future__ import annotations

import contextlib
import warnings

import pytest
from _helpers import TINY, make_plan, open_system

import imp_mem
from imp_mem import _core

# Skips the importing test module where torch is absent.
torch = pytest.importorskip("torch")
imt = pytest.importorskip("imp_mem.torch")

MIB = 1 << 20


class MemPoolStandIn:
    """Stands in for ``torch.cuda.MemPool``: an id and nothing else."""

    made = 0

    def __init__(self, allocator=None):
        MemPoolStandIn.made += 1
        self.id = (0, MemPoolStandIn.made)


class _Allocator:
    def allocator(self):
        return None


def stand_in(monkeypatch) -> None:
    """torch's CUDA calls the Pool makes, stood in for; the hooks emptied."""
    monkeypatch.setattr(torch.cuda, "MemPool", MemPoolStandIn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    # Set on the module that defines them: every module of the package reads
    # them through it.
    monkeypatch.setattr(imt._hooks, "pluggable_allocator", lambda: _Allocator())
    monkeypatch.setattr(imt._hooks, "_clear_cublas_workspaces", lambda: None)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda *a, **k: contextlib.nullcontext())
    _core.uninstall_hooks()


def tear_down() -> None:
    for p in list(imt._pools.values()):
        p.close()
    _core.uninstall_hooks()
    imt._installed.update(activations=None, device=None)


def small_system():
    """A small system on the fake backend with a 16 MiB activations tier."""
    features = imp_mem.Features(activation_bytes=16 * MIB)
    return open_system(make_plan(TINY, features=features))[1]


def closes_clean(system) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error", imp_mem.ImpMemWarning)
        return system.close()["still_held"] == {}


def torch_hooks():
    import ctypes

    lib = ctypes.CDLL(_core.hook_library_path())
    malloc = getattr(lib, _core.TORCH_MALLOC_SYMBOL)
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, _core.TORCH_FREE_SYMBOL)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return malloc, free


def in_use(system) -> int:
    return int(system.activations.stats()["in_use"])
