"""What the binding adds to staged wake, the sleep host buffer pinned ahead
and a wake under pressure (issue 24): the arguments and their refusals, the
attributes of a refused wake, the GIL released while pinning, and the pinned
bytes counted. The rules are proved in Rust
(``crates/imp-mem-core/tests/wake_props.rs``).
"""

from __future__ import annotations

import threading

import pytest
from test_sleep_swap import make_plan

from imp_mem import (
    Asleep,
    FakeBackend,
    InvalidArgument,
    MemorySystem,
    OutOfMemory,
    pinned_stats,
)

MIB = 1 << 20


@pytest.fixture
def system():
    fb = FakeBackend(capacity=256 * MIB, granularity=64 * 1024)
    s = MemorySystem(fb, make_plan())
    s.begin_serving()
    yield fb, s
    s.release_sleep_host()
    s.close()


def write_t1(fb, s, n=4096):
    span = s.weights_arena.take(n, 256)
    data = bytes(range(256)) * (n // 256)
    fb.write(span.address, data)
    return span.address, data


def test_a_staged_wake_wakes_the_weights_then_the_kv_cache(system):
    fb, s = system
    address, data = write_t1(fb, s)
    s.sleep(1, tiers=("weights", "kv_cache"))
    assert s.wake(tiers="weights") == ["model_resident"]
    assert fb.read(address, len(data)) == data
    assert s.asleep == {"kv_pool": 1}
    with pytest.raises(Asleep):
        s.kv_pool.allocate()
    # Waking an awake tier is a no-op.
    assert s.wake(["weights"]) == []
    assert s.wake(("kv_cache",)) == ["kv_pool"]
    assert s.asleep == {}
    assert s.wake() == []


def test_wake_arguments_are_checked_and_change_nothing(system):
    _fb, s = system
    s.sleep(2)
    with pytest.raises(InvalidArgument, match="tiers") as info:
        s.wake(tiers="nope")
    assert "model_resident" in str(info.value)
    assert info.value.still_asleep == ["model_resident", "kv_pool"]
    with pytest.raises(InvalidArgument, match="T2"):
        s.wake(tiers="engine_persistent")
    with pytest.raises(TypeError, match="tiers"):
        s.wake(tiers=3)
    with pytest.raises(TypeError, match="tier name"):
        s.wake(tiers=["weights", 3])
    # A lone surrogate is a typed refusal, not a UnicodeEncodeError (found by
    # the misuse driver).
    for bad in ("\ud800", ["\ud800"]):
        with pytest.raises(InvalidArgument, match="surrogate"):
            s.wake(tiers=bad)
        with pytest.raises(InvalidArgument, match="surrogate"):
            s.sleep(1, tiers=bad)
    assert s.asleep == {"model_resident": 2, "kv_pool": 2}
    assert s.wake() == ["model_resident", "kv_pool"]


def test_a_wake_the_device_refuses_says_what_it_needs_and_can_be_retried(system):
    fb, s = system
    address, data = write_t1(fb, s)
    out = s.sleep(1)
    assert s.wake_needs() == out["released"]
    assert s.wake_needs("weights") == out["tiers"][0]["released"]
    with pytest.raises(InvalidArgument, match="tiers"):
        s.wake_needs("nope")
    free = fb.stats()["capacity"] - fb.device_used
    fb.set_external_usage(free - 1024)
    with pytest.raises(OutOfMemory) as info:
        s.wake()
    err = info.value
    assert err.needed == out["released"] > 0
    assert err.still_asleep == ["model_resident", "kv_pool"]
    assert err.woken == []
    assert err.device_free is None  # the fake cannot read its device
    assert err.budget_free > 0
    assert err.device_refused
    assert "call wake again" in str(err)
    assert s.asleep == {"model_resident": 1, "kv_pool": 1}
    fb.set_external_usage(0)
    assert s.wake() == ["model_resident", "kv_pool"]
    assert fb.read(address, len(data)) == data


def test_the_sleep_host_pinned_ahead_is_counted_and_used_by_the_first_sleep(system):
    fb, s = system
    before = pinned_stats()
    planned = s.plan.sleep_host
    assert s.pin_sleep_host() == planned
    after = pinned_stats()
    assert after["live_bytes"] - before["live_bytes"] == planned
    assert s.mem_report()["sleep_host"] == planned
    # Again: nothing more is pinned.
    assert s.pin_sleep_host() == planned
    assert pinned_stats()["buffers"] == after["buffers"]
    address, data = write_t1(fb, s)
    out = s.sleep(1, tiers="weights")
    assert out["host_bytes"] == s.weights_arena.used
    assert pinned_stats()["buffers"] == after["buffers"], "the sleep pinned again"
    s.wake()
    assert fb.read(address, len(data)) == data
    assert s.release_sleep_host() == planned
    assert pinned_stats()["live_bytes"] == before["live_bytes"]


def test_pin_sleep_host_runs_on_a_thread_without_the_gil(system):
    fb, s = system
    result = {}
    thread = threading.Thread(target=lambda: result.update(held=s.pin_sleep_host(MIB)))
    thread.start()
    # The weight load goes on meanwhile.
    write_t1(fb, s)
    thread.join()
    assert result["held"] == MIB


def test_pin_sleep_host_arguments_are_checked(system):
    _fb, s = system
    for bad in (0, -1, 1 << 40):
        with pytest.raises(InvalidArgument, match="nbytes"):
            s.pin_sleep_host(bad)
    assert s.mem_report()["sleep_host"] == 0
