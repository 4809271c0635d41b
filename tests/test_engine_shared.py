"""The engine on a shared GPU (issue 27), on fake backends: two engines on
one device ledger serve what a lone engine serves, commit only what the
ledger grants, never preempt for memory, shrink when idle, sleep and wake
inside a request, and refuse what no share could hold."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_engine_runtime import prompts, tiny  # noqa: E402

import imp_mem  # noqa: E402
from imp_mem import CapacityError, FakeBackend, PlanFailure  # noqa: E402
from imp_mem.engine import Engine  # noqa: E402
from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.shared import SharedGPU  # noqa: E402

MIB = 1 << 20
PROMPTS = prompts(6, seed=5)
NEW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("shared") / "m", tiny("full"), seed=3, scale=0.1
    )


def engine(directory, shared=None, backend=None, **kw) -> Engine:
    return Engine(
        directory,
        backend=FakeBackend(capacity="256MiB") if backend is None else backend,
        max_batch=4,
        max_seq_len=64,
        block_size=4,
        prefill_chunk=8,
        shared=shared,
        **kw,
    )


@pytest.fixture(scope="module")
def expected(checkpoint):
    with engine(checkpoint) as e:
        return e.generate(PROMPTS, NEW)


def cfg(tmp_path, **kw) -> SharedGPU:
    kw.setdefault("cap", "64MiB")
    kw.setdefault("device_budget", "160MiB")
    return SharedGPU(key="fake-engine", dir=str(tmp_path), **kw)


def test_two_engines_on_one_ledger_serve_what_one_serves(checkpoint, expected, tmp_path):
    a = engine(checkpoint, cfg(tmp_path, name="a"))
    b = engine(checkpoint, cfg(tmp_path, name="b"))
    try:
        led = imp_mem.DeviceLedger("fake-engine", None, str(tmp_path))
        rows = {t["name"]: t for t in led.tenants()}
        assert set(rows) == {"a", "b"}
        for t in rows.values():
            assert t["floor"] > 0 and t["committed"] <= t["cap"]
        assert a.generate(PROMPTS, NEW) == expected
        assert b.generate(PROMPTS, NEW) == expected
        assert a.scheduler.stats.preempted == 0 and b.scheduler.stats.preempted == 0
        rows = led.tenants()
        assert sum(t["committed"] for t in rows) <= led.budget
        # A third whose floor does not fit is refused, naming the others.
        floors = sum(t["floor"] for t in rows)
        hog = led.join("hog", led.budget - floors - a.tenancy.floor // 2, "1GiB")
        with pytest.raises(PlanFailure) as info:
            engine(checkpoint, cfg(tmp_path, name="c"))
        assert info.value.kind == "ledger_full"
        for who in ("a (pid", "b (pid", "hog (pid"):
            assert who in str(info.value)
        del hog
        # Idle: the pool shrinks to its live blocks plus a chunk.
        grown = a.tenancy.tenant.record()["committed"]
        a.tenancy.cfg.idle_trim_s = 0.0
        a.kv.reset_prefix_cache()
        a.idle()
        assert a.tenancy.tenant.record()["committed"] <= grown
        assert a.kv.stats()["capacity"] <= a.tenancy.initial + a.tenancy.chunk
    finally:
        a.close()
        b.close()
    assert led.tenants() == []


def test_an_idle_engine_sleeps_and_the_next_request_wakes_it(checkpoint, expected, tmp_path):
    e = engine(checkpoint, cfg(tmp_path, idle_sleep_s=0.0, idle_trim_s=0.0))
    try:
        assert e.generate(PROMPTS[:2], NEW) == expected[:2]
        awake = e.tenancy.tenant.record()["committed"]
        weights = e.backend.stats()["tags"]["weights"]["committed"]
        given = e.idle()
        assert e.asleep
        rec = e.tenancy.tenant.record()
        assert rec["asleep"] == 1 and rec["committed"] < awake
        # idle() counts what the sleep gave back, the weights among it.
        assert given == awake - rec["committed"] and given >= weights > 0
        # The wake happens inside submit: the request's clock includes it.
        assert e.generate(PROMPTS, NEW) == expected
        assert not e.asleep and e.tenancy.tenant.record()["asleep"] == 0
    finally:
        e.close()


def test_with_the_rest_taken_requests_wait_their_turn_and_none_is_preempted(checkpoint, tmp_path):
    e = engine(checkpoint, cfg(tmp_path, cap="256MiB", device_budget="256MiB"))
    try:
        led = e.tenancy.ledger
        hog = led.join("hog", led.budget - e.tenancy.floor, "1GiB")
        hog.grow(led.budget - e.tenancy.floor)  # all but this engine's floor
        # Four sequences of the full length; the floor holds about two.
        long = [list(range(i, i + 40)) for i in range(4)]
        out = e.generate(long, 20)
        assert [len(o) for o in out] == [20] * 4
        st = e.scheduler.stats
        assert st.preempted == 0 and st.capacity_waits > 0
        rows = led.tenants()
        assert sum(t["committed"] for t in rows) <= led.budget
        mine = next(t for t in rows if t["name"] != "hog")
        assert mine["committed"] <= mine["floor"]
        # A request longer than any share is refused at submit.
        with pytest.raises((CapacityError, imp_mem.InvalidArgument)):
            e.submit(list(range(60)), 20)
        del hog
    finally:
        e.close()


def test_shared_argument_is_checked(checkpoint, tmp_path):
    with pytest.raises(imp_mem.InvalidArgument):
        engine(checkpoint, shared=3)
    for bad in (0, -1, "0B", 1.5):
        with pytest.raises(imp_mem.InvalidArgument, match="chunk_bytes"):
            engine(checkpoint, cfg(tmp_path, chunk_bytes=bad))
    # Nothing joined the ledger on the way (it may not even have a table).
    if "fake-engine" in imp_mem.ledger_devices(str(tmp_path)):
        assert imp_mem.DeviceLedger("fake-engine", None, str(tmp_path)).tenants() == []
    assert SharedGPU.of(None) is None and SharedGPU.of(True) == SharedGPU()
    assert SharedGPU.of({"cap": "1GiB"}).cap == "1GiB"


def fresh(n, seed, length=20):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(257) for _ in range(length)] for _ in range(n)]


def test_the_steady_state_neither_grows_nor_writes_and_reads_the_ledger_at_most_each_interval(
    checkpoint, tmp_path
):
    e = engine(checkpoint, cfg(tmp_path, pressure_interval_s=3600.0))
    try:
        t = e.tenancy
        e.generate(fresh(4, 1), NEW)  # the pool grows to the working size
        e.kv.reset_prefix_cache()
        committed = t.tenant.record()["committed"]
        reads, writes = t.ledger_reads, t.ledger_writes
        steps = e.stats.steps
        for seed in (2, 3, 4):
            e.kv.reset_prefix_cache()
            e.generate(fresh(4, seed), NEW)
        assert e.stats.steps - steps >= 3 * (NEW - 1)
        # No grow, no shrink, no pressure read within the interval, and
        # submits within max_seq_len never consult the ledger.
        assert t.tenant.record()["committed"] == committed
        assert t.ledger_reads == reads
        # KV live is written only when it moved by a chunk (here never:
        # the chunk is the whole pool).
        assert t.ledger_writes == writes
        # At the default interval the pressure is read, at most once a step.
        t.cfg.pressure_interval_s = 0.0
        steps = e.stats.steps
        e.generate(fresh(4, 5), NEW)
        assert 0 < t.ledger_reads - reads <= e.stats.steps - steps
    finally:
        e.close()


def test_an_idle_tenant_holds_its_live_blocks_plus_a_chunk_the_prefix_cache_evicted(
    checkpoint, expected, tmp_path
):
    k = engine(checkpoint, cfg(tmp_path, name="keeps", idle_cache_s=None, idle_trim_s=0.0))
    # Chunks of one sequence (16 blocks of a 65-block pool): several.
    chunk = 16 * k.tenancy.block_bytes
    e = engine(
        checkpoint,
        cfg(tmp_path, name="evicts", chunk_bytes=chunk, idle_trim_s=0.0, idle_cache_s=0.0),
    )
    try:
        t = e.tenancy
        assert t.chunk == 16 and e.kv.stats()["max_blocks"] > 3 * t.chunk
        for x in (e, k):
            x.generate(fresh(4, 7, length=40), NEW)
            assert x.kv.stats()["cached"] > 0
        grown = t.tenant.record()["committed"]
        assert e.kv.stats()["capacity"] > t.initial
        # Idle with nothing in flight: the cache goes, a chunk at a time
        # from the top, and the pool is back to the blocks it opened with
        # (cached blocks among those stay: they cost the ledger nothing).
        e.idle()
        k.idle()
        st, rec = e.kv.stats(), t.tenant.record()
        assert st["capacity"] == t.initial and st["cached"] < t.initial
        live_bytes = st["live"] * t.block_bytes
        assert rec["kv_live"] == live_bytes
        above = rec["committed"] - rec["floor"]
        assert rec["committed"] < grown
        assert above <= max(0, live_bytes - t.initial * t.block_bytes) + t.chunk * t.block_bytes
        # The one that keeps its cache still holds it.
        assert k.kv.stats()["cached"] > 0
        # After the shrink, requests are served as before it (the pool
        # grows back through the ledger).
        assert e.generate(PROMPTS, NEW) == expected
    finally:
        e.close()
        k.close()


def test_the_floor_counts_what_the_plan_holds_outside_the_backend_and_the_ledger_does_too(
    checkpoint, tmp_path
):
    e = engine(checkpoint, cfg(tmp_path))
    try:
        t, plan = e.tenancy, e.plan
        assert t.outside == plan.context + plan.library_reserve + plan.warmup
        rec = t.tenant.record()
        # Open: the join's rounding slack given back, the floor is what the
        # tenant holds at rest.
        assert rec["committed"] == rec["floor"] == t.floor
        # A warm-up measured above the plan's line is charged on top, and
        # the floor raised with it (torch keeps those bytes).
        floor = t.floor
        t.settle_warmup(t.planned_warmup + 3 * MIB)
        now = t.tenant.record()
        assert now["committed"] == rec["committed"] + 3 * MIB
        assert now["floor"] == rec["floor"] + 3 * MIB and t.floor == floor + 3 * MIB
        assert t.outside_past_floor == 0
        t.settle_warmup(0)  # below the line: nothing changes
        assert t.tenant.record()["committed"] == rec["committed"] + 3 * MIB
        # Past the cap the ledger refuses: the charge stays as it was.
        t.settle_warmup(t.planned_warmup + 1024 * MIB)
        assert t.tenant.record()["committed"] == rec["committed"] + 3 * MIB
        assert t.tenant.record()["floor"] == now["floor"]

        # Charged, but the floor refused (the others' reservations): the
        # charge is counted above the floor instead.
        class NoRaise:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def raise_floor(self, nbytes):
                raise imp_mem.OutOfMemory("no room for the floor")

        real, t.tenant = t.tenant, NoRaise(t.tenant)
        try:
            t.settle_warmup(t.planned_warmup + 2 * MIB)
        finally:
            t.tenant = real
        assert real.record()["committed"] == rec["committed"] + 5 * MIB
        assert real.record()["floor"] == now["floor"] and t.outside_past_floor == 2 * MIB
    finally:
        e.close()


def test_a_coarse_granularity_s_slack_is_not_reserved_once_the_tiers_are_open(checkpoint, tmp_path):
    # A VMM backend's 64 MiB chunk made the join's slack (a granule a tier)
    # 1 GiB on the H200, reserved from the other tenants for good; here 4 MiB.
    gran = 4 * MIB
    e = engine(
        checkpoint,
        cfg(tmp_path, cap="96MiB"),
        backend=FakeBackend(capacity="256MiB", granularity=gran),
    )
    try:
        t, plan = e.tenancy, e.plan
        rec = t.tenant.record()
        joined = plan.total() - plan.kv["bytes"] + t.initial * t.block_bytes + 16 * gran
        assert rec["committed"] == rec["floor"] == t.floor
        assert rec["floor"] <= joined - 8 * gran
        # What it holds does not move across serving and the idle shrink:
        # nothing above the floor is left for the others to press for.
        e.generate(PROMPTS, NEW)
        e.idle()
        assert t.tenant.record()["committed"] - t.floor <= t.chunk * t.block_bytes + gran
        # A floor below what it holds (more rounding than the slack) is
        # raised to it: those bytes are not the KV's to give back.
        t.tenant.lower_floor(3 * gran)
        t.floor -= 3 * gran
        held = t.tenant.record()["committed"]
        t.fit_floor()
        assert t.floor == t.tenant.record()["floor"] == held
        # The other tenants find the room the slack held.
        led = imp_mem.DeviceLedger("fake-engine", "160MiB", str(tmp_path))
        other = led.join("other", 160 * MIB - held, 160 * MIB - held)
        del other
    finally:
        e.close()


def test_a_raised_floor_is_met_by_the_next_join(tmp_path):
    led = imp_mem.DeviceLedger("fake-floor", "100MiB", str(tmp_path))
    a = led.join("a", "20MiB", "40MiB")
    a.grow("25MiB")
    a.raise_floor("45MiB")
    rec = a.record()
    assert (rec["floor"], rec["cap"]) == (65 * MIB, 65 * MIB)
    with pytest.raises(PlanFailure):
        led.join("b", "36MiB", "36MiB")
    b = led.join("b", "35MiB", "35MiB")
    with pytest.raises(imp_mem.OutOfMemory):
        a.raise_floor("1MiB")
    assert a.record()["floor"] == 65 * MIB
    with pytest.raises(imp_mem.InvalidArgument, match="nbytes"):
        a.raise_floor(-1)
    # Lowered (always granted, the cap kept), the room is the next join's.
    a.lower_floor("30MiB")
    assert (a.record()["floor"], a.record()["cap"]) == (35 * MIB, 65 * MIB)
    c = led.join("c", "5MiB", "5MiB")
    with pytest.raises(imp_mem.InvalidArgument, match="nbytes"):
        a.lower_floor(-1)
    a.lower_floor("1GiB")
    assert a.record()["floor"] == 0
    del a, b, c
