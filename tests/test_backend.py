"""L1 through Python: acquisition, accounting, phases, bad input, the fake's
controls."""

from __future__ import annotations

import gc
import warnings

import pytest

import imp_mem
from imp_mem import (
    FakeBackend,
    ImpMemError,
    InvalidArgument,
    OutOfMemory,
    Phase,
    PhaseViolation,
)

MIB = 1 << 20


def test_cuda_is_not_available_here_and_import_needs_no_driver():
    assert imp_mem.cuda_available() in (True, False)
    assert isinstance(imp_mem.__version__, str)


def test_acquire_release_accounting_by_tag(fake):
    a = fake.acquire(3 * MIB, tag="weights")
    b = fake.acquire(MIB, align=4096, tag="kv_cache")
    assert a.address % 256 == 0 and b.address % 4096 == 0
    assert a.nbytes == 3 * MIB and a.tag == "weights"
    s = fake.stats()
    assert s["live"] == 4 * MIB
    assert s["tags"]["weights"]["live"] == 3 * MIB
    assert s["tags"]["kv_cache"]["acquisitions"] == 1
    a.release()
    s = fake.stats()
    assert s["live"] == MIB and s["peak"] == 4 * MIB
    assert s["tags"]["weights"] == {
        "reserved": 0,
        "committed": 0,
        "live": 0,
        "peak": 3 * MIB,
        "acquisitions": 1,
        "releases": 1,
    }
    assert s["acquired_bytes_total"] - s["released_bytes_total"] == s["live"]
    fake.check_invariants()


def test_sizes_accept_text_units():
    backend = FakeBackend(capacity="64MiB", budget="32 MB")
    assert backend.capacity == 64 * MIB
    assert backend.budget == 32 * MIB  # MB is MiB, as a GPU's "80GB" is 80 GiB
    r = backend.acquire("1MiB")
    assert r.nbytes == MIB


def test_region_context_manager_and_gc_release(fake):
    with fake.acquire(MIB) as r:
        assert fake.live == MIB
    assert r.released and fake.live == 0
    fake.acquire(MIB)  # dropped at once
    gc.collect()
    assert fake.live == 0


def test_release_twice_is_an_error_not_a_double_free(fake):
    r = fake.acquire(MIB)
    r.release()
    with pytest.raises(InvalidArgument, match="already released"):
        r.release()
    with pytest.raises(InvalidArgument, match="already released"):
        fake.release(r)
    assert fake.stats()["releases"] == 1


def test_region_from_another_backend_is_refused(fake):
    other = FakeBackend(capacity=8 * MIB)
    r = other.acquire(MIB)
    with pytest.raises(InvalidArgument, match="belongs to backend"):
        fake.release(r)
    assert other.live == 0 and fake.live == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"nbytes": 0}, "must be positive"),
        ({"nbytes": -5}, "non-negative"),
        ({"nbytes": 2**70}, "absurdly large"),
        ({"nbytes": 1 << 55}, "1 PiB"),
        ({"nbytes": 1.5}, "must be an integer"),
        ({"nbytes": True}, "bool"),
        ({"nbytes": "many"}, "byte count"),
        ({"nbytes": 64, "align": 3}, "power of two"),
        ({"nbytes": 64, "align": 0}, "power of two"),
        ({"nbytes": 64, "align": -8}, "non-negative"),
        ({"nbytes": 64, "align": 1 << 31}, "1 GiB"),
        ({"nbytes": 64, "tag": "kv"}, "unknown tag"),
    ],
)
def test_bad_input_is_a_typed_error_that_says_what_to_change(fake, kwargs, pattern):
    nbytes = kwargs.pop("nbytes")
    with pytest.raises(InvalidArgument, match=pattern):
        fake.acquire(nbytes, **kwargs)
    assert fake.live == 0


def test_invalid_argument_is_also_a_value_error(fake):
    with pytest.raises(ValueError):
        fake.acquire(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0},
        {"capacity": -1},
        {"capacity": 1024, "budget": 2048},
        {"granularity": 3000},
        {"capacity": "lots"},
    ],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        FakeBackend(**kwargs)


def test_budget_cap_refuses_with_the_arithmetic():
    backend = FakeBackend(capacity=16 * MIB, budget=8 * MIB)
    held = backend.acquire(6 * MIB, tag="weights")
    with pytest.raises(OutOfMemory) as info:
        backend.acquire(4 * MIB, tag="kv_cache")
    e = info.value
    assert (e.asked, e.live, e.budget, e.capacity) == (4 * MIB, 6 * MIB, 8 * MIB, 16 * MIB)
    assert e.tag == "kv_cache" and not e.device_refused
    assert "exceeds the budget" in str(e) and "2.00 MiB" in str(e)
    assert isinstance(e, MemoryError) and isinstance(e, ImpMemError)
    held.release()
    backend.acquire(4 * MIB)


def test_device_refusal_is_distinguished_from_the_budget():
    backend = FakeBackend(capacity=16 * MIB)
    backend.set_external_usage(12 * MIB)
    with pytest.raises(OutOfMemory) as info:
        backend.acquire(8 * MIB)
    assert info.value.device_refused
    assert "outside this backend" in str(info.value)
    assert backend.live == 0


def test_set_budget_checks_both_ends(fake):
    r = fake.acquire(4 * MIB)
    with pytest.raises(InvalidArgument, match="already committed"):
        fake.set_budget(MIB)
    with pytest.raises(InvalidArgument, match="capacity"):
        fake.set_budget(1 << 40)
    fake.set_budget(8 * MIB)
    assert fake.budget == 8 * MIB
    r.release()


def test_phases_are_monotonic_one_step_at_a_time(fake):
    assert fake.phase == Phase.LOADING
    with pytest.raises(PhaseViolation, match="begin_planning"):
        fake.begin_serving()
    fake.begin_planning()
    assert fake.phase == Phase.PLANNING
    fake.advance(Phase.SERVING)
    assert fake.phase == Phase.SERVING and str(fake.phase) == "SERVING"
    with pytest.raises(PhaseViolation, match="monotonic"):
        fake.advance(Phase.PLANNING)
    with pytest.raises(PhaseViolation):
        fake.begin_planning()
    with pytest.raises(InvalidArgument, match="takes a Phase"):
        fake.advance("SERVING")


def test_strict_mode_refuses_acquisition_while_serving(fake):
    fake.begin_planning()
    fake.begin_serving()
    with pytest.raises(PhaseViolation, match="while SERVING") as info:
        fake.acquire(MIB, tag="scratch")
    assert info.value.phase == "SERVING"
    assert fake.live == 0
    assert fake.stats()["steady_state_allocations_total"] == {}


def test_production_mode_counts_and_warns_once_per_tag():
    backend = FakeBackend(capacity=64 * MIB, strict=False)
    backend.begin_planning()
    backend.begin_serving()
    with pytest.warns(imp_mem.ImpMemWarning, match="steady-state acquisition"):
        a = backend.acquire(MIB, tag="scratch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = backend.acquire(MIB, tag="scratch")  # second time: no warning
    with pytest.warns(imp_mem.ImpMemWarning, match="'other'"):
        c = backend.acquire(MIB, tag="other")
    assert backend.stats()["steady_state_allocations_total"] == {"scratch": 2, "other": 1}
    assert [r.nbytes for r in (a, b, c)] == [MIB] * 3
    assert [row[1] for row in backend.journal()] == ["SERVING"] * 3


def test_replanning_bracket_allows_a_model_swap_and_is_logged(fake, caplog):
    fake.begin_planning()
    fake.begin_serving()
    with pytest.raises(PhaseViolation, match="only for a serving"):
        with FakeBackend().replanning():
            pass
    caplog.set_level("INFO", logger="imp_mem")
    with fake.replanning("swap to model B"):
        assert fake.phase == Phase.PLANNING
        r = fake.acquire(MIB, tag="weights")
    assert fake.phase == Phase.SERVING
    assert r.nbytes == MIB
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "imp_mem"]
    assert any("re-entering PLANNING" in m and "swap to model B" in m for m in messages)
    assert any("back to SERVING" in m for m in messages)
    with pytest.raises(PhaseViolation):
        fake.acquire(MIB)


def test_journal_records_every_operation(fake):
    r = fake.acquire(MIB, tag="weights")
    fake.begin_planning()
    g = fake.acquire_growable(8 * MIB, MIB, tag="kv_cache")
    g.commit(3 * MIB)
    g.decommit(2 * MIB)
    r.release()
    g.release()
    rows = fake.journal()
    assert rows == [
        (0, "LOADING", "weights", MIB, "acquire"),
        (1, "PLANNING", "kv_cache", MIB, "acquire"),
        (2, "PLANNING", "kv_cache", 2 * MIB, "commit"),
        (3, "PLANNING", "kv_cache", MIB, "decommit"),
        (4, "PLANNING", "weights", MIB, "release"),
        (5, "PLANNING", "kv_cache", 2 * MIB, "release"),
    ]


def test_poison_on_release_and_quarantine_of_sixteen(fake):
    r = fake.acquire(4096)
    fake.write(r.address, b"hello")
    assert fake.read(r.address, 5) == b"hello"
    addr = r.address
    r.release()
    assert fake.is_poisoned(addr, 4096)
    assert fake.read(addr, 2) == b"\xde\xde"
    with pytest.raises(imp_mem.StaleSpan, match="use after free"):
        fake.write(addr, b"x")
    for _ in range(16):
        fake.acquire(4096).release()
    assert addr not in fake.quarantine() and len(fake.quarantine()) == 16
    with pytest.raises(InvalidArgument, match="not inside any"):
        fake.read(addr, 1)


def test_reads_outside_regions_are_refused_not_segfaults(fake):
    r = fake.acquire(4096)
    for addr, n in [(0, 8), (r.address + 4090, 16), (r.address - 1, 2), (2**63, 1)]:
        with pytest.raises(InvalidArgument):
            fake.read(addr, n)
    with pytest.raises(InvalidArgument, match="bytes-like"):
        fake.write(r.address, 12)
    fake.write(r.address, bytearray(b"ab"))
    fake.write(r.address + 2, memoryview(b"cd"))
    assert fake.read(r.address, 4) == b"abcd"


def test_unbacked_fake_scales_to_a_large_device_but_cannot_be_read():
    backend = FakeBackend(capacity="80GiB", backed=False)
    r = backend.acquire("70GiB", tag="weights")
    assert backend.live == 70 << 30
    with pytest.raises(InvalidArgument, match="unbacked"):
        backend.read(r.address, 1)


def test_growable_region_commits_in_granules_and_keeps_its_base(fake):
    g = fake.acquire_growable(16 * MIB, 1, tag="kv_cache")
    base = g.address
    assert g.nbytes == 4096 and g.reserved == 16 * MIB and g.growable
    fake.write(base, b"keep me")
    g.commit(10 * MIB + 1)
    assert g.nbytes == 10 * MIB + 4096
    assert g.address == base and fake.read(base, 7) == b"keep me"
    g.decommit(4096)
    assert g.nbytes == 4096 and fake.is_poisoned(base + 4096, 4096)
    g.commit(MIB)
    assert g.address == base
    with pytest.raises(InvalidArgument, match="past the reservation"):
        g.commit(17 * MIB)
    assert fake.stats()["tags"]["kv_cache"]["reserved"] == 16 * MIB


def test_growth_failures_on_command_leave_the_region_as_it_was(fake):
    g = fake.acquire_growable(8 * MIB, MIB)
    fake.fail_commits(1)
    with pytest.raises(OutOfMemory):
        g.commit(4 * MIB)
    assert g.nbytes == MIB
    fake.fail_decommits(1)
    with pytest.raises(imp_mem.DriverError, match="on command"):
        g.decommit(0)
    assert g.nbytes == MIB
    g.commit(4 * MIB)
    assert g.nbytes == 4 * MIB
    fake.check_invariants()


def test_fixed_regions_do_not_grow(fake):
    r = fake.acquire(MIB)
    with pytest.raises(InvalidArgument, match="acquire_growable"):
        r.commit(2 * MIB)
    with pytest.raises(InvalidArgument, match="larger than the reservation"):
        fake.acquire_growable(MIB, 2 * MIB)


def test_released_region_refuses_growth(fake):
    g = fake.acquire_growable(MIB)
    g.release()
    assert g.nbytes == 0
    with pytest.raises(imp_mem.StaleSpan):
        g.commit(4096)


def test_fail_nth_validation(fake):
    with pytest.raises(InvalidArgument, match="counts from 1"):
        fake.fail_nth(0)
    fake.fail_nth(2)
    fake.acquire(4096)
    with pytest.raises(OutOfMemory):
        fake.acquire(4096)
    fake.acquire(4096)
    fake.fail_nth(1)
    fake.fail_nth(None)
    fake.acquire(4096)


def test_repr_is_informative(fake):
    r = fake.acquire(MIB, tag="weights")
    assert "weights" in repr(r) and "fake backend" in repr(fake)
    r.release()
    assert "released" in repr(r)
