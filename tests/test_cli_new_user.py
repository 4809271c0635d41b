"""A new user's first hour (issue 55): every shipped preset plans and
demos where torch is not installed; one rule for sizes, Python and CLI
alike (a unit or an int, never silent bytes); shapes checked where they are
made; the silent or misleading answers the issue lists, each refused or
said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import imp_mem
from imp_mem import InvalidArgument

# Runs the CLI in a fresh interpreter in which `import torch` raises
# ImportError, as in a virtual environment without torch.
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "IMP_MEM_LEDGER_DIR": os.environ.get("TMPDIR", "/tmp")},
    )


def cli(*argv: str) -> subprocess.CompletedProcess:
    return run_without_torch(f"from imp_mem.cli import main\nsys.exit(main({list(argv)!r}))")


def test_every_preset_plans_and_demos_on_the_fake_backend_without_torch():
    # The list is the CLI's own (`imp-mem plan --list`); each preset is
    # planned and served at the smallest options, on a budget every one
    # fits (deepseek-v3's weights alone are over 600 GiB).
    listed = cli("plan", "--list")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert len(names) >= 10 and "gemma-3-4b" in names and "mistral-7b-v0.1" in names
    small = ["--max-batch", "1", "--max-seq-len", "64"]
    done = run_without_torch(
        f"""
        import contextlib, io, json
        from imp_mem.cli import main
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit("torch imported")
        results = {{}}
        for name in {names!r}:
            for argv in (
                ["plan", name, "--budget", "2TiB", "--json", *{small!r}],
                ["demo", "--backend", "fake", "--model", name, "--capacity", "2TiB",
                 "--steps", "1", "--json", *{small!r}],
            ):
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main(argv)
                results[argv[0] + " " + name] = [rc, out.getvalue(), err.getvalue()]
        print(json.dumps(results))
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == 2 * len(names)
    for what, (rc, out, err) in results.items():
        assert rc == 0, (what, err[-800:], out[-800:])
        document = json.loads(out)
        plan = document if what.startswith("plan") else document["plan"]
        kv, swa = plan["kv"], plan.get("swa")
        # Every preset has somewhere to put its KV (or state).
        assert kv["blocks"] > 0 or (swa and swa["blocks"] > 0) or plan["pools"], what
        if what.startswith(("plan gemma-3", "demo gemma-3")):
            assert plan["vision_tower"] > 0, what


def test_the_vision_tower_is_sized_without_torch():
    done = cli("plan", "gemma-3-4b", "--max-batch", "1", "--max-seq-len", "64")
    assert done.returncode == 0, done.stderr
    assert "vision tower" in done.stdout or "vision_tower" in done.stdout


def test_the_torch_free_tower_is_the_engines_byte_for_byte():
    pytest.importorskip("torch")
    from imp_mem import _vision
    from imp_mem._presets import preset
    from imp_mem.engine import dummy
    from imp_mem.engine.config import ModelConfig
    from imp_mem.engine.model import siglip

    for name in ("gemma-3-4b", "gemma-3-27b"):
        config = ModelConfig.from_hf_config(preset(name))
        assert _vision.tensors(config.vision, config.hidden_size) == siglip.weight_names(
            config.vision, config.hidden_size
        )
        assert _vision.tower_bytes(preset(name)) == dummy.vision_bytes(config) > 0


def test_a_model_whose_every_layer_slides_plans_and_serves():
    plan = cli("plan", "mistral-7b-v0.1", "--max-batch", "2", "--max-seq-len", "8192")
    assert plan.returncode == 0, plan.stderr
    assert "KV: 0 blocks" not in plan.stdout
    assert "sliding window only (4096 tokens on every layer)" in plan.stdout
    demo = cli("demo", "--backend", "fake", "--model", "mistral-7b-v0.1", "--steps", "2")
    assert demo.returncode == 0, demo.stderr
    assert "SWA pool:" in demo.stdout and "Warning" not in demo.stderr


def test_demo_serves_what_its_header_says_or_refuses_as_plan_does():
    argv = ["--max-batch", "1000", "--max-seq-len", "8192"]
    demo = cli("demo", "--backend", "fake", "--model", "llama-3-8b", *argv)
    plan = cli("plan", "llama-3-8b", *argv)
    assert (demo.returncode, plan.returncode) == (2, 2), demo.stdout[-800:]
    # Refused with the plan's report, as plan refuses it: nothing served.
    assert demo.stdout.startswith("Cannot fit") and "[SERVING]" not in demo.stdout
    assert "max_batch" in demo.stdout
    # Its levers name tp, which the demo does not take: it says where to try it.
    assert "imp-mem plan llama-3-8b --tp N" in demo.stdout


# -- sizes: one rule ---------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: imp_mem.FakeBackend(capacity="80"),
        lambda: imp_mem.parse_size("80", "budget"),
        lambda: imp_mem.PlanInput(
            imp_mem.ModelShape.from_hf_config(imp_mem.preset_config("llama-3-8b")),
            imp_mem.Limits(1, 64),
            imp_mem.Features(),
            budget="80",
        ),
    ],
    ids=["fake-capacity", "parse_size", "plan-budget"],
)
def test_a_size_string_without_a_unit_is_refused_in_python(make):
    with pytest.raises(InvalidArgument, match=r'"80" has no unit; write "80GiB"'):
        make()


def test_a_ledger_budget_without_a_unit_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=r"budget: .*has no unit.*the int 10"):
        imp_mem.DeviceLedger("fake-units", "10", str(tmp_path))


def test_gb_and_g_are_gib_as_gpus_are_sold():
    assert imp_mem.parse_size("80GB") == imp_mem.parse_size("80G") == 80 << 30
    assert imp_mem.FakeBackend(capacity="80GB", backed=False).capacity == 80 << 30


@pytest.mark.parametrize(
    ("argv", "says", "never"),
    [
        (["--context", "527"], '"527MiB"', "527GiB"),
        (["--budget", "1.5"], '"1.5GiB"', "1.5B"),
        (["--budget", "1.5B"], "whole number of bytes", "Traceback"),
        (["--budget", "-1GiB"], "negative", "usage:"),
        (["--budget=-1GiB"], "negative", "cannot read"),
        (["--budget", "99999999TiB"], "too large", "cannot read"),
    ],
)
def test_cli_size_messages_say_what_is_wrong_and_a_true_fix(argv, says, never):
    done = cli("plan", "llama-3-8b", *argv)
    assert done.returncode == 2
    assert says in done.stderr and never not in done.stderr, done.stderr


# -- silent or misleading answers ----------------------------------------------


def test_a_second_ledger_open_with_another_budget_is_refused(tmp_path):
    first = imp_mem.DeviceLedger("fake-two", "10GiB", str(tmp_path))
    with pytest.raises(InvalidArgument, match=r"already shares 10\.0 GiB"):
        imp_mem.DeviceLedger("fake-two", "20GiB", str(tmp_path))
    assert imp_mem.DeviceLedger("fake-two", None, str(tmp_path)).budget == first.budget
    with pytest.raises(InvalidArgument, match="no ledger for device"):
        imp_mem.DeviceLedger("fake-none", None, str(tmp_path))


def test_a_grow_past_the_tenants_cap_names_its_cap_and_commitment(tmp_path):
    led = imp_mem.DeviceLedger("fake-cap", "10GiB", str(tmp_path))
    tenant = led.join("alone", "1GiB", "8GiB", wait_s=0)
    tenant.grow("7GiB")
    with pytest.raises(imp_mem.OutOfMemory) as info:
        tenant.grow("2GiB")
    text = str(info.value)
    assert "past its own cap of 8.00 GiB" in text and "7.00 GiB committed" in text, text
    assert "workspace" not in text and "0 B live" not in text and "10.0 GiB" not in text


def test_range_messages_are_words_not_rust_syntax():
    kv = imp_mem.KVCacheManager(16, 4)
    with pytest.raises(InvalidArgument) as info:
        kv.admit(1, [1, -7])
    assert "..=" not in str(info.value) and "outside 0 to 4294967295" in str(info.value)


def test_limits_below_one_say_at_least_one_for_negatives_too():
    with pytest.raises(InvalidArgument, match="max_batch: must be at least 1, got -1"):
        imp_mem.Limits(-1, 64)


def test_the_package_namespace_has_no_future_import():
    assert "annotations" not in dir(imp_mem)


# -- shapes checked where they are made ---------------------------------------

LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"num_key_value_heads": 5}, r"num_key_value_heads \(5\) must divide.*4 or 8"),
        ({"num_key_value_heads": 64}, r"num_key_value_heads \(64\) must divide"),
        ({"hidden_size": 4095}, r"hidden_size \(4095\) is not a multiple"),
    ],
)
def test_an_impossible_attention_geometry_is_refused(change, says):
    with pytest.raises(InvalidArgument, match=says):
        imp_mem.ModelShape.from_hf_config({**LLAMA, **change})


def test_an_explicit_head_dim_stands():
    shape = imp_mem.ModelShape.from_hf_config({**LLAMA, "hidden_size": 4095, "head_dim": 128})
    assert shape.kv_bytes_per_token()["full"] == 32 * 8 * 2 * 128 * 2


def test_a_misspelt_model_shape_field_names_the_one_meant():
    fields = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    with pytest.raises(InvalidArgument, match="did you mean num_key_value_heads"):
        imp_mem.ModelShape(**fields, num_key_value_head=8)
    assert imp_mem.ModelShape(**LLAMA).kv_bytes_per_token()["full"] == 32 * 8 * 2 * 128 * 2


# -- presets --------------------------------------------------------------------


def test_presets_from_python_by_name_or_hugging_face_id():
    listed = imp_mem.presets()
    assert listed["llama-3-8b"] == "meta-llama/Meta-Llama-3-8B"
    by_id = imp_mem.preset_config("meta-llama/Meta-Llama-3-8B")
    assert by_id == imp_mem.preset_config("llama-3-8b") and "source" not in by_id
    assert imp_mem.preset_config("qwen3_8b") == imp_mem.preset_config("qwen3-8b")
    with pytest.raises(InvalidArgument, match="did you mean qwen3-8b"):
        imp_mem.preset_config("qwen3-9b")
    shape = imp_mem.ModelShape.from_preset("Qwen/Qwen3-8B")
    assert shape == imp_mem.ModelShape.from_hf_config(imp_mem.preset_config("qwen3-8b"))
    with pytest.raises(InvalidArgument, match="did you mean qwen3-8b"):
        imp_mem.ModelShape.from_preset("qwen3-9b")


def test_the_cli_takes_a_hugging_face_id_and_suggests_near_misses():
    done = cli("plan", "meta-llama/Meta-Llama-3-8B", "--max-batch", "1", "--max-seq-len", "64")
    assert done.returncode == 0, done.stderr
    miss = cli("demo", "--backend", "fake", "--model", "qwen3-9b")
    assert miss.returncode == 2 and "did you mean qwen3-8b" in miss.stderr


# -- the command line's rough edges ----------------------------------------------


def test_every_error_under_json_is_a_json_document():
    done = cli("plan", "llama-3-8b", "--budget", "80", "--json")
    assert done.returncode == 2
    document = json.loads(done.stdout)
    assert document["error"] == "InvalidArgument" and "has no unit" in document["message"]


def test_help_texts_name_the_command_and_carry_no_markup():
    top = cli("top", "--help")
    assert top.returncode == 0 and top.stdout.startswith("usage: imp-mem top")
    assert "KV bytes live" in top.stdout and "KV blocks live" not in top.stdout
    plan = cli("plan", "--help")
    assert "``" not in plan.stdout
    demo = cli("demo", "--help")
    assert "fake backend" in demo.stdout and "(default 8, as plan's)" in demo.stdout


def test_demo_says_which_options_it_ignores_on_the_fake_backend():
    done = cli("demo", "--backend", "fake", "--seconds", "1", "--max-seq-len", "64", "--steps", "1")
    assert done.returncode == 0, done.stderr
    assert "--seconds apply to the engine on a GPU with torch" in done.stderr


def test_ledger_dir_that_is_missing_or_a_file_is_refused(tmp_path):
    missing = cli("ledger", "--once", "--dir", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    a_file = tmp_path / "f"
    a_file.write_text("")
    done = cli("ledger", "--once", "--dir", str(a_file))
    assert done.returncode == 2 and "is a file, not a directory" in done.stderr
    assert "IMP_MEM_LEDGER_DIR" not in done.stderr


def test_the_engine_without_torch_says_what_to_install():
    done = run_without_torch(
        """
        try:
            from imp_mem.engine import Engine
        except ImportError as exc:
            print(type(exc).__name__, exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "pip install imp-mem[torch]" in done.stdout and "Traceback" not in done.stderr


def test_an_unknown_model_type_is_planned_with_a_warning():
    with pytest.warns(imp_mem.ImpMemWarning, match=r'model_type "llamma" is not one the planner'):
        shape = imp_mem.ModelShape.from_hf_config({**LLAMA, "model_type": "llamma"})
    assert shape.kv_bytes_per_token()["full"] == 32 * 8 * 2 * 128 * 2


def test_a_plan_plots_from_python_as_the_cli_draws_it():
    pytest.importorskip("matplotlib")
    shape = imp_mem.ModelShape.from_hf_config(imp_mem.preset_config("llama-3-8b"))
    plan = imp_mem.plan_memory(
        imp_mem.PlanInput(shape, imp_mem.Limits(1, 64), imp_mem.Features(), budget="24GiB")
    )
    fig = imp_mem.plot_plan(plan, title="llama-3-8b")
    ax = fig.axes[0]
    assert ax.get_title() == "llama-3-8b"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("headroom") for label in labels)
    with pytest.raises(imp_mem.PlanFailure) as info:
        imp_mem.plan_memory(
            imp_mem.PlanInput(shape, imp_mem.Limits(1, 64), imp_mem.Features(), budget="8GiB")
        )
    over = imp_mem.plot_plan(info.value)
    labels = [t.get_text() for t in over.axes[0].get_legend().get_texts()]
    assert any(label.startswith("over budget by") for label in labels)
    assert any("levers" in t.get_text() for t in over.axes[0].texts)
    with pytest.raises(InvalidArgument, match="MemoryPlan or a PlanFailure"):
        imp_mem.plot_plan("plan")


def test_a_preset_or_a_one_tier_plan_refuses_a_bad_argument_typed():
    # Found by tests/test_misuse.py's random calls: a NumPy array as a
    # preset's name raised AttributeError, a negative context OverflowError.
    with pytest.raises(TypeError, match="preset"):
        imp_mem.ModelShape.from_preset([0, 1, 2])
    with pytest.raises(imp_mem.InvalidArgument, match="context"):
        imp_mem.MemoryPlan.activations_room(0, -(1 << 63))
    with pytest.raises(imp_mem.InvalidArgument, match="activations"):
        imp_mem.MemoryPlan.activations_only(1 << 30, 0, -1)
