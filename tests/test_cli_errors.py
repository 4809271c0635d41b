"""Every CLI error is one clear line on stderr and exit status 2, never a
traceback (issue 14); the silently accepted cases are refused or warned;
`--json` documents carry their inputs and a schema version; the plot draws
what the plan says; and the README's examples run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def imp_mem(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "imp_mem", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


BAD = [
    ["demo", "--model", "nope"],
    ["demo", "--backend", "fake", "--capacity", "lots"],
    ["demo", "--backend", "fake", "--max-batch", "0"],
    ["demo", "--backend", "fake", "--steps", "-1"],
    ["demo", "--backend", "cuda"],
    ["plan"],
    ["plan", "no-such-model"],
    ["plan", "/no/such/config.json"],
    ["plan", "llama-3-8b", "--tp", "3"],
    ["plan", "llama-3-8b", "--tp", "0"],
    ["plan", "llama-3-8b", "--max-batch", "-4"],
    ["plan", "llama-3-8b", "--budget", "lots"],
    ["plan", "llama-3-8b", "--budget", "80"],
    ["plan", "llama-3-8b", "--max-batch", "0"],
    ["plan", "llama-3-8b", "--kv-dtype", "fp7"],
    ["plan", "llama-3-8b", "--block-size", "0"],
    ["plan", "llama-3-8b", "--block-size", "-3"],
    ["plan", "llama-3-8b", "--tp", "-2"],
    ["plan", "llama-3-8b", "--weights-bytes", "-1"],
    ["plan", "llama-3-8b", "--plot", "/missing/dir/x.png"],
    ["plan", "llama-3-8b", "--max-batch", "x"],  # argparse's own error
    ["nonsense"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) for a in BAD])
def test_class_no_command_prints_a_traceback(argv, tmp_path):
    done = imp_mem(*argv, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout[-500:], done.stderr[-1500:])
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr
    assert "imp-mem" in errors[0]


def test_a_budget_without_a_unit_says_what_to_write():
    done = imp_mem("plan", "llama-3-8b", "--budget", "80")
    assert done.returncode == 2
    assert '--budget: "80" has no unit' in done.stderr and 'write "80GiB"' in done.stderr
    demo = imp_mem("demo", "--backend", "fake", "--capacity", "80")
    assert demo.returncode == 2 and '--capacity: "80" has no unit' in demo.stderr


@pytest.mark.parametrize("command", ["plan", "demo"])
def test_max_batch_below_one_is_one_rule_with_one_message(command):
    first, second = (
        imp_mem(command, "llama-3-8b" if command == "plan" else "--backend=fake", "--max-batch", n)
        for n in ("-4", "0")
    )
    assert "--max-batch must be at least 1, got -4" in first.stderr
    assert "--max-batch must be at least 1, got 0" in second.stderr


@pytest.mark.parametrize("flag", ["--tp", "--block-size"])
def test_tp_and_block_size_below_one_say_at_least_1_as_max_batch_does(flag):
    for n in ("-2", "0"):
        done = imp_mem("plan", "llama-3-8b", flag, n)
        assert done.returncode == 2
        assert f"{flag} must be at least 1, got {n}" in done.stderr, done.stderr
        assert "non-negative" not in done.stderr


def test_demo_on_a_missing_backend_names_the_cli_option():
    import imp_mem as api

    if api.cuda_available():
        pytest.skip("a CUDA driver is here")
    done = imp_mem("demo", "--backend", "cuda")
    assert done.returncode == 2
    assert "--backend fake" in done.stderr and "FakeBackend" not in done.stderr


def test_a_bad_config_file_is_one_line_too(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    done = imp_mem("plan", str(bad))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_tp_that_does_not_split_the_heads_names_the_nearest_degrees():
    done = imp_mem("plan", "llama-3-8b", "--tp", "3")
    assert "use tp 2 or 4" in done.stderr and "8 KV heads" in done.stderr


def test_max_seq_len_past_the_trained_context_warns():
    done = imp_mem("plan", "llama-3-8b", "--max-seq-len", "16384", "--budget", "200GiB")
    assert done.returncode == 0
    assert "max_position_embeddings (8192)" in done.stderr
    assert "not trained" in done.stderr
    quiet = imp_mem("plan", "llama-3-8b", "--max-seq-len", "8192")
    assert "warning" not in quiet.stderr
    demo = imp_mem("demo", "--backend", "fake", "--max-seq-len", "9000", "--steps", "1")
    assert "max_position_embeddings (8192)" in demo.stderr


def test_demo_never_serves_a_request_past_max_seq_len():
    done = imp_mem("demo", "--backend", "fake", "--max-seq-len", "100", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["longest_request_tokens"] <= 100
    text = imp_mem("demo", "--backend", "fake", "--max-seq-len", "100").stdout
    lengths = [int(n) for n in re.findall(r"request \d+: (\d+) tokens", text)]
    assert lengths and max(lengths) + 1 <= 100  # +1: the decoded token


def test_plan_json_has_inputs_and_a_schema_version():
    doc = json.loads(imp_mem("plan", "llama-3-8b", "--tp", "2", "--json").stdout)
    assert doc["schema_version"] == 1
    assert doc["inputs"]["config"] == "llama-3-8b" and doc["inputs"]["tp"] == 2
    assert doc["inputs"]["max_batch"] == 8 and "kv" in doc
    failed = imp_mem("plan", "llama-3-8b", "--budget", "8GiB", "--json")
    assert failed.returncode == 2
    doc = json.loads(failed.stdout)
    assert doc["schema_version"] == 1 and doc["error"] == "plan_failure"
    assert doc["inputs"]["budget"] == 8 << 30


def test_demo_json_reports_the_plan_and_attributes_only_what_was_claimed():
    done = imp_mem("demo", "--backend", "fake", "--json", "--steps", "3")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["schema_version"] == 1 and doc["inputs"]["steps"] == 3
    assert doc["plan"]["budget"] > 0
    report = doc["mem_report"]
    # The planned library reserve and context were not measured or claimed
    # on the fake: shown apart, not attributed.
    estimated = sum(c["bytes"] for c in report["charges"] if not c["measured"])
    assert report["planned_unclaimed"] == estimated > 0
    assert report["attributed"] == report["backend_committed"] + sum(
        c["bytes"] for c in report["charges"] if c["measured"]
    )
    if report["device"] is not None:
        assert report["device"]["attribution_pct"] <= 100.0


def test_the_plot_stacks_in_legend_order_with_headroom_overflow_and_levers(tmp_path):
    pytest.importorskip("matplotlib")
    from imp_mem import _cli_plan

    calls = {}
    import matplotlib.axes

    original = matplotlib.axes.Axes.legend

    def spy(self, *args, **kwargs):
        calls["labels"] = [h.get_label() for h in kwargs["handles"]]
        calls["bars"] = [(p.get_y(), p.get_height()) for p in self.patches]
        calls["texts"] = [t.get_text() for t in self.texts]
        return original(self, *args, **kwargs)

    charges = [
        {"label": "weights", "bytes": 10 << 30},
        {"label": "tiny", "bytes": 1 << 20},
        {"label": "kv", "bytes": 4 << 30},
    ]
    matplotlib.axes.Axes.legend = spy
    try:
        _cli_plan.plot(str(tmp_path / "fits.png"), charges, 20 << 30, "fits")
        fits = dict(calls)
        levers = [{"setting": "tp", "from": "1", "to": "2", "frees": 8 << 30, "sufficient": True}]
        _cli_plan.plot(str(tmp_path / "over.png"), charges, 12 << 30, "over", levers=levers)
        over = dict(calls)
    finally:
        matplotlib.axes.Axes.legend = original
    # Top of the legend is the top of the stack; the budget line first.
    assert fits["labels"][0].startswith("budget")
    assert [lb.split(" (")[0] for lb in fits["labels"][1:]] == ["headroom", "kv", "tiny", "weights"]
    assert "tiny (1 MiB)" in fits["labels"]
    heights = dict(zip(["weights", "tiny", "kv"], [h for _, h in fits["bars"][:3]], strict=True))
    assert heights["tiny"] >= 0.008 * 20 * 1024 * 0.99, "a small charge stays visible"
    assert any(lb.startswith("over budget by 2,049 MiB") for lb in over["labels"])
    assert any("tp 1 -> 2" in t for t in over["texts"])
    assert (tmp_path / "fits.png").stat().st_size > 0


def _readme_blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_command_lines_run(tmp_path):
    config = tmp_path / "config.json"
    from imp_mem._presets import preset

    config.write_text(json.dumps(preset("llama-3-8b")))
    lines = [
        line.split("#")[0].strip()
        for block in _readme_blocks("bash")
        for line in block.splitlines()
        if line.strip().startswith("imp-mem plan")
    ]
    assert len(lines) >= 3
    for line in lines:
        argv = shlex.split(line.replace("path/to/config.json", str(config)))[1:]
        done = imp_mem(*argv, cwd=tmp_path)
        assert done.returncode == 0, (line, done.stdout[-800:], done.stderr[-800:])
    assert (tmp_path / "plan.png").exists() or "matplotlib" in done.stderr


def test_readme_python_examples_run():
    import imp_mem

    blocks = _readme_blocks("python")
    first, kv = blocks[0], blocks[1]
    with pytest.raises(imp_mem.PhaseViolation):
        exec(first, {"imp_mem": imp_mem})
    ns = {"imp_mem": imp_mem}
    exec(kv, ns)
    assert "numpy" not in kv and "np." not in kv, "the KV example runs without NumPy"
    # What its comments claim: sequence 2 hit six cached blocks.
    assert ns["kv"].num_tokens(2) == 100 and ns["kv"].stats()["prefix_hit_blocks"] == 6
    # The third runs after the second (its `prompt`), on an 80 GiB fake,
    # with no warning that the system closed with memory still referenced.
    system = blocks[2]
    assert "..." not in system and "path/to" not in system
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(system, ns)
    assert "kv_cache" in ns["body"] and ns["system"].closed
    # The other blocks are schematic (a GPU, its UUID, a running engine).
