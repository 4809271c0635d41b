"""Weights as tensors viewing the weights arena (T1): :func:`arena_tensor`
makes one over a fresh take of the arena (a StableSpan, whose address never
moves), and :func:`to_arena` moves a module's parameters and buffers there."""

from __future__ import annotations

import operator
from typing import Any

import torch


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
