"""The per-thread region configuration (tag, whether allocations are caught,
CPU backup and its kind), and a view of it under the C names
torch_memory_saver's library exports (``tms_get_current_tag()`` ...), which
its test suite and some callers read through ``_impl._binary_wrapper.cdll``.

The configuration starts from the ``TMS_INIT_*`` environment variables, read
when a thread first looks (as the original's thread-local state does):
``TMS_INIT_ENABLE`` (allocations are caught outside any ``region()``, under
the tag ``"default"``; preload mode), ``TMS_INIT_ENABLE_CPU_BACKUP``,
``TMS_INIT_CPU_BACKUP_BACKEND`` (``pinned`` or ``mmap``) and
``TMS_INIT_ENABLE_DISK_BACKUP``. ``TMS_RETAIN_CPU_BACKUP`` sets the
process-wide ``retain_cpu_backup`` at start.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from imp_mem.errors import InvalidArgument

CPU_BACKUP_BACKENDS = ("pinned", "mmap")
_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO", "")


def env_flag(name: str) -> bool:
    """A boolean environment variable as the original reads one; anything else
    than its spellings of yes and no is refused, naming the variable."""
    value = os.environ.get(name, "")
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidArgument(f"{name}: expected 1/true/yes or 0/false/no, got {value!r}")


def env_backend() -> str:
    """``TMS_INIT_CPU_BACKUP_BACKEND`` (default ``pinned``), checked."""
    value = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
    if value not in CPU_BACKUP_BACKENDS:
        raise InvalidArgument(
            f"TMS_INIT_CPU_BACKUP_BACKEND: expected 'pinned' or 'mmap', got {value!r}"
        )
    return value


class RegionConfig(threading.local):
    """This thread's configuration: what ``region()`` sets and restores."""

    def __init__(self) -> None:
        self.tag = "default"
        self.interesting = env_flag("TMS_INIT_ENABLE")
        self.enable_cpu_backup = env_flag("TMS_INIT_ENABLE_CPU_BACKUP")
        self.cpu_backup_backend = env_backend()
        self.enable_disk_backup = env_flag("TMS_INIT_ENABLE_DISK_BACKUP")

    def snapshot(self) -> tuple[str, bool, bool, str, bool]:
        return (
            self.tag,
            self.interesting,
            self.enable_cpu_backup,
            self.cpu_backup_backend,
            self.enable_disk_backup,
        )

    def restore(self, saved: tuple[str, bool, bool, str, bool]) -> None:
        (
            self.tag,
            self.interesting,
            self.enable_cpu_backup,
            self.cpu_backup_backend,
            self.enable_disk_backup,
        ) = saved


class ConfigView:
    """The configuration under the original library's exported names (bytes
    for strings, as ctypes returns them). Other names (``cudaHostGetFlags``,
    ...) are looked up in the CUDA runtime torch loaded."""

    def __init__(self, impl: Any) -> None:
        self._impl = impl

    @property
    def _config(self) -> RegionConfig:
        return self._impl._config

    def tms_get_current_tag(self) -> bytes:
        return self._config.tag.encode()

    def tms_set_current_tag(self, tag: bytes) -> None:
        self._config.tag = tag.decode()

    def tms_get_interesting_region(self) -> bool:
        return self._config.interesting

    def tms_set_interesting_region(self, value: bool) -> None:
        self._config.interesting = bool(value)

    def tms_get_enable_cpu_backup(self) -> bool:
        return self._config.enable_cpu_backup

    def tms_set_enable_cpu_backup(self, value: bool) -> None:
        self._config.enable_cpu_backup = bool(value)

    def tms_get_cpu_backup_backend(self) -> bytes:
        return self._config.cpu_backup_backend.encode()

    def tms_set_cpu_backup_backend(self, value: bytes) -> None:
        self._config.cpu_backup_backend = value.decode()

    def tms_get_enable_disk_backup(self) -> bool:
        return self._config.enable_disk_backup

    def tms_set_enable_disk_backup(self, value: bool) -> None:
        self._config.enable_disk_backup = bool(value)

    def tms_get_retain_cpu_backup(self) -> bool:
        return self._impl.retain_cpu_backup

    def tms_set_retain_cpu_backup(self, value: bool) -> None:
        self._impl.retain_cpu_backup = bool(value)

    def set_memory_margin_bytes(self, value: int) -> None:
        self._impl.memory_margin_bytes = int(value)

    def tms_pause(self, tag: bytes | None) -> int:
        self._impl.pause(tag.decode() if tag else None)
        return 0

    def tms_resume(self, tag: bytes | None) -> int:
        self._impl.resume(tag.decode() if tag else None)
        return 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("cuda"):
            return getattr(_cudart(), name)
        raise AttributeError(name)


_cudart_lib: list[Any] = []


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (found in this process's maps)."""
    if not _cudart_lib:
        import torch

        torch.cuda.init()
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart.so" in line:
                    path = line.split()[-1]
                    break
        _cudart_lib.append(ctypes.CDLL(path or "libcudart.so"))
    return _cudart_lib[0]


class BinaryWrapper:
    """Holds the view (``.cdll``), as the original's wrapper holds its library
    (``path_binary``: the library that catches the allocations, kept for
    reference; ``impl``: the saver whose state the view shows)."""

    def __init__(self, path_binary: str, *, impl: Any) -> None:
        self.path_binary = path_binary
        self.cdll = ConfigView(impl)

    def set_config(
        self,
        *,
        tag: str,
        interesting_region: bool,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None = None,
        enable_disk_backup: bool = False,
    ) -> None:
        """Sets this thread's configuration (``cpu_backup_backend=None`` keeps it)."""
        config = self.cdll._config
        config.tag = tag
        config.interesting = interesting_region
        config.enable_cpu_backup = enable_cpu_backup
        if cpu_backup_backend is not None:
            config.cpu_backup_backend = cpu_backup_backend
        config.enable_disk_backup = enable_disk_backup
