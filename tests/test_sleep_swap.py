"""What the binding adds to model swap and sleep / wake (issue 19): the
arguments and their refusals, the result dictionaries, the ``asleep``
property, the ``Asleep`` exception raised by every sleeping tier, the plan
the system reports after a swap, and the attributes of a failed swap. The
rules themselves are proved in Rust (``crates/imp-mem-core/tests/swap_props.rs``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from imp_mem import (
    Asleep,
    FakeBackend,
    Features,
    InvalidArgument,
    Limits,
    MemorySystem,
    ModelShape,
    Phase,
    PhaseViolation,
    PlanInput,
    plan_memory,
)

MIB = 1 << 20


def model(layers: int, hidden: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def make_plan(layers: int = 4, hidden: int = 256):
    return plan_memory(
        PlanInput(
            ModelShape.from_hf_config(model(layers, hidden)),
            Limits(4, 1024, kv_policy="fit"),
            Features(engine_persistent_bytes=4 * MIB, scratch_bytes=2 * MIB),
            budget=96 * MIB,
            context=8 * MIB,
            library_reserve=4 * MIB,
        )
    )


@pytest.fixture
def system():
    fb = FakeBackend(capacity=256 * MIB, granularity=64 * 1024)
    s = MemorySystem(fb, make_plan())
    s.begin_serving()
    yield fb, s
    s.close()


def test_sleep_returns_what_it_did_and_wake_brings_the_bytes_back(system):
    fb, s = system
    t1 = s.weights_arena
    span = t1.take(4096, 256)
    data = bytes(range(256)) * 16
    fb.write(span.address, data)
    address = span.address
    out = s.sleep()
    assert out["level"] == 1
    assert [t["key"] for t in out["tiers"]] == ["model_resident", "kv_pool"]
    assert out["host_bytes"] == t1.used
    assert out["released"] == sum(t["released"] for t in out["tiers"]) > 0
    assert s.asleep == {"model_resident": 1, "kv_pool": 1}
    report = s.mem_report()
    assert report["asleep"] == ["model_resident", "kv_pool"]
    assert report["sleep_host"] == t1.used
    assert "asleep: model_resident, kv_pool" in s.mem_report_text()
    assert s.wake() == ["model_resident", "kv_pool"]
    assert s.asleep == {}
    assert span.address == address
    assert fb.read(address, len(data)) == data
    assert s.wake() == []
    # The pinned buffer stays for the next sleep, until released.
    assert s.mem_report()["sleep_host"] == t1.used
    assert s.release_sleep_host() == t1.used
    assert s.mem_report()["sleep_host"] == 0


def test_every_sleeping_tier_raises_asleep_a_phase_violation(system):
    _, s = system
    span = s.weights_arena.take(64)
    s.sleep(level=2)
    with pytest.raises(Asleep, match="wake"):
        s.weights_arena.take(64)
    with pytest.raises(Asleep):
        _ = span.address
    with pytest.raises(Asleep):
        s.kv_pool.allocate()
    kv = s.kv_manager()
    with pytest.raises(PhaseViolation):
        kv.admit(1, [1, 2, 3])
    del kv
    s.wake()
    s.weights_arena.take(64)


def test_sleep_arguments_are_checked(system):
    _, s = system
    with pytest.raises(InvalidArgument, match="level=3"):
        s.sleep(3)
    with pytest.raises(InvalidArgument, match="level"):
        s.sleep(-1)
    with pytest.raises(TypeError, match="tiers"):
        s.sleep(1, tiers=5)
    with pytest.raises(InvalidArgument, match="nope"):
        s.sleep(1, tiers="nope")
    with pytest.raises(InvalidArgument, match="T2"):
        s.sleep(1, tiers=["engine_persistent"])
    assert s.asleep == {}
    out = s.sleep(1, tiers="kv_cache")
    assert [t["key"] for t in out["tiers"]] == ["kv_pool"]
    with pytest.raises(InvalidArgument, match="already sleeps"):
        s.sleep(1, tiers=("kv_pool",))
    s.wake()


def test_a_busy_kv_pool_refuses_sleep_and_swap_until_its_manager_goes(system):
    _, s = system
    kv = s.kv_manager()
    kv.admit(1, list(range(40)))
    with pytest.raises(InvalidArgument, match="live"):
        s.sleep()
    assert s.asleep == {}
    kv.free(1)
    with pytest.raises(InvalidArgument) as info:
        s.swap_model(make_plan(8, 512))
    assert info.value.old_model_kept is True
    assert info.value.missing == []
    del kv
    out = s.swap_model(make_plan(8, 512))
    assert out["prefix_cache_dropped"] is True


def test_swap_model_reports_and_the_system_serves_the_new_plan(system):
    fb, s = system
    t2 = s.engine_arena.take(256)
    fb.write(t2.address, b"\x07" * 256)
    t2_address = t2.address
    t1_base = s.weights_arena.take(16).address
    new = make_plan(8, 512)
    out = s.swap_model(new)
    assert "engine_persistent" in out["kept"]
    assert "kv_pool" in out["relaid"]
    assert out["t1_in_place"] is True
    assert out["t1_base"] == (t1_base, t1_base)
    assert s.plan.model_resident == new.model_resident
    assert s.weights_arena.capacity == new.model_resident
    assert s.phase == Phase.SERVING
    assert t2.address == t2_address
    assert fb.read(t2_address, 256) == b"\x07" * 256
    s.check()


def test_a_failed_swap_says_the_old_model_serves_on(system):
    fb, s = system
    span = s.weights_arena.take(128)
    fb.write(span.address, b"\x05" * 128)
    fb.fail_commits(1)
    with pytest.raises(Exception) as info:
        s.swap_model(make_plan(8, 512))
    fb.fail_commits(0)
    assert info.value.old_model_kept is True
    assert "old model serves on" in str(info.value)
    assert fb.read(span.address, 128) == b"\x05" * 128
    assert s.plan.model_resident == make_plan().model_resident
    s.check()
    del info, span


def test_a_plan_that_changes_t2_is_refused_item_by_item(system):
    _, s = system
    other = plan_memory(
        PlanInput(
            ModelShape.from_hf_config(model(4, 256)),
            Limits(4, 1024, kv_policy="fit"),
            Features(engine_persistent_bytes=6 * MIB, scratch_bytes=2 * MIB),
            budget=96 * MIB,
            context=8 * MIB,
            library_reserve=4 * MIB,
        )
    )
    with pytest.raises(InvalidArgument, match="T2 engine-persistent") as info:
        s.swap_model(other)
    assert info.value.old_model_kept is True


def test_a_fixed_t1_cannot_sleep():
    fb = FakeBackend(capacity=256 * MIB)
    with MemorySystem(fb, make_plan(), sleepable=False) as s:
        from imp_mem import BackendUnavailable

        with pytest.raises(BackendUnavailable, match="VMM"):
            s.sleep()
        assert s.asleep == {}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["sleep1", "sleep2", "wake", "write"]), max_size=12))
def test_sleep_and_wake_in_any_order_keep_level_one_bytes(ops):
    fb = FakeBackend(capacity=256 * MIB, granularity=64 * 1024)
    with MemorySystem(fb, make_plan()) as s:
        written = []
        asleep = None
        for op in ops:
            if op == "write" and asleep is None:
                span = s.weights_arena.take(512)
                data = bytes([len(written) + 1]) * 512
                fb.write(span.address, data)
                written.append((span, data))
            elif op.startswith("sleep") and asleep is None:
                asleep = int(op[-1])
                s.sleep(asleep)
            elif op == "wake":
                s.wake()
                if asleep == 2:
                    written.clear()
                asleep = None
            assert s.asleep == (
                {} if asleep is None else {"model_resident": asleep, "kv_pool": asleep}
            )
        s.wake()
        if asleep == 2:
            written.clear()
        for span, data in written:
            assert fb.read(span.address, len(data)) == data
        s.check()
        written.clear()
        span = None
