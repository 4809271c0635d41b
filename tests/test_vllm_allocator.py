"""``imp_mem.vllm`` on the CPU (issue 51): the surface of vLLM 0.33's
``CuMemAllocator`` (every public name and signature), the opt-in plugin, and
the sleep / discard / wake state machine over real tiers on the fake backend,
with torch's CUDA side stood in for and torch's segments allocated through
the real allocator hooks (as torch calls them). On the GPU, vLLM's own
allocator tests run against it (``docs/gpu-runs/``)."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
from _torch_standins import stand_in, torch, torch_hooks

import imp_mem
from imp_mem import InvalidArgument, OutOfMemory
from imp_mem import _vllm_plugin as plugin

vllm_mod = pytest.importorskip("imp_mem.vllm")
CuMemAllocator = vllm_mod.CuMemAllocator

MIB = 1 << 20

# vLLM 0.33.0's ``vllm/device_allocator/cumem.py``, read off its wheel: each
# public method with its parameters (name, default) after ``self``.
VLLM_033_METHODS = {
    "release_pools": [],
    "close": [],
    "sleep": [("offload_tags", None)],
    "discard": [("tags", inspect.Parameter.empty)],
    "wake_up": [("tags", None)],
    "use_memory_pool": [("tag", None)],
    "cudagraph_pool": [],
    "get_current_usage": [],
}
VLLM_033_STATIC = {"get_instance": []}
VLLM_033_ATTRIBUTES = {"instance": None, "default_tag": "default"}


def test_the_surface_is_vllm_033s():
    for name, params in {**VLLM_033_METHODS, **VLLM_033_STATIC}.items():
        member = getattr(CuMemAllocator, name)
        sig = inspect.signature(member)
        got = [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]
        assert got == params, name
    for name in VLLM_033_STATIC:
        assert isinstance(inspect.getattr_static(CuMemAllocator, name), staticmethod), name
    for name, value in VLLM_033_ATTRIBUTES.items():
        assert getattr(CuMemAllocator, name) == value, name
    # vLLM constructs it with no arguments.
    assert not [
        p
        for p in inspect.signature(CuMemAllocator.__init__).parameters.values()
        if p.name != "self" and p.default is inspect.Parameter.empty
    ]
    assert set(vllm_mod.DEFERRABLE_TAGS) == {"weights", "kv_cache"}


def test_the_refused_wake_is_both_imp_mems_and_vllms_error():
    assert issubclass(vllm_mod.WakeRefused, OutOfMemory)
    assert issubclass(vllm_mod.WakeRefused, RuntimeError)


# -- the plugin --------------------------------------------------------------


class _VllmsAllocator:
    pass


@pytest.fixture
def fake_vllm(monkeypatch):
    """Stands in for ``vllm.device_allocator.cumem`` (vLLM needs torch 2.14)."""
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.CuMemAllocator = _VllmsAllocator
    cumem.cumem_available = False
    names = ["vllm", "vllm.device_allocator", "vllm.device_allocator.cumem"]
    parents = [types.ModuleType(n) for n in names[:2]]
    for name, module in zip(names, [*parents, cumem], strict=True):
        monkeypatch.setitem(sys.modules, name, module)
    parents[0].device_allocator = parents[1]
    parents[1].cumem = cumem
    return cumem


def test_the_plugin_changes_nothing_without_the_switch(fake_vllm, monkeypatch):
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    plugin.register()
    assert fake_vllm.CuMemAllocator is _VllmsAllocator
    monkeypatch.setenv(plugin.ENV_SWITCH, "0")
    plugin.register()
    assert fake_vllm.CuMemAllocator is _VllmsAllocator
    assert fake_vllm.cumem_available is False


def test_the_plugin_puts_imp_mems_allocator_in_place_with_the_switch(fake_vllm, monkeypatch):
    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    plugin.register()
    plugin.register()  # vLLM may load its plugins more than once
    assert fake_vllm.CuMemAllocator is CuMemAllocator
    assert fake_vllm.cumem_available is True


def test_a_switch_that_is_neither_on_nor_off_is_refused_by_name(fake_vllm, monkeypatch):
    monkeypatch.setenv(plugin.ENV_SWITCH, "maybe")
    with pytest.raises(InvalidArgument, match="IMP_MEM_VLLM_SLEEP='maybe'"):
        plugin.register()
    assert fake_vllm.CuMemAllocator is _VllmsAllocator


def test_with_the_switch_a_vllm_without_its_cuda_module_warns_and_starts(monkeypatch):
    # vLLM's cumem module loads its CUDA extension at import; without the
    # driver (libcuda) it raises ImportError, which must not stop vLLM.
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", None)
    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    with pytest.warns(imp_mem.ImpMemWarning, match="left in place"):
        plugin.register()


def test_the_plugin_is_registered_in_the_wheels_metadata():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "imp_mem_sleep"]
    assert len(found) == 1
    assert found[0].load() is plugin.register


def test_the_plugin_module_imports_neither_torch_nor_vllm():
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_SWITCH}
    code = (
        "import sys, imp_mem._vllm_plugin as p; p.register(); "
        "print(sorted(m for m in ('torch', 'vllm', 'imp_mem.vllm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "[]"


# -- the state machine on the fake backend ----------------------------------


@pytest.fixture
def alloc(monkeypatch):
    stand_in(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fb = imp_mem.FakeBackend(capacity=64 * MIB, granularity=64 * 1024)
    a = CuMemAllocator(fb, capacity=8 * MIB)
    a._test_fb = fb
    a._test_live = []
    yield a
    _, free = torch_hooks()
    for ptr, size in a._test_live:
        free(ptr, size, 0, None)
    a.release_pools()
    for t in a._tags.values():
        if t.asleep:
            t.region.activations.resume()
        imp_mem._core.remove_hook_region(t.region.activations)
        t.region.activations.release_host_copy()


def _segment(alloc, size, seed):
    """What torch's allocator does in a pool scope: a segment through the
    hooks, then bytes written into it."""
    malloc, _ = torch_hooks()
    ptr = malloc(size, 0, None)
    assert ptr, "the hooks refused a segment"
    data = bytes((i * 7 + seed) % 251 for i in range(size))
    alloc._test_fb.write(ptr, data)
    alloc._test_live.append((ptr, size))
    return ptr, data


def test_sleep_keeps_the_offloaded_tags_and_wake_brings_them_back_in_place(alloc):
    with alloc.use_memory_pool("weights"):
        assert alloc.current_tag == "weights"
        w, w_data = _segment(alloc, 300_000, 1)
    assert alloc.current_tag == "default"
    with alloc.use_memory_pool(tag="kv_cache"):
        kv, _ = _segment(alloc, 100_000, 2)
    with alloc.use_memory_pool():
        d, d_data = _segment(alloc, 50_000, 3)
    usage = alloc.get_current_usage()
    assert usage >= 450_000
    assert alloc.tags()["weights"]["host_bytes"] > 0 or alloc._tags["weights"].pinner is not None

    alloc.sleep(offload_tags=("weights", "default"))
    fb = alloc._test_fb
    assert all(state["asleep"] for state in alloc.tags().values())
    assert all(state["committed"] == 0 for state in alloc.tags().values())
    assert fb.is_poisoned(w, 300_000) and fb.is_poisoned(kv, 100_000)
    assert alloc.get_current_usage() == usage, "asleep tags still count, as vLLM's do"

    # A selective wake: the weights, and every tag that is not deferrable.
    alloc.wake_up(["weights"])
    states = alloc.tags()
    assert not states["weights"]["asleep"] and not states["default"]["asleep"]
    assert states["kv_cache"]["asleep"]
    assert fb.read(w, 300_000) == w_data and fb.read(d, 50_000) == d_data
    with pytest.raises(InvalidArgument, match="kv_cache"):
        with alloc.use_memory_pool("kv_cache"):
            pass
    alloc.wake_up()
    assert not any(state["asleep"] for state in alloc.tags().values())


def test_a_tag_commits_what_torch_asks_for_not_what_it_reserves(alloc):
    # Each tag reserves the whole capacity (8 MiB here; the device's on a
    # GPU) and commits 2 MiB chunks as segments reach further: on an H100 a
    # tier committed whole at creation was refused by the budget (2026-12-07).
    with alloc.use_memory_pool("weights"):
        _segment(alloc, 300_000, 8)
    state = alloc.tags()["weights"]
    assert state["committed"] == vllm_mod.COMMIT_CHUNK
    assert alloc._tags["weights"].region.activations.capacity == 8 * MIB
    with alloc.use_memory_pool("weights"):
        _segment(alloc, 3 * MIB, 9)
    assert alloc.tags()["weights"]["committed"] == 2 * vllm_mod.COMMIT_CHUNK
    alloc.sleep(offload_tags=("weights",))
    assert alloc.tags()["weights"]["committed"] == 0
    alloc.wake_up()
    assert alloc.tags()["weights"]["committed"] == 2 * vllm_mod.COMMIT_CHUNK


def test_discard_drops_the_bytes_and_a_second_sleep_keeps_each_tags_policy(alloc):
    with alloc.use_memory_pool("weights"):
        w, w_data = _segment(alloc, 200_000, 4)
    with alloc.use_memory_pool("kv_cache"):
        _segment(alloc, 100_000, 5)
    alloc.discard("kv_cache")
    assert alloc.tags()["kv_cache"] == {**alloc.tags()["kv_cache"], "asleep": True, "kept": False}
    assert not alloc.tags()["weights"]["asleep"]
    with pytest.warns(RuntimeWarning, match="policy"):
        alloc.sleep(offload_tags=("weights", "kv_cache"))
    assert alloc.tags()["kv_cache"]["kept"] is False
    assert alloc.tags()["weights"]["kept"] is True
    alloc.wake_up()
    assert alloc._test_fb.read(w, 200_000) == w_data
    alloc.discard(("weights",))  # a tuple, as vLLM passes it
    alloc.wake_up(["weights"])
    assert alloc._test_fb.read(w, 200_000) != w_data


def test_a_wake_without_room_is_refused_typed_and_the_rest_stays_asleep(alloc):
    with alloc.use_memory_pool("weights"):
        w, w_data = _segment(alloc, 200_000, 6)
    alloc.sleep(offload_tags="weights")
    alloc._test_fb.fail_commits(1)
    with pytest.raises(vllm_mod.WakeRefused, match="wake_up") as refused:
        alloc.wake_up()
    assert isinstance(refused.value, RuntimeError)
    assert refused.value.still_asleep == ("weights",)
    assert "torch's caching allocator holds" in str(refused.value)
    assert alloc.tags()["weights"]["asleep"]
    alloc.wake_up()  # the retry works, bytes intact
    assert alloc._test_fb.read(w, 200_000) == w_data


def test_bad_tags_are_refused_by_name(alloc):
    with pytest.raises(InvalidArgument, match="tag"):
        with alloc.use_memory_pool(""):
            pass
    with pytest.raises(InvalidArgument, match="offload_tags"):
        alloc.sleep(offload_tags=("weights", 3))
    with pytest.raises(TypeError, match="tags"):
        alloc.wake_up(5)
    with pytest.raises(InvalidArgument, match="backend"):
        CuMemAllocator(object())
    with pytest.raises(InvalidArgument, match="capacity"):
        CuMemAllocator(alloc._test_fb, capacity=-1)
    # Nothing slept or woke on a refusal; sleeping with nothing made is a no-op.
    alloc.sleep()
    alloc.wake_up()
    assert alloc.tags() == {}


def test_the_graph_pool_routes_its_segments_to_the_cudagraph_tier(alloc):
    with alloc.cudagraph_pool() as pool_id:
        assert alloc.current_tag == "cudagraph"
        assert pool_id == alloc._tags["cudagraph"].region.mempool.id
        g, g_data = _segment(alloc, 70_000, 7)
    assert alloc.current_tag == "default"
    assert "cudagraph" in alloc.allocator_and_pools
    assert alloc._tags["cudagraph"].region.activations.stats()["allocated"] >= 70_000
    alloc.sleep(offload_tags=("cudagraph",))
    with pytest.raises(InvalidArgument, match="cudagraph"):
        with alloc.cudagraph_pool():
            pass
    alloc.wake_up()
    assert alloc._test_fb.read(g, 70_000) == g_data
    alloc.release_pools()
    alloc.close()  # twice is fine
    assert alloc.allocator_and_pools == {}
    assert alloc._tags["cudagraph"].region.mempool is None


def test_get_instance_is_one_allocator_a_process(monkeypatch):
    monkeypatch.setattr(CuMemAllocator, "instance", None)
    first = CuMemAllocator.get_instance()
    assert CuMemAllocator.get_instance() is first
    assert CuMemAllocator.instance is first
