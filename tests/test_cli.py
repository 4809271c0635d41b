"""The command line: `imp-mem demo` on the fake backend, and the usage paths."""

from __future__ import annotations

import subprocess
import sys

from imp_mem import cli


def test_demo_runs_on_the_fake_backend(capsys):
    assert cli.main(["demo", "--backend", "fake"]) == 0
    out = capsys.readouterr().out
    assert "[SERVING]" in out and "refused while serving" in out
    assert "steady-state allocations while serving: 0" in out
    assert "released everything: live = 0 B" in out
    for tag in ("weights", "kv_cache", "scratch", "total"):
        assert tag in out


def test_demo_scales_to_a_smaller_device(capsys):
    assert cli.main(["demo", "--backend", "fake", "--capacity", "8GiB"]) == 0
    assert "live = 0 B" in capsys.readouterr().out


def test_bad_capacity_is_a_clean_error(capsys):
    assert cli.main(["demo", "--backend", "fake", "--capacity", "lots"]) == 1
    assert "InvalidArgument" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_python_dash_m_is_the_same_command():
    done = subprocess.run(
        [sys.executable, "-m", "imp_mem", "--version"], capture_output=True, text=True, check=True
    )
    import imp_mem

    assert done.stdout.strip() == imp_mem.__version__
