"""The one switch (issue 51): ``import torch_memory_saver`` resolves to
imp-mem's drop-in after ``imp_mem.torch_memory_saver.install()``, or with
``IMP_MEM_TORCH_MEMORY_SAVER=1`` through the ``.pth`` file the wheel
installs; without it, nothing changes. Each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parent.parent / "python"
PTH = PYTHON_DIR / "imp_mem_torch_memory_saver.pth"

PROBE = """
import sys
try:
    import torch_memory_saver
except ImportError:
    print("absent")
else:
    print(torch_memory_saver.__name__)
print("torch" in sys.modules)
"""


def _run(code: str, env_switch: str | None = None) -> list[str]:
    # The installed wheel is imported, as everywhere in tests/ (python/ holds
    # no compiled extension): the child inherits this interpreter's path.
    env = dict(os.environ)
    env.pop("IMP_MEM_TORCH_MEMORY_SAVER", None)
    if env_switch is not None:
        env["IMP_MEM_TORCH_MEMORY_SAVER"] = env_switch
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return out.stdout.split()


def test_without_the_switch_nothing_changes():
    name = _run(PROBE)[0]
    assert name in ("absent", "torch_memory_saver"), name


def test_install_aliases_the_package_and_its_submodules():
    code = """
import imp_mem.torch_memory_saver as ours
ours.install()
import torch_memory_saver
import torch_memory_saver.utils, torch_memory_saver.testing_utils
import torch_memory_saver.hooks.mode_preload as mp
from torch_memory_saver import torch_memory_saver as saver, configure_subprocess
from torch_memory_saver.entrypoint import TorchMemorySaver
import imp_mem.torch_memory_saver.hooks.mode_preload as our_mp
print(torch_memory_saver is ours, mp is our_mp, saver is ours.torch_memory_saver)
print(isinstance(saver, TorchMemorySaver), configure_subprocess is our_mp.configure_subprocess)
print(torch_memory_saver.__spec__.name)
ours.uninstall()
import importlib, sys
try:
    m = importlib.import_module("torch_memory_saver")
    print(m.__name__)
except ImportError:
    print("absent")
"""
    out = _run(code)
    assert out[:5] == ["True"] * 5
    assert out[5] == "imp_mem.torch_memory_saver"
    assert out[6] in ("absent", "torch_memory_saver"), "uninstall() undoes the alias"


@pytest.mark.parametrize(("value", "ours"), [("1", True), ("yes", True), ("0", False), ("", False)])
def test_the_pth_file_switches_on_at_interpreter_start_only_when_asked(tmp_path, value, ours):
    # A site directory holding the wheel's .pth, processed as site-packages is.
    (tmp_path / PTH.name).write_text(PTH.read_text())
    code = f"import site; site.addsitedir({str(tmp_path)!r})\n" + PROBE
    out = _run(code, env_switch=value)
    if ours:
        assert out == ["imp_mem.torch_memory_saver", "False"], (
            "resolved to imp-mem, torch not loaded"
        )
    else:
        assert out[0] in ("absent", "torch_memory_saver")


def test_install_after_the_original_was_imported_warns_and_takes_over_later_imports():
    code = """
import sys, types, warnings
sys.modules["torch_memory_saver"] = types.ModuleType("torch_memory_saver")
import imp_mem.torch_memory_saver as ours
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ours.install()
print(any("imported before" in str(x.message) for x in w))
import torch_memory_saver
print(torch_memory_saver is ours)
"""
    assert _run(code) == ["True", "True"]
