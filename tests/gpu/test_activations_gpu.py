"""The activation pool (T4a) and its C hooks on a real GPU (issue 12).
Skipped where ``imp_mem.cuda_available()`` is False (``tests/conftest.py``).

What is checked, on the device:

* a pool over ``CudaBackend`` hands out aligned, adjacent device blocks and
  refuses past its capacity (strict);
* a block freed on one torch stream and reused on another goes through
  ``CudaStreamOrder`` (event record + stream wait) without a driver error,
  and counts as a cross-stream reuse;
* in a fresh process, torch's ``CUDAPluggableAllocator`` over
  ``imp_mem_torch_malloc`` / ``imp_mem_torch_free`` (process-wide, set
  before the first CUDA allocation) serves a matmul whose result matches
  the CPU's, with no misuse counted and every block back at the end;
* in a fresh process, CuPy's ``CFunctionAllocator`` over
  ``imp_mem_cupy_malloc`` / ``imp_mem_cupy_free`` serves an array sum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def _run(script: str) -> dict:
    """Runs `script` in a fresh interpreter (no CUDA state yet) and returns
    the JSON object its last stdout line holds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pool_on_a_cuda_backend_allocates_device_memory():
    backend = imp_mem.CudaBackend(0, strict=True)
    pool = imp_mem.ActivationPool(backend, 64 * MIB)
    assert pool.strict is True
    a = pool.allocate(10 * MIB)
    b = pool.allocate(1000)
    assert a % 512 == 0 and b == a + 10 * MIB
    free, total = imp_mem.cuda_mem_get_info(0)
    assert 0 < free < total
    pool.free(a)
    pool.free(b)
    with pytest.raises(imp_mem.OutOfMemory):
        pool.allocate(65 * MIB)
    pool.check_invariants()
    assert pool.memory_stats()["num_ooms"] == 1


def test_cross_stream_reuse_orders_with_real_streams():
    torch = pytest.importorskip("torch")
    backend = imp_mem.CudaBackend(0)
    pool = imp_mem.ActivationPool(backend, 16 * MIB, strict=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = pool.allocate(16 * MIB, stream=s1.cuda_stream)
    pool.free(a, stream=s1.cuda_stream)
    b = pool.allocate(4 * MIB, stream=s2.cuda_stream)  # needs an event wait
    assert b == a
    assert pool.stats()["cross_stream_reuses"] == 1
    pool.free(b, stream=s2.cuda_stream)
    # Only the union of both streams' blocks fits: a reclaim orders the
    # default stream after both.
    c = pool.allocate(16 * MIB, stream=0)
    assert pool.stats()["reclaims"] == 1
    pool.free(c)
    torch.cuda.synchronize()
    pool.check_invariants()


TORCH_SCRIPT = """
import json
import torch
import imp_mem
from imp_mem import _core

backend = imp_mem.CudaBackend(0)
pool = imp_mem.ActivationPool(backend, "1GiB", strict=True)
pool.install(device=0)
alloc = torch.cuda.memory.CUDAPluggableAllocator(
    _core.hook_library_path(), _core.TORCH_MALLOC_SYMBOL, _core.TORCH_FREE_SYMBOL
)
torch.cuda.memory.change_current_allocator(alloc)
g = torch.Generator().manual_seed(0)
x_cpu = torch.randn(512, 512, generator=g)
x = x_cpu.to("cuda")
y = (x @ x).relu()
empty = torch.empty(0, device="cuda")  # torch asks for 0 bytes: null, counted
ok = torch.allclose(y.cpu(), (x_cpu @ x_cpu).relu(), atol=1e-2, rtol=1e-3)
torch.cuda.synchronize()
during = pool.stats()
del x, y, empty
torch.cuda.synchronize()
print(json.dumps({
    "ok": bool(ok),
    "during_live": during["live"],
    "after": pool.stats(),
    "hooks": _core.hook_stats(),
}))
"""


def test_torch_pluggable_allocator_runs_on_the_pool():
    pytest.importorskip("torch")
    r = _run(TORCH_SCRIPT)
    assert r["ok"]
    hooks = r["hooks"]
    assert hooks["malloc_ok"] >= 2 and r["during_live"] >= 2
    # torch's pluggable allocator asks for 0 bytes for an empty tensor (and
    # never frees the null it gets back): counted, not an error.
    assert hooks["zero_size"] >= 1
    calls = {"mallocs", "frees", "malloc_ok", "free_ok", "installed", "route", "zero_size"}
    misuse = {k: v for k, v in hooks.items() if k not in calls and v}
    assert misuse == {}
    # What torch still holds at exit (cuBLAS workspaces, if it allocated
    # them through us) stays live; the two tensors are back.
    assert r["after"]["live"] <= r["during_live"] - 2
    assert r["after"]["refused_frees"] == 0


CUPY_SCRIPT = """
import json
import cupy
import imp_mem
from imp_mem import _core

backend = imp_mem.CudaBackend(0)
pool = imp_mem.ActivationPool(backend, "256MiB", strict=True)
pool.install(device=0)
addr = _core.hook_addresses()
allocator = cupy.cuda.memory.CFunctionAllocator(
    0, addr[_core.CUPY_MALLOC_SYMBOL], addr[_core.CUPY_FREE_SYMBOL], pool
)
cupy.cuda.set_allocator(allocator.malloc)
a = cupy.arange(1_000_000, dtype=cupy.float64)
total = float(a.sum())
during = pool.stats()["live"]
del a
result = {"total": total, "during": during, "after": pool.stats(), "hooks": _core.hook_stats()}
print(json.dumps(result))
"""


def test_cupy_c_function_allocator_runs_on_the_pool():
    pytest.importorskip("cupy")
    r = _run(CUPY_SCRIPT)
    assert r["total"] == 499999500000.0
    assert r["during"] >= 1
    assert r["hooks"]["malloc_ok"] >= 1
    assert r["hooks"]["foreign_frees"] == 0 and r["hooks"]["double_frees"] == 0
    assert r["after"]["refused_frees"] == 0


MEMPOOL_SCRIPT = """
import json
import torch
import imp_mem
from imp_mem import _core

torch.cuda.init()
backend = imp_mem.CudaBackend(0)
pool = imp_mem.ActivationPool(backend, "256MiB", strict=True)
pool.install(device=0)
alloc = torch.cuda.memory.CUDAPluggableAllocator(
    _core.hook_library_path(), _core.TORCH_MALLOC_SYMBOL, _core.TORCH_FREE_SYMBOL
)
mempool = torch.cuda.MemPool(alloc.allocator())
with torch.cuda.use_mem_pool(mempool):
    x = torch.ones(1024, 1024, device="cuda")
    y = (x * 2).sum()
inside = pool.stats()["live"]
oom = None
try:
    with torch.cuda.use_mem_pool(mempool):
        big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
except Exception as e:
    oom = type(e).__name__
outside = torch.ones(16, device="cuda").sum().item()  # the default allocator
result = {
    "sum": y.item(), "inside": inside, "oom": oom, "outside": outside,
    "hooks": _core.hook_stats(), "stats": pool.stats(),
}
print(json.dumps(result))
"""


def test_a_torch_mempool_over_the_pool_caches_and_raises_on_exhaustion():
    pytest.importorskip("torch")
    r = _run(MEMPOOL_SCRIPT)
    assert r["sum"] == 2 * 1024 * 1024
    assert r["inside"] >= 1  # torch's segments come from the pool
    # A strict pool returns null past its capacity; inside a MemPool torch
    # turns that into its own out-of-memory error, and nothing is corrupted.
    assert r["oom"] in {"OutOfMemoryError", "RuntimeError"}, r["oom"]
    assert r["hooks"]["ooms"] >= 1
    assert r["outside"] == 16.0
    assert r["stats"]["refused_frees"] == 0
