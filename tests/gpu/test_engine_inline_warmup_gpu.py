"""A cold boot that measures its warm-up in its own process (issue 25,
``Engine(warmup_probe="inline")``), on the GPU.

Each boot runs in a fresh child process (nothing else of the test process on
the device, its own CUDA context) with one warm-up cache: the first boot
finds no figure, plans the line at 0 with the KV pool growable, measures
its own warm-up and capture, re-plans and grows the pool before serving
(cold, no probe child); the second reads the figure back (warm). Both must
hold the same KV blocks, come within 1 % of the device memory they use,
attribute at least 99 % of it, acquire nothing while serving, and time
their boot (printed: the first token and the boot split).
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
from imp_mem.engine import warmup
from imp_mem.engine.llm_engine import Engine

def refuse(*args, **kw):
    raise AssertionError("an inline boot started a probe child")

warmup.probe = refuse
other = int(sys.argv[2])  # the test process's own device memory

with Engine(sys.argv[1], max_batch=32, max_seq_len=640, keep_logits=False,
            warmup_probe="inline", pin_sleep_host=False) as e:
    reqs = [e.submit([7 + i] * 500, 24) for i in range(32)]
    e.run()
    torch.cuda.synchronize()
    free, whole = torch.cuda.mem_get_info()
    report = e.mem_report(other_processes=other)
    pool = e.system.kv_pool.stats()
    print(json.dumps({
        "plan_total": e.plan.total() + report["granule_rounding"],
        "warmup_line": e.plan.warmup, "kv_blocks": e.plan.kv_blocks,
        "pool": [pool["capacity"], pool["max_blocks"]],
        "planned": e.warmup_planned, "measured": e.warmup_measured,
        "used": whole - free - other, "attribution": report["device"]["attribution_pct"],
        "steady": sum(e.backend.stats()["steady_state_allocations_total"].values()),
        "boot": e.boot_seconds, "first_token": e.first_token_seconds,
        "tokens": [list(r.output) for r in reqs[:4]],
        "text": e.mem_report_text(other_processes=other),
    }), flush=True)
"""


def test_an_inline_cold_boot_holds_the_warm_boots_pool(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", qwen3_0_6b_config(), device="cuda")
    cold = boot_in_child(CHILD, directory, tmp_path)
    warm = boot_in_child(CHILD, directory, tmp_path)
    for name, r in (("cold", cold), ("warm", warm)):
        split = " ".join(f"{k}={v:.2f}" for k, v in r["boot"].items())
        print(f"\n{name}: first token {r['first_token']:.2f} s; boot {split}")
        print(json.dumps({k: v for k, v in r.items() if k not in ("text", "boot")}))
        assert r["planned"] is not None and r["warmup_line"] > 0, name
        assert r["pool"] == [r["kv_blocks"], r["kv_blocks"]], (name, r["pool"])
        assert abs(r["used"] / r["plan_total"] - 1) <= 0.01, r["text"]
        assert r["attribution"] >= 99.0, r["text"]
        assert r["steady"] == 0
        assert r["first_token"] and r["first_token"] > 0
        assert {"plan", "open", "load", "warm_up", "capture"} <= set(r["boot"])
        assert "probe" not in r["boot"]
    assert "kv_grow" in cold["boot"] and "kv_grow" not in warm["boot"]
    # The cold boot planned, after its warm-up, what it measured; the warm
    # one reads that back: the same pool.
    assert cold["planned"] == cold["measured"] == warm["planned"]
    assert cold["kv_blocks"] == warm["kv_blocks"]
    planned = warm["planned"]["torch"] + warm["planned"]["modules"]
    measured = warm["measured"]["torch"] + warm["measured"]["modules"]
    assert abs(measured - planned) <= max(0.05 * planned, 64 << 20), warm
    assert cold["tokens"] == warm["tokens"]
