"""imp-mem's LD_PRELOAD interposer under torch on a GPU (issue 51's preload
mode): a process started with it in ``LD_PRELOAD`` routes torch's
``cudaMalloc`` (its caching allocator's segments, cuBLAS's workspace) into a
hook region inside ``_hook_region(region) + _preload.routing()``, the
region's pause / resume keeps their bytes, cuBLAS runs there, torch outside
is untouched, and torch's ``empty_cache`` frees the region's segments home.
The child process is ``_preload_torch_child.py``.

Skipped where no CUDA device exists; needs torch. Run:
``pytest -m gpu tests/gpu/test_preload_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import imp_mem
from imp_mem import _preload

pytestmark = pytest.mark.gpu

pytest.importorskip("torch")
CHILD = Path(__file__).with_name("_preload_torch_child.py")
MIB = 1 << 20


def _run(env: dict[str, str]) -> dict:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(imp_mem.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=300
    )
    sys.stderr.write(done.stderr)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not imp_mem.cuda_available():
        pytest.skip("no CUDA device")


def test_torch_under_the_interposer_lands_in_the_region_and_survives_pause():
    out = _run(_preload.subprocess_env())
    assert out["loaded"] is True
    assert out["inside_in_region"] == [True, True, True, True]
    assert out["region_allocated_growth"] >= 256 * MIB + 3 * 16 * MIB
    assert out["hook_mallocs"] >= 1
    assert out["gemm_inside_ok"] is True
    assert out["outside_in_region"] is False
    assert out["outside_region_growth"] == 0
    assert out["paused_copied"] >= 256 * MIB
    assert out["freed_while_paused"] >= out["paused_copied"] - 192 * MIB
    assert out["bytes_kept"] is True and out["same_addresses"] is True
    assert out["gemm_after_resume_ok"] is True
    assert out["outside_intact"] is True
    # torch's frees outside routing reach home: w, a, b, c at least (a
    # cuBLAS workspace torch keeps for the process stays live), and every
    # segment the hooks handed out is either freed or still live.
    assert out["hook_free_ok"] >= 4
    assert out["region_live_after_empty_cache"] == out["hook_malloc_ok"] - out["hook_free_ok"]
    assert out["hook_misuse"] == {}


def test_without_the_preload_routing_refuses():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = _run(env)
    assert out["loaded"] is False
    assert "LD_PRELOAD" in out["refused"]
