"""The GPU benchmarks' CPU modes, run whole.

A benchmark that only ever runs on the H200 can rot between its GPU runs:
an argument renamed in the library, a row format changed. These run each
benchmark that has a CPU mode end to end on fake backends and check that it
printed every row it promises, so device time is never spent on a script
that breaks before its first measurement. The figures themselves mean
nothing on a CPU and are not asserted. The tools in ``tools/`` that a bench's
output feeds (the shared GPU's plot, the HF trace recorder, the caching
allocator's model) run here too, beside the bench they serve.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _run(script: str, *args: str, timeout: float, folder: Path = BENCHES) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, str(folder / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=folder,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{out[-4000:]}"
    return out


def test_kv_persist_bench_prints_every_row_on_the_fake_backend(tmp_path):
    out = _run(
        "bench_kv_persist.py",
        "--backends",
        "fake",
        "--mib",
        "4",
        "--turns",
        "1",
        "--disk-turns",
        "1",
        "--dir",
        str(tmp_path),
        timeout=300,
    )
    rows = re.findall(
        r"^fake\s+(\d+) KiB .*?\b(save|load|offload|spill|reload)\s+ours .*?([\d.]+)x of the file$",
        out,
        re.M,
    )
    seen = {(int(kib), op) for kib, op, _ in rows}
    ops = ("save", "load", "offload", "spill", "reload")
    want = {(kib, op) for kib in (256, 2048) for op in ops}
    assert seen == want, out
    assert all(float(ratio) > 0 for _, _, ratio in rows), out


def test_shared_gpu_bench_smoke_runs_every_phase(tmp_path):
    pytest.importorskip("torch")
    rows_path = tmp_path / "shared.json"
    out = _run("bench_shared_gpu.py", "--smoke", "--json", str(rows_path), timeout=900)
    for model in ("a", "b", "c"):
        for setup in ("shared", "static"):
            assert re.search(rf"^{model}\s+{setup}\s+\d+\s+[\d.]+\s+[\d.]+", out, re.M), out
        assert re.search(rf"^{model}\s+TTFT p99 static/shared\s+[\d.]+x", out, re.M), out
    assert "idle footprint" in out, out
    feet = re.findall(
        r"above its floor\s+-?[\d.]+ MiB .*, allowed\s+[\d.]+ MiB (ok|OVER)$", out, re.M
    )
    assert feet and all(f == "ok" for f in feet), out
    assert re.search(r"SIGKILL of \w+ while \w+ bursts: share back in [\d.]+ s", out), out
    assert re.search(r"saturation, a alone: .* overhead\s+-?[\d.]+ %", out), out
    growable = r"growable pool without a ledger .* the ledger over it:\s+-?[\d.]+ %"
    assert re.search(growable, out), out
    assert re.search(r"^\s+a\s+static\s+\d+\s+shared\s+\d+\s+burst\s+\d+", out, re.M), out
    # The JSON holds each request's (arrival, TTFT) and the trace's windows;
    # the figure draws a panel a model from it.
    rows = json.loads(rows_path.read_text())
    trace = next(r["trace"] for r in rows if "trace" in r)
    assert trace["models"] == ["a", "b", "c"]
    for r in (r for r in rows if "setup" in r):
        assert r["finished"] <= len(r["ttft_at"]) <= r["arrived"], r
        assert all(t >= 0 and at >= 0 for at, t in r["ttft_at"]), r
        assert r["ttft_p99"] <= max(t for _, t in r["ttft_at"]) + 1e-3, r
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "shared.png"
        drawn = _run("plot_shared_gpu.py", str(rows_path), str(png), timeout=120, folder=TOOLS)
        assert "3 panels" in drawn and png.stat().st_size > 10_000, drawn


def test_shared_gpu_bursts_are_bounded_by_what_a_cap_holds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_shared_gpu as b

    args = type("Args", (), {"max_batch": 256, "burst_factor": 1.8})()
    # 1 GiB beside the KV, 100 MiB a sequence: a 21 GiB cap holds
    # (0.95 * 21 GiB - 1 GiB) / 100 MiB = 194 sequences at once.
    facts = {"fixed": 1 << 30, "per_seq": 100 << 20}
    holds = b.cap_holds(facts, 21 << 30)
    assert holds == int((0.95 * (21 << 30) - (1 << 30)) // (100 << 20)) == 194
    # 1.8 x 110 = 198 is past what the cap holds: 194 less the trickle's two.
    assert b.bursts_for({"m": 110, "n": 19}, args, {"m": holds, "n": 40}) == {"m": 192, "n": 35}
    # Without the bound, and at most --max-batch.
    assert b.bursts_for({"m": 110, "n": 200}, args) == {"m": 198, "n": 256}


def test_ledger_step_bench_prints_the_step_costs_and_every_ledger_operation():
    pytest.importorskip("torch")
    out = _run("bench_ledger_step.py", "--passes", "2", timeout=300)
    assert re.search(r"^\s+plain\s+step median\s+[\d.]+ us", out, re.M), out
    assert re.search(r"^\s+ledger\s+step median\s+[\d.]+ us", out, re.M), out
    assert re.search(r"in the tenancy [\d.]+ us a step .* [\d.]+ ledger calls a step", out), out
    for op in ("pressure", "headroom", "set_kv_live", "grow \\+ shrink", "tenants"):
        assert re.search(rf"^\s+{op}.*\s[\d.]+ us$", out, re.M), out


def test_measured_replay_bench_runs_the_trace_without_fallbacks():
    """The HF-shaped trace at a small size: the tier planned at the measured
    size serves the same work again, frozen and on a second start, with no
    acquisition past it (the property the core's replay proptest proves)."""
    out = _run(
        "bench_measured_replay.py", "--batch", "4", "--prompt", "128", "--new", "16", timeout=120
    )
    assert re.search(r"^first start:  warm-up fallbacks 0, served run 0$", out, re.M), out
    assert re.search(r"^second start: run 1 fallbacks 0, run 2 0$", out, re.M), out
    assert re.search(r"^RATIOS high-water/live-peak [\d.]+, frozen/live-peak [\d.]+", out, re.M), (
        out
    )


def test_a_recorded_hf_trace_replays_through_the_tier(tmp_path):
    """record_hf_trace.py's trace of transformers' own Qwen3 (meta device,
    a tiny batch) replays through the measured tier, frozen and on a second
    start, with no fallback; the figures come back as JSON."""
    pytest.importorskip("transformers")
    trace, figures = tmp_path / "trace.json", tmp_path / "figures.json"
    _run(
        "record_hf_trace.py",
        *("--batch", "1", "--prompt", "16", "--new", "2", "--out", str(trace)),
        timeout=300,
        folder=TOOLS,
    )
    out = _run(
        "bench_measured_replay.py", "--trace", str(trace), "--json", str(figures), timeout=120
    )
    assert re.search(r"^second start: run 1 fallbacks 0, run 2 0$", out, re.M), out
    got = json.loads(figures.read_text())
    assert got["fallbacks"] == {"warm_up": 0, "served": 0, "second_start": [0, 0]}
    assert got["live_peak"] <= got["high_water"] <= got["frozen"]


def test_a_compiled_trace_measures_only_the_pass_after_the_reset(tmp_path):
    """A compiled run's trace (``second_ops``): the first generate()'s
    blocks that outlive it stay where they were placed, reset_high_water()
    forgets the compile's peak, and the live peak is the second pass's. Here
    the compile's 50 MiB temporary leaves a hole under a 20 MiB block that
    stays; the second pass's 30 MiB fits in it, so the high-water is the
    kept block's top (170 MiB) over a live peak of 150."""
    m = 1 << 20
    ops = [["a", 1, 100 * m], ["a", 2, 50 * m], ["a", 3, 20 * m], ["f", 2]]
    ops += [["a", 4, 30 * m], ["f", 4]]
    trace, figures = tmp_path / "trace.json", tmp_path / "figures.json"
    meta = {"batch": 1, "prompt": 1, "new": 1, "model_ops": 1, "second_ops": 4}
    trace.write_text(json.dumps(dict(meta, ops=ops)))
    out = _run(
        "bench_measured_replay.py",
        "--trace",
        str(trace),
        "--json",
        str(figures),
        "--time-passes",
        "2",
        timeout=120,
    )
    got = json.loads(figures.read_text())
    assert got["live_peak"] == 150 * m and got["high_water"] == 170 * m, out
    assert got["fallbacks"] == {"warm_up": 0, "served": 0, "second_start": [0, 0]}
    timed = got["host_ms_a_pass"]
    assert sorted(timed) == ["first_start", "second_start"], out
    assert all(len(v) == 2 and min(v) > 0 for v in timed.values()), timed


def test_the_hf_bench_pins_its_children_where_asked(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_torch_hf as b

    assert b.parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert b.parse_cpus(None) == set() and b.parse_cpus("") == set()
    for bad in ("3-1", "x", "-2"):
        with pytest.raises(SystemExit, match="--cpus"):
            b.parse_cpus(bad)
    # Refused before any child runs.
    with pytest.raises(SystemExit):
        b.main(["--cpus", "a-b"])


def test_the_hf_bench_runs_ours_alone_where_torchs_side_crashes(monkeypatch, tmp_path):
    """reduce-overhead's torch-allocator child segfaults on torch 2.11: the
    bench still runs ours, reports its own figures with no ratio, and exits
    non-zero naming torch's failure."""
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_torch_hf as b

    def fake_child(kind, args, extra, cache, record=True):
        if kind == "default":
            raise RuntimeError("default failed (rc=-11)")
        assert extra[-2:] == ["--mode", "scope"], extra
        return {"tokens": [[1]], "report": "r", "seconds": 2.0, "committed": 5, "fallbacks": 0}

    monkeypatch.setattr(b, "run_child", fake_child)
    out = tmp_path / "hf.json"
    rc = b.main(["--quick", "--compiles", "reduce-overhead", "--json", str(out)])
    assert rc == 1
    got = json.loads(out.read_text())
    assert got["variants"] == {}
    alone = got["alone"]["scope/reduce-overhead"]
    assert alone["committed"] == 5 and "tokens" not in alone and "report" not in alone
    assert alone["tokens_per_s"] == 8 * 16 / 2.0
    assert "rc=-11" in got["failed"]["reduce-overhead/torch"]


def test_the_caching_allocator_model_follows_torchs_rules(monkeypatch):
    """`model_caching_allocator.py`'s arithmetic against worked cases of
    torch's rules (its defaults gave the H200's compiled trace's reserved
    figure to the MiB: 7 520.0 over a live peak of 5 616.4)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import model_caching_allocator as m

    mib = m.MIB
    # round_size: 512 B minimum and multiples; power-2 divisions above 512 x d.
    assert m.round_size(1, None) == 512 and m.round_size(513, None) == 1024
    four = m.parse_divisions("4")
    assert m.round_size(3_000_000, four) == 3_145_728  # 2 MiB + 2 steps of 512 KiB
    assert m.round_size(4 * mib, four) == 4 * mib  # a power of two stays
    assert m.round_size(1500, four) == 1536  # below 512 x 4: plain 512 B rounding
    # The list form: a key of B MiB governs [B, 2B); the first fills below it.
    table = m.parse_divisions("[256:1,512:2,1024:4,>:8]")
    assert table[:9] == [1] * 9 and table[9] == 2 and table[10] == 4 and table[11:] == [8] * 5
    with pytest.raises(ValueError, match="power of two"):
        m.parse_divisions("3")
    # Segments: 2 MiB small, 20 MiB for 1-10 MiB, 2 MiB multiples above.
    assert [m.segment_size(s) for s in (512, mib, mib + 512, 10 * mib, 11 * mib + 1)] == [
        2 * mib,
        2 * mib,
        20 * mib,
        10 * mib,
        12 * mib,
    ]
    # A 3 MiB request splits a 20 MiB segment; the 17 MiB rest serves a
    # 16 MiB request whole (1 MiB left is not over 1 MiB: no split); frees
    # merge the segment back into one block, reused without a new segment.
    model = m.CachingModel()
    a = model.malloc(3 * mib)
    b = model.malloc(16 * mib)
    assert (model.segments, model.reserved, b.size) == (1, 20 * mib, 17 * mib)
    model.free(a)
    model.free(b)
    assert model.keys[False] == [(20 * mib, 0)]
    c = model.malloc(19 * mib)
    assert model.segments == 1 and c.size == 20 * mib
    ops = [("a", 1, 3 * mib), ("a", 2, 16 * mib), ("f", 1), ("f", 2), ("a", 3, 19 * mib)]
    got = m.replay(ops, m.CachingModel())
    assert got["reserved_peak"] == 20 * mib and got["live_peak"] == 19 * mib
    # Expandable segments: one segment a pool, grown at its end by 20 MiB
    # pages (large); everything freed merges into its one free tail.
    ex = m.CachingModel(expandable=True)
    a, b = ex.malloc(3 * mib), ex.malloc(16 * mib)
    assert ex.reserved == 20 * mib and b.size == 17 * mib and b.addr == a.addr + 3 * mib
    c = ex.malloc(30 * mib)  # the tail is taken: 40 MiB more at the end
    assert ex.reserved == 60 * mib and c.addr == a.addr + 20 * mib and ex.segments == 1
    for block in (b, a, c):
        ex.free(block)
    assert ex.keys[False] == [(60 * mib, a.addr)] and ex.tail[False].size == 60 * mib
    ex.malloc(50 * mib)
    assert ex.reserved == 60 * mib
