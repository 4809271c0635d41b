"""Extracts torch_memory_saver's public Python surface (every module's public
functions and classes, their methods and properties, each parameter's name,
kind and default) from a wheel of it, by parsing its sources with ``ast``
(nothing of it is imported), and writes it as JSON: the list
``tests/test_tms_surface.py`` holds imp-mem's drop-in to (issue 51).

    python tools/tms_surface.py torch_memory_saver-0.0.10-*.whl > tests/data/tms_0_0_10_surface.json
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile

PACKAGE = "torch_memory_saver"


def _constants(tree: ast.Module) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    out[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out


def _default(node: ast.expr | None, consts: dict[str, object]) -> object:
    if node is None:
        return {"none": True}
    if isinstance(node, ast.Name) and node.id in consts:
        return {"repr": repr(consts[node.id])}
    try:
        return {"repr": repr(ast.literal_eval(node))}
    except ValueError:
        return {"expr": ast.unparse(node)}


def _params(fn: ast.FunctionDef, consts: dict[str, object]) -> list[dict[str, object]]:
    a = fn.args
    out: list[dict[str, object]] = []
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(
        a.defaults
    )
    for arg, d in zip(positional, defaults, strict=True):
        out.append({"name": arg.arg, "kind": "positional", "default": _default(d, consts)})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional", "default": {"none": True}})
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append({"name": arg.arg, "kind": "keyword_only", "default": _default(d, consts)})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "default": {"none": True}})
    return out


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "property")
        or (isinstance(d, ast.Attribute) and d.attr in ("setter", "getter"))
        for d in fn.decorator_list
    )


def _setter(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in fn.decorator_list)


def surface(sources: dict[str, str]) -> dict[str, object]:
    """``{module: {name: entry}}`` of every public top-level name."""
    modules: dict[str, object] = {}
    for module, text in sorted(sources.items()):
        tree = ast.parse(text)
        consts = _constants(tree)
        names: dict[str, object] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                names[node.name] = {"kind": "function", "params": _params(node, consts)}
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                members: dict[str, object] = {}
                for item in node.body:
                    if not isinstance(item, ast.FunctionDef):
                        continue
                    if item.name.startswith("_") and item.name not in (
                        "__init__",
                        "_ensure_initialized",
                    ):
                        continue
                    if _is_property(item):
                        entry = members.setdefault(item.name, {"kind": "property"})
                        if _setter(item):
                            entry["settable"] = True  # type: ignore[index]
                    else:
                        members[item.name] = {"kind": "method", "params": _params(item, consts)}
                names[node.name] = {"kind": "class", "members": members}
            elif isinstance(node, ast.ImportFrom) and module.endswith("__init__"):
                for alias in node.names:
                    names[alias.asname or alias.name] = {"kind": "reexport"}
            elif isinstance(node, ast.Assign) and module.endswith("__init__"):
                for t in node.targets:
                    if isinstance(t, ast.Name) and not t.id.startswith("_"):
                        names[t.id] = {"kind": "value"}
        modules[module] = names
    return modules


def main(wheel: str) -> None:
    sources: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(PACKAGE + "/") and name.endswith(".py"):
                module = name[:-3].replace("/", ".")
                sources[module] = z.read(name).decode()
    json.dump(
        {"wheel": wheel.rsplit("/", 1)[-1], "modules": surface(sources)}, sys.stdout, indent=1
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
