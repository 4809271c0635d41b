"""CuPy's allocations through a planned imp-mem tier (``pip install imp-mem[cupy]``).

The same activations tier (T4a) that :mod:`imp_mem.torch` routes torch to,
reached by CuPy through ``cupy.cuda.memory.CFunctionAllocator`` over C entry
points exported from imp-mem's own extension module
(``imp_mem_cupy_malloc`` / ``imp_mem_cupy_free``): no Python runs on an
allocation.

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

__all__ = ["FREE_SYMBOL", "MALLOC_SYMBOL", "allocator", "install", "use_pool"]

MALLOC_SYMBOL = "imp_mem_cupy_malloc"
FREE_SYMBOL = "imp_mem_cupy_free"


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
    activations.install(device=dev)
    alloc = cupy.cuda.memory.CFunctionAllocator(
        0, _symbol(MALLOC_SYMBOL), _symbol(FREE_SYMBOL), activations
    )
    if cached:
        return cupy.cuda.MemoryPool(alloc.malloc).malloc
    return alloc.malloc


@contextlib.contextmanager
def use_pool(target: Any, *, cached: bool = False) -> Iterator[Any]:
    """``with imp_mem.cupy.use_pool(system): ...`` routes CuPy's allocations in
    the block to the tier."""
    malloc = allocator(target, cached=cached)
    with cupy.cuda.using_allocator(malloc):
        yield malloc


def install(target: Any, *, cached: bool = False) -> Any:
    """Makes the tier CuPy's allocator for the whole process; returns it."""
    malloc = allocator(target, cached=cached)
    cupy.cuda.set_allocator(malloc)
    return malloc
