"""``benches/bench_tms_dropin.py`` (issue 51) without a GPU: it says it has
no CUDA device and exits 0, and its table puts each implementation's rounds
beside the raw copy's, with the ratios, from figures given to it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benches" / "bench_tms_dropin.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_tms_dropin", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_it_skips_cleanly():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the bench would run")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here; skipped" in done.stdout


def test_the_table_puts_every_round_beside_the_raw_copy():
    mod = _module()
    gib = mod.GIB
    raw = {
        "impl": "raw",
        "ok": True,
        "rounds": [
            {"pause": 0.3, "resume": 0.3, "device_held_paused": None, "host_held_paused": gib}
        ]
        * 2,
    }
    ours = {
        "impl": "imp-mem",
        "ok": True,
        "pin_ahead_wait": 1.5,
        "rounds": [
            {
                "pause": 0.6,
                "resume": 0.3,
                "device_held_paused": 0,
                "host_held_paused": gib,
                "pinned_paused": gib,
            },
            {
                "pause": 0.3,
                "resume": 0.15,
                "device_held_paused": 0,
                "host_held_paused": gib,
                "pinned_paused": gib,
            },
        ],
    }
    text = mod.table([raw, ours, {"impl": "tms-0.0.10", "error": "No module named x"}])
    rows = [
        ln.split() for ln in text.splitlines() if ln.startswith("imp-mem") and "ahead" not in ln
    ]
    assert [[*r[1:3], r[3], r[5]] for r in rows] == [
        ["1", "0.600", "0.50", "1.00"],
        ["2", "0.300", "1.00", "2.00"],
    ]
    assert "(pinned 1.00)" in text and "waited 1.500 s" in text
    assert "tms-0.0.10   skipped: No module named x" in text
