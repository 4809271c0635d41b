"""Small helpers torch_memory_saver's users and its test suite import
(``change_env``, ``is_xpu``, ``get_binary_path_from_package``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def is_xpu() -> bool:
    """Whether torch drives an Intel XPU here (imp-mem does not: always checked
    so callers can branch as they do on the original)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(hasattr(torch, "xpu") and torch.xpu.is_available())


def get_binary_path_from_package(stem: str) -> str:
    """The shared library of a hook mode: imp-mem's interposer for the preload
    stems (``imp_mem._preload.library_path()``), imp-mem's extension module
    (which exports the torch hooks) for the torch ones."""
    if "preload" in stem:
        from imp_mem import _preload

        return _preload.library_path()
    from imp_mem import _core

    return _core.hook_library_path()


@contextlib.contextmanager
def change_env(key: str, value: str) -> Iterator[None]:
    """``os.environ[key] = value`` for the block; the old value (or its absence)
    back afterwards."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
