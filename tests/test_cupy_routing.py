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

    class Memory:
        """CuPy's MemoryPointer, enough of it: frees through the allocator's
        free function with the allocator's param, as CuPy does."""

        def __init__(self, ptr, free, param):
            self.ptr, self._free, self._param = ptr, free, param

        def free(self):
            self._free(self._param, self.ptr, 0)

    class CFunctionAllocator:
        def __init__(self, param, malloc_func, free_func, owner):
            malloc = ctypes.CFUNCTYPE(
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
            )
            free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
            self.param, self.owner = param, owner
            self._malloc, self._free = malloc(malloc_func), free(free_func)

        def malloc(self, size):
            ptr = self._malloc(self.param, size, 0)
            return Memory(ptr, self._free, self.param) if ptr else None

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
        assert all(cupy_tier.size_of(m.ptr) for m in blocks), "a CuPy block left its tier"
        # Freed and taken again on the stream it was taken on: no order
        # between streams (CuPy passes the allocator's param, the pool id,
        # to the free too; taken as a stream, the block went to another lane).
        blocks.pop().free()
        blocks.append(malloc(512))
        assert cupy_tier.stats()["cross_stream_reuses"] == 0
    assert torch_tier.installed and torch_tier.stats()["live"] == 0
    # The last block's end took the region out; its live blocks keep the
    # tier (retired) and their frees still reach it.
    assert _core.hook_stats()["retired_pools"] == retired + 1
    for m in blocks:
        m.free()
    stats = _core.hook_stats()
    assert cupy_tier.stats()["live"] == 0
    assert stats["foreign_frees"] == foreign and stats["retired_pools"] == retired


def test_an_allocator_made_outside_a_scope_holds_its_region(imc):
    fake = imp_mem.FakeBackend(capacity=64 * MIB)
    tier = imp_mem.ActivationPool(fake, MIB)
    malloc = imc.allocator(tier)
    with imc.use_pool(tier):
        pass
    m = malloc(1000)  # still a region: the allocator's user is left
    assert tier.size_of(m.ptr) == 1000
    m.free()
    assert not tier.installed, "CuPy never takes the hooks' installed slot"
    imc._done_with_region(tier)
