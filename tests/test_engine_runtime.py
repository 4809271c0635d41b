"""The Engine end to end on the fake backend with CPU torch (skipped without
torch): the plan from config.json, weights loaded into T1, KV views over
the pools, continuous batching with shared prefixes and cancellations, and
the greedy tokens checked against Hugging Face's teacher-forced logits on
the same weights — for a full-attention model and one with sliding-window
layers (whose prefill runs over the scratch ring)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from imp_mem import FakeBackend, InvalidArgument  # noqa: E402
from imp_mem.engine import Engine, RequestState  # noqa: E402
from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.config import swa_config  # noqa: E402

WINDOW = 7
# float32 on both sides: the same operations up to attention's summation
# order, so logits agree to ~1e-5; greedy tokens must agree wherever HF's
# top-2 margin is above a generous 1e-3.
MARGIN = 1e-3


def tiny(kind: str) -> dict:
    config = swa_config(window=WINDOW, pattern=2)
    config.update(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        torch_dtype="float32",
        rope_theta=1000.0,
    )
    if kind == "swa":
        config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    else:
        config.update(use_sliding_window=False, sliding_window=None, layer_types=None)
    return config


@pytest.fixture(scope="module", params=["full", "swa"])
def checkpoint(request, tmp_path_factory):
    kind = request.param
    directory = write_random_checkpoint(
        tmp_path_factory.mktemp(f"engine-{kind}"), tiny(kind), seed=5, scale=0.1
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return kind, directory, hf


def open_engine(directory, **kw):
    kw.setdefault("max_batch", 4)
    kw.setdefault("max_seq_len", 64)
    return Engine(
        directory,
        backend=FakeBackend(capacity="2GiB"),
        block_size=4,
        prefill_chunk=8,
        **kw,
    )


def check_greedy(hf, prompt, output):
    tokens = prompt + output
    with torch.no_grad():
        logits = hf(torch.tensor([tokens[:-1]])).logits[0].float()
    for k, tok in enumerate(output):
        row = logits[len(prompt) - 1 + k]
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() > MARGIN:
            assert tok == row.argmax().item(), f"token {k} of {output} differs from HF's"


def prompts(n, seed, vocab=257):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(13)]
    out = []
    for i in range(n):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        out.append(shared + own if i % 2 else own)
    return out


def test_generate_matches_hf_and_serves_from_imp_mem(checkpoint):
    kind, directory, hf = checkpoint
    engine = open_engine(directory)
    assert str(engine.system.phase) == "SERVING"
    assert engine.sliding == (kind == "swa")
    # The weights view T1, the KV views the pools' reservations.
    arena = engine.system.weights_arena
    base = engine.weights["model.embed_tokens.weight"].data_ptr()
    assert arena.used >= sum(t.numel() * t.element_size() for t in engine.weights.values())
    assert engine.kv_views.full.data_ptr() == engine.system.kv_pool.span().address
    assert base != 0
    ps = prompts(9, seed=1)
    outs = engine.generate(ps, 6)
    for p, o in zip(ps, outs, strict=True):
        assert len(o) == 6
        check_greedy(hf, p, o)
    # Same prompts again: prefix hits (full attention only) change nothing.
    again = engine.generate(ps, 6)
    assert again == outs
    if kind == "full":
        assert engine.scheduler.stats.prefix_hit_tokens > 0
    else:
        assert engine.scheduler.stats.prefix_hit_tokens == 0
    stats = engine.backend.stats()
    assert sum(stats["steady_state_allocations_total"].values()) == 0
    assert engine.stats.decode_steps > 0 and engine.stats.imp_mem_seconds > 0
    assert 0 < engine.stats.imp_mem_share < 1
    kv = engine.kv.stats()
    # What stays is the engine's own: the padding (and ring) sequences.
    assert kv["sequences"] == len(engine.engine_seqs)
    assert sorted(engine.kv.sequences()) == sorted(engine.engine_seqs)
    report = engine.mem_report()
    assert report["phase"] == "SERVING"
    del arena
    engine.close()


def test_cancellations_at_random_points_drain_to_baseline(checkpoint):
    _, directory, hf = checkpoint
    engine = open_engine(directory)
    kv = engine.kv
    pool = engine.system.kv_pool
    held = pool.live  # the engine's own sequences' blocks
    swa_held = engine.system.swa_pool.live if engine.sliding else 0
    rng = random.Random(7)
    reqs = [engine.submit(p, rng.randrange(1, 9)) for p in prompts(12, seed=2)]
    cancelled = set()
    while engine.scheduler.has_work:
        engine.step()
        for r in reqs:
            if not r.done and rng.random() < 0.08:
                engine.cancel(r.seq_id)
                cancelled.add(r.seq_id)
    for r in reqs:
        assert r.done
        if r.state is RequestState.FINISHED:
            assert len(r.output) == r.max_new_tokens
            check_greedy(hf, r.prompt, r.output)
    assert cancelled, "the seed cancels some"
    s = kv.stats()
    assert sorted(kv.sequences()) == sorted(engine.engine_seqs)
    kv.evict(s["capacity"])
    assert pool.live == held, "live blocks back to the baseline"
    if engine.sliding:
        assert engine.system.swa_pool.live == swa_held
    kv.check_invariants()
    del kv, pool
    engine.close()


class _CountingReads:
    """A staging whose host reads (`np`) are counted: each waits for the device."""

    def __init__(self, staged):
        self.staged, self.t, self.reads = staged, staged.t, 0

    @property
    def np(self):
        self.reads += 1
        return self.staged.np


def test_a_steps_prefills_are_read_back_in_one_host_read(checkpoint):
    """The greedy tokens of a step's prefills (chunked, and after a prefix
    hit with full attention; over the ring with sliding layers) come back in
    one host read, the decode's in another; the step's pairs in admission
    order, the tokens HF's."""
    kind, directory, hf = checkpoint
    engine = open_engine(directory)
    runner = engine.runner
    counted = _CountingReads(runner.staging["next"])
    runner.staging["next"] = counted
    ps = [p + p[:5] for p in prompts(4, seed=3)]
    assert max(map(len, ps)) > 2 * 8, "some take several chunks"
    for _ in range(2):
        reqs = [engine.submit(p, 4) for p in ps]
        before = counted.reads
        out = engine.step()
        assert counted.reads - before == 2, "one read for the 4 prefills, one for the decode"
        assert [sid for sid, _ in out[:4]] == [r.seq_id for r in reqs]
        assert [tok for _, tok in out[:4]] == [r.output[0] for r in reqs]
        assert len(out) == 8
        while engine.scheduler.has_work:
            engine.step()
        for p, r in zip(ps, reqs, strict=True):
            assert r.state is RequestState.FINISHED
            check_greedy(hf, p, r.output)
    if kind == "full":
        assert engine.scheduler.stats.prefix_hit_tokens > 0
    with pytest.raises(InvalidArgument, match="row"):
        runner.prefill(None, engine.max_batch)
    engine.close()


class _InFlightEvent:
    """Stands in for a slot's CUDA event: `record` keeps the bytes the copy
    would read while in flight; `synchronize` (the copy done) checks the host
    has not rewritten them meanwhile."""

    def __init__(self, raw, index, log):
        self.raw, self.index, self.log, self.in_flight = raw, index, log, None

    def record(self):
        assert self.in_flight is None, f"slot {self.index} copied again, its last copy not waited"
        self.in_flight = self.raw.clone()
        self.log.append(self.index)

    def synchronize(self):
        if self.in_flight is not None:
            assert torch.equal(self.raw, self.in_flight), f"slot {self.index} rewritten in flight"
            self.in_flight = None


@pytest.mark.parametrize("batch_tokens", [0, 24])
def test_prefill_staging_slots_rotate_and_wait_before_a_rewrite(checkpoint, batch_tokens):
    """Each prefill forward (a chunk of one request, or a batch of several
    requests' chunks) stages its inputs in the next slot, copied once."""
    from imp_mem.engine.model_runner import PREFILL_SLOTS

    _, directory, hf = checkpoint
    engine = open_engine(directory, prefill_batch_tokens=batch_tokens)
    slots = engine.runner.prefill_slots
    assert len(slots.slots) == PREFILL_SLOTS >= 2
    log: list[int] = []
    slots.events = [_InFlightEvent(s.raw, i, log) for i, s in enumerate(slots.slots)]
    first = slots.turn
    model = engine.runner.model
    forwards = {"prefill": 0, "prefill_batch": 0}
    for name in forwards:
        inner = getattr(model, name)

        def counted(*a, _inner=inner, _name=name, **kw):
            forwards[_name] += 1
            return _inner(*a, **kw)

        setattr(model, name, counted)
    rng = random.Random(11)
    ps = [[rng.randrange(257) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    outs = engine.generate(ps, 3)
    for p, o in zip(ps, outs, strict=True):
        check_greedy(hf, p, o)
    chunks = sum(-(-len(p) // 8) for p in ps)
    if batch_tokens:
        assert forwards["prefill"] == 0
        # Up to 3 chunks of 8 a forward, one chunk of a request each.
        assert chunks / 3 <= forwards["prefill_batch"] < chunks
    else:
        assert forwards == {"prefill": chunks, "prefill_batch": 0}
    assert log == [(first + k) % PREFILL_SLOTS for k in range(sum(forwards.values()))]
    engine.close()


def test_bad_arguments():
    with pytest.raises(Exception):  # noqa: B017 (no config.json there)
        Engine("/nonexistent-model-dir")


def test_refuses_a_seq_len_beyond_the_model(checkpoint):
    _, directory, _ = checkpoint
    with pytest.raises(InvalidArgument, match="max_position_embeddings"):
        open_engine(directory, max_seq_len=4096)


def test_the_gpu_demo_runs_on_the_cpu_with_a_tiny_model():
    from imp_mem.engine.demo import run_engine_demo

    lines = []
    rc = run_engine_demo(
        FakeBackend(capacity="2GiB"),
        lines.append,
        seconds=1.0,
        max_batch=4,
        max_seq_len=64,
        prompt_len=(2, 20),
        max_new_tokens=(1, 20),
        config=tiny("swa"),
    )
    assert rc == 0
    text = "\n".join(lines)
    assert "acquisitions while serving: 0" in text
    assert "decode tokens" in text and "SERVING" in text


def test_the_torch_pool_hook_wraps_every_forward_pass(checkpoint):
    import contextlib

    _, directory, _ = checkpoint
    seen = {"systems": [], "entered": 0}

    @contextlib.contextmanager
    def activations():
        seen["entered"] += 1
        yield

    def hook(system):
        seen["systems"].append(system)
        return activations

    engine = open_engine(directory, torch_pool=hook)
    assert seen["systems"] == [engine.system]
    warm = seen["entered"]
    assert warm >= 2, "warm-up runs inside it"
    engine.generate(prompts(3, seed=9), 3)
    assert seen["entered"] > warm
    engine.close()


def test_a_callers_features_keep_their_fields_and_gain_the_engines_blocks(checkpoint):
    from imp_mem import Features

    _, directory, _ = checkpoint
    mine = Features(engine_persistent_bytes=8 << 20, scratch_bytes=3 << 20, engine_kv_blocks=2)
    with open_engine(directory, features=mine) as engine:
        got = engine.plan_input.features
        assert (got.engine_persistent_bytes, got.scratch_bytes) == (8 << 20, 3 << 20)
        assert got.engine_kv_blocks == 2 + engine.runner.engine_blocks[0]
        assert got.engine_swa_blocks == engine.runner.engine_blocks[1]
        assert len(engine.generate(prompts(2, seed=9), 3)[0]) == 3
