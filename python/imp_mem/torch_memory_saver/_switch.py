"""The one switch: after :func:`install`, ``import torch_memory_saver`` (and
``torch_memory_saver.<sub>``) gives imp-mem's modules, so SGLang's, verl's
and slime's code runs unchanged on imp-mem.

A meta-path finder placed first aliases each name ``torch_memory_saver[.X]``
to ``imp_mem.torch_memory_saver[.X]``: the same module object under both
names, so a patch through one is seen through the other. ``IMP_MEM_TORCH_MEMORY_SAVER=1``
in the environment does the same at interpreter start, through the
``imp_mem_torch_memory_saver.pth`` file the wheel installs in site-packages,
so worker processes that SGLang or Ray spawn get it without importing
imp_mem first. Without the switch nothing changes. This module imports
neither torch nor the saver until an aliased name is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from types import ModuleType
from typing import Any

ENV_SWITCH = "IMP_MEM_TORCH_MEMORY_SAVER"
ALIAS = "torch_memory_saver"
TARGET = "imp_mem.torch_memory_saver"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias's spec on the real module;
        # give it its own back (its relative imports and reloads use it).
        real = sys.modules[self.target]
        own = getattr(real, "__imp_mem_spec__", None)
        if own is not None:
            module.__spec__ = own


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_memory_saver`` and its submodules as imp-mem's."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real_name = TARGET + fullname[len(ALIAS) :]
        real = importlib.import_module(real_name)
        if not hasattr(real, "__imp_mem_spec__"):
            real.__imp_mem_spec__ = real.__spec__  # type: ignore[attr-defined]
        is_pkg = hasattr(real, "__path__")
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(real_name), is_package=is_pkg)
        if is_pkg:
            spec.submodule_search_locations = list(real.__path__)
        return spec


_finder = _AliasFinder()


def install() -> None:
    """From now on ``import torch_memory_saver`` gives imp-mem's drop-in. Code
    that already imported the original keeps it: a warning says so."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    already = sys.modules.get(ALIAS)
    if already is not None and not getattr(already, "__name__", "").startswith(TARGET):
        from imp_mem.errors import ImpMemWarning

        warnings.warn(
            "torch_memory_saver was imported before imp_mem.torch_memory_saver.install(); "
            "code holding it keeps the original. Install the switch first (or set "
            f"{ENV_SWITCH}=1 before the interpreter starts)",
            ImpMemWarning,
            stacklevel=2,
        )
        for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
            del sys.modules[name]


def uninstall() -> None:
    """Undoes :func:`install` for later imports (modules already imported stay)."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]


def installed() -> bool:
    """Whether the switch is on in this process."""
    return _finder in sys.meta_path


def install_from_env() -> None:
    """:func:`install` where ``IMP_MEM_TORCH_MEMORY_SAVER`` is set to a yes
    (1, true, yes); called by the ``.pth`` file at interpreter start."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on"):
        install()
