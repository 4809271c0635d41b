"""vLLM's sleep mode on imp-mem's tiers (issue 51): a drop-in for
``vllm.device_allocator.cumem.CuMemAllocator``.

vLLM's sleep mode routes the weights (tag ``"weights"``), the KV cache
(``"kv_cache"``), the runtime buffers and the CUDA graph pool
(``"cudagraph"``) through a pluggable allocator of its own, then
``sleep(offload_tags)`` copies the offloaded tags to host memory and gives
every tag's physical memory back, and ``wake_up(tags)`` maps it again at the
same addresses. :class:`CuMemAllocator` has the same API (``get_instance()``,
``use_memory_pool(tag)``, ``sleep``, ``discard``, ``wake_up``,
``get_current_usage()``, ``cudagraph_pool()``, ``release_pools()``,
``close()``), with each tag an :func:`imp_mem.torch.region`-style tier: a
strict activation pool on a VMM backend without a handle cache (the
backend's whole capacity reserved as address space, physical memory
committed in 2 MiB chunks as torch asks for segments), reached by torch
through a ``MemPool`` over imp-mem's allocator entry points. So a sleep
copies only the live segments, into one pinned buffer a tag that is kept
for the next sleep, and a wake recommits the tier's chunks at the same
addresses.

Turning it on: vLLM loads every ``vllm.general_plugins`` entry point in each
of its processes; imp-mem's (``imp_mem._vllm_plugin:register``) swaps this
class in for vLLM's only when ``IMP_MEM_VLLM_SLEEP=1`` is set. Installing
imp-mem alone changes nothing in vLLM::

    IMP_MEM_VLLM_SLEEP=1 vllm serve MODEL --enable-sleep-mode

Level 1 (``offload_tags`` holding ``"weights"``): the first time the
``"weights"`` pool is left, its pinned host buffer is pinned on a thread of
its own, so the first sleep copies at the line rate instead of pinning first.
Level 2 drops the weights. While asleep, each tag's tier holds no physical
memory; the address space stays reserved.

Known differences from vLLM's allocator: free segments torch caches inside a
tag's ``MemPool`` stay in the tier until :meth:`CuMemAllocator.release_pools`
(vLLM releases them when a ``use_memory_pool`` block ends), so a level-1
sleep copies them too; a wake that does not fit raises :class:`WakeRefused`,
which is both imp-mem's :class:`~imp_mem.OutOfMemory` and the
``RuntimeError`` vLLM's own extension raises, and leaves the tags it could
not map asleep (a later ``wake_up`` retries).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        "imp_mem.vllm needs PyTorch: install it with `pip install imp-mem[torch]`"
    ) from exc

from imp_mem import _core
from imp_mem import torch as _imp_torch
from imp_mem._format import byte_count, human_bytes
from imp_mem.errors import BackendUnavailable, InvalidArgument, OutOfMemory

__all__ = ["DEFERRABLE_TAGS", "CuMemAllocator", "WakeRefused"]

#: The tags a selective ``wake_up(tags)`` may leave asleep; every other tag
#: wakes on any wake (vLLM 0.33's rule).
DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")

_WEIGHTS = "weights"
_GRAPHS = "cudagraph"
_EXPANDABLE = "expandable_segments"
# What a tag's tier commits at a time as torch asks for segments (the VMM
# granularity): each tier reserves the backend's whole capacity as address
# space and commits only what is used.
COMMIT_CHUNK = 2 << 20


class WakeRefused(OutOfMemory, RuntimeError):
    """A ``wake_up`` found no room on the device for a sleeping tag. The tags
    named in ``still_asleep`` stay asleep with their bytes; free memory (torch's
    cache: ``torch.cuda.empty_cache()``) and call ``wake_up`` again."""

    still_asleep: tuple[str, ...]
    torch_cached: int


class _Tag:
    """One tag's tier: the region, whether its bytes were kept at the last
    sleep, and the thread pinning its sleep buffer ahead."""

    def __init__(self, region: Any) -> None:
        self.region = region
        self.kept = False
        self.pinner: threading.Thread | None = None

    @property
    def asleep(self) -> bool:
        return self.region.activations.asleep is not None


def _tags_of(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"{what}: expected a tag or a tuple of tags, got {type(value).__name__}")
    tags = tuple(value)
    for tag in tags:
        if not isinstance(tag, str) or not tag:
            raise InvalidArgument(f"{what}: every tag must be a non-empty str, got {tag!r}")
    return tags


class CuMemAllocator:
    """vLLM's sleep-mode allocator on imp-mem's tiers (see the module's
    docstring). One instance a process: :meth:`get_instance`."""

    instance: CuMemAllocator | None = None
    default_tag: str = "default"
    _instance_lock = threading.Lock()

    @staticmethod
    def get_instance() -> CuMemAllocator:
        """The process's allocator, made on first use (vLLM's singleton
        accessor; its pools are released at interpreter exit)."""
        with CuMemAllocator._instance_lock:
            if CuMemAllocator.instance is None:
                CuMemAllocator.instance = CuMemAllocator()
                atexit.register(CuMemAllocator._shutdown_singleton)
            return CuMemAllocator.instance

    @staticmethod
    def _shutdown_singleton() -> None:
        instance = CuMemAllocator.instance
        if instance is not None:
            with contextlib.suppress(Exception):
                instance.release_pools()

    def __init__(self, backend: Any = None, *, device: Any = None, capacity: Any = None) -> None:
        """``backend``: the VMM backend the tiers live on (default: one on
        ``device``, made at the first ``use_memory_pool``). ``capacity``: the
        address space reserved for each tag (default: the backend's whole
        capacity; reserving costs no physical memory)."""
        if backend is not None and not isinstance(backend, _core.Backend):
            raise InvalidArgument(
                f"backend: expected an imp_mem VmmBackend, got {type(backend).__name__}"
            )
        self._backend = backend
        self._device = device
        self._capacity_bytes = None if capacity is None else byte_count(capacity, "capacity")
        self._tags: dict[str, _Tag] = {}
        self._lock = threading.RLock()
        self.current_tag: str = CuMemAllocator.default_tag
        # vLLM's own attribute: tag -> [(MemPool, allocator)], read by code
        # that checks whether a tag's pool exists ("cudagraph" in it).
        self.allocator_and_pools: dict[str, list[Any]] = {}

    # -- the tiers ---------------------------------------------------------

    @property
    def device(self) -> int:
        """The CUDA device the tiers live on."""
        return _imp_torch._device_index(self._device)

    @property
    def backend(self) -> Any:
        """The VMM backend under every tag's tier (made on first use)."""
        if self._backend is None:
            if not _core.cuda_available():
                raise BackendUnavailable(
                    "imp_mem.vllm.CuMemAllocator maps device memory through the CUDA VMM API; "
                    "no CUDA driver or device is visible here"
                )
            # No handle cache: a sleep gives its memory back to the driver,
            # and a tag that drops its bytes never gets another's old ones.
            self._backend = _core.VmmBackend(self.device, cache_chunks=0)
        return self._backend

    def _tag(self, tag: str) -> _Tag:
        with self._lock:
            found = self._tags.get(tag)
            if found is None:
                capacity = self._capacity()
                # A measured region that is never frozen: reserved whole,
                # committed chunk by chunk as its blocks reach further.
                region = _imp_torch.Region(
                    self.backend,
                    tag,
                    capacity,
                    cpu_backup=True,
                    device=self.device,
                    measure_chunk=COMMIT_CHUNK,
                )
                found = self._tags[tag] = _Tag(region)
            return found

    def _capacity(self) -> int:
        """Address space reserved for one tag: the backend's whole capacity
        unless told (a tag can never hold more; reserving costs nothing)."""
        if self._capacity_bytes is None:
            self._capacity_bytes = int(self.backend.stats()["capacity"])
        return self._capacity_bytes

    def tags(self) -> dict[str, dict[str, Any]]:
        """Each tag's state: live bytes, committed bytes, asleep, host bytes
        held for sleeping."""
        out = {}
        for tag, t in self._tags.items():
            act = t.region.activations
            out[tag] = {
                "live_bytes": int(act.stats()["allocated"]),
                "committed": int(act.committed),
                "asleep": t.asleep,
                "kept": t.kept if t.asleep else None,
                "host_bytes": int(act.host_bytes),
            }
        return out

    # -- vLLM's API --------------------------------------------------------

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Routes the block's torch allocations (on this thread) to the tier of
        ``tag`` (default ``"default"``). torch's expandable segments are off
        inside (a ``MemPool`` cannot use them) and restored after."""
        if tag is None:
            tag = CuMemAllocator.default_tag
        if not isinstance(tag, str) or not tag:
            raise InvalidArgument(f"tag: expected a non-empty str, got {tag!r}")
        t = self._tag(tag)
        if t.asleep:
            raise InvalidArgument(
                f"tag: {tag!r} sleeps; call wake_up() (or wake_up([{tag!r}])) before "
                "allocating in it"
            )
        conf = _alloc_conf()
        expandable = _flag(conf, _EXPANDABLE)
        if expandable:
            _set_alloc_conf(_with_flag(conf, _EXPANDABLE, False))
        old_tag = self.current_tag
        self.current_tag = tag
        try:
            with t.region.scope():
                entry = (t.region.mempool, _imp_torch.pluggable_allocator())
                self.allocator_and_pools[tag] = [entry]
                yield
        finally:
            self.current_tag = old_tag
            if expandable:
                _set_alloc_conf(conf)
        if tag == _WEIGHTS:
            self._pin_ahead(t)

    def _pin_ahead(self, t: _Tag) -> None:
        """Pins the weights' sleep buffer on a thread of its own (the binding
        releases the GIL while the driver pins): a level-1 sleep then copies
        at once. A failure is a warning; that sleep pins, slowly."""
        if t.pinner is not None and t.pinner.is_alive():
            return
        act = t.region.activations

        def pin() -> None:
            try:
                act.pin_host_copy()
            except Exception as e:
                warnings.warn(
                    f"imp_mem.vllm: pinning the weights' sleep buffer ahead failed ({e}); the "
                    "first level-1 sleep pins it, at the cost of seconds per 16 GiB",
                    RuntimeWarning,
                    stacklevel=1,
                )

        t.pinner = threading.Thread(target=pin, name="imp-mem-vllm-pin", daemon=True)
        t.pinner.start()

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Gives every tag's physical memory back, its addresses kept: the
        tags in ``offload_tags`` (default ``("default",)``) keep their live
        bytes in pinned host memory, the rest are discarded. A tag already
        asleep keeps the policy it slept with."""
        offload = (
            (CuMemAllocator.default_tag,)
            if offload_tags is None
            else _tags_of(offload_tags, "offload_tags")
        )
        with self._lock:
            awake = [(tag, t) for tag, t in self._tags.items() if not t.asleep]
            conflict = any((tag in offload) != t.kept for tag, t in self._tags.items() if t.asleep)
            if awake:
                torch.cuda.synchronize(self.device)
            for tag, t in awake:
                keep = tag in offload
                if keep and t.pinner is not None:
                    t.pinner.join()
                t.region.activations.pause(cpu_backup=keep)
                t.kept = keep
        if conflict:
            warnings.warn(
                "imp_mem.vllm: sleep cannot change the policy of tags already asleep; each kept "
                "the one it slept with",
                RuntimeWarning,
                stacklevel=2,
            )
        gc.collect()
        torch.cuda.empty_cache()
        self._trim_backend()

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Gives the physical memory of ``tags`` back without keeping their
        bytes (they hold garbage after the wake)."""
        wanted = _tags_of(tags, "tags")
        with self._lock:
            chosen = [t for tag, t in self._tags.items() if tag in wanted and not t.asleep]
            if chosen:
                torch.cuda.synchronize(self.device)
            for t in chosen:
                t.region.activations.pause(cpu_backup=False)
                t.kept = False
        self._trim_backend()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps the sleeping tags again at their addresses and copies back the
        bytes of those that kept them: all of them when ``tags`` is None,
        else ``tags`` and every tag that is not deferrable
        (:data:`DEFERRABLE_TAGS`). Raises :class:`WakeRefused` when the device
        has no room; the tags not mapped stay asleep."""
        wanted = None if tags is None else _tags_of(tags, "tags")
        gc.collect()
        torch.cuda.empty_cache()
        with self._lock:
            todo = [
                (tag, t)
                for tag, t in self._tags.items()
                if t.asleep and (wanted is None or tag in wanted or tag not in DEFERRABLE_TAGS)
            ]
            for i, (tag, t) in enumerate(todo):
                try:
                    t.region.activations.resume()
                except OutOfMemory as e:
                    raise self._refused(tag, [name for name, _ in todo[i:]], e) from e

    def _refused(self, tag: str, still: list[str], cause: OutOfMemory) -> WakeRefused:
        device = self.device
        cached = 0
        if torch.cuda.is_initialized():
            cached = int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        err = WakeRefused(
            f"wake_up: no room on cuda:{device} to map tag {tag!r} again ({cause}); torch's "
            f"caching allocator holds {human_bytes(cached)} it does not use: free it "
            "(torch.cuda.empty_cache()) or drop tensors, then call wake_up() again. Still "
            f"asleep: {still}"
        )
        for name in ("asked", "live", "budget", "capacity", "tag", "device_refused"):
            if hasattr(cause, name):
                setattr(err, name, getattr(cause, name))
        err.still_asleep = tuple(still)
        err.torch_cached = cached
        return err

    def get_current_usage(self) -> int:
        """Bytes of torch segments held in every tag's tier, asleep or awake."""
        return sum(int(t.region.activations.stats()["allocated"]) for t in self._tags.values())

    @contextlib.contextmanager
    def cudagraph_pool(self) -> Iterator[tuple[int, int]]:
        """Yields the id of a ``MemPool`` over the ``"cudagraph"`` tier for
        ``torch.cuda.graph(g, pool=...)``: graphs captured into it sleep and
        wake with it and replay after a wake without a new capture."""
        t = self._tag(_GRAPHS)
        if t.asleep:
            raise InvalidArgument(
                "cudagraph_pool: the 'cudagraph' tag sleeps; call wake_up() before capturing"
            )
        if t.region.mempool is None:
            t.region.mempool = torch.cuda.MemPool(_imp_torch.pluggable_allocator().allocator())
        self.allocator_and_pools[_GRAPHS] = [(t.region.mempool, _imp_torch.pluggable_allocator())]
        old_tag = self.current_tag
        self.current_tag = _GRAPHS
        try:
            # The capture routes to the pool by its id; the hooks route the
            # pool's segments to this tier for this thread.
            with _imp_torch._hook_region(t.region.activations):
                yield t.region.mempool.id
        finally:
            self.current_tag = old_tag

    def release_pools(self) -> None:
        """Drops the ``MemPool`` of every tag (torch gives their free segments
        back to the tiers); safe to call more than once. Live tensors keep
        their memory; a later ``use_memory_pool`` makes a new pool."""
        with self._lock:
            had = False
            for t in self._tags.values():
                if t.region.mempool is not None:
                    t.region.mempool = None
                    had = True
            self.allocator_and_pools.clear()
            if had and torch.cuda.is_initialized():
                _imp_torch._release_dropped_pools(self.device)

    def close(self) -> None:
        """vLLM's alias of :meth:`release_pools`."""
        self.release_pools()

    def _trim_backend(self) -> None:
        """Handles a VMM backend caches for reuse hold physical memory: a
        sleep gives them to the driver too."""
        trim = getattr(self._backend, "trim_cache", None)
        if trim is not None:
            trim()

    def __repr__(self) -> str:
        states = ", ".join(
            f"{tag}={'asleep' if t.asleep else 'awake'}" for tag, t in self._tags.items()
        )
        return f"imp_mem.vllm.CuMemAllocator({states})"


# torch's allocator settings, read and written whole: torch resets every
# option a settings string leaves out, so one flag is changed in place.


def _alloc_conf() -> str:
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def _flag(conf: str, name: str) -> bool:
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == name:
            return value.strip().lower() == "true"
    return False


def _with_flag(conf: str, name: str, on: bool) -> str:
    items = [i for i in conf.split(",") if i.strip() and i.partition(":")[0].strip() != name]
    items.append(f"{name}:{'True' if on else 'False'}")
    return ",".join(items)


def _set_alloc_conf(conf: str) -> None:
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None and torch.cuda.is_available():
        setter(conf)
