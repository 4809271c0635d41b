"""A cold boot that measures its warm-up in its own process (issue 25,
``Engine(warmup_probe="inline")``): planned with the line at 0, the KV pool
opened growable, the warm-up measured, the plan made again with the figure
and the pool capped at and grown to the re-planned blocks before serving.
It must end as a warm boot (the figure read back) begins: the same blocks,
the same plan, the same budget; no child process; the figure remembered.

On the fake backend the meter reads no device: a stand-in meter
(`warmup.cpu_meter`, monkeypatched) injects the figure."""

from __future__ import annotations

import json

import pytest

import imp_mem
from imp_mem.errors import InvalidArgument

torch = pytest.importorskip("torch")

from imp_mem.engine import Engine, warmup  # noqa: E402

MIB = 1 << 20
KW = dict(max_batch=2, max_seq_len=64, budget="256MiB")
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


def _tiny_checkpoint(tmp_path):
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import qwen3_0_6b_config

    config = qwen3_0_6b_config()
    config.update(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    return write_random_checkpoint(tmp_path / "ckpt", config, seed=0, scale=0.1)


@pytest.fixture
def no_child(tmp_path, monkeypatch):
    """A warm-up cache of the test's own, and no probe child (one would fail)."""
    monkeypatch.setenv("IMP_MEM_WARMUP_CACHE", str(tmp_path / "warmup.json"))

    def refuse(*args, **kw):
        raise AssertionError("an inline boot started a probe child")

    monkeypatch.setattr(warmup, "probe", refuse)
    return monkeypatch


def _steady(engine) -> int:
    return sum(engine.backend.stats()["steady_state_allocations_total"].values())


def test_an_inline_cold_boot_ends_as_the_warm_boot_begins(tmp_path, no_child):
    directory = _tiny_checkpoint(tmp_path)
    # The reference: no figure planned (the provisional plan's KV pool).
    with Engine(directory, warmup_probe=False, **KW) as ref:
        provisional = ref.plan
        expected = ref.generate(PROMPTS, max_new_tokens=6)
    assert provisional.warmup == 0
    # A figure of 3 MiB, split as a meter would.
    figure = {"torch": 2 * MIB, "modules": MIB}
    no_child.setattr(warmup, "cpu_meter", lambda: warmup.FixedMeter(figure))

    with Engine(directory, warmup_probe="inline", **KW) as cold:
        assert cold.warmup_measured == figure and cold.warmup_planned == figure
        # The re-plan has the line at the figure, taken from the headroom:
        # the engine plans its KV for its limits ("full"), so the blocks are
        # the provisional plan's, and the pool holds them all, committed,
        # before serving (opened with the warm-up's blocks only).
        assert cold.plan.warmup == 3 * MIB
        assert cold.plan.headroom == provisional.headroom - 3 * MIB
        assert cold.plan.total() == provisional.total() + 3 * MIB
        blocks = int(cold.plan.kv["blocks"])
        assert blocks == int(provisional.kv["blocks"])
        pool = cold.system.kv_pool.stats()
        assert pool["min_blocks"] < blocks and pool["growths"] >= 1
        assert (pool["capacity"], pool["max_blocks"]) == (blocks, blocks)
        st = cold.kv.stats()
        assert (st["capacity"], st["max_blocks"]) == (blocks, blocks)
        assert warmup.lookup(cold._warmup_fp) == figure, "remembered for the next boot"
        boot = cold.boot_seconds
        assert "kv_grow" in boot and "probe" not in boot
        inside = sum(v for k, v in boot.items() if k not in ("process", "pin"))
        assert inside == pytest.approx(cold.open_seconds, abs=1e-6)
        cold_budget, cold_total = cold.backend.budget, cold.plan.total()
        cold_committed = cold.backend.stats()["committed"]
        assert cold.generate(PROMPTS, max_new_tokens=6) == expected
        assert _steady(cold) == 0, "nothing acquired while serving after the growth"
        assert cold.system.kv_pool.stats()["capacity"] == blocks

    with Engine(directory, warmup_probe="inline", **KW) as warm:
        assert warm.warmup_planned == figure and warm.warmup_measured is None
        assert "kv_grow" not in warm.boot_seconds and "probe" not in warm.boot_seconds
        assert int(warm.plan.kv["blocks"]) == blocks
        assert warm.kv.stats()["capacity"] == blocks
        assert warm.plan.total() == cold_total
        assert warm.backend.budget == cold_budget
        assert warm.backend.stats()["committed"] == cold_committed
        assert warm.generate(PROMPTS, max_new_tokens=6) == expected
        assert _steady(warm) == 0


def test_an_inline_engine_swaps_to_a_pool_held_whole(tmp_path, no_child):
    """After a model swap that re-lays the (growable) KV pool, the pool is
    grown to the new plan's blocks before serving: nothing is acquired
    while serving, as at the boot."""
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import qwen3_0_6b_config

    directory = _tiny_checkpoint(tmp_path)
    config = qwen3_0_6b_config()
    config.update(
        vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    other = write_random_checkpoint(tmp_path / "other", config, seed=1, scale=0.1)
    with Engine(other, warmup_probe=False, **KW) as ref:
        want = ref.generate(PROMPTS, max_new_tokens=4)
    with Engine(directory, warmup_probe="inline", **KW) as e:
        report = e.swap_model(other)
        assert "kv_pool" in report["relaid"], report
        blocks = int(e.plan.kv["blocks"])
        assert e.system.kv_pool.stats()["capacity"] == blocks
        assert e.generate(PROMPTS, max_new_tokens=4) == want
        assert _steady(e) == 0


def test_a_figure_the_budget_cannot_hold_fails_the_boot_and_is_remembered(tmp_path, no_child):
    """The re-plan is the planner's: a figure past the budget refuses the
    boot (everything opened is closed), and the next boot plans it too."""
    directory = _tiny_checkpoint(tmp_path)
    figure = {"torch": 0, "modules": 300 * MIB}
    no_child.setattr(warmup, "cpu_meter", lambda: warmup.FixedMeter(figure))
    with pytest.raises(imp_mem.ImpMemError, match="warm-up"):
        Engine(directory, warmup_probe="inline", **KW)
    entries = json.loads((tmp_path / "warmup.json").read_text())
    assert [e["modules"] for e in entries.values()] == [300 * MIB]
    # The next boot plans it (and fails at its plan, before opening).
    with pytest.raises(imp_mem.ImpMemError, match="warm-up"):
        Engine(directory, warmup_probe="inline", **KW)


def test_the_cpu_meter_measures_nothing_and_the_pool_grows_to_the_whole_plan(tmp_path, no_child):
    directory = _tiny_checkpoint(tmp_path)
    with Engine(directory, warmup_probe="inline", **KW) as cold:
        assert cold.warmup_measured == {"torch": 0, "modules": 0}
        blocks = int(cold.plan.kv["blocks"])
        st = cold.system.kv_pool.stats()
        # Opened with the warm-up's blocks, grown to the plan's before serving.
        assert st["min_blocks"] < blocks and st["growths"] >= 1
        assert (st["capacity"], st["max_blocks"]) == (blocks, blocks)
        assert warmup.lookup(cold._warmup_fp) == {"torch": 0, "modules": 0}
    with Engine(directory, warmup_probe=False, **KW) as ref:
        assert int(ref.plan.kv["blocks"]) == blocks


def test_a_growable_inline_pool_is_capped_not_grown(tmp_path, no_child):
    """With ``kv_growable=True`` the pool keeps growing on demand, but no
    further than the re-planned blocks."""
    directory = _tiny_checkpoint(tmp_path)
    figure = {"torch": 0, "modules": 2 * MIB}
    no_child.setattr(warmup, "cpu_meter", lambda: warmup.FixedMeter(figure))
    with Engine(directory, warmup_probe="inline", kv_growable=True, **KW) as e:
        blocks = int(e.plan.kv["blocks"])
        st = e.system.kv_pool.stats()
        assert st["max_blocks"] == blocks and st["capacity"] < blocks
        assert e.generate(PROMPTS, max_new_tokens=3)


def test_a_pool_capped_below_its_reservation_refuses_growth_past_the_cap():
    """`BlockPool.limit_blocks`, what an inline boot calls where the re-plan
    has fewer KV blocks than the provisional plan: the manager then counts
    no room past the cap, so an admission that would need more waits
    (None), as on a fixed pool; the base address stays."""
    from _helpers import make_plan

    from imp_mem.engine.config import qwen3_0_6b_config

    plan = make_plan(qwen3_0_6b_config(), budget=2 << 30, max_batch=4, max_seq_len=256)
    fb = imp_mem.FakeBackend(capacity="4GiB")
    with imp_mem.MemorySystem(fb, plan, kv_growable=True, kv_initial_blocks=4) as system:
        pool = system.kv_pool
        base = pool.span().address
        st = pool.stats()
        assert st["max_blocks"] == plan.kv["blocks"] > 20 and st["capacity"] < 20
        with pytest.raises(InvalidArgument, match="max_blocks"):
            pool.limit_blocks(st["capacity"] - 1)
        with pytest.raises(InvalidArgument, match="max_blocks"):
            pool.limit_blocks(st["max_blocks"] + 1)
        pool.limit_blocks(20)
        kv = system.kv_manager()
        assert kv.stats()["max_blocks"] == 20
        bs = kv.block_size
        for i in range(5):  # 4 blocks each: 20 in all
            assert kv.try_admit(i, list(range(i * 1000, i * 1000 + 4 * bs - 1))) is not None
        assert kv.try_admit(9, [1, 2, 3]) is None
        assert kv.stats()["capacity"] == 20 and pool.span().address == base
        for i in range(5):
            kv.abort(i)
        del kv, pool  # the tier objects, before the system closes


@pytest.mark.parametrize("bad", ["child", "INLINE", ""])
def test_other_strings_are_refused_naming_the_argument(tmp_path, bad):
    with pytest.raises(InvalidArgument, match="warmup_probe"):
        Engine(tmp_path, warmup_probe=bad)


@pytest.mark.parametrize("bad", [1, 0.5, ["inline"]])
def test_other_types_are_a_type_error(tmp_path, bad):
    with pytest.raises(TypeError, match=r"warmup_probe.*'inline'"):
        Engine(tmp_path, warmup_probe=bad)


@pytest.mark.parametrize("kw", [{"group": object()}, {"shared": True}])
def test_inline_serves_tp1_outside_a_shared_gpu(tmp_path, kw):
    with pytest.raises(InvalidArgument, match="warmup_probe='inline'"):
        Engine(tmp_path, warmup_probe="inline", **kw)


def test_a_backend_without_growable_regions_is_refused(tmp_path, no_child):
    """The refusal comes while planning, before anything is opened."""
    directory = _tiny_checkpoint(tmp_path)

    class Fixed:
        """A fake backend that says it cannot grow a region."""

        def __init__(self) -> None:
            self._b = imp_mem.FakeBackend(capacity="256MiB")

        growable = False

        def __getattr__(self, name):
            return getattr(self._b, name)

    with pytest.raises(InvalidArgument, match=r"warmup_probe='inline'.*growable"):
        Engine(directory, warmup_probe="inline", backend=Fixed(), **KW)
