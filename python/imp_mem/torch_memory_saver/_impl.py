"""The saver's state machine on imp-mem's regions: which region an allocation
lands in, all-or-nothing pause and resume, the CPU backup's host buffer
(pinned ahead, kept or given back), ``get_cpu_backup`` and the memory report.

One :class:`imp_mem.torch.Region` per ``(tag, backup kind, device)`` (its
``imp_mem.torch`` name: ``torch_memory_saver:<tag>:<kind>:<device>``), so that
``region(enable_cpu_backup=True)`` and ``region(enable_cpu_backup=False)`` of
one tag are two tiers that ``pause(tag)`` pauses together, as the original
keys its pools. Each reserves the device's total memory as address space on
the device's VMM backend and commits only what its allocations reach (a
*measured* ``imp_mem.torch`` region, in 2 MiB chunks, never frozen).

Threads: the configuration is per thread (:class:`RegionConfig`); the region
table is guarded by ``_lock``; pause and resume hold it for their whole run,
so two of them never interleave. A pinning thread per region fills the host
buffer ahead of the first pause; pause joins it first.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

import imp_mem.torch as imt
from imp_mem import _core
from imp_mem.errors import BackendUnavailable, ImpMemWarning, InvalidArgument, OutOfMemory
from imp_mem.torch_memory_saver.binary_wrapper import (
    CPU_BACKUP_BACKENDS,
    BinaryWrapper,
    RegionConfig,
    env_flag,
)
from imp_mem.torch_memory_saver.hooks.base import HOOK_MODES, HookUtilBase

REGION_PREFIX = "torch_memory_saver"
# What a region commits at a time as it grows: torch_memory_saver rounds each
# allocation to the VMM granularity (2 MiB) too.
COMMIT_CHUNK = 2 << 20


class Key(NamedTuple):
    """What tells two regions apart."""

    tag: str
    backup: str  # "none", "pinned" or "mmap"
    device: int

    @property
    def pool_key(self) -> tuple[str, bool, bool, str, int]:
        """The original's key of this region's pool: ``(tag, enable_cpu_backup,
        enable_disk_backup, cpu_backup_backend or "", device)``."""
        backup = self.backup != "none"
        return (self.tag, backup, False, self.backup if backup else "", self.device)

    @property
    def name(self) -> str:
        """The region's name in ``imp_mem.torch.regions()``."""
        return f"{REGION_PREFIX}:{self.tag}:{self.backup}:{self.device}"


def _current_device() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


class SaverImpl:
    """The saver once its hook mode is fixed (made at the first call that
    needs it, as the original makes its implementation)."""

    def __init__(self, hook_mode: str = "preload") -> None:
        if hook_mode not in HOOK_MODES:
            raise InvalidArgument(f"hook_mode: expected 'preload' or 'torch', got {hook_mode!r}")
        self._hook_mode = hook_mode
        self._hook_util = HookUtilBase.create(hook_mode)  # type: ignore[arg-type]
        # Refuses (preload mode) where the interposer is not in the process.
        path = self._hook_util.get_path_binary()
        self._config = RegionConfig()
        self._binary_wrapper = BinaryWrapper(path, impl=self)
        self._lock = threading.RLock()
        self._backends: dict[int, Any] = {}
        self._regions: dict[Key, Any] = {}
        self._pinners: dict[Key, _Pinner] = {}
        # The regions under the original's pool keys (its test suite takes
        # one out to drop it): see _PoolRef.
        self._mem_pools: dict[tuple[str, bool, bool, str, int], _PoolRef] = {}
        self.retain_cpu_backup = env_flag("TMS_RETAIN_CPU_BACKUP")
        self.memory_margin_bytes = 0
        # TMS_INIT_ENABLE (preload mode): this thread's allocations are
        # caught from the start, under the tag "default", for the process's life.
        self._init_route = contextlib.ExitStack()
        if hook_mode == "preload" and self._config.interesting:
            self._init_route.enter_context(self._route(self._region_for(self._key_now())))

    # -- regions ---------------------------------------------------------

    def _backend(self, device: int) -> Any:
        backend = self._backends.get(device)
        if backend is None:
            # No handle cache: a pause gives its memory back to the driver
            # (as the original does), and a region that drops its bytes
            # never gets another's old bytes back.
            backend = self._backends[device] = _core.VmmBackend(device=device, cache_chunks=0)
        return backend

    def _key_now(self) -> Key:
        c = self._config
        backup = c.cpu_backup_backend if c.enable_cpu_backup else "none"
        return Key(c.tag, backup, _current_device())

    def _region_for(self, key: Key) -> Any:
        """The region of ``key``, made on first use (its capacity: the
        device's total memory, as reserved address space)."""
        with self._lock:
            found = self._regions.get(key)
            if found is not None:
                return found
            if key.name in imt._regions:
                found = imt._regions[key.name]
            else:
                backend = self._backend(key.device)
                capacity = backend.stats()["capacity"]
                # A measured region: reserved whole, committed in chunks as
                # its blocks reach further (never frozen).
                imt.region(
                    backend,
                    key.name,
                    capacity=capacity,
                    cpu_backup=key.backup != "none",
                    device=key.device,
                    measure_chunk=COMMIT_CHUNK,
                )
                found = imt._regions[key.name]
            self._regions[key] = found
            self._mem_pools[key.pool_key] = _PoolRef(self, key)
            return found

    def _refuse_paused(self, tag: str) -> None:
        if any(k.tag == tag and r.activations.asleep is not None for k, r in self._regions.items()):
            raise InvalidArgument(
                f"tag: {tag!r} is paused; resume({tag!r}) before allocating in its region"
            )

    @contextlib.contextmanager
    def _route(self, found: Any) -> Iterator[None]:
        """This thread's allocations go to ``found`` for the block; refused
        while any region of its tag is paused (a resume of the tag would
        then find part of it awake)."""
        self._refuse_paused(found.tag.split(":")[1])
        if self._hook_mode == "torch":
            with found.scope():
                yield
            return
        from imp_mem import _preload

        with imt._hook_region(found.activations), _preload.routing():
            yield

    @contextlib.contextmanager
    def _with_region_config(
        self,
        tag: str,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None,
        enable_disk_backup: bool = False,
    ) -> Iterator[None]:
        """This thread's configuration set for the block (allocations are not
        routed by it: ``region()`` does that), the outer one back after; the
        original's name, which its test suite calls."""
        saved = self._config.snapshot()
        self._binary_wrapper.set_config(
            tag=tag,
            interesting_region=True,
            enable_cpu_backup=bool(enable_cpu_backup),
            cpu_backup_backend=cpu_backup_backend,
            enable_disk_backup=enable_disk_backup,
        )
        try:
            yield
        finally:
            self._config.restore(saved)

    @contextlib.contextmanager
    def region(
        self,
        tag: str,
        enable_cpu_backup: bool,
        enable_disk_backup: bool,
        cpu_backup_backend: str | None,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.region``."""
        if not isinstance(tag, str) or not tag or ":" in tag:
            raise InvalidArgument(f"tag: expected a non-empty str without ':', got {tag!r}")
        if enable_disk_backup:
            raise BackendUnavailable(
                "enable_disk_backup: imp-mem keeps paused bytes in host memory, not in files; "
                "use enable_cpu_backup=True"
            )
        with self._with_region_config(tag, enable_cpu_backup, cpu_backup_backend):
            key = self._key_now()
            self._refuse_paused(key.tag)
            found = self._region_for(key)
            with self._route(found):
                yield
        if key.backup == "pinned":
            self._pin_ahead(key, found)

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any,
        stream: Any,
        capture_error_mode: str,
        tag: str,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.cuda_graph``."""
        with self._with_region_config(tag, enable_cpu_backup, cpu_backup_backend):
            key = self._key_now()
            self._refuse_paused(key.tag)
            found = self._region_for(key)
            if self._hook_mode == "torch":
                # The capture's private pool is the region's MemPool, its
                # segments the region's (torch refuses a capture inside
                # use_mem_pool, so the pool is named instead).
                with found.scope():
                    pass
                with (
                    imt._hook_region(found.activations),
                    torch.cuda.graph(
                        cuda_graph,
                        pool=found.mempool.id if pool is None else pool,
                        stream=stream,
                        capture_error_mode=capture_error_mode,
                    ),
                ):
                    yield
            else:
                with (
                    torch.cuda.graph(
                        cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
                    ),
                    self._route(found),
                ):
                    yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """See ``TorchMemorySaver.disable``."""
        if not self._config.interesting:
            raise InvalidArgument(
                "disable(): nothing to disable here; call it inside a region() (or with "
                "TMS_INIT_ENABLE=1 in preload mode)"
            )
        saved = self._config.snapshot()
        self._config.interesting = False
        try:
            with contextlib.ExitStack() as stack:
                if self._hook_mode == "preload":
                    from imp_mem import _preload

                    suspended = getattr(_preload, "suspended", None) or _routing_suspended
                    stack.enter_context(suspended())
                # A fresh pool of torch's own allocator, dropped at the end
                # (the memory used inside goes back to the driver then).
                pool = torch.cuda.MemPool()
                stack.enter_context(torch.cuda.use_mem_pool(pool))
                yield
            del pool
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        finally:
            self._config.restore(saved)

    def _release(self, key: Key) -> None:
        """Drops region ``key`` (its pool, its host buffer, its tier); refused
        while tensors of it live."""
        with self._lock:
            found = self._regions.get(key)
            if found is None:
                return
            pinner = self._pinners.pop(key, None)
            if pinner is not None:
                pinner.join()
            with imt._made_lock:
                imt._release_region(found, key.name)
            del self._regions[key]
            self._mem_pools.pop(key.pool_key, None)

    # -- pause and resume ------------------------------------------------

    def _select(self, tag: str | None) -> list[tuple[Key, Any]]:
        if tag is not None and (not isinstance(tag, str) or not tag):
            raise InvalidArgument(f"tag: expected a region's tag (a str) or None, got {tag!r}")
        return [(k, r) for k, r in self._regions.items() if tag is None or k.tag == tag]

    def pause(self, tag: str | None) -> None:
        """Every selected region paused, or none (an error leaves all awake)."""
        with self._lock:
            chosen = self._select(tag)
            paused = sorted({k.tag for k, r in chosen if r.activations.asleep is not None})
            if paused:
                raise InvalidArgument(
                    f"tag: pause({tag!r}) asks again for {paused}, already paused; resume first "
                    "(nothing was paused by this call)"
                )
            for key, _ in chosen:
                pinner = self._pinners.pop(key, None)
                if pinner is not None:
                    pinner.join()
            done: list[Any] = []
            try:
                for _, found in chosen:
                    found.pause()
                    done.append(found)
            except BaseException:
                for found in reversed(done):
                    found.resume()
                raise

    def resume(self, tag: str | None) -> None:
        """Every selected region resumed, or none (an error leaves all paused)."""
        with self._lock:
            chosen = self._select(tag)
            awake = sorted({k.tag for k, r in chosen if r.activations.asleep is None})
            if awake:
                raise InvalidArgument(
                    f"tag: resume({tag!r}) finds {awake} not paused; pause before resuming "
                    "(nothing was resumed by this call)"
                )
            self._check_margin(chosen)
            done: list[Any] = []
            try:
                for _, found in chosen:
                    found.resume()
                    done.append(found)
            except OutOfMemory as exc:
                for found in reversed(done):
                    found.pause()
                raise OutOfMemory(
                    f"resume({tag!r}): the device has no room for the paused regions "
                    f"({exc}); {_cached_text(chosen)}; every region stays paused, call resume() "
                    "again once there is room"
                ) from exc
            except BaseException:
                for found in reversed(done):
                    found.pause()
                raise
            if not self.retain_cpu_backup:
                for key, found in chosen:
                    if key.backup != "none":
                        found.activations.release_host_copy()

    def _check_margin(self, chosen: list[tuple[Key, Any]]) -> None:
        """``memory_margin_bytes``: a resume that would leave less free is refused."""
        if not self.memory_margin_bytes or not torch.cuda.is_available():
            return
        need: dict[int, int] = {}
        for key, found in chosen:
            need[key.device] = need.get(key.device, 0) + found.activations.stats()["allocated"]
        for device, nbytes in need.items():
            free = torch.cuda.mem_get_info(device)[0]
            if nbytes + self.memory_margin_bytes > free:
                raise OutOfMemory(
                    f"resume: device {device} has {free} B free, the regions need {nbytes} B and "
                    f"memory_margin_bytes keeps {self.memory_margin_bytes} B free; "
                    f"{_cached_text(chosen)}; every region stays paused"
                )

    # -- CPU backup ------------------------------------------------------

    def _pin_ahead(self, key: Key, found: Any) -> None:
        """Pins the region's host buffer on a thread of its own, where the one
        kept is smaller than its live bytes."""
        with self._lock:
            act = found.activations
            need = act.stats()["allocated"]
            if act.asleep is not None or need == 0 or act.host_bytes >= need:
                return
            running = self._pinners.get(key)
            if running is not None and running.thread.is_alive():
                return
            pinner = self._pinners[key] = _Pinner(act, need)
            pinner.start()

    def wait_pinned(self) -> float:
        """Waits for every pinning thread; the seconds they spent."""
        with self._lock:
            pinners = list(self._pinners.values())
        return sum(p.join() for p in pinners)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        """See ``TorchMemorySaver.get_cpu_backup``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_contiguous():
            raise InvalidArgument("x: expected a contiguous tensor; pass x.contiguous()'s source")
        ptr, nbytes = x.data_ptr(), x.numel() * x.element_size()
        with self._lock:
            for key, found in self._regions.items():
                act = found.activations
                if not act.base <= ptr < act.base + act.capacity:
                    continue
                address = act.host_copy_address(ptr, nbytes)
                if address is None:
                    if act.asleep is not None and key.backup == "none":
                        raise InvalidArgument(
                            f"x: its region (tag {key.tag!r}) was paused without a CPU backup; "
                            "open the region with enable_cpu_backup=True to read it while paused"
                        )
                    return None
                raw = (ctypes.c_uint8 * nbytes).from_address(address)
                host = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0)
                out = host.view(x.dtype).view(x.shape)
                return out if zero_copy else out.clone()
        raise InvalidArgument(
            f"x: the tensor at {ptr:#x} was not allocated in a torch_memory_saver region"
        )

    # -- report ----------------------------------------------------------

    def mem_report(self) -> dict[str, Any]:
        """Each tag's device bytes (committed), live bytes, host bytes (the
        CPU backup, pinned) and state, plus each device backend's ledger."""
        tags: dict[str, dict[str, Any]] = {}
        with self._lock:
            for key, found in self._regions.items():
                act = found.activations
                t = tags.setdefault(
                    key.tag,
                    {"device_bytes": 0, "live_bytes": 0, "host_bytes": 0, "paused": False},
                )
                t["device_bytes"] += act.committed
                t["live_bytes"] += act.stats()["allocated"]
                t["host_bytes"] += act.host_bytes
                t["paused"] = t["paused"] or act.asleep is not None
            backends = {d: b.stats() for d, b in self._backends.items()}
        return {"hook_mode": self._hook_mode, "tags": tags, "backends": backends}


@contextlib.contextmanager
def _routing_suspended() -> Iterator[None]:
    """This thread's ``cudaMalloc`` goes to the driver again for the block:
    the interposer's routing depth taken to 0 and put back after (through
    ``imp_mem._preload``'s depth calls, until it offers a ``suspended()``)."""
    from imp_mem import _preload

    depth = _preload._depth()
    lib = _preload._interposer()
    for _ in range(depth):
        _preload._depth_call(lib, "imp_mem_preload_exit")
    try:
        yield
    finally:
        for _ in range(depth):
            _preload._depth_call(lib, "imp_mem_preload_enter")


def _cached_text(chosen: list[tuple[Key, Any]]) -> str:
    """What torch caches unused on the regions' devices (what
    ``torch.cuda.empty_cache()`` would give back)."""
    if not torch.cuda.is_available():
        return "torch caches nothing here"
    parts = []
    for device in sorted({k.device for k, _ in chosen}):
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        parts.append(f"device {device}: {cached} B")
    return "torch's cache holds unused (torch.cuda.empty_cache() gives it back): " + ", ".join(
        parts
    )


class _PoolRef:
    """A region under the original's pool key (``SaverImpl._mem_pools``): once
    taken out of that table and its last reference gone, the region is
    released, its host buffer with it (a warning where tensors of it still
    live)."""

    def __init__(self, impl: SaverImpl, key: Key) -> None:
        self._impl = impl
        self._key = key

    def __del__(self) -> None:
        if sys.is_finalizing() or self._key.pool_key in self._impl._mem_pools:
            return
        try:
            self._impl._release(self._key)
        except Exception as exc:
            warnings.warn(
                f"region {self._key.tag!r} was not released: {exc}", ImpMemWarning, stacklevel=1
            )


class _Pinner:
    """Pins one region's host buffer on a thread (the binding releases the GIL
    while the driver pins). A failure is a warning: the pause then pins."""

    def __init__(self, activations: Any, nbytes: int) -> None:
        self.activations = activations
        self.nbytes = nbytes
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="imp-mem-tms-pin", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        import time

        t0 = time.perf_counter()
        try:
            self.activations.pin_host_copy(self.nbytes)
        except Exception as exc:  # reported by join()
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def join(self) -> float:
        self.thread.join()
        if self.error is not None:
            warnings.warn(
                f"pinning a CPU backup of {self.nbytes} B ahead failed ({self.error}); the "
                "pause pins it, slowly",
                ImpMemWarning,
                stacklevel=3,
            )
            self.error = None
        return self.seconds


__all__ = ["CPU_BACKUP_BACKENDS", "Key", "SaverImpl"]
