"""Issue 4 on the H200: a BlockPool over a VmmBackend region grows, shrinks
with hysteresis behind a recorded fence, and gives the physical memory back
(device free memory returns to its baseline within one granule once the
VMM handle cache is trimmed); the base address is identical across
grow -> shrink -> grow, and bytes of live blocks survive every shrink.
Skipped where no CUDA device exists."""

from __future__ import annotations

import gc

import pytest

import imp_mem
from imp_mem import BlockPool

pytestmark = pytest.mark.gpu

CHUNK = 2 << 20  # VMM handle size and the region's granularity
BLOCK = 256 << 10  # 8 blocks a granule
START = 8  # one granule
GROW = 64  # 16 MiB a growth step: the pool's shrink chunk
IDLE = 4


def vmm_pool(vmm, **kw) -> BlockPool:
    kw.setdefault("min_idle_steps", IDLE)
    kw.setdefault("keep_chunks", 0)
    return BlockPool(vmm, BLOCK, START, max_blocks=1024, grow_blocks=GROW, **kw)


def settle(vmm) -> int:
    """Device free bytes with the handle cache emptied."""
    gc.collect()
    vmm.trim_cache()
    return vmm.mem_get_info()[0]


def test_free_memory_returns_after_the_hysteresis_with_a_recorded_fence():
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=CHUNK)
    assert vmm.chunk_bytes == CHUNK
    pool = vmm_pool(vmm)
    base = pool.allocate()
    base_address = base.span().address
    base.release()
    s = pool.stats()
    assert (s["capacity"], s["min_blocks"], s["chunk_blocks"]) == (START, START, GROW)
    assert s["committed_bytes"] == CHUNK
    baseline = settle(vmm)

    burst = pool.allocate_many(400)  # one growth step of 392 blocks (98 MiB)
    grown = pool.stats()
    assert grown["growths"] == 1 and grown["capacity"] == 400
    grown_bytes = grown["committed_bytes"] - CHUNK
    assert grown_bytes >= 400 * BLOCK - CHUNK
    assert vmm.mapped_bytes == grown["committed_bytes"]
    assert settle(vmm) <= baseline - grown_bytes + CHUNK, "growth took device memory"

    burst.release()
    returned = 0
    # The first step after growth starts the idle count; IDLE idle steps decide.
    for i in range(IDLE):
        returned += pool.step(vmm.record_fence(0))
        assert pool.capacity == grown["capacity"], f"shrank early, at step {i}"
    for _ in range(2):
        returned += pool.step(vmm.record_fence(0))
    returned += pool.flush_decommit()
    s = pool.stats()
    assert (s["capacity"], s["pending_blocks"], s["shrinks"]) == (START, 0, 1), s
    assert returned == s["decommitted_bytes"] == grown_bytes
    assert s["committed_bytes"] == CHUNK == vmm.mapped_bytes
    # Decommitted handles go to the cache first; trimming it frees them.
    after = settle(vmm)
    assert vmm.cached_bytes == 0
    granule = vmm.device_granularity
    assert abs(after - baseline) <= granule, (
        f"device free memory {after} vs baseline {baseline}: off by {after - baseline} B"
    )
    again = pool.allocate()
    assert again.span().address == base_address
    again.release()
    pool.check_invariants()


def test_base_and_bytes_survive_grow_shrink_grow():
    torch = pytest.importorskip("torch")
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=CHUNK)
    pool = vmm_pool(vmm)
    first = pool.allocate()
    base = first.span().address
    assert first.id == 0
    t0 = torch.from_dlpack(first.span())
    t0.fill_(0x5A)

    grown = pool.allocate_many(300)
    for i in range(0, len(grown), 37):
        t = torch.from_dlpack(grown.span(i))
        t.fill_(i % 200 + 1)
        del t
    torch.cuda.synchronize()
    ids = grown.ids
    assert max(ids) * BLOCK + base == grown.span(ids.index(max(ids))).address
    grown.release()
    gc.collect()

    fence = vmm.record_fence(torch.cuda.current_stream().cuda_stream)
    pool.shrink(fence)
    pool.flush_decommit()
    s = pool.stats()
    assert s["capacity"] == START and s["shrinks"] == 1, s
    assert first.span().address == base
    assert int((t0 == 0x5A).sum().item()) == BLOCK, "a live block kept its bytes"

    again = pool.allocate_many(300)
    assert pool.stats()["growths"] > s["growths"], "the range was committed again"
    for i, block in enumerate(again.ids):
        assert again.span(i).address == base + block * BLOCK
    last = torch.from_dlpack(again.span(len(again) - 1))
    last.fill_(7)
    torch.cuda.synchronize()
    assert int(last.sum().item()) == 7 * BLOCK, "the recommitted range is usable"
    assert int((t0 == 0x5A).sum().item()) == BLOCK
    del last
    gc.collect()
    again.release()
    del t0
    gc.collect()
    first.release()
    pool.check_invariants()


def test_the_decommit_waits_for_queued_work_on_a_torch_event():
    """A block freed while a kernel still writes it: the tail is withdrawn at
    once but unmapped only after the event completes."""
    torch = pytest.importorskip("torch")
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=CHUNK)
    pool = vmm_pool(vmm)
    burst = pool.allocate_many(200).split()
    tail = burst[-1]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.from_dlpack(tail.span().view("float32"))
        torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work before the write
        x.fill_(1.0)
    event = torch.cuda.Event()
    event.record(stream)
    del x
    for r in burst:
        r.release()
    gc.collect()
    assert pool.live == 0, "the tensor's share is gone; only the kernel still uses it"
    committed = pool.stats()["committed_bytes"]
    returned = pool.shrink(event)
    if not event.query():
        assert returned == 0
        s = pool.stats()
        assert s["pending_blocks"] > 0 and s["committed_bytes"] == committed, s
    returned += pool.step()
    returned += pool.flush_decommit()
    assert event.query()
    torch.cuda.synchronize()  # would raise had the kernel hit an unmapped page
    s = pool.stats()
    assert s["capacity"] == START and returned == committed - CHUNK, s


def test_an_imp_mem_fence_on_a_busy_stream_holds_the_decommit():
    torch = pytest.importorskip("torch")
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=CHUNK)
    pool = vmm_pool(vmm, min_idle_steps=1)
    pool.allocate_many(100).release()
    pool.step()  # the step after growth restarts the idle count
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
    fence = vmm.record_fence(stream.cuda_stream)
    returned = pool.step(fence)
    if not fence.is_complete():
        assert returned == 0 and pool.stats()["pending_blocks"] > 0
    returned += pool.flush_decommit()
    assert fence.is_complete()
    assert pool.capacity == START and returned > 0
    torch.cuda.synchronize()
