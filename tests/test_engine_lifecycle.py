"""The engine's RL lifecycle on the fake backend with CPU torch (issue 24;
skipped without torch): sleep by tag with a drain, the staged wake, weight
updates in place, and the refusals, each leaving the engine usable. The
state machine drives sleep, wake, drain, update and requests in any order
and checks after every step: no block lost (the pool's live blocks are the
engine's own plus its running sequences'), no prefix hit on KV computed
with older weights, and greedy tokens equal to a fresh engine's on the
weights the engine holds."""

from __future__ import annotations

from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_engine_runtime import prompts, tiny  # noqa: E402
from test_engine_swap import engine_on as swap_engine_on  # noqa: E402

from imp_mem import Features, InvalidArgument, OutOfMemory  # noqa: E402
from imp_mem.engine import Engine  # noqa: E402
from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.weights import checkpoint_tensors  # noqa: E402

PROMPTS = prompts(3, seed=11)
NEW = 4


def engine_on(directory, **kw) -> Engine:
    """`test_engine_swap`'s engine on a smaller fake (it is opened often)."""
    return swap_engine_on(directory, capacity="256MiB", **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    a = write_random_checkpoint(root / "a", tiny("full"), seed=21, scale=0.1)
    b = write_random_checkpoint(root / "b", tiny("full"), seed=22, scale=0.1)
    return a, b


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Greedy tokens of fresh engines on each checkpoint."""
    out = {}
    for directory in checkpoints:
        with engine_on(directory) as e:
            out[directory] = e.generate(PROMPTS, NEW)
    assert out[checkpoints[0]] != out[checkpoints[1]]
    return out


def test_sleep_wake_keeps_addresses_tokens_and_gives_every_kv_byte_back(checkpoints, expected):
    a, _ = checkpoints
    with engine_on(a) as e:
        assert e.memory.pinned_bytes == e.system.weights_arena.used  # pinned at load, exactly
        assert e.generate(PROMPTS, NEW) == expected[a]
        kv_base = e.kv_views.full.data_ptr()
        w_base = e.weights["model.embed_tokens.weight"].data_ptr()
        t2 = {k: t.data_ptr() for k, t in e.runner.t2_raw.items()}
        report = e.sleep(1)
        assert e.asleep == {"weights": 1, "kv_cache": 1}
        stats = e.backend.stats()
        assert stats["tags"]["kv_cache"]["committed"] == 0
        assert stats["tags"]["weights"]["committed"] == 0
        assert report["host_bytes"] == e.system.weights_arena.used
        with pytest.raises(InvalidArgument, match="sleeps"):
            e.generate(PROMPTS, NEW)
        assert e.wake() == ["weights", "kv_cache"]
        assert e.asleep == {}
        assert e.kv_views.full.data_ptr() == kv_base
        assert e.weights["model.embed_tokens.weight"].data_ptr() == w_base
        assert {k: t.data_ptr() for k, t in e.runner.t2_raw.items()} == t2
        assert e.generate(PROMPTS, NEW) == expected[a]


def test_level_two_staged_wake_and_update_serve_the_new_weights(checkpoints, expected):
    a, b = checkpoints
    with engine_on(a) as e:
        e.generate(PROMPTS, NEW)  # the prefix cache holds KV of a
        e.sleep(2)
        assert e.wake("weights") == ["weights"]
        e.wake("kv_cache")
        with pytest.raises(InvalidArgument, match="level-2 sleep dropped the weights"):
            e.generate(PROMPTS, NEW)
        assert not e.scheduler.has_work  # refused before anything was queued
        e.sleep(1, "kv_cache")
        # The staged order: weights awake, update, then the KV cache.
        new = {name: t.load() for name, t in checkpoint_tensors(b)}
        out = e.update_weights(new)
        assert out["tensors"] == len(new) and out["bytes"] > 0
        e.wake("kv_cache")
        assert e.generate(PROMPTS, NEW) == expected[b]
        assert e.weights_version == 1


def test_a_sleep_offloads_the_prefix_cache_to_the_host_tier(checkpoints, expected):
    a, b = checkpoints
    features = Features(kv_host_bytes="8MiB")
    with engine_on(a, features=features) as e:
        assert e.generate(PROMPTS, NEW) == expected[a]
        cached = e.kv.stats()["cached"]
        assert cached > 0
        e.sleep(1)
        assert e.kv.stats()["host_cached"] >= cached  # kept on the host, not dropped
        e.wake()
        assert e.generate(PROMPTS, NEW) == expected[a]
        assert e.kv.stats()["host_hit_blocks"] > 0  # served from the offloaded prefix
        e.reload_weights(b)  # KV of a is gone from both tiers
        assert e.kv.stats()["host_cached"] == 0 and e.kv.stats()["cached"] == 0
        assert e.generate(PROMPTS, NEW) == expected[b]


def test_an_update_empties_the_prefix_cache(checkpoints, expected):
    a, b = checkpoints
    with engine_on(a) as e:
        e.generate(PROMPTS, NEW)
        assert e.kv.stats()["cached"] > 0
        e.reload_weights(b)
        assert e.kv.stats()["cached"] == 0
        assert e.generate(PROMPTS, NEW) == expected[b]
        e.reload_weights()  # back to a, from its own directory
        assert e.generate(PROMPTS, NEW) == expected[a]


def test_refusals_name_what_to_change_and_change_nothing(checkpoints, expected):
    a, b = checkpoints
    with engine_on(a) as e:
        good = {name: t.load() for name, t in checkpoint_tensors(b)}
        name = "model.layers.0.mlp.up_proj.weight"
        cases = [
            ({**good, "model.nope.weight": good[name]}, InvalidArgument, "no tensor"),
            ({**good, name: good[name][:-1]}, InvalidArgument, "has shape"),
            ({**good, name: good[name].double()}, InvalidArgument, "float64"),
            ([(name, good[name]), (name, good[name])], InvalidArgument, "twice"),
            ([(name, [1.0])], TypeError, "torch.Tensor"),
            ([(3, good[name])], TypeError, "must be str"),
            ([name], TypeError, "pairs"),
        ]
        for update, kind, words in cases:
            with pytest.raises(kind, match=words):
                e.update_weights(update)
        assert e.weights_version == 0
        assert e.generate(PROMPTS, NEW) == expected[a]
        # Requests running: refused by default, served or cancelled on request.
        req = e.submit(PROMPTS[0], NEW)
        with pytest.raises(InvalidArgument, match=rf"seq {req.seq_id}"):
            e.sleep()
        with pytest.raises(InvalidArgument, match="waiting or running"):
            e.update_weights(good)
        for args, words in [
            (dict(level=3), "level=3"),
            (dict(level=True), "level=True"),
            (dict(drain="later"), "drain='later'"),
            (dict(tags="kv"), "'kv' is not one of"),
            (dict(tags=[]), "tags is empty"),
        ]:
            with pytest.raises(InvalidArgument, match=words):
                e.sleep(**args)
        assert e.asleep == {}
        e.sleep(drain="wait")
        assert e.scheduler.requests[req.seq_id].finish_reason == "length"
        with pytest.raises(InvalidArgument, match="already sleep"):
            e.sleep(tags="weights")
        with pytest.raises(InvalidArgument, match="the weights sleep"):
            e.update_weights(good)
        # Their device memory is given back: reading them is refused, not a
        # fault (on the GPU a CUDA "invalid argument" in the caller's read).
        with pytest.raises(InvalidArgument, match=r"engine.weights: .*wake\('weights'\)"):
            _ = e.weights
        e.wake("weights")
        assert e.weights[name].data_ptr() != 0  # readable again, the KV cache still asleep
        assert e.asleep == {"kv_cache": 1}
        e.wake()
        req = e.submit(PROMPTS[1], NEW)
        e.sleep(drain="abort")
        assert e.scheduler.requests[req.seq_id].finish_reason == "cancelled"
        e.wake()
        assert e.generate(PROMPTS, NEW) == expected[a]


def test_a_wake_the_device_cannot_hold_says_so_and_can_be_retried(checkpoints, expected):
    a, _ = checkpoints
    with engine_on(a) as e:
        e.sleep(1)
        # Another process takes the device while the engine sleeps.
        fb = e.backend
        fb.set_external_usage(fb.stats()["capacity"] - fb.device_used - 1024)
        with pytest.raises(OutOfMemory, match=r"wake\('weights'\).*still sleeps") as info:
            e.wake()
        assert info.value.needed > 0 and info.value.torch_cached == 0
        assert e.asleep == {"weights": 1, "kv_cache": 1}  # nothing woke
        with pytest.raises(InvalidArgument, match="sleeps"):
            e.generate(PROMPTS, NEW)
        fb.set_external_usage(0)
        e.wake()
        assert e.asleep == {}
        assert e.generate(PROMPTS, NEW) == expected[a]


class Lifecycle(RuleBasedStateMachine):
    """Sleep, wake, drain, update and requests in any order."""

    dirs: ClassVar[tuple] = ()
    tokens: ClassVar[dict] = {}

    @initialize()
    def start(self):
        self.engine = engine_on(self.dirs[0], pin_sleep_host=False)
        self.holds = self.dirs[0]  # the checkpoint whose weights T1 holds
        self.dropped = False

    def teardown(self):
        self.engine.close()

    @rule(level=st.sampled_from([1, 2]), tags=st.sampled_from([None, "weights", "kv_cache"]))
    def sleep(self, level, tags):
        e = self.engine
        names = ["weights", "kv_cache"] if tags is None else [tags]
        if any(t in e.asleep for t in names):
            with pytest.raises(InvalidArgument):
                e.sleep(level, tags, drain="abort")
            return
        e.sleep(level, tags, drain="abort")
        assert e.system.kv_pool.live == 0 or "kv_cache" not in names

    @rule(tags=st.sampled_from([None, "weights", "kv_cache"]))
    def wake(self, tags):
        before = self.engine.asleep
        woken = self.engine.wake(tags)
        if "weights" in woken and before["weights"] == 2:
            self.dropped = True

    @rule(which=st.sampled_from([0, 1]))
    def update(self, which):
        e = self.engine
        if "weights" in e.asleep or e.scheduler.has_work:
            with pytest.raises(InvalidArgument):
                e.reload_weights(self.dirs[which])
            return
        e.reload_weights(self.dirs[which])
        self.holds = self.dirs[which]
        self.dropped = False
        assert e.kv.stats()["cached"] == 0

    @rule(i=st.integers(0, len(PROMPTS) - 1))
    def submit(self, i):
        self.engine.submit(PROMPTS[i], NEW)

    @precondition(lambda self: not self.engine.asleep and not self.dropped)
    @rule()
    def serve(self):
        e = self.engine
        e.run()
        # Every prompt again: equal to a fresh engine's tokens on these
        # weights (a prefix hit on KV of older weights would change them).
        assert e.generate(PROMPTS, NEW) == self.tokens[self.holds]

    @invariant()
    def no_block_lost(self):
        e = self.engine
        if "kv_cache" in e.asleep:
            assert e.system.kv_pool.live == 0
            return
        stats = e.kv.stats()
        running = sum(1 for _ in e.scheduler.running)
        assert stats["sequences"] == len(e.engine_seqs) + running
        assert e.system.kv_pool.live == stats["live"]


def test_the_lifecycle_in_any_order(checkpoints, expected):
    Lifecycle.dirs = checkpoints
    Lifecycle.tokens = expected
    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=25,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
