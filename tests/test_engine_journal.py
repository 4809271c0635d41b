"""V8 in CI: the checked-in journals of an engine load (recorded on the GPU,
and on the fake backend by the same code) replay against their plans — no
tier's tag ever holds more than the plan gave it, nothing is acquired while
serving. No torch needed to replay; recording the fake one needs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import TINY

from imp_mem import FakeBackend, Features, Limits, ModelShape, PlanInput, plan_memory
from imp_mem.engine import journal

DATA = Path(__file__).resolve().parent / "data"
JOURNALS = sorted(DATA.glob("engine_load_journal_*.json"))


def test_there_is_a_journal_to_replay():
    assert JOURNALS, "tests/data holds no engine_load_journal_*.json"


@pytest.mark.parametrize("path", JOURNALS, ids=[p.stem for p in JOURNALS])
def test_a_recorded_load_replays_within_its_plan(path):
    rows, plan, granularity, about = journal.load(path)
    assert about
    result = journal.replay(rows, plan, granularity)
    assert result.ok, "\n".join(result.violations[:10])
    # A real load: every tier was acquired, the weights and the KV pool
    # with what the plan gave them (to the granule).
    for tag in ("weights", "kv_cache", "workspace"):
        assert result.peaks.get(tag, 0) > 0, tag
    assert result.peaks["weights"] <= result.limits["weights"]


def test_the_replay_catches_a_tier_past_its_plan_and_serving_acquisitions():
    shape = ModelShape.from_hf_config(TINY)
    plan = plan_memory(
        PlanInput(
            shape, Limits(2, 256), Features(), budget="1GiB", context="8MiB", library_reserve="4MiB"
        )
    )
    w = journal.plan_limits(plan, 4096)["weights"]
    good = [(0, "LOADING", "weights", w, "acquire"), (1, "LOADING", "weights", w, "release")]
    assert journal.replay(good, plan, 4096).ok
    over = [(0, "LOADING", "weights", w + 4096, "acquire")]
    (msg,) = journal.replay(over, plan, 4096).violations
    assert "weights holds" in msg
    serving = [(0, "SERVING", "kv_cache", 4096, "commit")]
    assert "while SERVING" in journal.replay(serving, plan, 4096).violations[0]
    stranger = [(0, "LOADING", "other", 1, "acquire")]
    assert not journal.replay(stranger, plan, 4096).ok


def test_record_the_fake_journal(tmp_path):
    """Records the load of a random-weight Qwen3-0.6B on the fake backend
    (CPU torch) with the code the GPU test uses, replays it, and with
    IMP_MEM_RECORD_JOURNAL=1 writes it to tests/data."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import qwen3_0_6b_config

    if not os.environ.get("IMP_MEM_RECORD_JOURNAL"):
        pytest.skip("set IMP_MEM_RECORD_JOURNAL=1 to record (a 1.2 GB checkpoint on the CPU)")
    directory = write_random_checkpoint(tmp_path / "ckpt", qwen3_0_6b_config())
    backend = FakeBackend(capacity="4GiB")
    rows, plan, granularity = journal.record_engine_load(
        backend, directory, max_batch=4, max_seq_len=256, prefill_chunk=64
    )
    result = journal.replay(rows, plan, granularity)
    assert result.ok, result.violations
    journal.save(
        DATA / "engine_load_journal_fake_qwen3_0_6b.json",
        rows,
        plan,
        granularity,
        "FakeBackend (CPU torch), random-weight Qwen3-0.6B, Engine(max_batch=4, "
        "max_seq_len=256, prefill_chunk=64): load, warm-up, two requests served. A stand-in "
        "until the GPU journal (tests/gpu/test_engine_gpu.py) is recorded.",
    )
