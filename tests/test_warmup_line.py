"""The plan's ``warmup`` line (issue 25): what a warm-up leaves outside the
tiers, measured, planned from a cache keyed by a fingerprint, claimed by
the engine's measurement. On the fake backend (the measurement itself is
a GPU test)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _helpers import make_plan

import imp_mem
from imp_mem import FakeBackend, Features, MemorySystem

MIB = 1 << 20


def _tiny_checkpoint(tmp_path):
    """A two-layer Qwen3 checkpoint of random weights (CPU engines boot it
    in a second)."""
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import qwen3_0_6b_config

    config = qwen3_0_6b_config()
    config.update(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    return write_random_checkpoint(tmp_path, config, seed=0, scale=0.1)


def plan(warmup: int, budget: str | int = "1GiB"):
    """SMALL's plan for 64 x 4096 tokens, its KV pool fitted to the budget."""
    return make_plan(
        budget=budget, max_batch=64, max_seq_len=4096, features=Features(warmup_bytes=warmup)
    )


def test_the_line_takes_its_bytes_from_the_kv_pool():
    without, with_line = plan(0), plan(300 * MIB)
    assert without.warmup == 0 and "warmup" not in [c["key"] for c in without.charges]
    assert with_line.warmup == 300 * MIB
    line = next(c for c in with_line.charges if c["key"] == "warmup")
    assert line["bytes"] == 300 * MIB and "measured" in line["label"]
    assert sum(c["bytes"] for c in with_line.charges) == with_line.total()
    # Same budget: the line's bytes leave the KV pool, nothing else moves.
    tight = plan(0, "8GiB").total() - 64 * MIB  # the KV pool short of its target
    a, b = plan(0, tight), plan(128 * MIB, tight)
    assert a.kv_bytes - b.kv_bytes >= 128 * MIB - a.kv["block_bytes"]
    assert b.total() <= tight
    assert a.weights == b.weights and a.engine_persistent == b.engine_persistent


def test_a_line_that_does_not_fit_is_a_plan_failure():
    with pytest.raises(imp_mem.PlanFailure) as e:
        plan(8 << 30)
    assert "warm-up" in str(e.value)


@pytest.mark.parametrize("bad", [-1, "lots", 1.5])
def test_bad_warmup_bytes_are_refused(bad):
    with pytest.raises((imp_mem.InvalidArgument, TypeError)) as e:
        Features(warmup_bytes=bad)
    assert "warmup_bytes" in str(e.value)


def test_the_system_keeps_the_line_outside_its_tiers_and_the_engine_claims_it():
    p = plan(64 * MIB, budget="1GiB")
    with MemorySystem(FakeBackend(capacity="1GiB"), p) as system:
        # The backend may commit the plan less every outside line.
        assert system.backend.budget <= p.budget - p.context - p.library_reserve - p.warmup
        report = system.mem_report()
        line = next(c for c in report["charges"] if c["key"] == "warmup")
        assert line["planned"] == 64 * MIB and not line["measured"]
        system.set_charge("warmup", 60 * MIB, "ignored: the plan names it")
        line = next(c for c in system.mem_report()["charges"] if c["key"] == "warmup")
        assert line["bytes"] == 60 * MIB and line["measured"] and line["planned"] == 64 * MIB
        assert "warm-up" in line["label"]


def test_the_cache_remembers_by_fingerprint(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from imp_mem.engine import warmup

    monkeypatch.setenv("IMP_MEM_WARMUP_CACHE", str(tmp_path / "w.json"))
    config = {"hidden_size": 64, "num_hidden_layers": 2}
    fp = warmup.fingerprint(config, {"max_batch": 8, "buckets": [1, 8]})
    assert warmup.lookup(fp) is None
    warmup.store(fp, {"torch": 5 * MIB, "modules": 3 * MIB})
    assert warmup.lookup(fp) == {"torch": 5 * MIB, "modules": 3 * MIB}
    assert warmup.total(warmup.lookup(fp)) == 8 * MIB
    # Anything that decides the bytes is in the key.
    assert warmup.lookup(warmup.fingerprint(config, {"max_batch": 16, "buckets": [1, 8]})) is None
    other = dict(config, hidden_size=128)
    assert warmup.lookup(warmup.fingerprint(other, {"max_batch": 8, "buckets": [1, 8]})) is None
    # A second entry keeps the first; a corrupt cache is a miss, then rewritten.
    fp2 = warmup.fingerprint(config, {"max_batch": 2})
    warmup.store(fp2, {"torch": 1, "modules": 2})
    assert warmup.lookup(fp) is not None and warmup.lookup(fp2) == {"torch": 1, "modules": 2}
    (tmp_path / "w.json").write_text("{not json")
    assert warmup.lookup(fp) is None
    warmup.store(fp, {"torch": 7, "modules": 0})
    assert json.loads((tmp_path / "w.json").read_text())


def test_the_engine_on_the_cpu_plans_no_warmup_line_and_times_its_boot(tmp_path):
    pytest.importorskip("torch")
    from imp_mem.engine import Engine

    directory = _tiny_checkpoint(tmp_path)
    with Engine(directory, max_batch=2, max_seq_len=64, budget="256MiB") as engine:
        assert engine.plan.warmup == 0 and engine.warmup_measured is None
        boot = dict(engine.boot_seconds)
        phases = {"process", "backend", "plan", "open", "load", "warm_up", "capture", "other"}
        assert phases <= set(boot)
        assert all(v >= 0 for v in boot.values())
        # The phases inside the constructor (the pinning overlaps the load)
        # add up to its time: "other" is the remainder, never hidden.
        inside = sum(v for k, v in boot.items() if k not in ("process", "pin"))
        assert inside == pytest.approx(engine.open_seconds, abs=1e-6)
        assert engine.first_token_seconds is None and "first_step" not in boot
        engine.generate([[1, 2, 3]], max_new_tokens=2)
        assert engine.first_token_seconds is not None and engine.first_token_seconds > 0
        first = engine.boot_seconds["first_step"]
        assert first > 0
        assert boot["process"] + engine.open_seconds + first == pytest.approx(
            engine.first_token_seconds, abs=1e-6
        )


def test_the_probe_child_boots_the_same_engine(tmp_path):
    """`warmup.probe` re-runs the engine's arguments in a child (weights laid
    out, not read); on the CPU nothing lies outside the tiers, so it
    measures zeros. A child that fails names its error."""
    pytest.importorskip("torch")
    from imp_mem.engine import warmup

    directory = _tiny_checkpoint(tmp_path)
    kw = {"max_batch": 2, "max_seq_len": 64, "budget": "256MiB", "progress": False}
    boot: dict[str, float] = {}
    assert warmup.probe(directory, kw, boot=boot) == {"torch": 0, "modules": 0}
    # The child's boot, split as the engine splits its own, and its exit.
    assert {"process", "backend", "plan", "load", "warm_up", "other", "exit"} <= set(boot)
    assert all(v >= 0 for v in boot.values()) and boot["process"] > 0
    with pytest.raises(RuntimeError, match="max_seq_len"):
        warmup.probe(directory, dict(kw, max_seq_len=100000))


def test_the_meter_names_only_what_no_line_holds(monkeypatch):
    """`Meter`: the device's growth across the warm-up less torch's, less
    what the backend and its source hold (handle cache, rounding), less the
    library reserve its own line charges: the kernel modules. torch's
    reserved bytes are charged only when they lie outside the tiers. The
    device is simulated: the arithmetic is what is checked."""
    torch = pytest.importorskip("torch")
    from imp_mem.engine import warmup

    state = {"used": 1000 * MIB, "reserved": 0, "committed": 500 * MIB, "cache": 0, "tier": 0}

    class Backend:
        def stats(self):
            return {"committed": state["committed"]}

    class System:
        def mem_report(self):
            return {
                "charges": [
                    {"key": "vmm_handle_cache", "bytes": state["cache"]},
                    {"key": "context", "bytes": 500 * MIB},
                ],
                "tiers": [
                    {"key": "activations", "in_use": state["tier"]},
                    {"key": "kv_pool", "in_use": 7 * MIB},
                ],
            }

    total = 80 << 30
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (total - state["used"], total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: state["reserved"])
    for outside in (True, False):
        meter = warmup.Meter(
            None, Backend(), torch_outside=outside, system=System(), library_reserve=66 * MIB
        )
        meter.start()
        # The warm-up: torch caches 80 MiB (on its own allocator, the
        # device grows by it; routed, its segments are blocks of the
        # activations tier, committed at open, and only the tier's in-use
        # bytes grow), the KV pool grows by 100 MiB, the source keeps 32 MiB
        # of handles, cuBLAS takes its 66 MiB and the kernels' modules 250 MiB.
        grow = {"reserved": 80 * MIB, "committed": 100 * MIB, "cache": 32 * MIB}
        for k, v in grow.items():
            state[k] += v
        state["used"] += 100 * MIB + 32 * MIB + 66 * MIB + 250 * MIB
        if outside:
            state["used"] += 80 * MIB
        else:
            state["tier"] += 80 * MIB
        got = meter.stop()
        assert got == {"torch": state["reserved"] if outside else 0, "modules": 250 * MIB}
    # A device that shrank (something freed) never gives negative modules.
    meter = warmup.Meter(None, Backend(), torch_outside=True, system=None)
    meter.start()
    state["used"] -= 400 * MIB
    assert meter.stop()["modules"] == 0


@pytest.mark.parametrize("kw", [{"fused": "yes"}, {"warmup_probe": 1}])
def test_the_engines_switches_are_booleans(tmp_path, kw):
    pytest.importorskip("torch")
    from imp_mem.engine import Engine

    with pytest.raises(TypeError, match=next(iter(kw))):
        Engine(tmp_path, **kw)


def test_the_probe_child_is_given_the_engines_library_reserve(tmp_path, monkeypatch):
    """The probe child's meter leaves out the library reserve as the engine's
    own does (cuBLAS claims it at the first GEMM; the report charges it on
    its own line): the engine hands the child the reserve it planned with.
    On the H200 a child without it planned 66 MiB of modules more than the
    engine measured. The probe itself is replaced; the handing is checked."""
    pytest.importorskip("torch")
    from imp_mem.engine import warmup
    from imp_mem.engine.llm_engine import Engine

    directory = _tiny_checkpoint(tmp_path)
    monkeypatch.setenv("IMP_MEM_WARMUP_CACHE", str(tmp_path / "warmup.json"))
    seen = []

    def fake_probe(source, kw, boot=None):
        seen.append(dict(kw))
        return {"torch": 0, "modules": 5 * MIB}

    with Engine(directory, max_batch=2, max_seq_len=64, budget="256MiB") as engine:
        monkeypatch.setattr(warmup, "probe", fake_probe)
        monkeypatch.setattr(warmup, "probe_by_default", lambda: True)
        engine.memory.on_gpu, engine._booted = True, False
        try:
            got = warmup.figure(engine, 16, 66 * MIB)
            assert got == {"torch": 0, "modules": 5 * MIB}
            assert seen[-1]["library_reserve"] == 66 * MIB
            # Without a reserve of its own, the child keeps the caller's argument.
            monkeypatch.setenv("IMP_MEM_WARMUP_CACHE", str(tmp_path / "other.json"))
            warmup.figure(engine, 16, None)
            assert seen[-1]["library_reserve"] is None
        finally:
            engine.memory.on_gpu = False  # closed as the CPU engine it is


def test_a_routed_engine_plans_the_probes_modules_alone(tmp_path, monkeypatch):
    """A probe child that ran torch on its own allocator (the engine's
    torch_pool was a callable, which does not travel to the child) reports
    the forward pass's working set as `torch`. An engine that routes torch
    into its own pool plans that set on the pool's line: its warm-up line
    takes the child's modules alone (and remembers no torch bytes)."""
    pytest.importorskip("torch")
    from imp_mem.engine import warmup
    from imp_mem.engine.llm_engine import Engine

    directory = _tiny_checkpoint(tmp_path)
    monkeypatch.setenv("IMP_MEM_WARMUP_CACHE", str(tmp_path / "warmup.json"))
    monkeypatch.setattr(
        warmup, "probe", lambda s, kw, boot=None: {"torch": 92 * MIB, "modules": 86 * MIB}
    )
    monkeypatch.setattr(warmup, "probe_by_default", lambda: True)
    with Engine(directory, max_batch=2, max_seq_len=64, budget="256MiB") as engine:
        engine.memory.on_gpu, engine._booted = True, False
        try:
            assert warmup.figure(engine, 16, 0) == {"torch": 92 * MIB, "modules": 86 * MIB}
            monkeypatch.setenv("IMP_MEM_WARMUP_CACHE", str(tmp_path / "routed.json"))
            # Routed, as torch_pool="imp_mem" makes it; such an engine probes
            # where asked (warmup_probe=True).
            engine.memory.torch_pool = object()
            engine.args = dataclasses.replace(engine.args, warmup_probe=True)
            routed = warmup.figure(engine, 16, 0)
            assert routed == {"torch": 0, "modules": 86 * MIB}
            assert warmup.lookup(engine._warmup_fp) == routed, "remembered as planned"
        finally:
            engine.memory.torch_pool = None
            engine.memory.on_gpu = False  # closed as the CPU engine it is
