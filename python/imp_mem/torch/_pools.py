"""Pools: torch's allocations routed to an activations tier. A :class:`Pool`
is a ``torch.cuda.MemPool`` whose segments come from the tier, entered for a
block (:meth:`Pool.scope`, :func:`use_pool`; :func:`pool` keeps one per
tier); :func:`install` makes the tier torch's only allocator, process-wide.

Thread safety: a Pool is found or made under ``_made_lock``, and enters or
leaves the set of open Pools (which decides whether its tier is installed
in the hooks or a hook region) under ``_lock``; its scopes route only the
thread that enters them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from imp_mem import _core
from imp_mem._frameworks import activations_of as _activations_of
from imp_mem.errors import InvalidArgument, PhaseViolation
from imp_mem.torch import _hooks
from imp_mem.torch._hooks import (
    _device_index,
    _hook_region,
    _install_hooks,
    _installed,
    _lock,
    _made_lock,
    _open,
    _release_dropped_pools,
    _renew_mempool,
    _same_tier,
    _uninstall_hooks,
    memory_stats,
)


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
        allocator = _hooks.pluggable_allocator().allocator()
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
        loading_pool = torch.cuda.MemPool(_hooks.pluggable_allocator().allocator())
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
        _hooks._clear_cublas_workspaces()
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
        torch.cuda.memory.change_current_allocator(_hooks.pluggable_allocator())
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
