"""The backed fake keeps to its budget in host RAM: what is resident follows
what is committed, never what is reserved (issue 30)."""

from __future__ import annotations

import os
import sys

import pytest

import imp_mem
from imp_mem import BlockPool, FakeBackend, PinnedBuffer
from imp_mem._presets import preset

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/statm"
)

MIB = 1 << 20
# What the interpreter may add on its own between two readings.
NOISE = 4 * MIB


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_reservation_costs_address_space_and_a_commit_costs_its_pages():
    before = resident()
    fb = FakeBackend(capacity="512MiB")
    pool = BlockPool(fb, 2048, 26, max_blocks=1 << 20)  # reserves 2 GiB
    assert fb.stats()["reserved"] == 2048 * MIB
    committed = fb.stats()["committed"]
    assert resident() - before <= committed + NOISE
    chunk = MIB
    region = fb.acquire_growable("2GiB", chunk)
    assert resident() - before <= fb.stats()["committed"] + chunk + NOISE
    # Writing the committed chunk makes it resident, and no more than it.
    fb.write(region.address, b"\x01" * chunk)
    grown = resident() - before
    assert grown >= chunk // 2
    assert grown <= fb.stats()["committed"] + chunk + NOISE
    # A decommit hands the pages back; they read as the poison.
    region.decommit(0)
    assert resident() - before <= fb.stats()["committed"] + chunk + NOISE
    assert fb.is_poisoned(region.address, chunk)
    fb.release(region)
    del pool


def test_a_pinned_buffer_of_the_fake_costs_only_what_is_written():
    before = resident()
    with PinnedBuffer(1 << 32) as buf:
        assert buf.nbytes == 1 << 32
        assert resident() - before <= NOISE


def test_the_readme_tiers_on_an_80_gib_fake_open_without_taking_host_ram():
    # The 80 GiB reservations are address space: the fake neither refuses
    # for host RAM it will not touch nor takes it.
    shape = imp_mem.ModelShape.from_hf_config(preset("llama-3-8b"))
    limits = imp_mem.Limits(16, 8192)
    plan = imp_mem.plan_memory(imp_mem.PlanInput(shape, limits, imp_mem.Features(), budget="80GiB"))
    fb = FakeBackend(capacity="80GiB")
    before = resident()
    with imp_mem.MemorySystem(fb, plan):
        assert fb.stats()["committed"] > 10 << 30
        assert resident() - before <= NOISE
