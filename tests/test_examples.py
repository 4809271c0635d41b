"""The scripts in ``examples/`` run as a user runs them (a fresh
interpreter, the installed package) and say what they claim: each asserts
its own outcome and exits 0, and the lines checked here are the ones a
reader looks for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_every_example_is_listed_in_its_readme():
    listed = (EXAMPLES / "README.md").read_text()
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts, "no examples found"
    assert [s for s in scripts if f"`{s}`" not in listed] == []


def test_kv_cache():
    out = run("kv_cache.py")
    assert "96 tokens were a prefix hit" in out
    assert "refused up front: CapacityError" in out
    assert "tokens: token id -3 is outside" in out


def test_two_tenants():
    out = run("two_tenants.py")
    assert "model-c refused up front (ledger_full)" in out
    assert "model-a (pid" in out and "model-b (pid" in out
    assert "model-a killed and reaped; model-b now holds 700 MiB" in out


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("safetensors") is None,
    reason="the engine needs torch and safetensors",
)
def test_rl_colocation():
    out = run("rl_colocation.py", "--steps", "2")
    assert out.count("asleep: {'weights': 0, 'kv_cache': 0") == 2, out
    assert out.count("new weights: ") == 2
    assert "a fresh engine on the trained weights generates the same tokens" in out


def test_rl_colocation_refuses_a_bad_step_count():
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "rl_colocation.py"), "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--steps must be at least 1 (got 0)" in proc.stderr
