"""``imp_mem.torch.Pool``'s bookkeeping on the CPU: one Pool a tier through
``pool()`` (found by the tier's id: ``system.activations`` is a new handle at
each access), the hooks kept while any Pool of the tier is open and taken
out by the last close, a Pool dropped unclosed not counted, and a closed
Pool letting go of the tier so the system closes holding nothing.

torch's MemPool and device calls are stood in for (no GPU here); the hooks
and the tier are the real ones on the fake backend. The GPU side (torch's
segments, its cuBLAS workspace) is ``tests/gpu/test_torch_gpu.py``.
"""

from __future__ import annotations

import gc
import warnings

import pytest
from _helpers import TINY, make_plan, open_system

import imp_mem
from imp_mem import _core

torch = pytest.importorskip("torch")
imt = pytest.importorskip("imp_mem.torch")

MIB = 1 << 20


class _MemPool:
    """Stands in for ``torch.cuda.MemPool``: an id and nothing else."""

    made = 0

    def __init__(self, allocator=None):
        _MemPool.made += 1
        self.id = (0, _MemPool.made)


class _Allocator:
    def allocator(self):
        return None


@pytest.fixture(autouse=True)
def cpu_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "MemPool", _MemPool)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(imt, "pluggable_allocator", lambda: _Allocator())
    monkeypatch.setattr(imt, "_clear_cublas_workspaces", lambda: None)
    _core.uninstall_hooks()
    yield
    for p in list(imt._pools.values()):
        p.close()
    _core.uninstall_hooks()
    imt._installed.update(activations=None, device=None)


def _system():
    """A small system on the fake backend with a 16 MiB activations tier."""
    features = imp_mem.Features(activation_bytes=16 * MIB)
    return open_system(make_plan(TINY, features=features))[1]


def _closes_clean(system):
    with warnings.catch_warnings():
        warnings.simplefilter("error", imp_mem.ImpMemWarning)
        return system.close()["still_held"] == {}


def test_pool_finds_one_pool_a_tier_and_its_close_lets_the_system_go():
    system = _system()
    first = imt.pool(system, device=0)
    assert system.activations is not system.activations  # a new handle each time
    assert imt.pool(system, device=0) is first
    assert _core.hook_stats()["installed"]
    first.close()
    first.close()  # a second close does nothing
    assert first.closed and "closed" in repr(first)
    assert not _core.hook_stats()["installed"]
    with pytest.raises(imp_mem.InvalidArgument, match="closed"):
        with first.scope():
            pass
    with pytest.raises(imp_mem.InvalidArgument, match="closed"):
        first.trim()
    again = imt.pool(system, device=0)
    assert again is not first and not again.closed
    again.close()
    assert _closes_clean(system)


def test_the_hooks_stay_while_any_pool_of_the_tier_is_open():
    system = _system()
    a = imt.Pool(system, device=0)
    b = imt.Pool(system, device=0)
    a.close()
    assert _core.hook_stats()["installed"], "b still routes into the tier"
    b.close()
    assert not _core.hook_stats()["installed"]
    assert _closes_clean(system)


def test_a_pool_dropped_unclosed_does_not_keep_the_hooks():
    system = _system()
    dropped = imt.Pool(system, device=0)
    kept = imt.Pool(system, device=0)
    del dropped
    gc.collect()
    kept.close()
    assert not _core.hook_stats()["installed"]
    assert _closes_clean(system)


def test_a_pool_as_a_context_manager_and_another_tier_left_installed():
    one, other = _system(), _system()
    with imt.Pool(one, device=0) as p:
        assert not p.closed
    assert p.closed and not _core.hook_stats()["installed"]
    q = imt.Pool(other, device=0)
    r = imt.Pool(one, device=0)  # the hooks route to one tier: now `one`'s
    tier = one.activations.id
    assert imt.installed().id == tier
    q.close()  # not the installed tier: the hooks stay on `one`
    assert _core.hook_stats()["installed"] and imt.installed().id == tier
    r.close()
    assert not _core.hook_stats()["installed"] and imt.installed() is None
    assert _closes_clean(one) and _closes_clean(other)
