"""The engine's warm-up planned on the first boot (issue 25), on the GPU.

Each boot runs in a fresh child process (nothing else of the test process on
the device, its own CUDA context) with one warm-up cache: the first boot
finds no figure and measures it in a probe child before planning (cold);
the second reads it back (warm). Both must plan the same KV pool, come
within 1 % of the device memory they use, attribute at least 99 % of it,
acquire nothing while serving, and time their boot.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from _device_plan import boot_in_child  # noqa: E402

from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.config import qwen3_0_6b_config  # noqa: E402

CHILD = r"""
import json, sys
import torch
from imp_mem.engine.llm_engine import Engine

other = int(sys.argv[2])  # the test process's own device memory

with Engine(sys.argv[1], max_batch=32, max_seq_len=640, keep_logits=False,
            warmup_probe=True, pin_sleep_host=False) as e:
    reqs = [e.submit([7 + i] * 500, 24) for i in range(32)]
    e.run()
    torch.cuda.synchronize()
    free, whole = torch.cuda.mem_get_info()
    report = e.mem_report(other_processes=other)
    print(json.dumps({
        # The plan's total with the open's rounding of growable tiers to
        # whole granules (decided before any acquisition; named in the report).
        "plan_total": e.plan.total() + report["granule_rounding"],
        "warmup_line": e.plan.warmup, "kv_blocks": e.plan.kv_blocks,
        "planned": e.warmup_planned, "measured": e.warmup_measured,
        "used": whole - free - other, "attribution": report["device"]["attribution_pct"],
        "steady": sum(e.backend.stats()["steady_state_allocations_total"].values()),
        "boot": e.boot_seconds, "probe_boot": e.probe_boot_seconds,
        "first_token": e.first_token_seconds,
        "tokens": [list(r.output) for r in reqs[:4]],
        "text": e.mem_report_text(other_processes=other),
    }), flush=True)
"""


def test_cold_and_warm_boots_plan_the_warmup_exactly(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", qwen3_0_6b_config(), device="cuda")
    cold = boot_in_child(CHILD, directory, tmp_path)
    warm = boot_in_child(CHILD, directory, tmp_path)
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"\n{name}: {json.dumps({k: v for k, v in r.items() if k != 'text'})}")
        assert r["planned"] is not None, f"{name}: no warm-up figure planned"
        assert r["warmup_line"] > 0
        assert abs(r["used"] / r["plan_total"] - 1) <= 0.01, r["text"]
        assert r["attribution"] >= 99.0, r["text"]
        assert r["steady"] == 0
        assert r["first_token"] and r["first_token"] > 0
        assert {"plan", "open", "load", "warm_up", "capture"} <= set(r["boot"])
    assert "probe" in cold["boot"] and "probe" not in warm["boot"]
    # The cold boot planned what the warm one reads back: the same pool.
    assert cold["kv_blocks"] == warm["kv_blocks"]
    assert cold["planned"] == warm["planned"]
    # What each boot measured across its own warm-up is what it planned.
    for r in (cold, warm):
        planned = r["planned"]["torch"] + r["planned"]["modules"]
        measured = r["measured"]["torch"] + r["measured"]["modules"]
        assert abs(measured - planned) <= max(0.05 * planned, 64 << 20), r
    assert cold["tokens"] == warm["tokens"]
