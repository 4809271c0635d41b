"""The type stubs (`_core.pyi`) name exactly what the compiled module has:
every public class, function and method on both sides."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import imp_mem
from imp_mem import _core

STUB = Path(__file__).resolve().parents[1] / "python" / "imp_mem" / "_core.pyi"
# type aliases, not runtime names
STUB_ONLY = {
    "ByteCount",
    "TagName",
    "JournalRow",
    "DTypeLike",
    "TokenIds",
    "MmItem",
    "KvEventTuple",
    "StrOrBytesPath",
}


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = (
                {
                    item.name
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                | {
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
                | {
                    target.id
                    for item in node.body
                    if isinstance(item, ast.Assign)
                    for target in item.targets
                    if isinstance(target, ast.Name)
                }
            )
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = set()
    return names


def _public(obj) -> set[str]:
    return {n for n in vars(obj) if not n.startswith("_")}


def test_every_runtime_name_has_a_stub_and_back():
    stubs = _stub_names()
    # Public names, and private ones that are not dunders (test hooks such
    # as ``_set_buffer_protocol``): stubbed too, so both lists stay whole.
    runtime = {n for n in dir(_core) if not n.startswith("__")} | {"__version__"}
    assert runtime - set(stubs) == set(), "compiled names missing from _core.pyi"
    assert set(stubs) - runtime - STUB_ONLY == set(), "_core.pyi names that do not exist"


def test_every_public_method_has_a_stub_and_back():
    stubs = _stub_names()
    for name, members in stubs.items():
        cls = getattr(_core, name, None)
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        runtime = _public(cls)
        members = {m for m in members if not m.startswith("_")}
        assert runtime - members == set(), f"{name}: methods missing from _core.pyi"
        assert members - runtime == set(), f"{name}: stubbed methods that do not exist"


def test_package_exports_resolve():
    for name in imp_mem.__all__:
        assert hasattr(imp_mem, name), name
