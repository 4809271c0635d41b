"""`Engine.swap_model` on the fake backend with CPU torch (issue 19; skipped
without torch): the swapped engine serves the new checkpoint exactly as a
fresh engine on it does, T2 keeps its addresses, the KV pool is re-laid for
the new geometry; a swap that cannot happen (requests running, T2 laid out
differently, a plan over the budget) leaves the old model serving the same
tokens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_engine_runtime import prompts, tiny  # noqa: E402

from imp_mem import FakeBackend, InvalidArgument, PlanFailure  # noqa: E402
from imp_mem.engine import Engine  # noqa: E402
from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402


def model_b() -> dict:
    """Another shape on the same vocabulary: fewer, wider layers and other
    KV heads, so the KV pool's blocks change size."""
    config = tiny("full")
    config.update(
        num_hidden_layers=2,
        hidden_size=96,
        intermediate_size=160,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("swap")
    a = write_random_checkpoint(root / "a", tiny("full"), seed=5, scale=0.1)
    b = write_random_checkpoint(root / "b", model_b(), seed=6, scale=0.1)
    other_vocab = tiny("full")
    other_vocab["vocab_size"] = 300
    c = write_random_checkpoint(root / "c", other_vocab, seed=7, scale=0.1)
    # Megabytes more weights: past a budget the first model just fits.
    big = tiny("full")
    big["intermediate_size"] = 4096
    d = write_random_checkpoint(root / "d", big, seed=8, scale=0.1)
    return a, b, c, d


def engine_on(directory, *, capacity: str = "2GiB", **kw) -> Engine:
    return Engine(
        directory,
        backend=FakeBackend(capacity=capacity),
        max_batch=4,
        max_seq_len=64,
        block_size=4,
        prefill_chunk=8,
        **kw,
    )


def t2_addresses(engine: Engine) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in engine.runner.t2_raw.items()}


def test_a_swapped_engine_serves_the_new_checkpoint_as_a_fresh_one_does(checkpoints):
    a, b, *_ = checkpoints
    ps = prompts(6, seed=3)
    with engine_on(b) as fresh:
        want_b = fresh.generate(ps, 5)
    with engine_on(a) as engine:
        want_a = engine.generate(ps, 5)
        t2 = t2_addresses(engine)
        block_bytes = engine.system.kv_pool.block_bytes
        report = engine.swap_model(b)
        assert "kv_pool" in report["relaid"], report
        assert engine.system.kv_pool.block_bytes != block_bytes
        assert str(engine.system.phase) == "SERVING"
        assert t2_addresses(engine) == t2, "T2 is kept in place"
        assert engine.config.num_layers == 2
        assert engine.generate(ps, 5) == want_b
        # And back: the first model's tokens again.
        engine.swap_model(a)
        assert engine.generate(ps, 5) == want_a
        assert t2_addresses(engine) == t2
        kv = engine.kv.stats()
        assert kv["sequences"] == len(engine.engine_seqs)
        engine.system.check()


def test_a_swap_is_refused_while_requests_run_and_the_model_serves_on(checkpoints):
    a, b, *_ = checkpoints
    ps = prompts(3, seed=4)
    with engine_on(a) as engine:
        want = engine.generate(ps, 4)
        requests = [engine.submit(p, 4) for p in ps]
        engine.step()
        with pytest.raises(InvalidArgument, match="requests are waiting or running"):
            engine.swap_model(b)
        engine.run()
        assert [r.output for r in requests] == want


def test_a_swap_to_another_vocabulary_is_refused_changing_nothing(checkpoints):
    a, _, c, _ = checkpoints
    ps = prompts(3, seed=5)
    with engine_on(a) as engine:
        want = engine.generate(ps, 4)
        with pytest.raises(InvalidArgument, match="T2"):
            engine.swap_model(c)
        assert engine.model_dir == a
        assert engine.generate(ps, 4) == want


def test_a_swap_whose_plan_does_not_fit_leaves_the_old_model_serving(checkpoints):
    a, _, _, big = checkpoints
    ps = prompts(3, seed=6)
    # A budget the first model's plan fits and the second's does not.
    with engine_on(a) as probe:
        fits = probe.plan.total()
    with engine_on(a, budget=fits) as engine:
        want = engine.generate(ps, 4)
        with pytest.raises(PlanFailure):
            engine.swap_model(big)
        assert engine.model_dir == a
        assert str(engine.system.phase) == "SERVING"
        assert engine.generate(ps, 4) == want
        engine.system.check()


def test_a_directory_without_a_config_is_refused_naming_model_dir(checkpoints, tmp_path):
    a, *_ = checkpoints
    with pytest.raises(InvalidArgument, match="model_dir: cannot read"):
        engine_on(tmp_path / "nowhere")
    ps = prompts(2, seed=7)
    with engine_on(a) as engine:
        want = engine.generate(ps, 3)
        with pytest.raises(InvalidArgument, match="model_dir: cannot read"):
            engine.swap_model(tmp_path)
        assert engine.generate(ps, 3) == want
