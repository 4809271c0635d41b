"""The device ledger from Python (issue 27): admission and its PlanFailure,
a backend that commits through a tenant, elastic KV over a MemorySystem,
a SIGKILLed process reaped, and ``imp-mem ledger``."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
from _helpers import GIB, MIB, TINY, make_plan
from hypothesis import given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import cli


@pytest.fixture
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("IMP_MEM_LEDGER_DIR", str(tmp_path))
    return tmp_path


def test_floors_that_do_not_fit_raise_plan_failure_naming_every_tenant(ledger_dir):
    led = imp_mem.DeviceLedger("fake-a", "100MiB")
    assert led.budget == 100 * MIB and led.key == "fake-a"
    a = led.join("alpha", "60MiB", "100MiB")
    _b = led.join("beta", "30MiB", "100MiB")
    with pytest.raises(imp_mem.PlanFailure) as info:
        led.join("gamma", "20MiB", "100MiB")
    err = info.value
    assert err.kind == "ledger_full"
    assert err.total == 110 * MIB and err.over_by == 10 * MIB and err.budget == 100 * MIB
    labels = " ".join(c["label"] for c in err.charges)
    assert "alpha" in labels and "beta" in labels and "gamma" in labels
    assert "alpha" in str(err) and "60.0 MiB" in str(err)
    rec = a.record()
    assert rec["name"] == "alpha" and rec["state"] == "live" and rec["pid"] == os.getpid()
    assert imp_mem.ledger_devices() == ["fake-a"]
    assert imp_mem.ledger_dir() == str(ledger_dir)


def test_bad_arguments_are_invalid_argument(ledger_dir):
    with pytest.raises(imp_mem.InvalidArgument):
        imp_mem.DeviceLedger("../x", "1MiB")
    with pytest.raises(imp_mem.InvalidArgument):
        imp_mem.DeviceLedger("ok", 0)
    led = imp_mem.DeviceLedger("ok", "10MiB")
    with pytest.raises(imp_mem.InvalidArgument):
        led.join("t", "5MiB", "1MiB")
    with pytest.raises(imp_mem.InvalidArgument):
        led.join("t", 0, "1MiB", wait_s=-1.0)
    t = led.join("t", 0, "1MiB")
    with pytest.raises(imp_mem.InvalidArgument):
        t.set_asleep(3)
    with pytest.raises(imp_mem.InvalidArgument):
        t.grow(-1)


def test_a_backend_on_the_ledger_commits_what_it_grants(ledger_dir):
    led = imp_mem.DeviceLedger("fake-b", "64MiB")
    other = led.join("other", "16MiB", "64MiB")
    fb = imp_mem.FakeBackend(capacity="256MiB", granularity=2 * MIB)
    t = led.join("me", "8MiB", "64MiB")
    fb.attach_ledger(t)
    region = fb.acquire_growable("64MiB", 0, tag="kv_cache")
    assert fb.headroom() == 48 * MIB
    region.commit(48 * MIB)
    with pytest.raises(imp_mem.OutOfMemory) as info:
        region.commit(50 * MIB)
    assert info.value.ledger_headroom == 0
    assert t.record()["committed"] == 48 * MIB
    region.decommit(8 * MIB)
    assert t.record()["committed"] == 8 * MIB
    other.grow("56MiB")  # all but my floor
    with pytest.raises(imp_mem.OutOfMemory):
        other.grow("1MiB")
    region.release()
    assert t.record()["committed"] == 0


def test_elastic_kv_on_a_memory_system_gives_back_under_pressure(ledger_dir):
    plan = make_plan(TINY, budget=256 * MIB, max_batch=4, max_seq_len=1024)
    led = imp_mem.DeviceLedger("fake-kv", 2 * GIB)
    fb = imp_mem.FakeBackend(capacity=GIB)
    me = led.join("engine", 0, plan.budget)
    fb.attach_ledger(me)
    system = imp_mem.MemorySystem(fb, plan, kv_growable=True, kv_initial_blocks=8, kv_grow_blocks=8)
    kv = system.kv_manager()
    bb = plan.kv["block_bytes"]
    committed0 = me.record()["committed"]
    assert committed0 == fb.stats()["committed"]
    # Fill and cache 40 blocks, then let them go to the prefix cache.
    bs = kv.block_size
    for i in range(4):
        kv.admit(i, list(range(i * 10_000, i * 10_000 + 10 * bs)))
    for i in range(4):
        kv.free(i)
    grown = me.record()["committed"]
    assert grown > committed0
    # Another tenant wants most of the rest of the device.
    other = led.join("burst", 0, 2 * GIB)
    room = other.headroom()
    other.want(room + (grown - committed0))
    given_back = kv.ledger_tick()
    assert given_back >= bb * 8
    assert me.record()["committed"] == grown - given_back
    assert me.record()["kv_live"] >= 0
    assert other.headroom() >= room + given_back - bb
    del kv
    system.close()


def _hold(dir_, ready, nbytes):
    os.environ["IMP_MEM_LEDGER_DIR"] = dir_
    led = imp_mem.DeviceLedger("fake-kill", "1GiB")
    t = led.join("victim", "100MiB", "1GiB")
    t.grow(nbytes)
    ready.set()
    signal.pause()


def test_a_sigkilled_tenant_is_reaped_and_top_shows_it(ledger_dir, capsys):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold, args=(str(ledger_dir), ready, 900 * MIB))
    child.start()
    try:
        assert ready.wait(60)
        led = imp_mem.DeviceLedger("fake-kill", "1GiB")
        me = led.join("survivor", 0, "1GiB")
        assert me.headroom() == 124 * MIB
        assert cli.main(["ledger", "--once"]) == 0
        out = capsys.readouterr().out
        assert "victim" in out and "survivor" in out and "900 MiB" in out
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        # The survivor's next look reaps the dead tenant: its share is back.
        me.grow("1GiB")
        assert [t["name"] for t in led.tenants()] == ["survivor"]
        assert cli.main(["top", "--once", "--dir", str(ledger_dir)]) == 0
        assert "victim" not in capsys.readouterr().out
    finally:
        if child.is_alive():
            child.kill()


def test_ledger_json_and_an_empty_directory(tmp_path, capsys):
    import json

    assert cli.main(["ledger", "--json", "--dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == []
    assert cli.main(["ledger", "--once", "--dir", str(tmp_path)]) == 0
    assert "no device ledgers" in capsys.readouterr().out
    # A directory that is not there is a mistake, not an empty table (issue 55).
    assert cli.main(["ledger", "--once", "--dir", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["ledger", "--once", "--interval", "0"]) == 2


@settings(max_examples=60, deadline=None)
@given(
    floors=st.lists(st.integers(0, 40), min_size=2, max_size=4),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(-30, 30)), max_size=40),
)
def test_grants_keep_the_invariants(tmp_path_factory, floors, ops):
    d = tmp_path_factory.mktemp("led")
    led = imp_mem.DeviceLedger("fake-prop", "100MiB", dir=d)
    tenants, mine = [], []
    for i, f in enumerate(floors):
        try:
            tenants.append((led.join(f"t{i}", f * MIB, "100MiB", wait_s=0.0), f * MIB))
            mine.append(0)
        except imp_mem.PlanFailure:
            assert sum(fl for _, fl in tenants) + f * MIB > 100 * MIB
    for who, delta in ops:
        if not tenants:
            break
        k = who % len(tenants)
        t, floor = tenants[k]
        if delta >= 0:
            try:
                t.grow(delta * MIB)
                mine[k] += delta * MIB
            except imp_mem.OutOfMemory:
                assert mine[k] + delta * MIB > floor
        else:
            d_ = min(-delta * MIB, mine[k])
            t.shrink(d_)
            mine[k] -= d_
        rows = led.tenants()
        assert sum(r["committed"] for r in rows) <= 100 * MIB
        assert sum(max(r["committed"], r["floor"]) for r in rows) <= 100 * MIB
        assert sorted(r["committed"] for r in rows) == sorted(mine)
