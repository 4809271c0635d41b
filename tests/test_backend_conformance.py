"""One backend conformance suite, run against every backend (RMM's
``mr_ref_test`` is the model): the fake here, the CUDA backends on a GPU.

A backend factory takes a budget in bytes and returns a fresh backend in
LOADING. GPU factories are marked ``gpu`` and skipped where no device exists.
"""

from __future__ import annotations

from itertools import pairwise

import pytest

import imp_mem

MIB = 1 << 20


def _fake(budget: int) -> imp_mem.Backend:
    return imp_mem.FakeBackend(capacity=4 * budget, budget=budget, granularity=2 * MIB)


def _cuda(budget: int) -> imp_mem.Backend:
    return imp_mem.CudaBackend(device=0, budget=budget, strict=True)


def _vmm(budget: int) -> imp_mem.Backend:
    return imp_mem.VmmBackend(device=0, budget=budget, strict=True)


FACTORIES = [
    pytest.param(_fake, id="fake"),
    pytest.param(_cuda, id="cuda", marks=pytest.mark.gpu),
    pytest.param(_vmm, id="vmm", marks=pytest.mark.gpu),
]


@pytest.fixture(params=FACTORIES)
def make(request):
    return request.param


def test_acquire_release_conserves_bytes(make):
    backend = make(256 * MIB)
    sizes = [1, 255, 256, 4096, 3 * MIB + 7, 16 * MIB]
    regions = [backend.acquire(n, tag="workspace") for n in sizes]
    assert backend.live == sum(sizes)
    assert len({r.address for r in regions}) == len(regions)
    spans = sorted((r.address, r.address + r.nbytes) for r in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))
    for r in regions[::2]:
        r.release()
    assert backend.live == sum(sizes[1::2])
    for r in regions[1::2]:
        backend.release(r)
    s = backend.stats()
    assert s["live"] == 0 and s["acquisitions"] == s["releases"] == len(sizes)
    assert s["acquired_bytes_total"] == s["released_bytes_total"] == sum(sizes)
    backend.check_invariants()


@pytest.mark.parametrize("align", [1, 256, 4096, 1 << 16, 2 * MIB])
def test_alignment_is_honoured(make, align):
    backend = make(64 * MIB)
    regions = [backend.acquire(1000 + i, align=align) for i in range(4)]
    assert all(r.address % align == 0 for r in regions)


def test_budget_refusal_is_typed_and_leaves_nothing(make):
    backend = make(32 * MIB)
    held = backend.acquire(24 * MIB, tag="weights")
    with pytest.raises(imp_mem.OutOfMemory) as info:
        backend.acquire(16 * MIB, tag="kv_cache")
    assert info.value.budget == 32 * MIB and info.value.asked == 16 * MIB
    assert backend.live == 24 * MIB
    held.release()
    assert backend.live == 0


def test_phase_guard_is_enforced(make):
    backend = make(64 * MIB)
    keep = backend.acquire(MIB, tag="weights")
    backend.begin_planning()
    plan = backend.acquire(MIB, tag="workspace")
    backend.begin_serving()
    with pytest.raises(imp_mem.PhaseViolation):
        backend.acquire(MIB, tag="scratch")
    with backend.replanning("conformance"):
        swap = backend.acquire(MIB, tag="weights")
    assert backend.phase == imp_mem.Phase.SERVING
    for r in (keep, plan, swap):
        r.release()
    assert backend.live == 0


def test_bad_input_is_refused_the_same_way_everywhere(make):
    backend = make(64 * MIB)
    for kwargs in ({"nbytes": 0}, {"nbytes": -1}, {"nbytes": 64, "align": 6}):
        nbytes = kwargs.pop("nbytes")
        with pytest.raises(imp_mem.InvalidArgument):
            backend.acquire(nbytes, **kwargs)
    r = backend.acquire(64)
    r.release()
    with pytest.raises(imp_mem.InvalidArgument):
        r.release()
    assert backend.live == 0


def test_growable_regions_keep_their_base_or_are_refused(make):
    backend = make(256 * MIB)
    gran = backend.granularity
    try:
        region = backend.acquire_growable(64 * MIB, gran, tag="kv_cache")
    except imp_mem.InvalidArgument as exc:
        assert "growable" in str(exc)
        return
    base = region.address
    for target in (8 * MIB, 32 * MIB, 4 * MIB, 64 * MIB, 0, 16 * MIB):
        if target >= region.nbytes:
            region.commit(target)
        else:
            region.decommit(target)
        assert region.address == base
        assert region.nbytes % gran == 0 and region.nbytes >= min(target, 64 * MIB)
        assert backend.live == region.nbytes
    region.release()
    assert backend.live == 0
    backend.check_invariants()
