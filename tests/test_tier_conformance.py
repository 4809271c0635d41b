"""One tier conformance suite, run against every tier allocator and every
backend (RMM's ``mr_ref_test`` is the model). Each tier is wrapped in a small
adapter that allocates, frees and reads back; GPU backends are marked ``gpu``
and skipped where no device exists."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

import imp_mem
from imp_mem import Arena, BlockPool, CapacityError, InvalidArgument, ScratchStack, Tier

CAPACITY = 64 << 10
BLOCK = 1024


def _fake() -> imp_mem.Backend:
    return imp_mem.FakeBackend(capacity=16 << 20)


def _cuda() -> imp_mem.Backend:
    return imp_mem.CudaBackend(device=0)


def _vmm() -> imp_mem.Backend:
    return imp_mem.VmmBackend(device=0)


BACKENDS = [
    pytest.param(_fake, id="fake"),
    pytest.param(_cuda, id="cuda", marks=pytest.mark.gpu),
    pytest.param(_vmm, id="vmm", marks=pytest.mark.gpu),
]


class ArenaTier:
    unit = CAPACITY
    lifo = False
    frees_individually = False

    def __init__(self, backend):
        self.arena = Arena(backend, CAPACITY, tier=Tier.MODEL_RESIDENT)

    def alloc(self, nbytes, align):
        return self.arena.take(nbytes, align=align)

    def free(self, handle):
        pass

    def free_all(self, handles):
        self.arena.reset()

    def in_use(self):
        return self.arena.used

    def span(self, handle):
        return handle


class ReleasableHandles:
    """Adapters whose handles are released one by one (`release()`,
    `released`) and know their span."""

    def free(self, handle):
        handle.release()

    def free_all(self, handles):
        for h in handles:
            if not h.released:
                h.release()

    def span(self, handle):
        return handle.span()


class PoolTier(ReleasableHandles):
    unit = BLOCK
    lifo = False
    frees_individually = True

    def __init__(self, backend):
        self.pool = BlockPool(backend, BLOCK, CAPACITY // BLOCK)

    def alloc(self, nbytes, align):
        if nbytes <= 0 or nbytes > BLOCK or align > BLOCK or align & (align - 1):
            raise InvalidArgument("a block pool serves one block size")
        return self.pool.allocate()

    def in_use(self):
        return self.pool.live * BLOCK


class ScratchTier:
    unit = CAPACITY
    lifo = True
    frees_individually = True

    def __init__(self, backend):
        self.stack = ScratchStack(backend, CAPACITY)

    def alloc(self, nbytes, align):
        mark = self.stack.mark()
        try:
            return (mark, mark.take(nbytes, align=align))
        except BaseException:
            mark.rewind()
            raise

    def free(self, handle):
        handle[0].rewind()

    def free_all(self, handles):
        for mark, _ in reversed(handles):
            if mark.open:
                mark.rewind()

    def in_use(self):
        return self.stack.used

    def span(self, handle):
        return handle[1]


class PinnedTier(ReleasableHandles):
    """T5b: one `PinnedBuffer` per allocation, page-aligned, released once.
    Host memory has no tier capacity to exhaust (`bounded = False`)."""

    unit = CAPACITY
    lifo = False
    frees_individually = True
    bounded = False
    on_backend = False  # host memory, outside the backend's regions
    host_memory = True  # numpy reads it on every backend

    def __init__(self, backend):
        self.backend = backend
        self.live: list[imp_mem.PinnedBuffer] = []

    def alloc(self, nbytes, align):
        if align > 4096 or align & (align - 1):
            raise InvalidArgument(
                "pinned buffers are page-aligned: align must be a power of two <= 4096"
            )
        buf = imp_mem.PinnedBuffer(nbytes, backend=self.backend)
        self.live.append(buf)
        return buf

    def in_use(self):
        return sum(b.nbytes for b in self.live if not b.released)


TIERS = [
    pytest.param(ArenaTier, id="arena"),
    pytest.param(PoolTier, id="block_pool"),
    pytest.param(ScratchTier, id="scratch"),
    pytest.param(PinnedTier, id="pinned"),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param()


@pytest.fixture(params=TIERS)
def tier(request, backend):
    return request.param(backend)


def sizes(unit, n, seed=12345):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, min(unit, 3000) + 1, size=n)]


def test_allocate_and_free_return_to_empty(tier):
    h = tier.alloc(min(tier.unit, 512), 8)
    assert tier.in_use() >= 1
    tier.free(h)
    tier.free_all([h])
    assert tier.in_use() == 0


def test_allocations_are_aligned_and_disjoint(tier):
    live, handles = [], []
    for i, n in enumerate(sizes(tier.unit, 24)):
        align = 1 << (i % 9)
        try:
            h = tier.alloc(n, align)
        except (CapacityError, imp_mem.OutOfMemory):
            break
        handles.append(h)  # a scratch mark dropped out of order is a V6 violation
        span = tier.span(h)
        assert span.address % align == 0
        assert span.nbytes >= n
        live.append(span)
    assert len(live) >= 4
    ranges = sorted((s.address, s.address + s.nbytes) for s in live)
    assert all(a[1] <= b[0] for a, b in pairwise(ranges))


def test_contents_survive_other_allocations(tier, backend):
    if not isinstance(backend, imp_mem.FakeBackend) and not getattr(tier, "host_memory", False):
        pytest.skip("reads device memory through numpy; the fake is host memory")
    held = []
    for i, n in enumerate(sizes(tier.unit, 10)):
        h = tier.alloc(n, 16)
        view = np.from_dlpack(tier.span(h))
        view[:] = i + 1
        held.append((h, i + 1))
    for h, value in held:
        assert (np.from_dlpack(tier.span(h)) == value).all()


def test_exhaustion_fails_cleanly_and_recovers(tier):
    if not getattr(tier, "bounded", True):
        pytest.skip("host memory: no tier capacity to exhaust")
    unit = min(tier.unit, 4096)
    held = []
    with pytest.raises((CapacityError, imp_mem.OutOfMemory)):
        for _ in range(CAPACITY // unit + 2):
            held.append(tier.alloc(unit, 8))
    before = tier.in_use()
    with pytest.raises((CapacityError, imp_mem.OutOfMemory)):
        tier.alloc(unit, 8)
    assert tier.in_use() == before
    tier.free_all(held)
    assert tier.in_use() == 0
    tier.alloc(unit, 8)


@pytest.mark.parametrize(("nbytes", "align"), [(0, 8), (8, 3)])
def test_zero_size_and_bad_alignment_are_invalid(tier, nbytes, align):
    with pytest.raises(InvalidArgument):
        tier.alloc(nbytes, align)
    assert tier.in_use() == 0


def test_mixed_allocate_and_free_keeps_accounting(tier):
    rng = np.random.default_rng(7)
    live = []
    for n in sizes(min(tier.unit, 2048), 200):
        if rng.integers(3) == 0 and live:
            i = len(live) - 1 if tier.lifo else int(rng.integers(len(live)))
            tier.free(live.pop(i))
        else:
            try:
                live.append(tier.alloc(n, 64))
            except (CapacityError, imp_mem.OutOfMemory):
                pass
        if tier.frees_individually:
            assert tier.in_use() >= sum(tier.span(h).nbytes for h in live)
    tier.free_all(live)
    assert tier.in_use() == 0


def test_released_memory_reads_as_poison_on_the_fake(tier, backend):
    if not isinstance(backend, imp_mem.FakeBackend):
        pytest.skip("poison is the fake's")
    if not getattr(tier, "on_backend", True):
        pytest.skip("the tier's memory is not the backend's")
    h = tier.alloc(min(tier.unit, 256), 8)
    span = tier.span(h)
    address, nbytes = span.address, span.nbytes
    backend.write(address, b"\x11" * nbytes)
    tier.free(h)
    tier.free_all([h])
    assert backend.is_poisoned(address, nbytes)


def test_takes_never_reach_the_backend(tier, backend):
    live = backend.live
    for n in sizes(min(tier.unit, 1024), 20):
        tier.free(tier.alloc(n, 8))
    assert backend.live == live


def test_pinned_buffers_leave_the_host_allocator_as_they_found_it():
    # The library's own count (the fake's host allocator), not the adapter's.
    before = imp_mem.pinned_stats()["live_bytes"]
    tier = PinnedTier(_fake())
    held = [tier.alloc(n, 64) for n in sizes(CAPACITY, 16)]
    assert imp_mem.pinned_stats()["live_bytes"] == before + sum(h.nbytes for h in held)
    tier.free(held[0])
    tier.free_all(held)
    assert imp_mem.pinned_stats()["live_bytes"] == before
