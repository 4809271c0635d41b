"""The ActivationPool binding (T4a): conversions, errors, the two stats
views, the system's pool and its plan line. The allocator's rules are proven
in Rust (crates/imp-mem-core/tests/activations_props.rs); this file tests what
the binding adds."""

from __future__ import annotations

import pytest
from _helpers import make_plan
from hypothesis import given
from hypothesis import strategies as st

import imp_mem

MIB = 1 << 20


def test_capacity_takes_ints_and_size_strings(fake):
    pools = [
        imp_mem.ActivationPool(fake, "1MiB"),
        imp_mem.ActivationPool(fake, 4096 + 100),  # rounded down to 512
        imp_mem.ActivationPool(fake, MIB, align=4096),
    ]
    assert [p.capacity for p in pools] == [MIB, 4096, MIB]
    pool = pools[2]
    assert (pool.align, pool.base % 4096, pool.tag) == (4096, 0, "activations")
    assert fake.stats()["tags"]["activations"]["live"] == MIB + 4096 + MIB
    del pools, pool
    assert fake.stats()["tags"]["activations"]["live"] == 0


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 100}, "capacity"),
        ({"capacity": -1}, "capacity"),
        ({"capacity": "lots"}, "lots"),
        ({"capacity": MIB, "align": 3}, "align"),
        ({"capacity": MIB, "align": -512}, "align"),
    ],
)
def test_bad_construction_names_the_argument(fake, kwargs, word):
    with pytest.raises(imp_mem.InvalidArgument, match=word):
        imp_mem.ActivationPool(fake, **kwargs)


def test_wrong_types_are_refused(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    with pytest.raises(imp_mem.InvalidArgument, match="nbytes"):
        pool.allocate(True)
    with pytest.raises(imp_mem.InvalidArgument, match="nbytes"):
        pool.allocate(0)
    with pytest.raises(imp_mem.InvalidArgument, match="stream"):
        pool.allocate(512, stream=-1)
    with pytest.raises(imp_mem.InvalidArgument, match="ptr"):
        pool.free("0x10")
    with pytest.raises(TypeError):
        imp_mem.ActivationPool(fake, MIB, strict="yes")


def test_allocate_write_read_free_through_the_fake(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    a = pool.allocate(1000)
    b = pool.allocate("2KiB", stream=7)
    assert a % 512 == 0 and b % 512 == 0 and a != b
    assert pool.size_of(a) == 1000 and pool.size_of(b) == 2048 and pool.size_of(a + 1) is None
    fake.write(a, b"x" * 1000)
    fake.write(b, b"y" * 2048)
    assert fake.read(a, 1000) == b"x" * 1000
    pool.free(a)
    assert fake.is_poisoned(a, 1000)  # scrubbed on free
    assert fake.read(b, 2048) == b"y" * 2048
    pool.free(b, stream=7)
    pool.check_invariants()


def test_refused_frees_raise_and_change_nothing(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    a = pool.allocate(4096)
    before = pool.stats()
    with pytest.raises(imp_mem.InvalidArgument, match="did not hand out"):
        pool.free(0x1234)
    with pytest.raises(imp_mem.InvalidArgument, match="double free"):
        pool.free(a + 512)
    pool.free(a)
    with pytest.raises(imp_mem.InvalidArgument, match="double free"):
        pool.free(a)
    after = pool.stats()
    assert after["refused_frees"] == before["refused_frees"] + 3
    assert after["live"] == 0 and after["frees_total"] == 1
    pool.check_invariants()


def test_strict_exhaustion_raises_out_of_memory(fake):
    pool = imp_mem.ActivationPool(fake, 8192, strict=True)
    pool.allocate(8192)
    with pytest.raises(imp_mem.OutOfMemory) as info:
        pool.allocate(1)
    assert info.value.tag == "activations"
    assert pool.stats()["ooms"] == 1
    assert pool.memory_stats()["num_ooms"] == 1


def test_production_falls_back_and_counts_a_steady_state_allocation():
    fake = imp_mem.FakeBackend(capacity=64 * MIB, strict=False)
    pool = imp_mem.ActivationPool(fake, 8192)
    assert pool.strict is False
    fake.begin_planning()
    fake.begin_serving()
    pool.allocate(8192)
    with pytest.warns(imp_mem.ImpMemWarning, match="activations"):
        extra = pool.allocate(3000)
    s = pool.stats()
    assert (s["fallbacks_total"], s["fallback_bytes"], s["fallback_live"]) == (1, 3072, 1)
    m = pool.memory_stats()
    assert m["reserved_bytes.all.current"] == 8192 + 3072
    assert m["segment.all.current"] == 2
    assert fake.stats()["steady_state_allocations_total"]["activations"] == 1
    pool.free(extra)
    assert pool.memory_stats()["num_device_free"] == 1
    pool.check_invariants()


def test_memory_stats_use_torch_key_names(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    a, b = pool.allocate(100), pool.allocate(5000)
    m = pool.memory_stats()
    assert m["allocated_bytes.all.current"] == 512 + 5120
    assert m["requested_bytes.all.current"] == 5100
    assert m["allocation.all.current"] == 2
    assert m["reserved_bytes.all.current"] == MIB
    pool.free(a)
    pool.free(b)
    pool.reset_peak()
    m = pool.memory_stats()
    assert m["allocated_bytes.all.peak"] == 0 and m["allocation.all.peak"] == 0
    assert m["allocation.all.allocated"] == m["allocation.all.freed"] == 2
    assert m["allocated_bytes.all.allocated"] == m["allocated_bytes.all.freed"] == 5632
    assert all(isinstance(v, int) for v in m.values())


@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(1, 40_000), st.integers(0, 2), st.integers(0, 99)),
        max_size=60,
    )
)
def test_sequences_through_the_binding_keep_bytes_and_counts(ops):
    fake = imp_mem.FakeBackend(capacity=4 * MIB)
    pool = imp_mem.ActivationPool(fake, MIB)
    live: dict[int, tuple[int, int]] = {}  # addr -> (nbytes, marker)
    for n, (alloc, nbytes, stream, pick) in enumerate(ops):
        if alloc or not live:
            try:
                addr = pool.allocate(nbytes, stream=stream)
            except imp_mem.OutOfMemory:
                continue
            marker = n % 251 + 1
            fake.write(addr, bytes([marker]) * nbytes)
            live[addr] = (nbytes, marker)
        else:
            addr = sorted(live)[pick % len(live)]
            nbytes, marker = live.pop(addr)
            assert fake.read(addr, nbytes) == bytes([marker]) * nbytes
            pool.free(addr, stream=stream)
        s = pool.stats()
        assert s["live"] == len(live)
        assert s["requested"] == sum(v[0] for v in live.values())
        assert s["free_bytes"] + s["allocated"] == MIB
    pool.check_invariants()


def small_plan(features: imp_mem.Features) -> imp_mem.MemoryPlan:
    return make_plan(
        max_batch=2,
        max_seq_len=512,
        features=features,
        budget=96 * MIB,
        context=0,
        library_reserve=0,
    )


def test_plan_line_and_the_systems_pool():
    plain = small_plan(imp_mem.Features())
    assert plain.activations == 0
    assert "activations" not in plain.to_json()
    features = imp_mem.Features(activation_bytes="3MiB")
    assert features.activation_bytes == 3 * MIB
    plan = small_plan(features)
    assert plan.activations == 3 * MIB
    assert imp_mem.MemoryPlan.from_json(plan.to_json()).activations == 3 * MIB
    with imp_mem.MemorySystem(imp_mem.FakeBackend(capacity=128 * MIB), plain) as system:
        assert system.activations is None
    with imp_mem.MemorySystem(imp_mem.FakeBackend(capacity=128 * MIB), plan) as system:
        pool = system.activations
        assert isinstance(pool, imp_mem.ActivationPool) and pool.capacity == 3 * MIB
        tiers = system.tiers
        assert tiers[-1] == "kv_pool" and tiers[-2] == "activations"
        a = pool.allocate(MIB)
        report = system.mem_report(device=False)
        line = next(t for t in report["tiers"] if t["key"] == "activations")
        assert (line["tier"], line["tag"], line["in_use"]) == ("T4a", "activations", MIB)
        assert 'tier="activations"' in system.metrics(device=False)
        pool.free(a)
        system.check()
        del pool  # the system's close would report it as still held


def test_tier_and_tag_enumerations_include_activations():
    assert imp_mem.Tier.ACTIVATIONS.label == "T4a"
    fake = imp_mem.FakeBackend(capacity=MIB)
    with fake.acquire(4096, tag="activations") as region:
        assert region.tag == "activations"
        assert fake.stats()["tags"]["activations"]["live"] == 4096
