"""Regions (the trainer's side of RL colocation, issue 24): one tag's tier
for any torch code. ``with region(backend, "train", capacity=...):`` routes
the block's torch allocations (on this thread) to a growable activation
pool of the tag's own, in a ``MemPool`` of its own; :func:`pause` gives its
physical memory back (the live segments copied to pinned host memory first
with ``cpu_backup``) and :func:`resume` recommits it at the same addresses,
so every tensor made inside is where and what it was.

Thread safety: a region is found or made, and released, under ``_made_lock``
(two threads opening a tag at once get one region); its scope routes only
the thread that enters it (the hook-region stack, ``_hooks._hook_region``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from imp_mem import _core
from imp_mem.errors import BackendUnavailable, InvalidArgument
from imp_mem.torch import _hooks
from imp_mem.torch._hooks import (
    _device_index,
    _hook_region,
    _made_lock,
    _release_dropped_pools,
    _renew_mempool,
)


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
            self.mempool = torch.cuda.MemPool(_hooks.pluggable_allocator().allocator())
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
