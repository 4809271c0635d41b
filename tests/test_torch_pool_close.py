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

import pytest
from _helpers import TINY, make_plan, open_system
from _torch_standins import closes_clean, in_use, small_system, stand_in, tear_down, torch_hooks

import imp_mem
from imp_mem import _core

torch = pytest.importorskip("torch")
imt = pytest.importorskip("imp_mem.torch")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def cpu_torch(monkeypatch):
    stand_in(monkeypatch)
    yield
    tear_down()


_system, _closes_clean, _in_use = small_system, closes_clean, in_use


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
    # `other`'s open Pool holds the hooks: `one`'s Pool is a hook region,
    # which its scopes select (it no longer takes the hooks from q).
    r = imt.Pool(one, device=0)
    assert not q._region and r._region
    assert imt.installed().id == other.activations.id
    q.close()  # the installed tier: its last Pool takes it out of the hooks
    assert not _core.hook_stats()["installed"] and imt.installed() is None
    r.close()  # the region goes with its last Pool
    assert not _core.hook_stats()["installed"]
    assert _closes_clean(one) and _closes_clean(other)


_hooks = torch_hooks


def test_two_tiers_pools_each_scope_reaches_its_own_tier(monkeypatch):
    """Two engines with ``torch_pool="imp_mem"`` in one process: each Pool's
    scope (and a capture into its MemPool, and a graph pool over it) puts
    torch's segments in its own tier, nested either way, and a segment
    freed anywhere goes back to the tier it came from. Before, the second
    Pool took the hooks and the first engine's segments landed in the
    second engine's tier."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    malloc, free = _hooks()
    one, other = _system(), _system()
    a, b = imt.Pool(one, device=0), imt.Pool(other, device=0)
    assert not a._region and b._region
    held = []

    def take(n):
        ptr = malloc(n, 0, None)
        assert ptr, _core.hook_stats()
        held.append((ptr, n))
        return ptr

    with b.scope():
        take(MIB)
    assert (_in_use(one), _in_use(other)) == (0, MIB)
    with a.scope():
        take(2 * MIB)
        with b.scope():
            take(3 * MIB)
        take(MIB)  # back on `one` after the inner scope
    assert (_in_use(one), _in_use(other)) == (3 * MIB, 4 * MIB)
    with b.graph(object()):
        take(MIB)
    with imt.graph_pool(b):
        take(MIB)
    assert (_in_use(one), _in_use(other)) == (3 * MIB, 6 * MIB)
    # Nested in a region scope of its own, the installed Pool still wins.
    with b.scope(), a.scope():
        take(MIB)
    assert _in_use(one) == 4 * MIB
    with pytest.raises(imp_mem.InvalidArgument, match="hook region"):
        with b.loading():
            pass
    # Freed outside any scope (torch releases segments at empty_cache):
    # each goes home by its address.
    for ptr, n in held:
        free(ptr, n, 0, None)
    assert (_in_use(one), _in_use(other)) == (0, 0)
    assert _core.hook_stats().get("refused_frees", 0) == 0
    b.close()
    a.close()
    assert not _core.hook_stats()["installed"]
    assert _closes_clean(one) and _closes_clean(other)


def test_a_region_pools_segment_outliving_it_still_goes_home(monkeypatch):
    """A Pool that routes through a hook region, closed while torch still
    holds a segment of it: the region is retired with the block, the
    block's free reaches its tier, and the tier then goes."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda *a, **k: contextlib.nullcontext())
    malloc, free = _hooks()
    one, other = _system(), _system()
    a, b = imt.Pool(one, device=0), imt.Pool(other, device=0)
    # Pools other tests' tensors still hold stay retired: counted from here.
    retired = _core.hook_stats()["retired_pools"]
    with b.scope():
        ptr = malloc(MIB, 0, None)
    assert ptr and _in_use(other) == MIB
    b.close()
    assert _core.hook_stats()["retired_pools"] == retired + 1
    free(ptr, MIB, 0, None)
    assert _core.hook_stats()["retired_pools"] == retired
    assert _in_use(other) == 0
    # Closed with a live block and opened again: a region again, not
    # retired, and the old block's free goes home through it (left
    # retired, the entry never saw that free and held the tier for good).
    b = imt.Pool(other, device=0)
    with b.scope():
        ptr = malloc(MIB, 0, None)
    b.close()
    b = imt.Pool(other, device=0)
    assert b._region and _core.hook_stats()["retired_pools"] == retired
    free(ptr, MIB, 0, None)
    assert _in_use(other) == 0
    b.close()
    a.close()
    assert _closes_clean(one) and _closes_clean(other)


def _loose_system():
    """A system whose activations tier falls back when full (install()'s
    kind: a strict one is refused process-wide)."""
    features = imp_mem.Features(activation_bytes=16 * MIB)
    return open_system(make_plan(TINY, features=features), activation_strict=False)[1]


def _refusing_swap(*args, **kwargs):
    raise RuntimeError("Can't swap an already initialized allocator")


def test_an_install_torch_refuses_leaves_the_hooks_as_they_were(monkeypatch):
    """install() after torch's first CUDA allocation: PhaseViolation, and
    the hooks neither keep the new tier (its memory held for nothing) nor
    lose the tier installed before."""
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", _refusing_swap)
    before = _system()
    imt._install_hooks(before.activations, 0)
    system = _loose_system()
    with pytest.raises(imp_mem.PhaseViolation, match="before torch's first CUDA allocation"):
        imt.install(system)
    assert not imt._installed["process_wide"]
    assert imt.installed().id == before.activations.id
    assert _core.hook_stats()["installed"]
    _core.uninstall_hooks()
    imt._installed.update(activations=None, device=None)
    with pytest.raises(imp_mem.PhaseViolation):
        imt.install(system)
    assert imt.installed() is None and not _core.hook_stats()["installed"]
    assert _closes_clean(system), "the refused install left the tier held"
    assert _closes_clean(before)


def test_install_refuses_while_another_tiers_pool_holds_the_hooks():
    """Process-wide, torch's allocations would go to the open Pool's tier."""
    first = _system()
    pool = imt.Pool(first)
    second = _loose_system()
    with pytest.raises(imp_mem.PhaseViolation, match="close that Pool first"):
        imt.install(second)
    assert not imt._installed["process_wide"]
    assert imt.installed().id == first.activations.id
    # No region of the refused tier is left behind in the hooks.
    assert _core.remove_hook_region(second.activations) is False
    pool.close()
    assert _closes_clean(second) and _closes_clean(first)


def test_graph_pool_blocks_on_two_threads_each_answer_for_their_own(monkeypatch):
    """torch.cuda.graph_pool_handle() inside graph_pool() is that thread's
    innermost block's pool, whatever another thread enters or leaves
    meanwhile, and torch's own once every block has ended."""
    import threading

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "torch's own")
    monkeypatch.setattr(imt._graphs, "_torch_graph_pool_handle", None)
    a, b = imt.Pool(_system()), imt.Pool(_system())
    entered, a_left = threading.Barrier(2), threading.Event()
    seen = {}

    def run(pool, name):
        with imt.graph_pool(pool) as mempool:
            seen[name, "id"] = mempool.id
            entered.wait()
            if name == "b":
                a_left.wait()  # a's block has ended; b's has not
            seen[name, "inside"] = torch.cuda.graph_pool_handle()
        if name == "a":
            a_left.set()

    threads = [threading.Thread(target=run, args=(p, n)) for p, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a", "inside"] == seen["a", "id"]
    assert seen["b", "inside"] == seen["b", "id"] != seen["a", "id"]
    assert torch.cuda.graph_pool_handle() == "torch's own"
    # Nested on one thread: the innermost block's pool, then the outer's.
    with imt.graph_pool(a) as outer:
        with imt.graph_pool(b) as inner:
            assert torch.cuda.graph_pool_handle() == inner.id
        assert torch.cuda.graph_pool_handle() == outer.id
    assert torch.cuda.graph_pool_handle() == "torch's own"
    a.close()
    b.close()
