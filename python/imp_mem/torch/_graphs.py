"""CUDA graphs' memory in the tier: inside a :func:`graph_pool` block,
``torch.cuda.graph_pool_handle()`` (which inductor's CUDA graph trees ask
for the pool to capture into) answers with a MemPool over the tier.

Thread safety: torch's function is replaced once, under ``_lock``; each
thread's blocks then answer for that thread alone (a stack per thread).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from imp_mem.torch import _hooks
from imp_mem.torch._hooks import _lock
from imp_mem.torch._pools import Pool, pool

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
        p.graph_mempool = torch.cuda.MemPool(_hooks.pluggable_allocator().allocator())
    _route_graph_pool_handles()
    stack = _graph_handle_stack()
    stack.append(p.graph_mempool.id)
    try:
        with p.routed():
            yield p.graph_mempool
    finally:
        stack.pop()
