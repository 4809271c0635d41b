"""The command line: `imp-mem demo` on the fake backend, and the usage paths."""

from __future__ import annotations

import subprocess
import sys

from imp_mem import cli


def test_demo_runs_on_the_fake_backend(capsys):
    assert cli.main(["demo", "--backend", "fake"]) == 0
    out = capsys.readouterr().out
    assert "[LOADING] opened in plan order" in out and "[SERVING]" in out
    assert "steady-state allocations while serving: 0" in out
    assert 'imp_mem_steady_state_allocations_total{tag="kv_cache"} 0' in out
    assert "backend live = 0 B" in out
    for tag in ("weights", "kv_cache", "scratch", "workspace"):
        assert tag in out


def test_demo_report_reads_without_puzzles(capsys):
    assert cli.main(["demo", "--backend", "fake"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first == "backend: fake, device 0, capacity 80.0 GiB, budget 80.0 GiB", first
    # T1's reservation, larger than its plan, is explained where it shows.
    assert "T1 reserves more than planned: reserved is address space" in out
    # Eight requests, six sequences: the report says why.
    assert "6 sequences in flight (at most 6; 2 finished" in out
    assert "no device reading (this backend has no real device)" in out
    # The plan and the report agree on where the library reserve comes from.
    assert "(measured)" not in out and "library reserve (plan)" in out


def test_demo_that_does_not_fit_prints_the_plan_failure(capsys):
    assert cli.main(["demo", "--backend", "fake", "--capacity", "8GiB"]) == 2
    out = capsys.readouterr().out
    assert "Cannot fit this configuration" in out and "levers" in out


def test_demo_takes_the_model_and_limits(capsys):
    argv = ["demo", "--backend", "fake", "--model", "qwen3-8b", "--max-batch", "4"]
    assert cli.main([*argv, "--max-seq-len", "4096", "--steps", "2"]) == 0
    assert "qwen3-8b, 4 x 4096 tokens" in capsys.readouterr().out


def test_bad_capacity_is_a_clean_error(capsys):
    assert cli.main(["demo", "--backend", "fake", "--capacity", "lots"]) == 2
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
