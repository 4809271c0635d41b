"""The engine on a shared H200 (issue 27), idle sleep on the VMM backend: an
idle tenant sleeps (level 1) once idle for `SharedGPU.idle_sleep_s`; its
ledger record and the device both get its weights and KV pool back; its
next request wakes it inside `submit`, so that request's clock, started
before the submit, holds the wake; the woken engine serves the same greedy
tokens with its captured graphs. (`tests/test_engine_shared.py` proves the
same on fake backends; `benches/bench_shared_gpu.py` measures the bursts.)"""

from __future__ import annotations

import os
import time

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("safetensors")

from _device_plan import SMALL_QWEN3, small_prompts  # noqa: E402

from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.llm_engine import Engine  # noqa: E402
from imp_mem.engine.shared import SharedGPU  # noqa: E402

MIB = 1 << 20


def prompts():
    return small_prompts(6, 48, 5, seed=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-gpu")
    return write_random_checkpoint(root / "m", SMALL_QWEN3, seed=0, device="cuda")


def test_an_idle_shared_engine_sleeps_and_its_next_request_wakes_it(checkpoint, tmp_path):
    shared = SharedGPU(
        cap="6GiB",
        device_budget="24GiB",
        key=f"gpu-test-shared-{os.getpid()}",
        dir=str(tmp_path),
        idle_trim_s=0.0,
        idle_sleep_s=0.0,
    )
    with Engine(checkpoint, max_batch=8, max_seq_len=512, shared=shared) as e:
        assert e.use_graphs and e.graphs
        graphs = {b: id(g) for b, g in e.graphs.items()}
        first = e.generate(prompts(), 16)
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        awake = e.tenancy.tenant.record()["committed"]
        weights = e.backend.stats()["tags"]["weights"]["committed"]
        assert weights > 0

        given = e.idle()
        assert e.asleep
        rec = e.tenancy.tenant.record()
        assert rec["asleep"] == 1
        tags = e.backend.stats()["tags"]
        assert tags["weights"]["committed"] == 0 and tags["kv_cache"]["committed"] == 0
        # What the ledger took back is really free on the device, but for
        # the handles the backend keeps cached (at most `cache_chunks`).
        back = awake - rec["committed"]
        assert back >= weights and given >= weights, (back, given, weights)
        torch.cuda.synchronize()
        freed = torch.cuda.mem_get_info()[0] - free_awake
        cached = e.backend.cached_bytes
        assert cached <= e.backend.cache_chunks * e.backend.chunk_bytes
        assert freed >= back - cached - 2 * MIB, (freed, back, cached)

        # The next request wakes it inside submit: its clock holds the wake.
        t0 = time.perf_counter()
        req = e.submit(prompts()[0], 16)
        woke = time.perf_counter() - t0
        assert not e.asleep and e.tenancy.tenant.record()["asleep"] == 0
        while e.scheduler.has_work:
            e.step()
        ttft = time.perf_counter() - t0
        assert req.output == first[0]
        assert ttft >= woke
        assert e.generate(prompts(), 16) == first
        assert {b: id(g) for b, g in e.graphs.items()} == graphs  # never re-captured
        keep = os.environ.get("IMP_MEM_GPU_OUT")
        line = (
            f"idle sleep on the ledger: gave back {back / MIB:.0f} MiB "
            f"(weights {weights / MIB:.0f} MiB), device freed {freed / MIB:.0f} MiB; "
            f"wake inside submit {woke * 1e3:.1f} ms, the woken request's whole run "
            f"{ttft * 1e3:.1f} ms"
        )
        print(line)
        if keep:
            with open(os.path.join(keep, "shared_idle_sleep.txt"), "a") as f:
                f.write(line + "\n")
    assert imp_mem.DeviceLedger(shared.key, None, str(tmp_path)).tenants() == []


def test_a_shared_engine_s_floor_is_what_it_holds_at_rest(checkpoint, tmp_path):
    # The join plans a granule of slack a tier, 1 GiB at the VMM backend's
    # 64 MiB chunk; once the tiers are open the floor is lowered to what
    # the tenant holds, and the warm-up's bytes past the plan's line raise
    # both alike. Before, the floors sat ~1 GiB above the commitments on
    # the H200 and starved the tenant that burst (2026-12-03, issue 27).
    shared = SharedGPU(
        cap="6GiB", device_budget="24GiB", key=f"gpu-test-floor-{os.getpid()}", dir=str(tmp_path)
    )
    with Engine(checkpoint, max_batch=8, max_seq_len=512, shared=shared) as e:
        t = e.tenancy
        rec = t.tenant.record()
        gran = e.backend.granularity
        assert rec["floor"] == t.floor
        assert 0 <= rec["committed"] - rec["floor"] <= gran, (rec, gran)
        e.generate(prompts(), 16)
        e.idle()
        rec = t.tenant.record()
        assert rec["committed"] - rec["floor"] <= t.chunk * t.block_bytes + gran, (rec, gran)
        line = (
            f"shared floor at rest: committed {rec['committed'] / MIB:.1f} MiB, floor "
            f"{rec['floor'] / MIB:.1f} MiB (granularity {gran / MIB:.0f} MiB, warm-up past its "
            f"line {t.outside_past_floor / MIB:.0f} MiB unraised)"
        )
        print(line)
        keep = os.environ.get("IMP_MEM_GPU_OUT")
        if keep:
            with open(os.path.join(keep, "shared_idle_sleep.txt"), "a") as f:
                f.write(line + "\n")
