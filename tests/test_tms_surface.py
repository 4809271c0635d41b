"""imp-mem's torch_memory_saver drop-in has every public name and signature
of torch_memory_saver 0.0.10 (issue 51): the list in
``data/tms_0_0_10_surface.json``, extracted from the 0.0.10 wheel's sources
with ``ast`` by ``tools/tms_surface.py`` (the wheel is not needed here; where
it is present, the list is checked to be what it holds)."""

from __future__ import annotations

import glob
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SURFACE = Path(__file__).parent / "data" / "tms_0_0_10_surface.json"
PREFIX = "torch_memory_saver"


def _ours(module: str):
    name = "imp_mem." + module.removesuffix(".__init__")
    return importlib.import_module(name)


def _cases():
    data = json.loads(SURFACE.read_text())
    for module, names in data["modules"].items():
        for name, entry in names.items():
            yield pytest.param(module, name, entry, id=f"{module}:{name}")


def _check_params(where: str, ours, theirs: list[dict]) -> None:
    params = list(inspect.signature(ours).parameters.values())
    for i, want in enumerate(theirs):
        assert i < len(params), f"{where}: has no parameter {want['name']!r}"
        got = params[i]
        assert got.name == want["name"], (
            f"{where}: parameter {i} is {got.name!r}, not {want['name']!r}"
        )
        if want["kind"] == "positional":
            assert got.kind in (got.POSITIONAL_ONLY, got.POSITIONAL_OR_KEYWORD), where
        default = want["default"]
        if "none" in default:
            assert got.default is got.empty, f"{where}: {got.name} has a default"
        elif "repr" in default:
            assert got.default is not got.empty, f"{where}: {got.name} needs a default"
            assert repr(got.default) == default["repr"], f"{where}: {got.name}={got.default!r}"
    # Anything ours adds must not be required.
    for extra in params[len(theirs) :]:
        assert (
            extra.default is not extra.empty
            or extra.kind
            in (
                extra.VAR_POSITIONAL,
                extra.VAR_KEYWORD,
            )
            or extra.kind == extra.KEYWORD_ONLY
        ), f"{where}: extra required {extra.name!r}"


@pytest.mark.parametrize(("module", "name", "entry"), list(_cases()))
def test_every_public_name_of_0_0_10_has_its_signature_here(module, name, entry):
    mod = _ours(module)
    assert hasattr(mod, name), f"{module} lacks {name}"
    obj = getattr(mod, name)
    where = f"{module}.{name}"
    if entry["kind"] == "function":
        _check_params(where, obj, entry["params"])
    elif entry["kind"] == "class":
        assert inspect.isclass(obj), where
        for member, spec in entry["members"].items():
            raw = inspect.getattr_static(obj, member, None)
            assert raw is not None, f"{where} lacks {member}"
            if spec["kind"] == "property":
                assert isinstance(raw, property), f"{where}.{member} is no property"
                if spec.get("settable"):
                    assert raw.fset is not None, f"{where}.{member} cannot be set"
            elif member == "__init__" and [p["name"] for p in spec["params"]] == ["self"]:
                continue
            else:
                fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                _check_params(f"{where}.{member}", fn, spec["params"])


def test_the_singleton_is_a_torch_memory_saver():
    from imp_mem.torch_memory_saver import TorchMemorySaver, torch_memory_saver

    assert isinstance(torch_memory_saver, TorchMemorySaver)
    assert torch_memory_saver.enabled is True


def test_the_list_is_what_the_wheel_holds_where_the_wheel_is_here():
    wheels = glob.glob(str(ROOT.parent / "main" / ".whl" / "torch_memory_saver-0.0.10-*.whl"))
    wheels += glob.glob(os.environ.get("TMS_WHEEL", "/nonexistent"))
    if not wheels:
        pytest.skip("the torch_memory_saver 0.0.10 wheel is not here")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "tms_surface.py"), wheels[0]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["modules"] == json.loads(SURFACE.read_text())["modules"]
