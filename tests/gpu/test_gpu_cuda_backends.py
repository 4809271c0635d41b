"""The CUDA backends on a real GPU (issue 4). Skipped where
``imp_mem.cuda_available()`` is False (``tests/conftest.py``).

What is checked, on the device:

* bytes written by a kernel before a VMM growth read back intact after it;
* the base address is identical across grow -> shrink -> grow;
* after a full decommit (and a cache trim) device free memory is back at its
  baseline within one granule;
* a growth event maps one handle per chunk and sets access once, on the new
  chunks only; released handles are reused;
* a CUDA graph captured over VMM memory replays correctly after the region
  grew by several chunks, with no re-capture;
* fences complete only after the work before them;
* calls from a thread with no current context leave none behind (the
  primary context is pushed and popped, not set);
* `CudaBackend` and fixed `VmmBackend` regions round-trip bytes through
  torch, CuPy and the driver copies.

The backend conformance suite (``tests/test_backend_conformance.py``) runs
against both backends too.
"""

from __future__ import annotations

import threading

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

MIB = 1 << 20
CHUNK = 32 * MIB


class _View:
    """A zero-copy ``__cuda_array_interface__`` over raw device memory."""

    def __init__(self, address: int, nbytes: int, typestr: str = "|u1", itemsize: int = 1):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // itemsize,),
            "typestr": typestr,
            "strides": None,
            "data": (address, False),
            "version": 3,
            "stream": None,
        }


def tensor_at(address: int, nbytes: int, dtype=None):
    """A torch tensor viewing ``[address, address + nbytes)``, not owning it."""
    dtype = dtype or torch.uint8
    typestr, size = {torch.uint8: ("|u1", 1), torch.float32: ("<f4", 4)}[dtype]
    return torch.as_tensor(_View(address, nbytes, typestr, size), device="cuda")


def pattern(nbytes: int, seed: int):
    return ((torch.arange(nbytes, device="cuda", dtype=torch.int64) * 31 + seed) % 251).to(
        torch.uint8
    )


def stream_handle() -> int:
    return torch.cuda.current_stream().cuda_stream


def settle() -> None:
    torch.cuda.synchronize()


@pytest.fixture
def vmm():
    torch.cuda.init()
    # Load the kernels the tests use now: lazy module loading takes device
    # memory on first launch, which would move a free-memory baseline.
    warm = torch.ones(1024, device="cuda")
    warm.mul_(2.0)
    warm.to(torch.uint8).fill_(1)
    pattern(1024, 0)
    settle()
    backend = imp_mem.VmmBackend(0, chunk_bytes=CHUNK, cache_chunks=2, strict=False)
    backend.record_fence(stream_handle()).wait()
    return backend


def test_the_device_is_described(vmm):
    assert vmm.kind == "vmm" and vmm.granularity == CHUNK == vmm.chunk_bytes
    assert vmm.device_granularity > 0 and CHUNK % vmm.device_granularity == 0
    free, total = vmm.mem_get_info()
    assert 0 < free <= total
    assert vmm.capacity <= total - 2 * CHUNK
    assert imp_mem.cuda_device_count() >= 1
    assert imp_mem.cuda_driver_version() >= 12000
    assert vmm.device_name


def test_data_survives_growth(vmm):
    region = vmm.acquire_growable(16 * CHUNK, CHUNK, tag="kv_cache")
    base = region.address
    first = tensor_at(base, CHUNK)
    first.copy_(pattern(CHUNK, 7))
    settle()
    for chunks in (2, 5, 9, 16):
        region.commit(chunks * CHUNK)
        assert region.address == base
        tail = tensor_at(base + (chunks - 1) * CHUNK, CHUNK)
        tail.copy_(pattern(CHUNK, chunks))
        settle()
        assert torch.equal(tensor_at(base, CHUNK), pattern(CHUNK, 7)), f"after {chunks} chunks"
    # And through the driver copies.
    assert vmm.read(region, 0, 4096) == bytes(pattern(4096, 7).cpu().tolist())
    region.release()


def test_base_is_identical_across_grow_shrink_grow(vmm):
    region = vmm.acquire_growable(32 * CHUNK, 0, tag="kv_cache")
    base = region.address
    steps = [8, 2, 6, 4, 10, 0, 3]
    for chunks in steps:
        if chunks * CHUNK >= region.nbytes:
            region.commit(chunks * CHUNK)
        else:
            vmm.record_fence(stream_handle()).wait()
            region.decommit(chunks * CHUNK)
        assert region.address == base
        assert region.nbytes == chunks * CHUNK
        if chunks:
            # The committed prefix is usable memory.
            t = tensor_at(base, chunks * CHUNK)
            t.fill_(chunks)
            settle()
            assert int(t[-1]) == chunks
    region.release()
    assert vmm.live == 0


def test_full_decommit_returns_memory_to_the_baseline(vmm):
    settle()
    gran = vmm.device_granularity
    free0, _ = vmm.mem_get_info()
    region = vmm.acquire_growable(64 * CHUNK, 16 * CHUNK, tag="kv_cache")
    free1, _ = vmm.mem_get_info()
    assert abs((free0 - free1) - 16 * CHUNK) <= gran, (free0, free1)
    tensor_at(region.address, 16 * CHUNK).fill_(1)
    vmm.record_fence(stream_handle()).wait()
    region.decommit(0)
    # Two chunks stay in the handle cache until trimmed.
    assert vmm.cached_bytes == 2 * CHUNK
    free2, _ = vmm.mem_get_info()
    assert abs((free0 - free2) - 2 * CHUNK) <= gran, (free0, free2)
    vmm.trim_cache()
    free3, _ = vmm.mem_get_info()
    assert abs(free3 - free0) <= gran, (free0, free3)
    region.release()
    free4, _ = vmm.mem_get_info()
    assert abs(free4 - free0) <= gran


def test_growth_is_one_handle_per_chunk_and_one_set_access(vmm):
    region = vmm.acquire_growable(16 * CHUNK, 0, tag="kv_cache")
    before = vmm.counters()
    region.commit(CHUNK)
    region.commit(4 * CHUNK)
    after = vmm.counters()
    assert after["maps"] - before["maps"] == 4
    assert after["set_access_calls"] - before["set_access_calls"] == 2
    vmm.record_fence(stream_handle()).wait()
    region.decommit(2 * CHUNK)
    reused = vmm.counters()
    region.commit(4 * CHUNK)
    final = vmm.counters()
    assert final["cache_hits"] - reused["cache_hits"] == 2
    assert final["handles_created"] == reused["handles_created"]
    assert final["cleanup_failures"] == 0
    region.release()


def test_a_captured_graph_replays_after_growth(vmm):
    region = vmm.acquire_growable(16 * CHUNK, CHUNK, tag="kv_cache")
    n = CHUNK // 4
    x = tensor_at(region.address, CHUNK, torch.float32)
    x.fill_(1.0)
    settle()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(2.0)  # warm-up outside capture, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    settle()
    with torch.cuda.graph(graph):
        x.mul_(2.0)
    settle()
    assert float(x[0]) == 2.0
    for chunks in range(2, 8):
        region.commit(chunks * CHUNK)
        tensor_at(region.address + (chunks - 1) * CHUNK, CHUNK).fill_(0)
    graph.replay()
    graph.replay()
    settle()
    assert torch.all(x == 8.0), "the graph must see the same bytes at the same address"
    assert x.numel() == n
    del graph
    region.release()


def test_fences_complete_after_queued_work(vmm):
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the current stream
    fence = vmm.record_fence(stream_handle())
    assert fence.is_complete() in (False, True)  # usually False; never an error
    fence.wait()
    assert fence.is_complete()
    default = imp_mem.Fence(0, 0)
    default.wait()
    assert default.is_complete()


def test_calls_from_a_fresh_thread_leave_no_context_behind(vmm):
    cupy = pytest.importorskip("cupy")
    seen = {}

    def work():
        seen["before"] = cupy.cuda.driver.ctxGetCurrent()
        region = vmm.acquire(MIB, tag="workspace")
        vmm.write(region, b"\x01\x02\x03")
        seen["data"] = vmm.read(region, 0, 3)
        region.release()
        seen["after"] = cupy.cuda.driver.ctxGetCurrent()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["data"] == b"\x01\x02\x03"
    assert seen["before"] == seen["after"], "the caller's current context must be restored"


@pytest.mark.parametrize("kind", ["cuda", "vmm"])
def test_fixed_regions_round_trip_through_torch_cupy_and_the_driver(kind):
    backend = imp_mem.CudaBackend(0) if kind == "cuda" else imp_mem.VmmBackend(0)
    nbytes = 3 * MIB + 123
    region = backend.acquire(nbytes, align=4096, tag="workspace")
    assert region.address % 4096 == 0
    t = tensor_at(region.address, nbytes)
    t.copy_(pattern(nbytes, 3))
    settle()
    assert backend.read(region, 100, 16) == bytes(pattern(nbytes, 3)[100:116].cpu().tolist())
    backend.write(region, b"\xaa" * 64, offset=nbytes - 64)
    assert int(t[-1]) == 0xAA
    with pytest.raises(imp_mem.InvalidArgument):
        backend.read(region, nbytes - 1, 2)
    cupy = pytest.importorskip("cupy")
    c = cupy.asarray(_View(region.address, nbytes))
    assert int(c[5]) == int(t[5])
    region.release()
    with pytest.raises(imp_mem.ImpMemError):
        backend.read(region)


def test_cuda_backend_returns_memory_on_release():
    torch.cuda.init()
    backend = imp_mem.CudaBackend(0)
    settle()
    free0, _ = backend.mem_get_info()
    regions = [backend.acquire(256 * MIB, tag="weights") for _ in range(4)]
    free1, _ = backend.mem_get_info()
    assert free0 - free1 >= 4 * 256 * MIB
    for r in regions:
        r.release()
    free2, _ = backend.mem_get_info()
    assert abs(free2 - free0) <= 2 * MIB
    assert backend.stats()["live"] == 0


def test_a_budget_refusal_on_the_device_is_typed(vmm):
    vmm.set_budget(4 * CHUNK)
    region = vmm.acquire_growable(64 * CHUNK, 2 * CHUNK, tag="kv_cache")
    with pytest.raises(imp_mem.OutOfMemory) as info:
        region.commit(8 * CHUNK)
    assert not info.value.device_refused
    assert region.nbytes == 2 * CHUNK
    region.release()
    vmm.check_invariants()
