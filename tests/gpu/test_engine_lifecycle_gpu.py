"""The engine's RL lifecycle on the H200 (issue 24), on a small Qwen3 shape
(`benches/bench_rl_colocate.py` runs Qwen3-8B's numbers): the default
engine on `VmmBackend` sleeps (its KV pool included) and wakes with its
captured graphs replaying at the same addresses and the same greedy tokens;
while asleep T1 and the KV pool commit nothing and the device holds at most
the context, T2, scratch and torch's graph pools beyond what it held before
the engine; with torch routed into the activations tier that tier sleeps
too; a staged wake around an update from the GPU serves the new weights
exactly as an engine that loaded them from disk."""

from __future__ import annotations

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("safetensors")

from _device_plan import SMALL_QWEN3, small_prompts  # noqa: E402

from imp_mem.engine.checkpoint import random_weights, write_random_checkpoint  # noqa: E402
from imp_mem.engine.llm_engine import Engine  # noqa: E402
from imp_mem.engine.memory import measure_torch_high_water  # noqa: E402

MIB = 1 << 20
CONFIG = SMALL_QWEN3
ENGINE = {"max_batch": 8, "max_seq_len": 512, "budget": "8GiB"}


def prompts():
    return small_prompts(8, 40, 7, seed=3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle-gpu")
    a = write_random_checkpoint(root / "a", CONFIG, seed=0, device="cuda")
    b = write_random_checkpoint(root / "b", CONFIG, seed=1, device="cuda")
    return a, b


def test_the_default_engine_sleeps_and_wakes_with_its_graphs(checkpoints):
    a, _ = checkpoints
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    with Engine(a, **ENGINE) as e:
        assert e.use_graphs and e.graphs
        first = e.generate(prompts(), 24)
        graphs = {b: id(g) for b, g in e.graphs.items()}
        tags = e.backend.stats()["tags"]
        assert tags["kv_cache"]["committed"] > 0
        e.sleep(1)
        tags = e.backend.stats()["tags"]
        assert tags["kv_cache"]["committed"] == 0 and tags["weights"]["committed"] == 0
        torch.cuda.synchronize()
        held = free0 - torch.cuda.mem_get_info()[0]
        stays = sum(line["bytes"] for line in e.system.mem_report()["asleep_stays"])
        # What the device holds for the engine while it sleeps is what the
        # report says stays (context, T2, scratch, torch, handle cache).
        assert held <= stays + 64 * MIB, (held, stays)
        e.wake()
        assert {b: id(g) for b, g in e.graphs.items()} == graphs  # never re-captured
        assert e.generate(prompts(), 24) == first


def test_an_engine_routed_into_the_activations_tier_sleeps_it_too(checkpoints):
    a, _ = checkpoints
    high = measure_torch_high_water(a, requests=4, **ENGINE)
    with Engine(
        a, torch_pool="imp_mem", activation_bytes=int(high * 1.1) + 64 * MIB, **ENGINE
    ) as e:
        assert "activations" in e.sleep_tags
        first = e.generate(prompts(), 16)
        e.sleep(1)
        assert e.backend.stats()["tags"]["activations"]["committed"] == 0
        e.wake()
        assert e.generate(prompts(), 16) == first


def test_a_staged_wake_around_an_update_serves_the_new_weights(checkpoints):
    a, b = checkpoints
    with Engine(b, **ENGINE) as ref:
        want = ref.generate(prompts(), 24)
    with Engine(a, **ENGINE) as e:
        before = e.generate(prompts(), 24)
        e.sleep(2)
        new = random_weights(CONFIG, seed=1, device="cuda")
        e.wake("weights")
        assert e.backend.stats()["tags"]["kv_cache"]["committed"] == 0  # staged
        e.update_weights(new)
        e.wake("kv_cache")
        got = e.generate(prompts(), 24)
    assert got == want and got != before
    # A wrong tensor is refused before anything moves.
    with Engine(a, **ENGINE) as e:
        bad = dict(new)
        bad["model.norm.weight"] = bad["model.norm.weight"].float()
        with pytest.raises(imp_mem.InvalidArgument, match=r"model\.norm\.weight"):
            e.update_weights(bad)
        assert e.generate(prompts(), 24) == before
