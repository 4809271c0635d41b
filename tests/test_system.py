"""MemorySystem on the fake backend: the plan's tier order, a clean failure
at every step, the phases, the memory report and its attribution, the
Prometheus metrics, close, the demo, and V8 as a property (a successful
plan opened and driven to its limits exceeds neither its budget nor any
tier, and closes to zero)."""

from __future__ import annotations

import re
import warnings

import pytest
from _helpers import GIB, HYBRID, MIB, make_plan
from _helpers import SMALL as SMALL  # tests/gpu/test_kv_system_gpu.py imports it from here
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import (
    Arena,
    BlockPool,
    FakeBackend,
    Features,
    ImpMemWarning,
    InvalidArgument,
    Limits,
    MemorySystem,
    ModelShape,
    OutOfMemory,
    Phase,
    PhaseViolation,
    PlanFailure,
    PlanInput,
    ScratchStack,
    plan_memory,
)
from imp_mem.system import run_demo

TAG_ORDER = ["workspace", "weights", "swa_cache", "state", "scratch", "kv_cache"]


def acquired_tags(backend):
    return [row[2] for row in backend.journal() if row[4] == "acquire"]


@pytest.fixture
def big():
    """An unbacked 4 GiB fake: capacity-scale without host memory."""
    return FakeBackend(capacity=4 * GIB, backed=False)


def test_hybrid_plan_has_every_tier():
    p = make_plan(HYBRID)
    assert p.swa is None or p.swa["blocks"] > 0
    assert p.pools, "the linear-attention state pool"


def test_tiers_open_in_plan_order_and_the_journal_shows_it(big, plan):
    with MemorySystem(big, plan) as system:
        assert system.tiers == ["engine_persistent", "model_resident", "scratch", "kv_pool"]
        assert acquired_tags(big) == ["workspace", "weights", "scratch", "kv_cache"]
        assert isinstance(system.weights_arena, Arena)
        assert isinstance(system.engine_arena, Arena)
        assert isinstance(system.kv_pool, BlockPool)
        assert isinstance(system.scratch, ScratchStack)
        assert system.swa_pool is None and system.state_pools == []
        assert system.weights_arena.capacity == plan.model_resident
        assert system.engine_arena.capacity == plan.engine_persistent
        assert system.scratch.capacity == plan.scratch
        kv = system.kv_pool.stats()
        assert kv["block_bytes"] == plan.kv["block_bytes"]
        assert kv["max_blocks"] == plan.kv_blocks
        assert kv["capacity"] < kv["max_blocks"], "growable: a first part is committed"
        assert system.phase == Phase.LOADING
        system.check()


def test_a_hybrid_model_opens_its_state_pool_before_scratch_and_kv(big):
    p = make_plan(HYBRID)
    with MemorySystem(big, p) as system:
        tags = acquired_tags(big)
        expected = [t for t in TAG_ORDER if t in tags]
        assert tags == expected
        assert "state" in tags and tags.index("state") < tags.index("kv_cache")
        (state,) = system.state_pools
        assert state.capacity == p.pools[0]["slots"]
        if p.swa is not None:
            assert system.swa_pool.capacity == p.swa["blocks"]
        del state


def test_a_failure_at_every_step_leaves_nothing_acquired(plan):
    steps = len(MemorySystem(FakeBackend(capacity=GIB), plan).tiers)
    assert steps == 4
    for n in range(1, steps + 1):
        fb = FakeBackend(capacity=GIB)
        fb.fail_nth(n)
        with pytest.raises(OutOfMemory) as info:
            MemorySystem(fb, plan)
        assert info.value.step == n
        assert "released" in str(info.value)
        assert info.value.step_name.startswith(("T1", "T2", "T3", "T4"))
        assert fb.live == 0 and fb.device_used == 0
        assert fb.budget == GIB, "the budget is restored"
        fb.check_invariants()
        assert len(acquired_tags(fb)) == n - 1


def test_a_plan_for_a_bigger_device_is_refused_before_acquiring():
    fb = FakeBackend(capacity=8 * MIB, backed=False)
    with pytest.raises(InvalidArgument, match="plan with this backend"):
        MemorySystem(fb, make_plan())
    assert fb.journal() == []


def test_opening_while_serving_is_refused(big, plan):
    big.begin_planning()
    big.begin_serving()
    with pytest.raises(PhaseViolation):
        MemorySystem(big, plan)


def test_the_budget_binds_while_open_and_is_restored(big, plan):
    with MemorySystem(big, plan) as system:
        assert big.budget == plan.budget - plan.context - plan.library_reserve
        room = big.budget - big.stats()["committed"]
        with pytest.raises(OutOfMemory):
            big.acquire(room + 1)
        assert system.mem_report()["budget"] == big.budget
    assert big.budget == 4 * GIB
    assert big.live == 0


def test_phases_and_growth_while_serving(big, plan):
    with MemorySystem(big, plan) as system:
        system.begin_serving()
        system.begin_serving()  # idempotent
        assert system.phase == Phase.SERVING
        with pytest.raises(PhaseViolation):
            big.acquire(4096)
        kv = system.kv_pool
        start = kv.capacity
        refs = kv.allocate_many(kv.stats()["max_blocks"])  # every planned block
        assert kv.capacity == plan.kv_blocks > start
        assert kv.stats()["growths"] >= 1
        with pytest.raises(imp_mem.CapacityError):
            kv.allocate()
        report = system.mem_report()
        assert report["steady_state_allocations_total"] == 0
        (kv_line,) = [t for t in report["tiers"] if t["key"] == "kv_pool"]
        assert kv_line["in_use"] == plan.kv_blocks * plan.kv["block_bytes"]
        assert kv_line["committed"] <= kv_line["planned"]
        system.check()
        refs.release()
        del kv


def test_mem_report_names_every_charge_and_attributes_against_a_device(big, plan):
    with MemorySystem(big, plan, context=20 * MIB, library_reserve=6 * MIB) as system:
        arena = system.weights_arena
        arena.take(arena.capacity // 2)
        system.set_charge("torch", 5 * MIB, label="torch caching allocator")
        committed = big.stats()["committed"]
        attributed = committed + 20 * MIB + 6 * MIB + 5 * MIB
        used = attributed + 3 * MIB + 200 * MIB  # 3 MiB nobody names, 200 MiB elsewhere
        report = system.mem_report(device=(4 * GIB - used, 4 * GIB), other_processes="200MiB")
        assert report["attributed"] == attributed
        assert [c["key"] for c in report["charges"]] == ["context", "library_reserve", "torch"]
        assert all(c["measured"] for c in report["charges"])
        assert report["charges"][0]["planned"] == plan.context
        device = report["device"]
        assert device["used"] == used
        assert device["own_used"] == attributed + 3 * MIB
        assert device["unattributed"] == 3 * MIB
        assert device["attribution_pct"] == pytest.approx(100 * attributed / (attributed + 3 * MIB))
        assert device["meets_target"]
        (t1,) = [t for t in report["tiers"] if t["tier"] == "T1"]
        assert (t1["planned"], t1["committed"], t1["tag"]) == (
            plan.model_resident,
            plan.model_resident,
            "weights",
        )
        assert t1["in_use"] == t1["high_water"] >= arena.capacity // 2
        tags = {t["tag"]: t for t in report["tags"]}
        assert tags["weights"]["live"] == plan.model_resident
        # An unnamed tenth of the device breaks criterion 6, visibly.
        bad = system.mem_report(device=(4 * GIB - attributed * 10 // 9, 4 * GIB))
        assert not bad["device"]["meets_target"]
        text = system.mem_report_text(device=(4 * GIB - attributed * 10 // 9, 4 * GIB))
        assert "NOT met" in text
        # No reading on a fake unless one is given.
        assert system.mem_report()["device"] is None
        assert system.mem_report(device=False)["device"] is None
        with pytest.raises(InvalidArgument):
            system.mem_report(device=(2, 1))
        del arena


def test_text_report(big, plan):
    with MemorySystem(big, plan) as system:
        text = str(system)
        for needle in (
            "model-resident arena",
            "engine-persistent arena",
            "KV pool (growable)",
            "CUDA context + driver (plan)",
            "library reserve (plan)",
            "attributed",
            "steady-state allocations while serving: 0",
        ):
            assert needle in text, needle
        assert "MemorySystem fake" in repr(system)


SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<key>tier|tag)="(?P<value>[a-z_]+)"\})? '
    r"(?P<number>-?[0-9]+(\.[0-9]+)?(e[+-]?[0-9]+)?)$"
)


def parse_metrics(text: str) -> dict[str, float]:
    declared: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            assert help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("gauge", "counter")
            assert (kind == "counter") == name.endswith("_total"), line
            declared[name] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample: {line!r}"
            assert m["name"] in declared, f"undeclared: {line!r}"
            assert m["name"].endswith(("_bytes", "_total", "_blocks", "_ratio")), line
            series = line.rsplit(" ", 1)[0]
            assert series not in samples, f"duplicate: {line!r}"
            samples[series] = float(m["number"])
    return samples


def test_metrics_are_prometheus_text(big):
    p = make_plan(HYBRID)
    with MemorySystem(big, p) as system:
        system.begin_serving()
        kv = system.kv_pool
        refs = kv.allocate_many(10)
        m = parse_metrics(system.metrics(device=(GIB, 4 * GIB)))
        assert m['imp_mem_pool_live_blocks{tag="kv_cache"}'] == 10
        assert m['imp_mem_pool_free_blocks{tag="kv_cache"}'] == kv.free
        assert m['imp_mem_pool_capacity_blocks{tag="kv_cache"}'] == kv.capacity
        assert m['imp_mem_pool_capacity_blocks{tag="state"}'] == p.pools[0]["slots"]
        assert m['imp_mem_tier_committed_bytes{tier="model_resident"}'] == p.model_resident
        assert m['imp_mem_tier_live_bytes{tier="pooled"}'] == 10 * p.kv["block_bytes"]
        assert m["imp_mem_budget_bytes"] == big.budget
        assert m["imp_mem_plan_budget_bytes"] == p.budget
        for tag in ("weights", "kv_cache", "state", "workspace", "scratch", "other"):
            assert m[f'imp_mem_steady_state_allocations_total{{tag="{tag}"}}'] == 0
        assert m['imp_mem_acquisitions_total{tag="kv_cache"}'] == 1
        assert 0 < m["imp_mem_attribution_ratio"] <= 1
        assert "imp_mem_device_used_bytes" in m
        refs.release()
        del kv
        # Without a reading there is no device family at all.
        assert "imp_mem_attribution_ratio" not in system.metrics()


def test_close_releases_everything_and_warns_about_what_is_still_held(plan):
    fb = FakeBackend(capacity=GIB)
    system = MemorySystem(fb, plan)
    block = system.kv_pool.allocate()
    with pytest.warns(ImpMemWarning, match="still referenced"):
        closed = system.close()
    assert closed["still_held"] == {"kv_cache": fb.stats()["tags"]["kv_cache"]["live"]}
    assert system.closed
    with pytest.raises(InvalidArgument, match="closed"):
        system.kv_pool  # noqa: B018
    with pytest.raises(InvalidArgument):
        system.begin_serving()
    assert system.mem_report()["closed"] is True
    block.release()
    assert fb.live == 0
    fb.check_invariants()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert system.close() == {"released": 0, "still_held": {}}


def test_context_manager_closes_and_releases(plan):
    fb = FakeBackend(capacity=GIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with MemorySystem(fb, plan) as system:
            assert fb.live > 0
    assert system.closed and fb.live == 0 and fb.budget == GIB


def test_bad_arguments_are_invalid(big, plan):
    with pytest.raises(TypeError):
        MemorySystem(big, "not a plan")
    with pytest.raises(InvalidArgument):
        MemorySystem(big, plan, context=-1)
    with MemorySystem(big, plan, kv_growable=False, apply_budget=False) as system:
        assert system.kv_pool.capacity == plan.kv_blocks
        assert big.budget == 4 * GIB, "apply_budget=False leaves the budget alone"
        with pytest.raises(InvalidArgument):
            system.set_charge("", 1)


def test_run_demo_on_the_default_fake():
    lines: list[str] = []
    assert run_demo(out=lines.append) == 0
    text = "\n".join(lines)
    assert "opened in plan order: engine_persistent -> model_resident -> scratch -> kv_pool" in text
    assert "[SERVING]" in text
    assert "imp-mem memory report" in text
    assert 'imp_mem_pool_live_blocks{tag="kv_cache"}' in text
    assert 'imp_mem_steady_state_allocations_total{tag="kv_cache"} 0' in text
    assert lines[-1].endswith("backend live = 0 B")
    grew = re.search(r"capacity (\d+) -> (\d+) of", text)
    assert grew and int(grew[2]) > int(grew[1]), "the KV pool grew while serving"


def test_run_demo_on_a_given_backend():
    fb = FakeBackend(capacity="40GiB", backed=False, strict=False)
    lines: list[str] = []
    run_demo(fb, out=lines.append, model="qwen3-8b", max_batch=4, steps=3)
    assert fb.live == 0
    assert fb.stats()["steady_state_allocations_total"] == {}


# --------------------------------------------------------------- V8 property

dense = st.fixed_dictionaries(
    {
        "model_type": st.just("llama"),
        "hidden_size": st.sampled_from([256, 512, 1024, 2048]),
        "intermediate_size": st.sampled_from([512, 1024, 4096, 8192]),
        "num_hidden_layers": st.integers(1, 32),
        "num_attention_heads": st.just(16),
        "num_key_value_heads": st.sampled_from([1, 2, 4, 8, 16]),
        "vocab_size": st.sampled_from([1000, 32000, 128256]),
        "tie_word_embeddings": st.booleans(),
        "torch_dtype": st.sampled_from(["bfloat16", "float32"]),
    }
)


@st.composite
def sliding(draw):
    """Alternating sliding-window and full layers: an SWA pool besides KV."""
    layers = draw(st.integers(2, 24))
    config = draw(dense)
    config.update(
        num_hidden_layers=layers,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        sliding_window=draw(st.sampled_from([64, 512, 4096])),
    )
    return config


@st.composite
def hybrid(draw):
    """Linear-attention layers (a state pool) every so often, Qwen3-Next style."""
    config = dict(HYBRID)
    config["num_hidden_layers"] = draw(st.sampled_from([4, 8, 16, 24]))
    config["hidden_size"] = draw(st.sampled_from([256, 512, 1024]))
    return config


configs = st.one_of(dense, sliding(), hybrid())


@settings(
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(
    config=configs,
    max_batch=st.integers(1, 16),
    max_seq_len=st.integers(16, 8192),
    block_size=st.sampled_from([16, 32]),
    kv_dtype=st.sampled_from(["auto", "fp8"]),
    policy=st.sampled_from(["full", "fit"]),
    budget_mib=st.integers(256, 96 * 1024),
    granularity=st.sampled_from([4096, 2 << 20]),
)
def test_v8_a_successful_plan_opened_and_driven_to_its_limits_exceeds_nothing(
    config, max_batch, max_seq_len, block_size, kv_dtype, policy, budget_mib, granularity
):
    try:
        plan = plan_memory(
            PlanInput(
                ModelShape.from_hf_config(config),
                Limits(
                    max_batch,
                    max_seq_len,
                    kv_dtype=kv_dtype,
                    block_size=block_size,
                    kv_policy=policy,
                ),
                Features(),
                budget=budget_mib * MIB,
            )
        )
    except PlanFailure:
        event("plan does not fit")
        return
    event("plan fits")
    fb = FakeBackend(capacity=plan.budget, backed=False, granularity=granularity)
    tier_budget = plan.budget - plan.context - plan.library_reserve
    with MemorySystem(fb, plan) as system:
        # Drive every tier to what the plan gave it.
        weights, engine, scratch = system.weights_arena, system.engine_arena, system.scratch
        pools = [p for p in (system.kv_pool, system.swa_pool) if p is not None]
        pools += system.state_pools
        weights.take(weights.capacity)
        if engine is not None:
            engine.take(engine.capacity)
        system.begin_serving()
        refs = [pool.allocate_many(pool.stats()["max_blocks"]) for pool in pools]
        if scratch is not None:
            with scratch.mark() as forward:
                forward.take(scratch.capacity)
            del forward
        assert fb.stats()["peak"] <= tier_budget <= plan.budget
        system.check()
        for r in refs:
            r.release()
        del weights, engine, scratch, pools, refs
    assert fb.live == 0
    # Replay the journal: no tag ever exceeds its tier's planned bytes
    # (to the granularity a growable region commits in), nor the total the
    # budget.
    planned = {
        "workspace": plan.engine_persistent,
        "weights": plan.model_resident,
        "scratch": plan.scratch,
        "kv_cache": plan.kv_bytes,
        "swa_cache": plan.swa["bytes"] if plan.swa else 0,
        "state": sum(pool["bytes"] for pool in plan.pools),
    }
    event(f"pools: {sorted(t for t in set(acquired_tags(fb)) if t in ('swa_cache', 'state'))}")
    running: dict[str, int] = {}
    total = 0
    for _seq, phase, tag, nbytes, op in fb.journal():
        sign = 1 if op in ("acquire", "commit") else -1
        running[tag] = running.get(tag, 0) + sign * nbytes
        total += sign * nbytes
        limit = -(-planned[tag] // granularity) * granularity
        assert running[tag] <= limit, (tag, running[tag], planned[tag])
        assert total <= tier_budget
        if op == "acquire":
            assert phase != "SERVING"
    assert all(v == 0 for v in running.values()) and total == 0
