"""The tiers on real device memory: spans export to torch through DLPack
(kDLCUDA) and to CuPy through ``__cuda_array_interface__``, without copies,
and the export keeps the memory alive. Skipped where no CUDA device exists."""

from __future__ import annotations

import ctypes
import gc

import pytest

import imp_mem
from imp_mem import Arena, BlockPool, PinnedBuffer, ScratchStack, StaleSpan, Tier

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    return imp_mem.CudaBackend(device=0)


def test_arena_span_is_a_cuda_tensor_in_torch_and_cupy(cuda):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    arena = Arena(cuda, 1 << 20, tier=Tier.ENGINE_PERSISTENT)
    span = arena.take(4096)
    assert span.__dlpack_device__() == (2, 0)
    t = torch.from_dlpack(span)
    assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == 4096
    assert t.data_ptr() == span.address
    t.fill_(7)
    torch.cuda.synchronize()
    cai = span.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (span.address, False)
    c = cupy.asarray(span)
    assert int(c.data.ptr) == span.address
    assert int((c == 7).all()) == 1


def test_typed_view_in_torch(cuda):
    torch = pytest.importorskip("torch")
    span = Arena(cuda, 1 << 20).take(4 * 8 * 2)
    t = torch.from_dlpack(span.view("float16", (4, 8)))
    assert t.shape == (4, 8) and t.dtype == torch.float16 and t.is_cuda
    t.copy_(torch.arange(32, dtype=torch.float16, device="cuda").reshape(4, 8))
    again = torch.from_dlpack(span.view(torch.float16, (32,)))
    assert again[31].item() == 31.0


def test_export_keeps_device_memory_alive_and_resets_refuse_old_spans(cuda):
    torch = pytest.importorskip("torch")
    arena = Arena(cuda, 1 << 20)
    span = arena.take(1024)
    t = torch.from_dlpack(span)
    t.fill_(3)
    live = cuda.live
    # A reset under a live export is refused (the tensor would read whatever
    # the arena hands out next); the caller may insist, and the old span is
    # then stale while the tensor still holds the region.
    with pytest.raises(imp_mem.InvalidArgument, match="unsafe_allow_live_exports"):
        arena.reset()
    assert int(t.sum().item()) == 3 * 1024
    arena.reset(unsafe_allow_live_exports=True)
    with pytest.raises(StaleSpan):
        torch.from_dlpack(span)
    del arena, span
    gc.collect()
    assert cuda.live == live, "the tensor holds the arena's region"
    assert int(t.sum().item()) == 3 * 1024
    del t
    gc.collect()
    assert cuda.live == live - (1 << 20)


def test_block_pool_on_a_growable_vmm_region(cuda):
    torch = pytest.importorskip("torch")
    # 2 MiB chunks, so the pool's 2-block start really has to grow for 21.
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=2 << 20)
    pool = BlockPool(vmm, 2 << 20, 2, max_blocks=64, grow_blocks=8)
    first = pool.allocate()
    address = first.span().address
    t = torch.from_dlpack(first.span())
    t.fill_(9)
    more = pool.allocate_many(20)
    assert pool.stats()["growths"] >= 1
    assert first.span().address == address, "growth never moves a block"
    assert int(t[:16].sum().item()) == 9 * 16
    more.release()
    first.release()
    del t
    gc.collect()
    assert pool.free == pool.capacity


def test_scratch_on_device(cuda):
    torch = pytest.importorskip("torch")
    stack = ScratchStack(cuda, 1 << 20)
    with stack.mark() as m:
        t = torch.from_dlpack(m.take(512).view("float32"))
        t.fill_(1.0)
        assert t.sum().item() == 128.0
    assert stack.used == 0


def test_pinned_buffer_from_the_driver():
    buf = PinnedBuffer(1 << 20, backend=imp_mem.CudaBackend(device=0))
    span = buf.span()
    # Exported as kDLCPU, as torch exports its own pinned tensors; a consumer
    # that understands kDLCUDAHost can ask for it.
    assert span.__dlpack_device__() == (1, 0)
    assert span.__dlpack__(dl_device=(3, 0)) is not None
    assert buf.address % 4096 == 0
    ctypes.memmove(buf.address, b"\x2a" * 64, 64)
    assert ctypes.string_at(buf.address, 64) == b"\x2a" * 64
    buf.release()
    assert buf.released


def test_a_graph_over_a_vmm_block_span_replays_after_the_pool_grows(cuda):
    """Issue 4: a CUDA graph captured over a tensor that views a VMM-backed
    StableSpan (through torch.from_dlpack) replays with the right result after
    the pool has grown by several chunks, with no re-capture."""
    torch = pytest.importorskip("torch")
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=2 << 20)
    pool = BlockPool(vmm, 2 << 20, 1, max_blocks=64, grow_blocks=4)
    block = pool.allocate()
    x = torch.from_dlpack(block.span().view("float32"))
    x.fill_(1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.mul_(2.0)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2.0)
    torch.cuda.synchronize()
    x.fill_(1.0)
    growths = pool.stats()["growths"]
    grown = [pool.allocate() for _ in range(24)]  # 24 more 2 MiB blocks, 4 per growth
    assert pool.stats()["growths"] >= growths + 5
    assert block.span().address == x.data_ptr(), "growth never moves a block"
    for ref in grown:
        torch.from_dlpack(ref.span().view("float32")).fill_(-1.0)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 4.0), "the replayed graph must update the same bytes"
    assert all(torch.all(torch.from_dlpack(r.span().view("float32")) == -1.0) for r in grown)
    del graph, x
    for ref in grown:
        ref.release()
    block.release()
    gc.collect()
    assert pool.free == pool.capacity


def _span_of(kind, cuda, keep):
    if kind == "arena":
        arena = Arena(cuda, 1 << 20)
        keep.append(arena)
        return arena.take(4096)
    if kind == "block":
        pool = BlockPool(cuda, 4096, 4)
        block = pool.allocate()
        keep += [pool, block]
        return block.span()
    if kind == "scratch":
        stack = ScratchStack(cuda, 1 << 20)
        mark = stack.mark()
        keep += [stack, mark]
        return mark.take(4096)
    buf = PinnedBuffer(4096, backend=cuda)
    keep.append(buf)
    return buf.span()


@pytest.mark.parametrize("kind", ["arena", "block", "scratch", "pinned"])
def test_torch_and_cupy_see_the_same_bytes_from_every_tier(cuda, kind):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    keep = []
    span = _span_of(kind, cuda, keep)
    t = torch.from_dlpack(span.view("int32"))
    t.copy_(torch.arange(1024, dtype=torch.int32))
    torch.cuda.synchronize()
    if kind == "pinned":
        # Pinned host memory: torch sees a pinned CPU tensor, and the device
        # reaches the same bytes through unified addressing.
        assert t.device.type == "cpu" and t.is_pinned()
        c = cupy.ndarray(
            (1024,),
            cupy.int32,
            cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(span.address, 4096, keep[0]), 0),
        )
        assert int(c.sum()) == sum(range(1024))
        return
    c = cupy.from_dlpack(span.view("int32"))
    assert c.__cuda_array_interface__["data"][0] == t.data_ptr() == span.address
    assert int(c.sum()) == sum(range(1024))
    assert bytes(cupy.asnumpy(c).tobytes()) == t.cpu().numpy().tobytes()


def test_an_exported_block_holds_its_own_reference(cuda):
    torch = pytest.importorskip("torch")
    pool = BlockPool(cuda, 4096, 4)
    block = pool.allocate()
    t = torch.from_dlpack(block.span())
    assert block.refcount == 2, "the capsule holds a share of the block"
    block.release()
    assert pool.live == 1, "the tensor keeps the block out of the free list"
    t.fill_(7)
    del t
    gc.collect()
    assert pool.live == 0 and pool.free == pool.capacity
