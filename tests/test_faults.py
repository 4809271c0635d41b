"""Fault injection: for every n, failing the n-th acquisition of a scripted
load leaves nothing live once the caller unwinds, and what surfaces is a
typed OutOfMemory, never a crash."""

from __future__ import annotations

import contextlib

import pytest

import imp_mem

MIB = 1 << 20

SCRIPT = [
    ("weights", 4 * MIB, False),
    ("weights", 2 * MIB, False),
    ("weight_cache", MIB, False),
    ("workspace", 512 << 10, False),
    ("kv_cache", 8 * MIB, True),
    ("state", MIB, False),
    ("scratch", 256 << 10, False),
    ("activations", 128 << 10, False),
    ("swa_cache", 2 * MIB, True),
    ("pinned_host", 64 << 10, False),
    ("other", 4096, False),
]


def load(backend: imp_mem.FakeBackend) -> list[imp_mem.Region]:
    """A scripted load in the style an engine would write: every region is
    registered on an ExitStack so that a failure anywhere releases the rest."""
    with contextlib.ExitStack() as stack:
        held = []
        for tag, nbytes, growable in SCRIPT:
            if growable:
                region = backend.acquire_growable(nbytes * 2, nbytes, tag=tag)
            else:
                region = backend.acquire(nbytes, tag=tag)
            stack.enter_context(region)
            held.append(region)
        stack.pop_all()
        return held


def test_script_succeeds_without_faults():
    backend = imp_mem.FakeBackend(capacity=64 * MIB)
    held = load(backend)
    assert len(held) == len(SCRIPT)
    assert backend.live == sum(n for _, n, _ in SCRIPT)


@pytest.mark.parametrize("n", range(1, len(SCRIPT) + 1))
def test_failing_the_nth_acquisition_unwinds_to_zero(n):
    backend = imp_mem.FakeBackend(capacity=64 * MIB)
    backend.fail_nth(n)
    with pytest.raises(imp_mem.OutOfMemory) as info:
        load(backend)
    assert info.value.device_refused
    assert backend.live == 0
    stats = backend.stats()
    assert stats["acquisitions"] == n - 1 == stats["releases"]
    backend.check_invariants()
    # The backend is usable afterwards: the fault was one-shot.
    assert len(load(backend)) == len(SCRIPT)
