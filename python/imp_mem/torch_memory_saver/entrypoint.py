"""``TorchMemorySaver``: torch_memory_saver 0.0.10's public class, every name
and signature of it, over :class:`._impl.SaverImpl` (made at the first call
that needs it, after which ``hook_mode`` is fixed), plus imp-mem's additions
``mem_report()`` and ``wait_pinned()``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal

from imp_mem.errors import InvalidArgument
from imp_mem.torch_memory_saver.binary_wrapper import CPU_BACKUP_BACKENDS, env_flag
from imp_mem.torch_memory_saver.hooks.base import HOOK_MODES, HookMode
from imp_mem.torch_memory_saver.utils import is_xpu

_TAG_DEFAULT = "default"
CpuBackupBackend = Literal["mmap", "pinned"]


class TorchMemorySaver:
    """Marks allocations (``region``, ``cuda_graph``) whose device memory
    ``pause`` gives back and ``resume`` brings back at the same addresses."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict[str, Any] = {}
        self._impl: Any = None

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """The block's allocations (this thread's) land in the region of
        ``tag``; with ``enable_cpu_backup`` a pause keeps their bytes in host
        memory (``cpu_backup_backend``: ``"pinned"``, the default, pins the
        buffer ahead so the first pause copies at the line rate; ``"mmap"``
        takes host memory only while paused), without it a resume gives
        them back undefined. Regions nest; the outer configuration comes
        back on exit. ``enable_disk_backup`` is refused (BackendUnavailable):
        imp-mem keeps paused bytes in host memory."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        if enable_cpu_backup and enable_disk_backup:
            raise InvalidArgument(
                "enable_disk_backup: it excludes enable_cpu_backup; pass one of them"
            )
        with impl.region(
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
            enable_disk_backup=enable_disk_backup,
            cpu_backup_backend=cpu_backup_backend,
        ):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode)``
        whose capture's memory is the region of ``tag`` (pausable; the graph
        replays after a resume without re-capture). In torch mode the capture
        uses the region's pool unless ``pool`` names another."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        with impl.cuda_graph(
            cuda_graph=cuda_graph,
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
            cpu_backup_backend=cpu_backup_backend,
        ):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Inside a region, the block's allocations use torch's own allocator
        in a pool of their own, given back at the end. InvalidArgument outside
        any region."""
        impl = self._ensure_initialized()
        with impl.disable():
            yield

    def pause(self, tag: str | None = None) -> None:
        """Gives the device memory of ``tag``'s regions (every region's when
        None) back, addresses kept, CPU backups taken; all or none. A tag
        with no region is a no-op (as in the original); a region already
        paused is refused (InvalidArgument) and nothing changes."""
        self._ensure_initialized().pause(tag=tag)

    def resume(self, tag: str | None = None) -> None:
        """Brings ``tag``'s regions (every region when None) back at the same
        addresses, CPU backups restored; all or none. A region not paused is
        refused (InvalidArgument); no room raises OutOfMemory naming what
        torch's cache holds, every region staying paused for a retry."""
        self._ensure_initialized().resume(tag=tag)

    @property
    def enabled(self) -> bool:
        """Always True (kept for compatibility, as in the original)."""
        return True

    @property
    def hook_mode(self) -> str:
        """``"preload"`` (the default) or ``"torch"``; set it before the first
        region."""
        if self._impl is not None:
            return self._impl._hook_mode
        return self._impl_ctor_kwargs.get("hook_mode", "preload")

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode) -> None:
        if hook_mode not in HOOK_MODES:
            raise InvalidArgument(f"hook_mode: expected 'preload' or 'torch', got {hook_mode!r}")
        if self._impl is not None:
            if hook_mode != self._impl._hook_mode:
                raise InvalidArgument(
                    f"hook_mode: the saver already runs in {self._impl._hook_mode!r} mode; set "
                    "hook_mode before the first region"
                )
            return
        self._impl_ctor_kwargs["hook_mode"] = hook_mode
        if hook_mode == "preload" and env_flag("TMS_INIT_ENABLE"):
            # The original catches allocations from the process's first one
            # on; here the routing starts once the mode is known.
            self._ensure_initialized()

    @property
    def memory_margin_bytes(self) -> int:
        """Device bytes a resume must leave free (0: none), else OutOfMemory."""
        return self._ensure_initialized().memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(
                f"memory_margin_bytes: expected bytes (an int >= 0), got {value!r}"
            )
        self._ensure_initialized().memory_margin_bytes = value

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether a resume keeps the CPU backup (pinned; the next pause reuses
        it at the same address) or gives it back. Default:
        ``TMS_RETAIN_CPU_BACKUP`` (else False)."""
        return bool(self._ensure_initialized().retain_cpu_backup)

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized().retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """The host copy of ``x`` (a contiguous tensor made in a region with a
        CPU backup) while paused, or kept after the resume; None where no copy
        is held. ``zero_copy`` returns a view of the backup itself (valid while
        it is held) instead of a clone."""
        return self._ensure_initialized().get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str) -> None:
        """Refused (BackendUnavailable): imp-mem keeps paused bytes in host
        memory, not in files."""
        from imp_mem.errors import BackendUnavailable

        self._ensure_initialized()
        os.fspath(path)
        raise BackendUnavailable(
            "set_disk_backup_dir: imp-mem keeps paused bytes in host memory, not in files; use "
            "enable_cpu_backup=True"
        )

    def mem_report(self) -> dict[str, Any]:
        """imp-mem's memory report of the saver: per tag ``device_bytes``
        (committed), ``live_bytes``, ``host_bytes`` (the CPU backup) and
        ``paused``; per device the backend's ledger (``stats()``)."""
        return self._ensure_initialized().mem_report()

    def wait_pinned(self) -> float:
        """Waits until the host buffers being pinned ahead are pinned; the
        seconds the pinning took."""
        return self._ensure_initialized().wait_pinned()

    def _validate_cpu_backup_backend(
        self, enable_cpu_backup: bool, cpu_backup_backend: CpuBackupBackend | None
    ) -> None:
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if is_xpu():
            raise ValueError("cpu_backup_backend is not supported on XPU")
        if cpu_backup_backend not in CPU_BACKUP_BACKENDS:
            raise InvalidArgument(
                f"cpu_backup_backend: expected 'pinned' or 'mmap', got {cpu_backup_backend!r}"
            )

    def _ensure_initialized(self) -> Any:
        if self._impl is None:
            from imp_mem.torch_memory_saver._impl import SaverImpl

            self._impl = SaverImpl(**self._impl_ctor_kwargs)
        return self._impl
