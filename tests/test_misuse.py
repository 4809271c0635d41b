"""Runs the random misuse driver (`misuse_driver.py`) in subprocesses:
thousands of calls of random public methods with good and bad arguments
must end with 0 aborts, 0 hangs and 0 untyped errors (issue 14)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parent / "misuse_driver.py"


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_random_misuse_never_aborts_hangs_or_raises_untyped(seed):
    try:
        done = subprocess.run(
            [sys.executable, str(DRIVER), str(seed), "2500"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"seed {seed} hung: {str(exc.stdout)[-2000:]}")
    assert done.returncode == 0, f"seed {seed} died ({done.returncode}): {done.stderr[-3000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] + report["typed"] + report["untyped"] == 2500
    assert report["typed"] > 100 and report["ok"] > 100, report
    assert report["untyped"] == 0, json.dumps(report["untyped_examples"], indent=2)
