"""CuPy's allocations through a planned imp-mem tier (``pip install imp-mem[cupy]``).

The same activations tier (T4a) that :mod:`imp_mem.torch` routes torch to,
reached by CuPy through ``cupy.cuda.memory.CFunctionAllocator`` over C entry
points exported from imp-mem's own extension module
(``imp_mem_cupy_region_malloc`` / ``imp_mem_cupy_region_free``): no Python runs on an
allocation. The tier is a *region* of the allocator hooks, named in each
call, so CuPy keeps to its tier whatever torch's side has installed (the
hooks' one installed pool is torch's: CuPy taking it sent torch's
allocations to CuPy's tier, and torch taking it back sent CuPy's to
torch's).

* :func:`allocator` returns the ``CFunctionAllocator``; ``cached=True`` wraps
  it in a ``cupy.cuda.MemoryPool``, so CuPy's own block cache runs on top
  (the tier then sees segment traffic only, as with torch's MemPool).
* :func:`use_pool` is a scope (``cupy.cuda.using_allocator``) and
  :func:`install` the process-wide form (``cupy.cuda.set_allocator``).

Limit: CuPy's allocator interface carries no stream, so the tier orders
CuPy's blocks on the legacy default stream, which synchronises with every
blocking stream. Code that runs CuPy kernels on non-blocking streams should
use ``cached=True``, whose cache CuPy keeps per stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

try:
    import cupy
except ImportError as exc:  # pragma: no cover - exercised where CuPy is absent
    raise ImportError(
        "imp_mem.cupy needs CuPy: install it with `pip install imp-mem[cupy]` "
        "(or the cupy-cudaXXx wheel for your CUDA)"
    ) from exc

from imp_mem import _core
from imp_mem._frameworks import activations_of as _activations_of
from imp_mem.errors import InvalidArgument

__all__ = [
    "FREE_SYMBOL",
    "MALLOC_SYMBOL",
    "REGION_FREE_SYMBOL",
    "REGION_MALLOC_SYMBOL",
    "allocator",
    "install",
    "use_pool",
]

MALLOC_SYMBOL = "imp_mem_cupy_malloc"
FREE_SYMBOL = "imp_mem_cupy_free"
REGION_MALLOC_SYMBOL = "imp_mem_cupy_region_malloc"
REGION_FREE_SYMBOL = "imp_mem_cupy_region_free"

# Users of each tier's hook region: allocators made outside a scope hold it
# for the process; a use_pool block, for the block.
_users: dict[int, int] = {}
_users_lock = threading.Lock()


def _symbol(name: str) -> int:
    import ctypes

    lib = ctypes.CDLL(_core.hook_library_path())
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if not address:
        raise InvalidArgument(f"{name}: not exported by {_core.hook_library_path()}")
    return int(address)


def allocator(target: Any, *, device: int | None = None, cached: bool = False) -> Any:
    """A CuPy allocator (a callable ``size -> MemoryPointer``) over the tier of
    ``target`` (a MemorySystem or an ActivationPool). ``cached=True`` puts
    CuPy's MemoryPool on top."""
    activations = _activations_of(target)
    dev = cupy.cuda.runtime.getDevice() if device is None else int(device)
    _use_region(activations, dev)
    return _malloc(activations, cached)


def _use_region(activations: Any, device: int) -> None:
    """Adds the tier as a hook region (once) and counts one user of it."""
    with _users_lock:
        if _users.get(activations.id, 0) == 0:
            _core.add_hook_region(activations, device=device)
        _users[activations.id] = _users.get(activations.id, 0) + 1


def _done_with_region(activations: Any) -> None:
    """One user fewer; the last takes the region out of the hooks (blocks of
    it still live keep it, retired, until they are freed)."""
    with _users_lock:
        left = _users.get(activations.id, 0) - 1
        if left > 0:
            _users[activations.id] = left
            return
        _users.pop(activations.id, None)
        _core.remove_hook_region(activations)


def _malloc(activations: Any, cached: bool) -> Any:
    alloc = cupy.cuda.memory.CFunctionAllocator(
        activations.id, _symbol(REGION_MALLOC_SYMBOL), _symbol(REGION_FREE_SYMBOL), activations
    )
    if cached:
        return cupy.cuda.MemoryPool(alloc.malloc).malloc
    return alloc.malloc


@contextlib.contextmanager
def use_pool(target: Any, *, cached: bool = False) -> Iterator[Any]:
    """``with imp_mem.cupy.use_pool(system): ...`` routes CuPy's allocations in
    the block to the tier."""
    activations = _activations_of(target)
    _use_region(activations, cupy.cuda.runtime.getDevice())
    try:
        malloc = _malloc(activations, cached)
        with cupy.cuda.using_allocator(malloc):
            yield malloc
    finally:
        _done_with_region(activations)


def install(target: Any, *, cached: bool = False) -> Any:
    """Makes the tier CuPy's allocator for the whole process; returns it."""
    malloc = allocator(target, cached=cached)
    cupy.cuda.set_allocator(malloc)
    return malloc
