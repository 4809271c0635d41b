"""Preload mode: imp-mem's interposer (``imp_mem._preload``, LD_PRELOADed)
catches every ``cudaMalloc`` / ``cudaFree`` of a thread inside a region, so
that NCCL's, cuBLAS's or a training framework's allocations land in the
region too. :func:`configure_subprocess` puts the interposer in
``LD_PRELOAD`` for the child processes started inside it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from imp_mem.torch_memory_saver.hooks.base import HookUtilBase
from imp_mem.torch_memory_saver.utils import change_env, get_binary_path_from_package

PRELOAD_STEM = "imp_mem_preload"


class HookUtilModePreload(HookUtilBase):
    """The interposer must already be in this process (started under
    ``LD_PRELOAD``, e.g. by a parent inside :func:`configure_subprocess`)."""

    def get_path_binary(self) -> str:
        """The interposer loaded in this process; BackendUnavailable naming
        the fix where it is not."""
        from imp_mem.errors import BackendUnavailable

        try:
            from imp_mem import _preload
        except ImportError as exc:
            raise BackendUnavailable(
                "hook_mode='preload' needs imp-mem's interposer (imp_mem._preload), which this "
                "install lacks; set torch_memory_saver.hook_mode = 'torch'"
            ) from exc
        if not _preload.loaded():
            raise BackendUnavailable(
                "hook_mode='preload': imp-mem's interposer is not in this process "
                f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}, pid {os.getpid()}); start it "
                "inside torch_memory_saver.configure_subprocess(), or with "
                f"LD_PRELOAD={_preload.library_path()}, or set "
                "torch_memory_saver.hook_mode = 'torch'"
            )
        return _preload.library_path()


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """Inside the block, ``LD_PRELOAD`` (in ``os.environ``, so children started
    there inherit it) begins with imp-mem's interposer, whatever it held
    before kept after it; restored on exit. Only preload mode needs it."""
    lib = str(get_binary_path_from_package(PRELOAD_STEM))
    current = os.environ.get("LD_PRELOAD", "")
    with change_env("LD_PRELOAD", f"{lib}:{current}" if current else lib):
        yield
