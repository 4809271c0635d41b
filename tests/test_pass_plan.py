"""Planned passes through the binding and ``imp_mem.torch.serve`` on the
fake backend (issue 28): a pass recorded after ``reset_high_water()``, laid
out at ``begin_serving()``, the tier frozen at the layout's top and the
served passes placed by its hints; the second start plans its remembered
size the same way. The layout and the hints' safety are proved in Rust
(``crates/imp-mem-core/tests/pass_plan_props.rs``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import InvalidArgument

MIB = 1 << 20
GRANULE = 2 * MIB

torch_mod = pytest.importorskip("imp_mem.torch")


def static_cache_pass(layers: int = 12, steps: int = 6) -> list[tuple]:
    """Each layer's long-lived cache block made between two larger
    temporaries, then decode steps with logits larger than any of them."""
    ops, n, caches = [], 0, []
    for _ in range(layers):
        ops += [("a", n, 64 * MIB), ("a", n + 1, 68 * MIB), ("a", n + 2, 128 * MIB)]
        ops += [("f", n), ("f", n + 2)]
        caches.append(n + 1)
        n += 3
    ops += [("a", n, 192 * MIB), ("f", n)]
    for k in range(steps):
        ops += [("a", n + 1 + k, 136 * MIB), ("f", n + 1 + k)]
    return ops + [("f", c) for c in caches]


def run(act, ops) -> None:
    held = {}
    for op in ops:
        if op[0] == "a":
            held[op[1]] = act.allocate(op[2])
        else:
            act.free(held.pop(op[1]))
    for addr in held.values():
        act.free(addr)


def test_serve_lays_out_the_recorded_pass_and_serves_on_its_hints(tmp_path):
    path = tmp_path / "measured.json"
    work = static_cache_pass()
    n = sum(op[0] == "a" for op in work)

    def start(**kw):
        fb = imp_mem.FakeBackend(capacity="16GiB", granularity=GRANULE, backed=False, strict=False)
        served = torch_mod.serve(
            backend=fb, fingerprint={"m": "toy"}, cache_path=path, chunk=GRANULE, **kw
        )
        act = served.activations
        weights = act.allocate(900 * MIB)
        run(act, work)  # the compile's pass
        served.reset_high_water()
        assert act.recording == served.plan_passes
        run(act, work)
        served.begin_serving()
        return served, act, weights

    plain, act0, _ = start(plan_passes=False)
    assert plain.pass_plan is None and act0.pass_hints is None
    unplanned = plain.measured()[0]["size"]
    path.unlink()

    first, act, _ = start()
    plan = first.pass_plan
    assert plan["installed"] and plan["hinted"] == plan["allocations"] == n
    assert plan["live_peak"] <= plan["top"] < plan["recorded_high_water"]
    frozen = first.measured()[0]
    assert frozen["high_water"] == plan["top"]
    assert frozen["size"] < unplanned
    for round_ in (1, 2):
        run(act, work)
        assert act.pass_hints == {"hints": n, "hits": n * round_, "misses": 0, "refused": 0}
    assert act.stats()["fallbacks_total"] == 0
    # The report names the layout and the hints taken.
    line = first.mem_report()["pass_plan"]
    assert (line["top"], line["hits"], line["installed"]) == (plan["top"], 2 * n, True)
    text = first.mem_report_text()
    assert f"planned pass (activations): {n} allocations laid out to" in text
    assert plain.mem_report()["pass_plan"] is None
    assert "planned pass" not in plain.mem_report_text()

    second, act2, _ = start()
    assert not second.measuring and second.pass_plan["installed"]
    assert act2.capacity == -(-frozen["size"] // MIB) * MIB
    before = act2.stats()["fallbacks_total"]
    run(act2, work)
    assert act2.stats()["fallbacks_total"] == before
    assert act2.pass_hints["hits"] == n


def test_plan_pass_is_refused_without_a_recording_and_serve_checks_its_flag():
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    pool = imp_mem.ActivationPool(fb, 64 * MIB, strict=True)
    with pytest.raises(InvalidArgument, match="record_pass"):
        pool.plan_pass()
    pool.record_pass()
    a = pool.allocate(MIB)
    pool.free(a)
    assert pool.plan_pass()["allocations"] == 1
    pool.drop_pass_plan()
    assert pool.pass_hints is None and not pool.recording
    with pytest.raises(TypeError, match="plan_passes"):
        torch_mod.serve(backend=fb, plan_passes="yes")


passes = st.lists(
    st.tuples(st.integers(1, 64), st.integers(0, 12), st.booleans()), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(spec=passes)
def test_a_fixed_pool_replays_any_recorded_pass_on_its_hints(spec):
    """The binding's counters: a pass run again after its plan is placed
    block for block by its hints, and the dicts add up."""
    ops, pending = [], []
    for i, (kib, after, long) in enumerate(spec):
        ops.append(("a", i, kib * 1024 + i % 3))
        if not long:
            pending.append((i + after, i))
        pending.sort()
        while pending and pending[0][0] <= i:
            ops.append(("f", pending.pop(0)[1]))
    ops += [("f", i) for _, i in pending]
    fb = imp_mem.FakeBackend(capacity=64 * MIB)
    pool = imp_mem.ActivationPool(fb, 16 * MIB, strict=True)
    pool.record_pass()
    run(pool, ops)
    plan = pool.plan_pass()
    assert plan["allocations"] == plan["hinted"] == len(spec)
    assert plan["installed"] and plan["live_peak"] <= plan["top"] <= 16 * MIB
    held, extent = {}, 0
    for op in ops:
        if op[0] == "a":
            held[op[1]] = pool.allocate(op[2])
            extent = max(extent, held[op[1]] - pool.base + -(-op[2] // 512) * 512)
        else:
            pool.free(held.pop(op[1]))
    assert pool.pass_hints["hits"] == len(spec)
    assert extent <= plan["top"], "a block of the replay lies past the layout's top"
