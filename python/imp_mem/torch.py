"""torch's allocations through a planned imp-mem tier (``pip install imp-mem[torch]``).

A torch engine allocates far more than its weights and its KV cache: every
activation, temporary and library workspace goes through torch's caching
allocator, which asks the driver for segments whenever its cache misses. This
module puts those allocations on the system's *activations* tier (T4a): a
region the plan reserved before serving, sub-allocated by the core's
general-purpose allocator (TLSF, stream-ordered, see
``crates/imp-mem-core/src/activations/``), reached by torch through C entry
points exported from imp-mem's own extension module
(``imp_mem_torch_malloc`` / ``imp_mem_torch_free``, loaded by
``torch.cuda.memory.CUDAPluggableAllocator``).

Two ways to route torch, both over the same tier:

* **Scopes** (:func:`use_pool`, :class:`Pool`): a ``torch.cuda.MemPool`` whose
  segments come from the tier, made active with ``torch.cuda.use_mem_pool``.
  torch's caching allocator still runs on top (its block cache lives inside
  the pool's segments), so a warm allocation costs what it always costs, and
  imp-mem sees only segment traffic. Code outside the scope uses torch's
  default allocator. The entry points cannot tell MemPools apart, so the
  first open Pool's tier is *installed* in them and a Pool over another
  tier (a second engine in the process) is a hook *region* that its
  :meth:`Pool.scope`, :meth:`Pool.graph` and :func:`graph_pool` select for
  their thread (:meth:`Pool.routed`); a segment freed anywhere goes back to
  its tier by address.
* **Process-wide** (:func:`install`): ``change_current_allocator`` makes the
  tier torch's only allocator. It must run before torch's first CUDA
  allocation; every tensor then reaches imp-mem directly (no caching layer).

Regions (:func:`region`, :func:`pause`, :func:`resume`; the trainer's side of
RL colocation, issue 24): ``with region(backend, "train", capacity=...):``
routes that code's torch allocations to a tier of its own (a growable
activation pool, one per tag, in a ``MemPool`` of its own);
``pause("train")`` gives its physical memory back, copying the live
segments to pinned host memory first when ``cpu_backup``, and
``resume("train")`` recommits it at the same addresses and copies them back,
so every tensor made inside is where and what it was. While paused, run no
torch code inside the region and touch none of its tensors.

**One call** (:func:`serve`): ``system = imp_mem.torch.serve(fingerprint=...)``
opens a VMM backend and a system for the device's free memory with a
*measured* activations tier and no KV pool, and makes the tier torch's
allocator process-wide; the caller's warm-up runs next (every torch
allocation commits the tier in chunks, addresses never move), and
``system.begin_serving()`` freezes the tier at its high-water plus the margin,
decommits the rest and remembers the figure under the fingerprint
(:mod:`imp_mem.measured`), so the next start plans the tier at that size and
does not measure::

    import imp_mem.torch
    system = imp_mem.torch.serve(fingerprint={"model": "Qwen3-0.6B", "batch": 32})
    model = build_model().cuda()          # every tensor is in the tier
    model.generate(**warmup_inputs)        # the warm-up: the tier grows
    system.begin_serving()                 # frozen; 0 allocations from here
    model.generate(**inputs)

Weights: :func:`to_arena` moves a module's parameters and buffers into T1
(tensors viewing the weights arena), and :meth:`Pool.loading` routes the
allocations of a loading scope into T1 as well (a later free of such a
segment cannot give bytes back to a bump arena: it is counted as stranded and
reported, never lost silently).

Known limits of torch's pluggable allocators (torch 2.11):

* One process-wide allocator per process, chosen before the first CUDA
  tensor; :func:`install` says so when it is too late. Scopes have no such
  limit.
* torch's process-wide pluggable path does not check a null return (it
  builds a tensor over address 0), so :func:`install` refuses a strict tier;
  inside a ``MemPool`` scope torch turns null into its ``OutOfMemoryError``
  after giving the pool's cached segments back and retrying.
* A custom ``MemPool`` has no expandable segments: torch asks for whole
  segments (2 MiB for small blocks, 20 MiB for 1-10 MiB ones, the rounded
  size above), and the tier serves each one as one block.
* A live ``MemPool`` keeps its free segments cached: ``torch.cuda.empty_cache()``
  does not release a private pool's segments. They go back to the tier (never
  to the driver: the tier's region stays reserved, as planned) when the pool
  is dropped (:meth:`Pool.close`).
* In process-wide mode torch keeps no statistics of its own
  (``torch.cuda.memory_stats`` raises or is empty); :func:`memory_stats`
  gives the tier's, under torch's key names.
* torch.compile: inductor's kernels and workspaces allocate through the
  current allocator, so they are blocks of the tier like any tensor (counted
  in its high-water and frozen with it); compile during the warm-up, before
  ``begin_serving()`` (``Served.reset_high_water()`` forgets the compiler's
  own peak). ``mode="reduce-overhead"`` (inductor's CUDA graph trees) needs
  the caching allocator's checkpoint state of its graph pool, which a
  process-wide pluggable allocator does not have (torch raises "does not yet
  support getCheckpointState"), so it runs in the scope mode: there
  :func:`graph_pool` makes the trees capture into a ``MemPool`` over the tier
  (``Served.scope()`` does it), so their memory is the tier's too.
* CUDA graphs: capture with ``torch.cuda.graph(g, pool=pool.id)`` *outside*
  ``use_mem_pool`` (torch refuses a capture inside it: "already recording to
  mempool_id"); :meth:`Pool.graph` does that.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        "imp_mem.torch needs PyTorch: install it with `pip install imp-mem[torch]` "
        "(or `pip install torch`)"
    ) from exc

from imp_mem import _core, _jsonfile
from imp_mem import measured as _measured
from imp_mem._format import byte_count, human_bytes
from imp_mem._frameworks import activations_of as _activations_of
from imp_mem._frameworks import source_held
from imp_mem.errors import BackendUnavailable, ImpMemWarning, InvalidArgument, PhaseViolation

__all__ = [
    "MALLOC_SYMBOL",
    "FREE_SYMBOL",
    "DEFAULT_CHUNK",
    "DEFAULT_MARGIN",
    "DEFAULT_SCOPE_MARGIN",
    "default_margin",
    "Pool",
    "Served",
    "graph_pool",
    "serve",
    "hook_stats",
    "install",
    "installed",
    "library_path",
    "measure_outside_charge",
    "measure_step_high_water",
    "memory_stats",
    "pause",
    "pluggable_allocator",
    "pool",
    "region",
    "regions",
    "release_region",
    "resume",
    "arena_tensor",
    "to_arena",
    "use_pool",
    "Region",
]

MALLOC_SYMBOL = "imp_mem_torch_malloc"
FREE_SYMBOL = "imp_mem_torch_free"

_lock = threading.Lock()
# Held while a Pool or a region is found or made (``pool()``, ``region()``)
# or a region released; re-entrant, and taken before ``_lock``, never inside.
_made_lock = threading.RLock()
_installed: dict[str, Any] = {"activations": None, "device": None, "process_wide": False}


def library_path() -> str:
    """The shared object that exports the allocator entry points (imp-mem's own
    extension module)."""
    return _core.hook_library_path()


@functools.lru_cache(maxsize=1)
def pluggable_allocator() -> torch.cuda.memory.CUDAPluggableAllocator:
    """torch's view of the entry points; one per process (the entry points route
    to whichever tier is installed)."""
    return torch.cuda.memory.CUDAPluggableAllocator(library_path(), MALLOC_SYMBOL, FREE_SYMBOL)


def _current_device() -> int:
    """torch's current device, without initialising torch's CUDA state
    where nothing has yet (device 0 then): `install()` must still be able to
    swap torch's allocator after this."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def _device_index(device: Any) -> int:
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"device: expected a CUDA device index or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise InvalidArgument(f"device: expected a CUDA device index (0 or more), got {device}")
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise InvalidArgument(f"device: expected a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else _current_device()


def _same_tier(a: Any, b: Any) -> bool:
    """Whether two ActivationPool handles are the same tier. A MemorySystem
    hands out a new wrapper at each ``system.activations``, so identity of
    the Python objects says nothing; the tier's id does."""
    return a is not None and b is not None and a.id == b.id


def _install_hooks(activations: Any, device: int, weights_arena: Any = None) -> bool:
    """Routes the hooks to ``activations``: installed (the tier every
    MemPool scope without a tier of its own reaches) where none is, or
    where the installed one is this tier or one no open Pool holds; else a
    hook *region* (``_core.add_hook_region``), which a scope of its Pool
    selects for its thread, so that two Pools over two tiers (two engines
    with ``torch_pool="imp_mem"`` in one process) each get their own
    tier's memory. Returns True where installed, False for a region."""
    with _lock:
        current = _installed["activations"]
        if current is not None and not _same_tier(current, activations):
            if _installed["process_wide"]:
                raise PhaseViolation(
                    "imp_mem.torch: another activations tier is installed process-wide; "
                    "torch has one allocator per process"
                )
            if any(p._tier == current.id and not p._region for p in _open):
                _core.add_hook_region(activations, device=device)
                return False
        if weights_arena is not None:
            activations.install(device=device, weights_arena=weights_arena)
        else:
            activations.install(device=device)
        _installed["activations"] = activations
        _installed["device"] = device
        return True


def _uninstall_hooks(activations: Any) -> None:
    """Takes ``activations`` out of the hooks if it is the tier installed for
    scopes (never a process-wide one: torch keeps calling its allocator). A
    block still live there (a tensor someone kept) keeps the tier: the core
    retires it, and its free still reaches it."""
    with _lock:
        if _installed["process_wide"] or not _same_tier(_installed["activations"], activations):
            return
        _core.uninstall_hooks()
        _installed["activations"] = None
        _installed["device"] = None


def _clear_cublas_workspaces() -> None:
    """torch keeps a cuBLAS workspace per handle and stream, allocated at the
    first GEMM from whatever pool was current then, for the process's life.
    Cleared before a tier closes so that no workspace lies in it (torch makes
    a new one at the next GEMM)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def installed() -> Any:
    """The ActivationPool the entry points route to now, or None."""
    return _installed["activations"]


def _renew_mempool(holder: Any) -> None:
    """Gives `holder` (a `Pool` or a `Region`) a fresh MemPool over the same
    tier and lets the old one go: once its tensors are gone, torch's free
    segments in it go back to the tier (``empty_cache`` does not release a
    live private pool's segments)."""
    holder.mempool = torch.cuda.MemPool(pluggable_allocator().allocator())
    _release_dropped_pools(holder.device)


def _release_dropped_pools(device: int) -> None:
    """Once a MemPool is dropped: its last tensors collected, the device
    synchronised, and torch's free segments of dropped pools given back
    (through the hooks, to their tier)."""
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


class Pool:
    """A ``torch.cuda.MemPool`` whose segments come from an imp-mem activations
    tier.

    ``Pool(system)`` (or an ``ActivationPool``); ``with pool.scope(): ...`` routes
    that code's allocations into it (``with Pool(system) as pool:`` closes it
    at the end), ``pool.graph(g)`` captures a CUDA graph into
    it, ``pool.memory_stats()`` reads the tier under torch's key names. With
    ``weights_arena`` (default: the system's T1 arena), ``with pool.loading():``
    routes a loading scope into T1.
    """

    def __init__(self, target: Any, *, device: Any = None, weights_arena: Any = None) -> None:
        self.activations = _activations_of(target)
        self.device = _device_index(device)
        if weights_arena is None and not isinstance(target, _core.ActivationPool):
            weights_arena = getattr(target, "weights_arena", None)
        self.weights_arena = weights_arena
        self._tier = self.activations.id
        # A tier another open Pool's tier already holds the hooks for is a
        # hook region of its own: its scopes select it for their thread.
        same = [p for p in _open if p._tier == self._tier]
        if same and same[0]._region:
            self._region = True
        else:
            self._region = not _install_hooks(self.activations, self.device, weights_arena)
        allocator = pluggable_allocator().allocator()
        self.mempool: Any = torch.cuda.MemPool(allocator)
        # The MemPool CUDA graphs capture into (graph_pool), made on first use.
        self.graph_mempool: Any = None
        self._open = True
        with _lock:
            _open.add(self)

    def _check_open(self) -> None:
        if not self._open:
            raise InvalidArgument("pool: this Pool was closed; make a new one")

    @property
    def id(self) -> tuple[int, int]:
        """The MemPool id, for ``torch.cuda.graph(..., pool=...)``."""
        self._check_open()
        return self.mempool.id

    @contextlib.contextmanager
    def routed(self) -> Iterator[Pool]:
        """Points this thread's allocator hooks at the tier for the block,
        without entering a MemPool (:meth:`scope` and :meth:`graph` do both):
        a capture into this Pool's MemPool run outside its scope needs it.
        Nested in a :func:`region` scope, the Pool's tier still wins."""
        self._check_open()
        with _hook_region(self.activations if self._region else None):
            yield self

    @contextlib.contextmanager
    def scope(self) -> Iterator[Pool]:
        """Routes torch's allocations in the block to the tier."""
        self._check_open()
        with self.routed(), torch.cuda.use_mem_pool(self.mempool, device=self.device):
            yield self

    @contextlib.contextmanager
    def loading(self) -> Iterator[Pool]:
        """Routes torch's allocations in the block (on this thread: the hooks'
        weights route is per thread, as torch's MemPool scopes are, so another
        thread's forward meanwhile stays in the activations) to T1 (the
        weights arena), in a MemPool of its own that is dropped when the block
        ends, so loading
        segments never serve activations. Segments freed after that (loading
        temporaries) cannot give their bytes back to a bump arena: the hooks
        count them as stranded (``hook_stats()["stranded_bytes"]``)."""
        if self.weights_arena is None:
            raise InvalidArgument(
                "weights_arena: this pool has no T1 arena to load into; pass "
                "weights_arena= (or build the Pool from a MemorySystem)"
            )
        if self._region:
            raise InvalidArgument(
                "pool: another tier's Pool holds the allocator hooks, so this one routes "
                "through a hook region, which has no weights route; load through the first "
                "Pool's system, or close it before making this one"
            )
        loading_pool = torch.cuda.MemPool(pluggable_allocator().allocator())
        previous = _core.hook_route()
        _core.set_hook_route("weights")
        try:
            with torch.cuda.use_mem_pool(loading_pool, device=self.device):
                yield self
        finally:
            _core.set_hook_route(previous)
            # torch releases a dropped pool's free segments at the next
            # empty_cache; segments with live tensors stay until those die.
            del loading_pool
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def trim(self) -> None:
        """Gives torch's cache inside the pool back to the tier: the pool's
        MemPool is replaced by a fresh one, so torch releases every free
        segment of the old one now and each remaining one when its last
        tensor dies (torch's ``empty_cache`` does not release a live private
        pool's segments). Run it at a phase change (before
        ``begin_serving()``), outside :meth:`scope`; the pool's ``id``
        changes, so capture CUDA graphs after it."""
        self._check_open()
        _renew_mempool(self)

    def close(self) -> None:
        """Drops the MemPools (the scope's and the graphs'): torch gives their
        free segments back to the tier at once, and the rest as their tensors
        die. The last open Pool over a tier also takes it out of the hooks
        (unless it is installed process-wide) and lets go of the tier and the
        T1 arena, so the system can close. The Pool cannot be used after;
        closing it again does nothing."""
        if not self._open:
            return
        self._open = False
        key = self._tier
        if _pools.get(key) is self:
            del _pools[key]
        with _lock:
            _open.discard(self)
            left = any(p._tier == key for p in _open)
        _clear_cublas_workspaces()
        self.mempool = None
        self.graph_mempool = None
        _release_dropped_pools(self.device)
        if not left:
            if self._region:
                # Blocks still live keep the tier (the core retires it).
                _core.remove_hook_region(self.activations)
            else:
                _uninstall_hooks(self.activations)
        # The tier's and T1's handles: held, they keep the system's memory.
        self.activations = None
        self.weights_arena = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return not self._open

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def graph(self, cuda_graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[Pool]:
        """``with pool.graph(g): ...``: ``torch.cuda.graph(g, pool=self.id,
        ...)`` with this thread's hooks on the tier, so the capture's
        allocations live in it. Call it outside :meth:`scope`."""
        with self.routed(), torch.cuda.graph(cuda_graph, pool=self.id, **kwargs):
            yield self

    def memory_stats(self) -> dict[str, int]:
        """The tier's counters under ``torch.cuda.memory_stats`` key names."""
        self._check_open()
        return memory_stats(self.activations)

    def __repr__(self) -> str:
        if not self._open:
            return f"imp_mem.torch.Pool(device={self.device}, closed)"
        stats = self.activations.stats()
        return (
            f"imp_mem.torch.Pool(device={self.device}, capacity={self.activations.capacity}, "
            f"allocated={stats.get('allocated_bytes', '?')})"
        )


_pools: dict[int, Pool] = {}
"""The Pool :func:`pool` made for each tier, by the tier's id."""
_open: weakref.WeakSet[Pool] = weakref.WeakSet()
"""The open Pools: the last one of a tier closed takes the tier out of the
hooks (one dropped unclosed no longer counts)."""


def pool(system: Any, *, device: Any = None) -> Pool:
    """The :class:`Pool` over ``system``'s activations tier (one per tier, made
    at the first call; closed with :meth:`Pool.close`, after which the next
    call makes a new one)."""
    activations = _activations_of(system)
    # Found or made under one lock: two threads asking at once get one Pool.
    with _made_lock:
        found = _pools.get(activations.id)
        if found is None:
            found = Pool(system, device=device)
            _pools[activations.id] = found
    return found


@contextlib.contextmanager
def use_pool(system: Any, *, device: Any = None) -> Iterator[Pool]:
    """``with imp_mem.torch.use_pool(system): ...`` routes that code's torch
    allocations to the system's activations tier."""
    p = pool(system, device=device)
    with p.scope():
        yield p


def install(system: Any, *, device: Any = None) -> None:
    """Makes the activations tier torch's only CUDA allocator, process-wide
    (``torch.cuda.memory.change_current_allocator``).

    Must run before torch's first CUDA allocation; raises PhaseViolation,
    saying so, when it is too late.
    """
    activations = _activations_of(system)
    if activations.strict:
        raise InvalidArgument(
            "system: its activations tier is strict, and a strict tier returns null when "
            "full, which torch's process-wide pluggable path does not check (it builds a "
            "tensor over address 0); open the system with activation_strict=False (the tier "
            "then falls back to a counted backend acquisition), or use a Pool scope, where "
            "torch turns null into its OutOfMemoryError"
        )
    dev = 0 if device is None else _device_index(device)
    if _installed["process_wide"]:
        if _same_tier(_installed["activations"], activations):
            return
        raise PhaseViolation(
            "imp_mem.torch.install: a tier is already torch's process-wide allocator; "
            "torch has one allocator per process"
        )
    was, was_device = _installed["activations"], _installed["device"]
    if not _install_hooks(activations, dev):
        # Another tier's open Pool holds the hooks: process-wide, torch's
        # allocations would go to that tier.
        _core.remove_hook_region(activations)
        raise PhaseViolation(
            "imp_mem.torch.install: an open Pool over another tier holds the allocator "
            "hooks, and torch has one allocator per process; close that Pool first (and "
            "install before torch's first CUDA allocation)"
        )
    try:
        torch.cuda.memory.change_current_allocator(pluggable_allocator())
    except BaseException as exc:
        # Left installed, the hooks would hold the tier (and its memory) for
        # a process whose torch never calls them; what was there comes back.
        if not _same_tier(was, activations):
            _uninstall_hooks(activations)
            if was is not None:
                _install_hooks(was, was_device)
        if isinstance(exc, RuntimeError):
            raise PhaseViolation(
                "imp_mem.torch.install must run before torch's first CUDA allocation "
                "(torch's allocator is already initialised; call install() right after "
                f"opening the MemorySystem, before any tensor is created on the GPU): {exc}"
            ) from exc
        raise
    _installed["process_wide"] = True


DEFAULT_CHUNK = 2 << 20
"""Bytes a measured tier commits at a time while it grows (:func:`serve`)."""
DEFAULT_MARGIN = 0.002
"""The margin :func:`serve` keeps above the measured high-water: a share of
it. Small, because the same work reaches the same high-water: on the H200,
HF Qwen3-0.6B's generate() (32 x 1 024 + 64) served and started again at
margin 0 with 0 fallbacks, and its allocation sequence recorded there
replays on the fake backend to the byte of the H200's high-water (1.0158 of
the live peak). Work past the frozen tier is not refused in
``mode="process"``: it falls back to the backend and is counted
(``fallbacks_total``). At 1 % the tier came to 1.026 of HF's live peak;
at 0.2 % to 1.018 (H200, both starts, 0 fallbacks)."""
DEFAULT_SCOPE_MARGIN = 64 << 20
"""The margin in ``mode="scope"``, in bytes: torch's caching allocator takes
its MemPool's memory in whole segments (20 MiB for a 1-10 MiB request, the
request rounded to 2 MiB above that) from a strict tier, so the served run
can need a segment or two past the warm-up's arrangement, and a segment past
the tier is torch's OutOfMemoryError, not a fallback. A share of a small
tier is less than a segment. HF's quick generate() (8 x 256 + 16) served
at this margin on the H200 once ``begin_serving`` kept the warm-up's pool
(1.069 of HF's live peak, session 20); its earlier failures, at 0.2 % and
at this margin, came from the fresh pool ``begin_serving`` used to swap
in."""


def _held_by_backend(system: Any) -> int:
    """The device bytes the backend holds: its regions' commits and what its
    source keeps past them (a VMM backend's handle cache and chunk
    rounding, which the report charges on lines of their own). The growth
    of this across the warm-up is not torch's: a warm-up whose fallback
    regions went back to the handle cache had those bytes charged twice,
    as torch's runtime and as the cache (H200, session 25: attribution
    100.06 % on a second start)."""
    return int(system.backend.stats()["committed"]) + source_held(system.mem_report())


class Served:
    """What :func:`serve` returns: the :class:`~imp_mem.MemorySystem` (every
    attribute of it is here too) plus the figures of the start.

    ``begin_serving()`` measures the device memory the warm-up took outside
    every allocator (torch's runtime, kernels loaded into the context,
    library handles) and charges it (``torch_runtime``), then freezes the
    measured tier and remembers its figure under the fingerprint."""

    def __init__(
        self,
        system: Any,
        *,
        device: int,
        mode: str,
        fingerprint: dict[str, Any] | None,
        cache_path: Any,
        recalled: dict[str, int] | None,
        other_processes: int,
        plan_passes: bool = True,
    ) -> None:
        self.system = system
        self.device = device
        self.mode = mode
        self.fingerprint = fingerprint
        self.cache_path = cache_path
        self.recalled = recalled
        self.other_processes = other_processes
        self.remembered: Any = None
        self.outside_charge: int | None = None
        self._free_at_open = _core.cuda_mem_get_info(device)[0] if device >= 0 else 0
        self._held_at_open = _held_by_backend(system)
        self.pool: Pool | None = None
        # A float margin: a share of the high-water, known at the freeze.
        self.margin_share: float | None = None
        self.plan_passes = plan_passes
        # What begin_serving() laid out of the recorded pass
        # (ActivationPool.plan_pass), or None.
        self.pass_plan: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.system, name)

    @property
    def measuring(self) -> bool:
        """Whether this start measures (no figure was remembered)."""
        return self.recalled is None

    def reset_high_water(self) -> None:
        """Forgets the measured peak of what ran so far (a ``torch.compile``,
        a first warm-up): the high-water starts again from the tensors live
        now, and the freeze decommits the chunks only that needed. Call it
        before the last warm-up pass, outside :meth:`scope` (in the scope
        mode it first trims torch's cache inside the pool, which only takes
        effect outside it).

        In ``mode="process"`` it also starts recording that pass
        (``ActivationPool.record_pass``): :meth:`begin_serving` lays it out
        with every lifetime known and, where that needs less than the
        pass's own high-water, freezes the tier at the layout's top and
        places the served passes' blocks where the layout put them
        (:attr:`pass_plan`). So the last warm-up should be one pass of the
        work the server repeats."""
        if self.system.phase == _core.Phase.SERVING:
            raise PhaseViolation(
                "reset_high_water: the tier was frozen at begin_serving(); it is for the "
                "warm-up (after a compile, before the last warm-up pass)"
            )
        if self.device >= 0 and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        if self.pool is not None:
            self.pool.trim()
        act = self.system.activations
        if act is not None:
            act.reset_high_water()
            if self.mode == "process" and self.plan_passes:
                act.record_pass()

    @contextlib.contextmanager
    def scope(self) -> Iterator[Served]:
        """``mode="scope"``: the block's torch allocations go to the tier (a
        MemPool over it), and CUDA graphs torch's compiler captures in it too
        (:func:`graph_pool`); ``mode="process"``: every allocation already
        does, so this is a no-op."""
        if self.pool is None:
            yield self
            return
        with self.pool.scope(), graph_pool(self.pool):
            yield self

    def begin_serving(self) -> None:
        """Charges what the warm-up took outside every allocator, freezes the
        measured tier (high-water + margin; the rest decommitted) and
        remembers its figure under the fingerprint; then SERVING.

        The scope mode's pool is kept as the warm-up left it: its cached
        segments are the served work's (a fresh pool, as :meth:`Pool.trim`
        makes, could not use the free parts of the segments still holding
        the weights, and ran out of a tier measured with them: H200,
        session 20). torch's cache in it is in the tier's high-water: torch
        2.11 gives a live ``MemPool``'s cached segments back to a refusing
        allocator only when they are at least ``max_split_size_mb`` (unset,
        none are; ``benches/probe_mempool_release.py``), and setting it
        took the H200's scope run from 1.310 to 1.608 (256 MiB) and 2.667
        (64 MiB) of HF's live peak (``benches/sweep_scope_split.py``), as
        oversize blocks are never split for smaller requests."""
        if self.device >= 0 and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        if self.device >= 0 and self.outside_charge is None:
            free, _ = _core.cuda_mem_get_info(self.device)
            held = _held_by_backend(self.system)
            charge = max(0, (self._free_at_open - free) - (held - self._held_at_open))
            self.system.set_charge(
                "torch_runtime", charge, "torch runtime + kernels + library handles (measured)"
            )
            self.outside_charge = charge
        act = self.system.activations
        if act is not None and act.recording:
            # The recorded pass laid out: a measuring tier's high-water
            # becomes the layout's top where that is lower.
            try:
                self.pass_plan = act.plan_pass()
            except InvalidArgument as exc:  # a pass too long to record
                warnings.warn(
                    f"imp_mem.torch: the warm-up pass was not laid out ({exc}); the tier is "
                    "frozen at its measured high-water",
                    ImpMemWarning,
                    stacklevel=2,
                )
        if self.margin_share is not None and act is not None and act.measuring:
            act.freeze(int(act.high_water * self.margin_share))
        self.system.begin_serving()
        if self.recalled is None and self.fingerprint is not None:
            for line in self.system.measured():
                if line["state"] != "frozen":
                    continue
                try:
                    self.remembered = _measured.remember(
                        self.fingerprint, line, line["tier"], self.cache_path
                    )
                except OSError as exc:
                    _jsonfile.warn_not_remembered(
                        "imp_mem.torch: the measured figure",
                        exc,
                        "IMP_MEM_CACHE_DIR (or cache_path=)",
                    )

    def close(self) -> dict[str, Any]:
        """Closes the scope mode's :class:`Pool` (its MemPools go back to the
        tier, the tier leaves the hooks) and then the system; the system's
        closing report. In ``mode="process"`` the tier stays torch's
        allocator for the process (torch cannot change it back), so its
        memory is released when the process ends."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        return self.system.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def report(self) -> dict[str, Any]:
        """``mem_report`` with the device reading, less what other processes
        held at the start."""
        return self.system.mem_report(device=True, other_processes=self.other_processes)

    def report_text(self) -> str:
        """The text of :meth:`report`."""
        return self.system.mem_report_text(device=True, other_processes=self.other_processes)

    def __repr__(self) -> str:
        state = "measuring" if self.recalled is None else f"recalled {self.recalled['size']} B"
        return f"imp_mem.torch.Served(device={self.device}, mode={self.mode!r}, {state})"


_graph_handles = threading.local()
_torch_graph_pool_handle: Callable[[], Any] | None = None


def _graph_handle_stack() -> list[Any]:
    stack = getattr(_graph_handles, "stack", None)
    if stack is None:
        stack = _graph_handles.stack = []
    return stack


def _graph_pool_handle() -> Any:
    """``torch.cuda.graph_pool_handle`` while imp-mem routes it: the pool of
    this thread's innermost :func:`graph_pool` block, else torch's own."""
    stack = _graph_handle_stack()
    if stack:
        return stack[-1]
    assert _torch_graph_pool_handle is not None
    return _torch_graph_pool_handle()


def _route_graph_pool_handles() -> None:
    """Puts :func:`_graph_pool_handle` in torch's place, once: each thread's
    blocks then answer for that thread alone (swapping torch's function in
    and out per block let one thread's exit restore another's pool for
    everyone)."""
    global _torch_graph_pool_handle
    with _lock:
        if torch.cuda.graph_pool_handle is not _graph_pool_handle:
            _torch_graph_pool_handle = torch.cuda.graph_pool_handle
            torch.cuda.graph_pool_handle = _graph_pool_handle  # type: ignore[assignment]


@contextlib.contextmanager
def graph_pool(target: Any) -> Iterator[Any]:
    """While the block runs, ``torch.cuda.graph_pool_handle()`` (the pool
    inductor's CUDA graph trees capture into, and anyone's who asks for a
    fresh graph pool) returns the id of a ``MemPool`` over ``target``'s tier
    (a :class:`Pool`, whose graph pool is made once and kept with it; or
    a MemorySystem / ActivationPool, through :func:`pool`): the graphs'
    memory is the tier's, counted in its high-water. torch's caching
    allocator still manages that pool (its checkpoint state, which the trees
    need, exists). Yields the MemPool."""
    p = target if isinstance(target, Pool) else pool(target)
    p._check_open()
    if p.graph_mempool is None:
        p.graph_mempool = torch.cuda.MemPool(pluggable_allocator().allocator())
    _route_graph_pool_handles()
    stack = _graph_handle_stack()
    stack.append(p.graph_mempool.id)
    try:
        with p.routed():
            yield p.graph_mempool
    finally:
        stack.pop()


def _check_mode(mode: Any) -> None:
    if mode not in ("process", "scope"):
        raise InvalidArgument(f'mode: expected "process" or "scope", got {mode!r}')


def default_margin(mode: str) -> float | int:
    """:func:`serve`'s margin where none is given: `DEFAULT_SCOPE_MARGIN` in
    ``mode="scope"``, `DEFAULT_MARGIN` in ``mode="process"``."""
    _check_mode(mode)
    return DEFAULT_SCOPE_MARGIN if mode == "scope" else DEFAULT_MARGIN


def _check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise InvalidArgument(
            f"margin: expected a share of the high-water (a float such as 0.01) or bytes "
            f"(an int), non-negative; got {margin!r}"
        )


def serve(
    budget: Any = None,
    *,
    device: Any = None,
    fingerprint: Any = None,
    shapes: Any = None,
    margin: float | int | None = None,
    chunk: Any = DEFAULT_CHUNK,
    mode: str = "process",
    cache_path: Any = None,
    backend: Any = None,
    other_processes: int | None = None,
    plan_passes: bool = True,
) -> Served:
    """One call for a process: a VMM backend on ``device`` (its handles
    ``chunk`` bytes, so the tier's freeze rounds up to one chunk) and a
    :class:`~imp_mem.MemorySystem` for ``budget`` (default: the device's
    memory less what other processes hold) with one tier, the activations
    tier, *measured* (it grows in ``chunk``-byte commits while the warm-up
    runs, addresses never moving) and no KV pool; the tier is then made
    torch's allocator (``mode="process"``: process-wide, so call this before
    torch's first CUDA tensor; ``mode="scope"``: a MemPool over it, entered
    with ``served.scope()``). Returns a :class:`Served`.

    The warm-up is the caller's code between this and
    ``served.begin_serving()``, which freezes the tier at its high-water plus
    ``margin`` (a float: a share of the high-water; an int: bytes; default
    `DEFAULT_MARGIN`, `DEFAULT_SCOPE_MARGIN` in the scope mode), rounded
    up to a chunk, and remembers the figure under ``fingerprint`` (the
    model's identity; with ``shapes`` and the torch / CUDA / driver versions,
    see :mod:`imp_mem.measured`). A later start with the same fingerprint
    plans the tier at the remembered size, committed at open, and does not
    measure (``served.measuring`` is False).

    ``plan_passes`` (``mode="process"``): the pass after
    ``served.reset_high_water()`` is recorded and laid out offline at
    ``begin_serving()``, and the served passes follow that layout
    (:meth:`Served.reset_high_water`); False keeps the ordinary placement.
    The layout is for work that repeats the recorded pass (the same shapes):
    other work is placed by the ordinary search in a tier sized for the
    layout, and what does not fit falls back (counted, ``fallbacks_total``),
    so warm up with the pass the server repeats. A later start must run the
    same warm-up (the same reset) to plan its remembered size the same way."""
    if not isinstance(plan_passes, bool):
        raise TypeError(f"plan_passes: expected a bool, got {type(plan_passes).__name__}")
    if cache_path is not None and not isinstance(cache_path, (str, os.PathLike)):
        raise TypeError(
            f"cache_path: expected a path (str or os.PathLike), got {type(cache_path).__name__}"
        )
    if other_processes is not None:
        if isinstance(other_processes, bool) or not isinstance(other_processes, int):
            raise TypeError(
                f"other_processes: expected bytes as an int, got {type(other_processes).__name__}"
            )
        if other_processes < 0:
            raise InvalidArgument(
                f"other_processes: expected the bytes other processes hold (0 or more), got "
                f"{other_processes}"
            )
    if fingerprint is not None:
        if fingerprint == "":
            raise InvalidArgument(
                "fingerprint: expected the model's identity (its name, or its config dict); "
                "pass None to measure every start"
            )
        _measured.check_plain(fingerprint, "fingerprint")
        _measured.check_plain(shapes, "shapes")
    _check_mode(mode)
    if margin is None:
        margin = default_margin(mode)
    _check_margin(margin)
    from imp_mem import MemorySystem, VmmBackend
    from imp_mem import _core as core

    dev = 0 if device is None else _device_index(device)
    if other_processes is None:
        if backend is None:
            from imp_mem.reserve import device_used_by_all_processes

            other_processes = device_used_by_all_processes(dev) or 0
        else:
            other_processes = 0
    chunk_bytes = byte_count(chunk, "chunk")
    if backend is None:
        # Handles of one chunk, so the freeze rounds the tier up to a chunk,
        # not to the backend's default 64 MiB handle (measured on the H200,
        # HF Qwen3-0.6B 32 x 1 024 + 64: reserved / live peak 1.040 with
        # 64 MiB handles, 1.029 with 2 MiB, tokens/s unchanged).
        backend = VmmBackend(dev, chunk_bytes=chunk_bytes)
    is_device = not isinstance(backend, core.FakeBackend)
    fp = None
    recalled = None
    if fingerprint is not None:
        # The GPU's name from the backend's driver, not torch's: asking torch
        # initialises its allocator, which install() must still swap.
        env = _measured.environment(dev, getattr(backend, "device_name", None))
        fp = _measured.fingerprint(fingerprint, shapes, device=dev, env=env)
        recalled = _measured.recall(fp, "activations", cache_path)
    if is_device:
        free, total = core.cuda_mem_get_info(dev)
        context = max(0, total - free - other_processes)
        capacity = total - other_processes
    else:
        context, capacity = 0, int(backend.stats()["capacity"])
    plan_budget = capacity if budget is None else byte_count(budget, "budget")
    if plan_budget > capacity:
        raise InvalidArgument(
            f"budget: {human_bytes(plan_budget)} is more than the device offers "
            f"({human_bytes(capacity)}, after the {human_bytes(other_processes)} other "
            "processes hold); give at most that, or None for all of it"
        )
    tier = _tier_bytes(plan_budget, context)
    if tier <= 0:
        raise InvalidArgument(
            f"budget: {plan_budget} B leaves nothing for the tier after the CUDA context "
            f"({context} B); give a larger budget"
        )
    if recalled is not None:
        tier = min(tier, recalled["size"])
    plan = _placeholder_plan(tier, plan_budget, context)
    measure = None if recalled is not None else chunk_bytes
    system = MemorySystem(
        backend,
        plan,
        context=context,
        library_reserve=0,
        activation_strict=mode == "scope",
        activation_measure=measure,
        activation_margin=0 if isinstance(margin, float) else int(margin),
    )
    served = Served(
        system,
        device=dev if is_device else -1,
        mode=mode,
        fingerprint=fp,
        cache_path=cache_path,
        recalled=recalled,
        other_processes=other_processes,
        plan_passes=plan_passes,
    )
    if isinstance(margin, float):
        served.margin_share = margin
    try:
        if mode == "process":
            if is_device:
                install(system, device=dev)
        else:
            served.pool = Pool(system, device=dev)
    except BaseException:
        # Nothing of it reached the caller: its memory goes back now.
        system.close()
        raise
    return served


def _tier_bytes(budget: int, context: int) -> int:
    """The most whole MiB the tier can have beside `context` in `budget`,
    as the planner rounds them (the core's ``MemoryPlan.activations_room``)."""
    return _core.MemoryPlan.activations_room(budget, context)


def _placeholder_plan(tier: int, budget: int, context: int) -> Any:
    """A plan of one tier: the activations (``tier`` bytes), no weights, no
    KV pool, no scratch; the context charged as measured (the core's
    ``MemoryPlan.activations_only``)."""
    return _core.MemoryPlan.activations_only(budget, context, tier)


def hook_stats() -> dict[str, int]:
    """The entry points' counters: calls, refusals by kind, caught panics."""
    return {k: v for k, v in _core.hook_stats().items() if isinstance(v, int)}


_TORCH_KEYS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "allocated_bytes.all.allocated": "total_allocated_bytes",
    "allocated_bytes.all.freed": "total_freed_bytes",
    "allocation.all.current": "allocations",
    "allocation.all.peak": "peak_allocations",
    "allocation.all.allocated": "total_allocations",
    "allocation.all.freed": "total_frees",
}


def memory_stats(target: Any = None) -> dict[str, int]:
    """The activations tier's counters in the shape of ``torch.cuda.memory_stats``
    (``allocated_bytes.all.current``, ``reserved_bytes.all.current``, ...), plus
    imp-mem's own under ``imp_mem.*``."""
    activations = _activations_of(target) if target is not None else installed()
    if activations is None:
        raise InvalidArgument("target: no activations tier is installed; pass a MemorySystem")
    out = {k: int(v) for k, v in activations.memory_stats().items()}
    for key, value in activations.stats().items():
        if isinstance(value, (int, bool)):
            out[f"imp_mem.{key}"] = int(value)
    return out


def to_arena(module: torch.nn.Module, arena: Any) -> int:
    """Moves every parameter and buffer of ``module`` into ``arena`` (T1): each
    becomes a tensor viewing the arena (a StableSpan), filled from the current
    data; tied tensors stay tied (one copy). Returns the bytes taken. Run it
    while LOADING."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    moved: dict[int, torch.Tensor] = {}
    taken = 0
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in list(store.items()):
                if tensor is None:
                    continue
                new = moved.get(id(tensor))
                if new is None:
                    view = arena_tensor(arena, tuple(tensor.shape), tensor.dtype)
                    with torch.no_grad():
                        view.copy_(tensor)
                    taken += view.numel() * view.element_size()
                    if isinstance(tensor, torch.nn.Parameter):
                        new = torch.nn.Parameter(view, requires_grad=False)
                    else:
                        new = view
                    moved[id(tensor)] = new
                store[name] = new
    return taken


def arena_tensor(
    arena: Any, shape: tuple[int, ...], dtype: torch.dtype, *, align: int = 256
) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` viewing a fresh take of ``arena`` (a
    StableSpan: its address never moves, so CUDA graphs may capture it). The
    tensor is on the arena's device (the CPU for a fake backend)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape: expected a tuple of ints, got {shape!r}") from None
    numel = 1
    for d in dims:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = arena.take(max(numel * itemsize, itemsize), align=align)
    out = torch.from_dlpack(span.view(dtype, dims if dims else (1,)))
    return out.reshape(()) if not dims else out


def measure_step_high_water(step: Callable[[], Any], *, warmup: int = 1, device: Any = None) -> int:
    """The peak bytes torch allocates during ``step()`` (after ``warmup`` calls),
    measured on torch's default allocator: the number to plan the activations
    tier with (``Features(activation_bytes=...)``, seed A3.3)."""
    if not callable(step):
        raise TypeError(f"step: expected a callable, got {type(step).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup: expected an int, got {type(warmup).__name__}")
    if warmup < 0:
        raise InvalidArgument(
            f"warmup: expected 0 or more calls before the measured one, got {warmup}"
        )
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "measure_step_high_water: torch sees no CUDA device; it measures torch's own "
            "allocator on the GPU"
        )
    dev = _device_index(device)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    return int(torch.cuda.max_memory_allocated(dev) - base)


def measure_outside_charge(
    system: Any, warmup: Callable[[], Any], *, device: int | None = None, key: str = "torch_runtime"
) -> int:
    """Measures the device memory ``warmup()`` takes outside every allocator
    (torch's own runtime when it initialises there, kernels loaded lazily into
    the context, library handles) and charges it to ``system`` under ``key``,
    so the report names it.

    The charge is the growth of the device's used memory over the whole warm-up
    (read through the driver, so torch need not be initialised before), less
    the growth of what the backend committed; run the real workload's warm-up
    (the window of lazily loaded kernels is what varies, not the charge)."""
    dev = 0 if device is None else int(device)
    free0, _ = _core.cuda_mem_get_info(dev)
    committed0 = int(system.backend.stats()["committed"])
    warmup()
    torch.cuda.synchronize(dev)
    free1, _ = _core.cuda_mem_get_info(dev)
    committed1 = int(system.backend.stats()["committed"])
    charge = max(0, (free0 - free1) - (committed1 - committed0))
    total = _outside_charges.get((id(system), key), 0) + charge
    _outside_charges[(id(system), key)] = total
    system.set_charge(key, total, "torch kernels + library handles (measured)")
    return charge


_outside_charges: dict[tuple[int, str], int] = {}


class Region:
    """One tag's tier for any torch code (:func:`region`): a growable, strict
    activation pool on ``backend`` (``capacity`` bytes, committed while
    awake), routed to by the allocator hooks on the threads inside a
    :meth:`scope`, in a ``torch.cuda.MemPool`` of its own."""

    def __init__(
        self,
        backend: Any,
        tag: str,
        capacity: Any,
        *,
        cpu_backup: bool,
        device: Any,
        measure_chunk: Any = None,
    ) -> None:
        self.tag = tag
        self.cpu_backup = cpu_backup
        self.backend = backend
        self.device = 0 if device is None else _device_index(device)
        self.capacity = capacity
        if measure_chunk is None:
            self.activations: Any = _core.ActivationPool(
                backend, capacity, strict=True, growable=True
            )
        else:
            self.activations = _core.ActivationPool(
                backend, capacity, strict=True, measure_chunk=measure_chunk
            )
        _core.add_hook_region(self.activations, device=self.device)
        self.mempool: Any = None

    @contextlib.contextmanager
    def scope(self) -> Iterator[Region]:
        """Routes torch's allocations in the block (on this thread) to the
        region."""
        if self.activations.asleep is not None:
            raise InvalidArgument(
                f"tag: region {self.tag!r} is paused; resume({self.tag!r}) before running torch "
                "code in it"
            )
        if self.mempool is None:
            if not torch.cuda.is_available():
                raise BackendUnavailable(
                    "imp_mem.torch.region routes torch's CUDA allocations; torch sees no CUDA "
                    "device here"
                )
            self.mempool = torch.cuda.MemPool(pluggable_allocator().allocator())
        with (
            _hook_region(self.activations),
            torch.cuda.use_mem_pool(self.mempool, device=self.device),
        ):
            yield self

    def freeze(self, margin: Any = 0) -> dict[str, int]:
        """A measured region (``measure_chunk=``): fixes it at its high-water
        plus ``margin`` bytes (rounded up to a chunk), the rest decommitted
        (``ActivationPool.freeze``). Trims torch's cache inside the region's
        MemPool first (its free segments go back to the tier)."""
        if self.mempool is not None:
            _renew_mempool(self)
        return self.activations.freeze(margin)

    def pause(self) -> int:
        """See :func:`pause`."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        return self.activations.pause(cpu_backup=self.cpu_backup)

    def resume(self) -> None:
        """See :func:`resume`."""
        self.activations.resume()

    def __repr__(self) -> str:
        state = "paused" if self.activations.asleep is not None else "awake"
        return (
            f"imp_mem.torch.Region(tag={self.tag!r}, capacity={self.activations.capacity}, "
            f"cpu_backup={self.cpu_backup}, {state})"
        )


_regions: dict[str, Region] = {}
_thread_regions = threading.local()


def _region_stack() -> list[Any]:
    stack = getattr(_thread_regions, "stack", None)
    if stack is None:
        stack = _thread_regions.stack = []
    return stack


@contextlib.contextmanager
def _hook_region(route: Any) -> Iterator[None]:
    """This thread's hook mallocs go to ``route`` (an ActivationPool added as
    a hook region; None: the installed pool) for the block, nested blocks
    restoring the one outside them."""
    stack = _region_stack()
    stack.append(route)
    _core.set_hook_region(route)
    try:
        yield
    finally:
        stack.pop()
        _core.set_hook_region(stack[-1] if stack else None)


def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgument(f"tag: expected a non-empty str naming the region, got {tag!r}")
    return tag


def _region_of(tag: Any) -> Region:
    found = _regions.get(_check_tag(tag))
    if found is None:
        raise InvalidArgument(
            f"tag: {tag!r} is no region; open it with imp_mem.torch.region(backend, {tag!r}, "
            f"capacity=...) (regions now: {sorted(_regions)})"
        )
    return found


def region(
    target: Any,
    tag: str,
    *,
    capacity: Any = None,
    cpu_backup: bool = True,
    device: Any = None,
    measure_chunk: Any = None,
) -> contextlib.AbstractContextManager[Region]:
    """``with imp_mem.torch.region(backend, "train", capacity="8GiB"): ...``
    routes the block's torch allocations (on this thread) to the region of
    ``tag``, made on first use: ``capacity`` bytes of a growable tier on
    ``target`` (a VMM backend, or a MemorySystem's), committed while awake.
    ``cpu_backup`` (fixed at first use): whether :func:`pause` keeps the
    bytes in pinned host memory (True) or drops them (False: the tensors
    hold garbage after :func:`resume`). Later uses of the tag take the same
    region; ``capacity`` and ``cpu_backup`` must then match or be left out.
    ``measure_chunk`` (bytes, fixed at first use) makes it a *measured*
    region: ``capacity`` is reserved and committed in chunks of that size as
    the code inside asks, until :meth:`Region.freeze` fixes it at its
    high-water plus a margin (a CUDA graph pool or ``torch.compile``'s
    workspaces sized by measuring; :mod:`imp_mem.measured` remembers the
    figure)."""
    tag = _check_tag(tag)
    if not isinstance(cpu_backup, bool):
        raise InvalidArgument(f"cpu_backup: expected True or False, got {cpu_backup!r}")
    # Found or made under one lock: two threads opening a tag at once get
    # one region (the other's tier would stay a hook region for nothing).
    with _made_lock:
        found = _find_or_make_region(target, tag, capacity, cpu_backup, device, measure_chunk)
    return found.scope()


def _find_or_make_region(
    target: Any, tag: str, capacity: Any, cpu_backup: bool, device: Any, measure_chunk: Any
) -> Region:
    found = _regions.get(tag)
    if found is None:
        if capacity is None:
            raise InvalidArgument(
                f"capacity: region {tag!r} is new, so it needs a size; pass capacity= (bytes, "
                'or a string such as "8GiB")'
            )
        backend = getattr(target, "backend", target)
        if not isinstance(backend, _core.Backend):
            raise InvalidArgument(
                f"target: expected a Backend (a VmmBackend) or a MemorySystem, got "
                f"{type(target).__name__}"
            )
        found = Region(
            backend,
            tag,
            capacity,
            cpu_backup=cpu_backup,
            device=device,
            measure_chunk=measure_chunk,
        )
        _regions[tag] = found
    else:
        if capacity is not None and capacity not in (found.capacity, found.activations.capacity):
            raise InvalidArgument(
                f"capacity: region {tag!r} already holds {found.activations.capacity} bytes; "
                "leave capacity out to use it"
            )
        if cpu_backup != found.cpu_backup:
            raise InvalidArgument(
                f"cpu_backup: region {tag!r} was made with cpu_backup={found.cpu_backup}; it "
                "is fixed at first use"
            )
    return found


def regions() -> dict[str, Region]:
    """The regions made so far, by tag."""
    return dict(_regions)


def pause(tag: str) -> int:
    """Gives region ``tag``'s physical memory back after synchronising the
    device: with ``cpu_backup`` its live segments are copied to pinned host
    memory first (the buffer of the last pause is reused, so every pause but
    the first runs at the line rate). Its addresses stay reserved. Returns
    the bytes copied."""
    return _region_of(tag).pause()


def resume(tag: str) -> None:
    """Recommits region ``tag`` at the same addresses and copies its bytes back
    (``cpu_backup``). If the device has no room it raises OutOfMemory and the
    region stays paused; call it again later."""
    _region_of(tag).resume()


def release_region(tag: str) -> None:
    """Drops region ``tag``: its MemPool (torch gives the free segments back),
    its pinned buffer and its tier. Refused while tensors made in it are
    alive (their memory would go with it)."""
    with _made_lock:
        _release_region(_region_of(tag), tag)


def _release_region(found: Region, tag: str) -> None:
    if found.activations.asleep is not None:
        found.resume()
    if found.mempool is not None:
        found.mempool = None
        _release_dropped_pools(found.device)
    live = found.activations.stats()["live"]
    if live:
        raise InvalidArgument(
            f"tag: region {tag!r} still holds {live} segment(s) of live tensors; drop them first"
        )
    _core.remove_hook_region(found.activations)
    found.activations.release_host_copy()
    del _regions[tag]
