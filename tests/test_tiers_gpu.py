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
    arena.reset()
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
    vmm = imp_mem.VmmBackend(device=0)
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
    assert span.__dlpack_device__() == (3, 0)
    assert buf.address % 4096 == 0
    ctypes.memmove(buf.address, b"\x2a" * 64, 64)
    assert ctypes.string_at(buf.address, 64) == b"\x2a" * 64
    buf.release()
    assert buf.released
