"""``imp_mem.cupy``'s routing on the CPU, with a stand-in for CuPy whose
``CFunctionAllocator`` calls the exported entry points through ctypes as
CuPy does: the tier is a hook region named in each call, so CuPy keeps to
its tier whatever torch's side has installed, and the region leaves the
hooks when its last ``use_pool`` block ends."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import pytest

import imp_mem
from imp_mem import _core

MIB = 1 << 20


def _stand_in_cupy() -> types.ModuleType:
    lib = ctypes.CDLL(_core.hook_library_path())

    class CFunctionAllocator:
        def __init__(self, param, malloc_func, free_func, owner):
            proto = ctypes.CFUNCTYPE(
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
            )
            self.param, self.owner = param, owner
            self._malloc = proto(malloc_func)
            self.free_func = free_func

        def malloc(self, size):
            return self._malloc(self.param, size, 0)

    state = {"allocator": None}

    @contextlib.contextmanager
    def using_allocator(malloc):
        state["allocator"] = malloc
        try:
            yield
        finally:
            state["allocator"] = None

    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        memory=types.SimpleNamespace(CFunctionAllocator=CFunctionAllocator),
        MemoryPool=lambda malloc: types.SimpleNamespace(malloc=malloc),
        using_allocator=using_allocator,
        set_allocator=lambda malloc: state.__setitem__("allocator", malloc),
    )
    module = types.ModuleType("cupy")
    module.cuda = cuda
    module._lib = lib
    return module


@pytest.fixture
def imc(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _stand_in_cupy())
    monkeypatch.delitem(sys.modules, "imp_mem.cupy", raising=False)
    import imp_mem.cupy as module

    yield module
    _core.uninstall_hooks()
    # Not left importable over the stand-in.
    sys.modules.pop("imp_mem.cupy", None)
    if hasattr(imp_mem, "cupy"):
        delattr(imp_mem, "cupy")


def _cupy_free():
    address = _core.hook_addresses()[_core.CUPY_FREE_SYMBOL]
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(address)


def test_cupy_keeps_to_its_tier_beside_an_installed_one(imc):
    fake = imp_mem.FakeBackend(capacity=64 * MIB)
    torch_tier = imp_mem.ActivationPool(fake, MIB)
    cupy_tier = imp_mem.ActivationPool(fake, MIB)
    torch_tier.install(device=0)
    retired, foreign = (_core.hook_stats()[k] for k in ("retired_pools", "foreign_frees"))
    with imc.use_pool(cupy_tier) as malloc:
        blocks = [malloc(4096)]
        with imc.use_pool(cupy_tier) as inner:  # nested: one region, two users
            blocks.append(inner(512))
        blocks.append(malloc(512))  # the inner block's end left the region
        assert all(cupy_tier.size_of(p) for p in blocks), "a CuPy block left its tier"
    assert torch_tier.installed and torch_tier.stats()["live"] == 0
    # The last block's end took the region out; its live blocks keep the
    # tier (retired) and their frees still reach it.
    assert _core.hook_stats()["retired_pools"] == retired + 1
    free = _cupy_free()
    for p in blocks:
        free(None, p, 0)
    stats = _core.hook_stats()
    assert cupy_tier.stats()["live"] == 0
    assert stats["foreign_frees"] == foreign and stats["retired_pools"] == retired


def test_an_allocator_made_outside_a_scope_holds_its_region(imc):
    fake = imp_mem.FakeBackend(capacity=64 * MIB)
    tier = imp_mem.ActivationPool(fake, MIB)
    malloc = imc.allocator(tier)
    with imc.use_pool(tier):
        pass
    p = malloc(1000)  # still a region: the allocator's user is left
    assert tier.size_of(p) == 1000
    _cupy_free()(None, p, 0)
    assert not tier.installed, "CuPy never takes the hooks' installed slot"
    imc._done_with_region(tier)
