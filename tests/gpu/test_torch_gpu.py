"""torch and CuPy on imp-mem's activations tier, on the GPU (issue 12).

* a ``Pool`` scope routes torch's segments into the tier; the bytes are
  torch's to use (kernels read back what they wrote); a live MemPool keeps
  its segments cached, and closing the Pool gives them back to the tier, not
  to the driver;
* a CUDA graph captured into the pool replays correctly, also after other
  work reused the pool;
* a loading scope places torch's allocations in T1 and a later free of such
  a segment is counted as stranded;
* the process-wide mode works before torch's first CUDA allocation and is
  refused, with a message that says why, after it;
* cross-stream reuse orders the new stream after the old one;
* CuPy allocates through the same tier;
* a Hugging Face model generates on imp-mem with 0 allocations of any kind
  while serving, >= 99 % attribution and the same greedy tokens as torch's
  own allocator in deterministic mode (``benches/bench_torch_hf.py``, whose
  ratios the GPU check prints).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _system(activations: int = 256 * MIB, weights: int = 64 * MIB):
    """A small MemorySystem on the VMM backend with an activations tier."""
    shape = imp_mem.ModelShape.from_hf_config(
        {
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
    ).with_weights_bytes(weights)
    features = imp_mem.Features(
        activation_bytes=activations,
        scratch_bytes=2 * MIB,
        engine_persistent_bytes=2 * MIB,
    )
    plan = imp_mem.plan_memory(
        imp_mem.PlanInput(shape, imp_mem.Limits(2, 64), features, budget="8GiB")
    )
    return imp_mem.MemorySystem(imp_mem.VmmBackend(0), plan)


@pytest.fixture
def system():
    import imp_mem.torch as imt

    s = _system()
    yield s
    torch.cuda.synchronize()
    for p in list(imt._pools.values()):
        p.close()


def test_one_pool_a_tier_and_the_system_closes_with_nothing_held():
    """``imp_mem.torch.pool`` gives one Pool a tier (a MemorySystem's
    ``activations`` is a new handle at each access); a GEMM in its scope puts
    torch's cuBLAS workspace in the tier; closing the Pool clears it, takes
    the tier out of the hooks, and the system then closes with no memory held
    and no warning; GEMMs after it run on torch's own allocator."""
    import warnings

    import imp_mem.torch as imt

    retired = imp_mem._core.hook_stats()["retired_pools"]  # earlier tests' leftovers
    system = _system()
    pool = imt.pool(system)
    assert imt.pool(system) is pool
    assert imp_mem._core.hook_stats()["installed"]
    a = torch.randn(512, 512, device="cuda")
    with pool.scope():
        b = a @ a
        c = torch.nn.functional.linear(b.bfloat16(), a.bfloat16())
    torch.cuda.synchronize()
    expect = float((a.double() @ a.double()).sum())
    assert abs(float(b.double().sum()) - expect) <= 1e-3 * max(1.0, abs(expect))
    del b, c
    pool.close()
    pool.close()  # a second close does nothing
    with pytest.raises(imp_mem.InvalidArgument, match="closed"):
        with pool.scope():
            pass
    hooks = imp_mem._core.hook_stats()
    assert not hooks["installed"] and hooks["retired_pools"] == retired, hooks
    assert system.activations.stats()["live"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", imp_mem.ImpMemWarning)
        report = system.close()
    assert report["still_held"] == {}
    d = a @ a  # a new cuBLAS workspace, on torch's allocator
    torch.cuda.synchronize()
    assert torch.isfinite(d).all()
    assert pool not in imt._pools.values()


def test_a_pool_as_a_context_manager_closes_at_the_end():
    import imp_mem.torch as imt

    system = _system()
    with imt.Pool(system) as pool:
        with pool.scope():
            x = torch.ones(1 << 20, device="cuda")
        assert float(x.sum()) == float(1 << 20)
        del x
    assert pool.closed and not imp_mem._core.hook_stats()["installed"]
    assert system.close()["still_held"] == {}


def test_weights_loaded_in_t1_outlive_the_system_that_closed_under_them():
    """A tensor made in a loading scope lies in T1; closing the Pool and the
    system while it is alive does not release T1 under it (the hooks keep
    the arena: the close reports it held, with a warning), and once the
    tensor goes, so does the arena."""
    import gc
    import warnings

    import imp_mem.torch as imt

    kept = imp_mem._core.hook_stats()["retired_arenas"]
    system = _system()
    pool = imt.pool(system)
    used = system.weights_arena.used
    with pool.loading():
        w = torch.full((1024, 1024), 3.0, device="cuda")
    assert system.weights_arena.used >= used + 4 * MIB, "not taken from T1"
    pool.close()
    assert imp_mem._core.hook_stats()["retired_arenas"] == kept + 1
    with pytest.warns(imp_mem.ImpMemWarning, match="weights"):
        report = system.close()
    assert "weights" in report["still_held"]
    assert float(w.sum()) == 3.0 * (1 << 20), "T1 was released under a live tensor"
    del w
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the loading pool's segment goes back through the hooks
    assert imp_mem._core.hook_stats()["retired_arenas"] == kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")).sum().item()


def test_scope_routes_torch_segments_into_the_tier(system):
    import imp_mem.torch as imt

    pool = imt.pool(system)
    before = pool.memory_stats()["allocated_bytes.all.current"]
    with pool.scope():
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        y = x * 2
    torch.cuda.synchronize()
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] >= before + 8 * MIB  # two 4 MiB tensors
    base = system.activations.base
    assert base <= x.data_ptr() < base + system.activations.capacity
    assert base <= y.data_ptr() < base + system.activations.capacity
    assert float(y[12345]) == 24690.0
    del x, y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # a live MemPool keeps its segments cached
    assert pool.memory_stats()["allocated_bytes.all.current"] >= before + 8 * MIB
    pool.close()  # dropping the MemPool gives them back to the tier
    assert system.activations.memory_stats()["allocated_bytes.all.current"] == before
    system.activations.check_invariants()


def test_graph_captured_into_the_pool_replays(system):
    import imp_mem.torch as imt

    pool = imt.pool(system)
    w = torch.randn(512, 512, device="cuda")
    x = torch.randn(64, 512, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pool.scope():
        for _ in range(3):  # warm-up on the capture stream, as torch asks
            (x @ w).relu()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with pool.graph(graph):
        out = (x @ w).relu()
    base = system.activations.base
    assert base <= out.data_ptr() < base + system.activations.capacity
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        with pool.scope():  # other work in the pool between replays
            junk = torch.randn(1 << 18, device="cuda")
            del junk
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, (x @ w).relu(), atol=1e-3, rtol=1e-3)


def test_two_tiers_pools_keep_their_tensors_and_graphs_apart(system):
    """Two engines' Pools in one process (two systems): each scope's tensors
    and each Pool's captured graph lie in their own tier, nested either
    way, and both tiers give everything back at close."""
    import imp_mem.torch as imt

    other = _system()
    a, b = imt.pool(system), imt.pool(other)
    assert not a._region and b._region

    def inside(p, t):
        act = p.activations
        return act.base <= t.data_ptr() < act.base + act.capacity

    with b.scope():
        xb = torch.full((1 << 20,), 2.0, device="cuda")
    with a.scope():
        xa = torch.full((1 << 20,), 3.0, device="cuda")
        with b.scope():
            yb = xb * xa
        ya = xa + 1
    assert inside(b, xb) and inside(b, yb) and inside(a, xa) and inside(a, ya)
    w = torch.randn(256, 256, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), b.scope():
        (w @ w).relu()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with b.graph(graph):
        out = (w @ w).relu()
    assert inside(b, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, (w @ w).relu(), atol=1e-3, rtol=1e-3)
    assert float(yb[7]) == 6.0 and float(ya[7]) == 4.0
    del xa, xb, ya, yb, out, graph
    torch.cuda.synchronize()
    b.close()
    a.close()
    for s in (system, other):
        assert s.activations.memory_stats()["allocated_bytes.all.current"] == 0
        s.activations.check_invariants()
    assert other.close()["still_held"] == {}


def test_loading_scope_places_allocations_in_t1_and_counts_stranded_frees(system):
    import imp_mem.torch as imt

    pool = imt.pool(system)
    used0 = system.weights_arena.used
    h0 = imt.hook_stats()
    with pool.loading():
        w = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
        w.fill_(7)
        tmp = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")  # a loading temporary
        del tmp
    torch.cuda.synchronize()
    assert system.weights_arena.used >= used0 + 48 * MIB
    assert int(w[-1]) == 7
    h1 = imt.hook_stats()
    assert h1["stranded_frees"] >= h0.get("stranded_frees", 0) + 1
    assert h1["stranded_bytes"] >= h0.get("stranded_bytes", 0) + 32 * MIB
    assert int(w[0]) == 7  # the weight itself is untouched


def test_cross_stream_reuse_waits_for_the_old_stream(system):
    acts = system.activations
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    before = acts.stats()
    ptr = acts.allocate(4 * MIB, stream=s1.cuda_stream)
    acts.free(ptr, stream=s1.cuda_stream)
    again = acts.allocate(4 * MIB, stream=s1.cuda_stream)
    assert again == ptr  # same stream: reusable at once
    acts.free(again, stream=s1.cuda_stream)
    # Take everything else so the only fitting block is the one s1 freed.
    other = acts.allocate(4 * MIB, stream=s2.cuda_stream)
    acts.free(other, stream=s2.cuda_stream)
    after = acts.stats()
    key = next(k for k in after if "cross_stream" in k)
    assert after[key] >= before.get(key, 0) + 1
    acts.check_invariants()


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT / "tests" / "gpu"),
    )


_SYSTEM_SNIPPET = """
import imp_mem, torch
MIB = 1 << 20
from test_torch_gpu import _system
"""


def test_process_wide_mode_before_the_first_allocation():
    proc = _run(
        _SYSTEM_SNIPPET
        + """
import imp_mem.torch as imt
s = _system()
imt.install(s)
x = torch.ones(1 << 20, device="cuda")
y = (x + 1).sum()
assert float(y) == 2 * (1 << 20), float(y)
st = imt.memory_stats(s)
assert st["allocation.all.allocated"] >= 2, st
base = s.activations.base
assert base <= x.data_ptr() < base + s.activations.capacity
print("OK", st["allocation.all.allocated"])
"""
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_process_wide_mode_after_the_first_allocation_says_why():
    proc = _run(
        _SYSTEM_SNIPPET
        + """
import imp_mem.torch as imt
x = torch.ones(16, device="cuda")
s = _system()
try:
    imt.install(s)
except imp_mem.PhaseViolation as exc:
    print("REFUSED", exc)
"""
    )
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "before torch's first CUDA allocation" in proc.stdout


def test_cupy_allocates_through_the_tier(system):
    cupy = pytest.importorskip("cupy")
    import imp_mem.cupy as imc

    acts = system.activations
    before = acts.memory_stats()["allocation.all.allocated"]
    with imc.use_pool(system):
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        total = float(a.sum())
    assert total == float((1 << 20) * ((1 << 20) - 1) / 2)
    assert acts.base <= a.data.ptr < acts.base + acts.capacity
    assert acts.memory_stats()["allocation.all.allocated"] > before
    del a
    acts.check_invariants()


def test_cupy_and_a_torch_pool_over_other_tiers_keep_apart(system):
    """CuPy names its tier in each call (a hook region): a torch Pool's tier
    holding the hooks' slot keeps torch's tensors, CuPy's arrays stay in
    CuPy's tier, and neither takes the other's (2026-12-05, issue 28; before, CuPy
    took the slot and torch's next tensors went to CuPy's tier)."""
    cupy = pytest.importorskip("cupy")
    import imp_mem.cupy as imc
    import imp_mem.torch as imt

    other = _system()
    pool = imt.pool(system)

    def inside(target, ptr):
        act = target.activations
        return act.base <= ptr < act.base + act.capacity

    with pool.scope():
        before = torch.ones(1 << 20, device="cuda")
    with imc.use_pool(other):
        arr = cupy.arange(1 << 20, dtype=cupy.float32)
        with pool.scope():
            during = torch.ones(1 << 20, device="cuda")
    with pool.scope():
        after = torch.ones(1 << 20, device="cuda")
    assert inside(other, arr.data.ptr)
    for t in (before, during, after):
        assert inside(system, t.data_ptr()), "a torch tensor left its Pool's tier"
    assert float(arr[7]) == 7.0 and float(during.sum()) == float(1 << 20)
    # The block outlives the use_pool: its free still reaches CuPy's tier.
    del arr
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.synchronize()
    assert other.activations.memory_stats()["allocated_bytes.all.current"] == 0
    del before, during, after
    pool.close()
    assert other.close()["still_held"] == {}


def test_hf_generate_on_imp_mem_allocates_nothing_while_serving(tmp_path):
    keep = os.environ.get("IMP_MEM_GPU_OUT")
    out = Path(keep) / "bench_torch_hf.json" if keep else tmp_path / "hf.json"
    # The full workload on the one-call path (issue 28), eager: process-wide
    # (first and second start) and scope mode; the compiled variants run in
    # tests/gpu/test_torch_serve_gpu.py on the quick workload.
    cmd = [sys.executable, str(ROOT / "benches" / "bench_torch_hf.py"), "--json", str(out)]
    cmd += ["--compiles", "none", "--cache", str(tmp_path / "cache"), "--peer-runs", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-8000:])
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert not r["failed"], r["failed"]
    for name, m in r["variants"].items():
        assert m["steady_state_allocations"] == 0, name
        assert m["backend_acquisitions_serving"] == 0, name
        assert m["committed_delta_serving"] == 0, name
        assert m["fallbacks"] == 0, name
        assert m["device_free_delta_serving_mib"] <= 2, name
        assert m["attribution_pct"] >= 99.0, name
        assert m["tokens_identical"], f"{name}: greedy tokens differ from torch's allocator's"
