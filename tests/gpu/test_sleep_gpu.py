"""Sleep / wake and model swap on the H200's VMM backend (issue 19).

* ``sleep(1)`` gives back to the device exactly what its report says it
  released (T1 and the KV pool), measured with ``cuda_mem_get_info`` and
  corrected for the VMM handle cache; what stays committed is T2 and the
  tiers the report still lists as awake. ``wake()`` takes the memory again,
  at the same addresses, with T1's bytes restored from the pinned copy.
* A CUDA graph captured (torch) over T1 weights and KV-pool memory before the
  sleep replays after the wake with the same result, without re-capture: the
  engine refills its (dropped) KV bytes at the same address and replays.
* A backend without growable regions (``CudaBackend``) refuses with
  ``BackendUnavailable``.
* A swap between two model shapes keeps T2's address and bytes and T1's base.

Skipped where no CUDA device exists; needs torch.
"""

from __future__ import annotations

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

MIB = 1 << 20
GIB = 1 << 30

SHAPE = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
}

# Device memory that may move between two readings without being ours to
# account: the driver's own bookkeeping, page-table granules.
SLACK = 8 * MIB


def _plan(weights: int, layers: int = 2, budget: int | None = None):
    shape = dict(SHAPE, num_hidden_layers=layers)
    return imp_mem.plan_memory(
        imp_mem.PlanInput(
            imp_mem.ModelShape.from_hf_config(shape).with_weights_bytes(weights),
            imp_mem.Limits(8, 4096),
            imp_mem.Features(scratch_bytes=64 * MIB, engine_persistent_bytes=64 * MIB),
            budget=budget or weights + 4 * GIB,
            context=512 * MIB,
            library_reserve=0,
        )
    )


def _tensor(span, n: int, dtype=torch.float32):
    return torch.from_dlpack(span.view(dtype, (n,)))


class _Raw:
    """Device memory by address, as an engine addresses its KV pool (base +
    block offset), holding no block ref."""

    def __init__(self, address: int, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<f4",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


def _kv_base(system) -> int:
    block = system.kv_pool.allocate()
    address = block.span().address
    block.release()
    return address


def test_sleep_gives_back_what_the_report_names_and_wake_restores_it():
    backend = imp_mem.VmmBackend(device=0)
    system = imp_mem.MemorySystem(backend, _plan(GIB))
    t1 = system.weights_arena
    n = t1.capacity // 4
    span = t1.take(n * 4)
    w = _tensor(span, n)
    torch.manual_seed(0)
    w.uniform_()
    expected = w.clone()
    address, kv_base = span.address, _kv_base(system)
    torch.cuda.synchronize()

    before = system.mem_report(device=False)
    cached0 = backend.cached_bytes
    free0, _ = imp_mem.cuda_mem_get_info(0)
    out = system.sleep(1)
    free1, _ = imp_mem.cuda_mem_get_info(0)
    cached1 = backend.cached_bytes
    assert [t["key"] for t in out["tiers"]] == ["model_resident", "kv_pool"]
    assert out["host_bytes"] == n * 4
    gained = free1 - free0
    expected_gain = out["released"] - (cached1 - cached0)
    assert abs(gained - expected_gain) <= SLACK, (gained, expected_gain, out)
    assert out["released"] >= n * 4

    report = system.mem_report(device=False)
    assert report["asleep"] == ["model_resident", "kv_pool"]
    awake = sum(t["committed"] for t in report["tiers"] if t["key"] not in report["asleep"])
    assert report["backend_committed"] == awake
    assert report["backend_committed"] == before["backend_committed"] - out["released"]
    assert any(t["key"] == "engine_persistent" and t["committed"] > 0 for t in report["tiers"])
    with pytest.raises(imp_mem.Asleep):
        t1.take(256)

    assert system.wake() == ["model_resident", "kv_pool"]
    free2, _ = imp_mem.cuda_mem_get_info(0)
    cached2 = backend.cached_bytes
    # Used again: what it was, plus or minus what the handle cache holds.
    assert abs((free0 - free2) - (cached2 - cached0)) <= SLACK, (free0, free2, cached0, cached2)
    assert span.address == address
    assert _kv_base(system) == kv_base
    assert torch.equal(w, expected), "T1's bytes did not come back from the host copy"
    assert system.mem_report(device=False)["backend_committed"] == before["backend_committed"]
    system.check()
    del w, span, expected, t1
    system.close()


def test_a_graph_captured_before_sleep_replays_after_wake_without_recapture():
    backend = imp_mem.VmmBackend(device=0)
    system = imp_mem.MemorySystem(backend, _plan(256 * MIB))
    rows, cols = 1024, 8
    span = system.weights_arena.take(rows * rows * 4)
    w = _tensor(span, rows * rows).view(rows, rows)
    torch.manual_seed(1)
    w.normal_()
    x = torch.as_tensor(_Raw(_kv_base(system), (rows, cols)), device="cuda")
    x_src = torch.randn(rows, cols, device="cuda")
    x.copy_(x_src)
    y = torch.empty(rows, cols, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.matmul(w, x, out=y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.matmul(w, x, out=y)
    graph.replay()
    torch.cuda.synchronize()
    ref = y.clone()
    assert torch.allclose(ref, w @ x_src, rtol=1e-4, atol=1e-3)

    system.sleep(1)
    system.wake()
    # The KV pool's bytes were dropped; the engine refills them in place.
    x.copy_(x_src)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref), "the replay after wake differs"
    del graph, w, x, span
    system.close()


def test_a_backend_without_growable_regions_refuses_to_sleep():
    backend = imp_mem.CudaBackend(device=0)
    with imp_mem.MemorySystem(backend, _plan(64 * MIB)) as system:
        with pytest.raises(imp_mem.BackendUnavailable):
            system.sleep(1)
        assert system.asleep == {}


def test_a_swap_between_two_shapes_keeps_t2_and_t1_base():
    backend = imp_mem.VmmBackend(device=0)
    system = imp_mem.MemorySystem(backend, _plan(512 * MIB, budget=6 * GIB))
    system.begin_serving()
    t2 = system.engine_arena.take(4096)
    marker = torch.arange(1024, dtype=torch.float32, device="cuda")
    _tensor(t2, 1024).copy_(marker)
    t2_address = t2.address
    t1_base = system.weights_arena.take(256).address
    out = system.swap_model(_plan(GIB, layers=4, budget=6 * GIB))
    assert out["t1_in_place"] is True
    assert out["t1_base"] == (t1_base, t1_base)
    assert "kv_pool" in out["relaid"]
    assert system.phase == imp_mem.Phase.SERVING
    assert t2.address == t2_address
    assert torch.equal(_tensor(t2, 1024), marker)
    new = system.weights_arena
    assert new.capacity == _plan(GIB, layers=4, budget=6 * GIB).model_resident
    w = _tensor(new.take(new.capacity), new.capacity // 4)
    w.fill_(2.0)
    assert float(w[-1]) == 2.0
    system.check()
    del w, new, t2
    system.close()


def test_torchs_pool_sleeps_and_a_graph_captured_into_it_replays_after_wake():
    """imp_mem.torch: torch's MemPool lives on the activation tier (T4a),
    which sleeps with T1 and the KV pool; a graph captured into the pool
    (its intermediates and output in T4a, its weights in T1) replays after
    the wake at the same addresses with the same result."""
    imt = pytest.importorskip("imp_mem.torch")
    shape = imp_mem.ModelShape.from_hf_config(SHAPE).with_weights_bytes(64 * MIB)
    features = imp_mem.Features(
        activation_bytes=256 * MIB, scratch_bytes=2 * MIB, engine_persistent_bytes=2 * MIB
    )
    plan = imp_mem.plan_memory(
        imp_mem.PlanInput(shape, imp_mem.Limits(2, 64), features, budget="8GiB")
    )
    backend = imp_mem.VmmBackend(0)
    system = imp_mem.MemorySystem(backend, plan)
    try:
        pool = imt.pool(system)
        w = imt.arena_tensor(system.weights_arena, (512, 512), torch.float32)
        torch.manual_seed(2)
        w.normal_()
        x = torch.randn(64, 512, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), pool.scope():
            for _ in range(3):
                (x @ w).relu()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with pool.graph(graph):
            out = (x @ w).relu()
        base = system.activations.base
        assert base <= out.data_ptr() < base + system.activations.capacity
        graph.replay()
        torch.cuda.synchronize()
        ref = out.clone()

        free0, _ = imp_mem.cuda_mem_get_info(0)
        cached0 = backend.cached_bytes
        slept = system.sleep(1)
        keys = [t["key"] for t in slept["tiers"]]
        assert "activations" in keys and "model_resident" in keys
        activations = next(t for t in slept["tiers"] if t["key"] == "activations")
        assert activations["released"] >= plan.activations
        free1, _ = imp_mem.cuda_mem_get_info(0)
        gained = free1 - free0
        expected = slept["released"] - (backend.cached_bytes - cached0)
        assert abs(gained - expected) <= SLACK, (gained, expected)
        with pytest.raises(imp_mem.Asleep):
            system.activations.allocate(512)

        system.wake()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), "the graph in torch's pool replays differently"
        del graph, out, w, x, ref
    finally:
        torch.cuda.synchronize()
        for p in list(imt._pools.values()):
            p.close()
        system.close()
