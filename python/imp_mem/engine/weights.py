"""New weights for `Engine.update_weights`: where they come from (a
trainer's tensors in this process, another process's over CUDA IPC, or a
checkpoint on disk read one tensor at a time), how an update is checked
against T1 before any byte moves (`check_update`), and the copy in place
(`copy_update`).

CUDA IPC. A trainer process turns its named GPU tensors into picklable
handles (`ipc_handles`: torch's own tensor reductions, an IPC memory handle
and an offset per tensor) and sends them to the engine's process (a pipe,
a queue); the engine maps them (`open_ipc_handles`) and copies device to
device, never through the host. The trainer must keep its tensors alive
until the engine's `update_weights_from_ipc` returns. Both processes must
see the same GPU.

A checkpoint. `checkpoint_tensors` lists a safetensors checkpoint's tensors
from its headers (names, shapes, dtypes: what the update checks before the
first byte moves) and reads each tensor's bytes only when it is copied, so
a reload holds one tensor in host memory at a time, not the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from imp_mem._safetensors import DTYPES, TensorEntry, read_header, safetensors_files


def ipc_handles(named_tensors: Any) -> list[tuple[str, Any]]:
    """Picklable CUDA IPC handles of `(name, tensor)` pairs (or a mapping)
    of CUDA tensors, for `Engine.update_weights_from_ipc` in another
    process on the same GPU."""
    from torch.multiprocessing.reductions import reduce_tensor

    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    out = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            raise TypeError(f"ipc_handles: {name!r} must be a CUDA torch.Tensor")
        out.append((name, reduce_tensor(tensor)))
    return out


def open_ipc_handles(handles: Iterable[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors `ipc_handles` made in another process, mapped here."""
    out = []
    for item in handles:
        try:
            name, (rebuild, args) = item
        except (TypeError, ValueError):
            raise TypeError(
                "update_weights_from_ipc: expected the list imp_mem.engine.weights.ipc_handles "
                "returned"
            ) from None
        out.append((name, rebuild(*args)))
    return out


@dataclass(frozen=True)
class FileTensor:
    """A checkpoint's tensor, read from its file when `load` is called."""

    entry: TensorEntry

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.entry.dtype][0])

    def load(self) -> torch.Tensor:
        e = self.entry
        with open(e.file, "rb") as f:
            f.seek(e.begin)
            data = bytearray(f.read(e.end - e.begin))
        if not data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(self.shape)


def checkpoint_tensors(path: str | Path) -> list[tuple[str, FileTensor]]:
    """Every tensor of the safetensors checkpoint at `path` (a file or a
    directory of shards), read lazily."""
    return [(t.name, FileTensor(t)) for f in safetensors_files(path) for t in read_header(f)]


def check_update(
    weights: dict[str, torch.Tensor], items: Any, config: Any, shards: dict[str, Any]
) -> list[tuple[torch.Tensor, Any, Any]]:
    """``(T1 view, source, this rank's shard or None)`` for every tensor of
    an update, each checked against the checkpoint loaded as `weights`: a
    name it has, given once, the whole tensor's shape (`shards`: this rank's
    slices, which it narrows to), the same dtype. Nothing is copied here, so
    a refusal changes nothing."""
    from imp_mem.engine.model import weight_names
    from imp_mem.errors import InvalidArgument

    full = weight_names(config)
    seen: set[str] = set()
    plan = []
    # A vision model's tensors also answer to transformers' module names
    # (``model.language_model.*``, a trainer's ``named_parameters()``) and to
    # the Hub's tower names, whichever the checkpoint used.
    alias: dict[str, str] = {}
    if getattr(config, "vision", None) is not None:
        from imp_mem.engine.model.siglip import canonical_name

        alias = {canonical_name(k): k for k in weights}
    for item in items:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise TypeError(
                "update_weights: expected (name, tensor) pairs or a mapping of them"
            ) from None
        if not isinstance(name, str):
            raise TypeError(f"update_weights: a name must be str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor | FileTensor):
            raise TypeError(
                f"update_weights: {name!r} must be a torch.Tensor, got {type(tensor).__name__}"
            )
        dst = weights.get(name)
        if dst is None and alias:
            name = alias.get(canonical_name(name), name)
            dst = weights.get(name)
        if dst is None:
            raise InvalidArgument(
                f"update_weights: {name!r} is no tensor of this checkpoint; give the "
                "checkpoint's own Hugging Face names (nothing was copied)"
            )
        if name in seen:
            raise InvalidArgument(f"update_weights: {name!r} is given twice (nothing copied)")
        seen.add(name)
        want = full.get(name, tuple(dst.shape)) if shards else tuple(dst.shape)
        if tuple(tensor.shape) != tuple(want):
            raise InvalidArgument(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}; the checkpoint's "
                f"is {tuple(want)} (nothing was copied)"
            )
        if tensor.dtype != dst.dtype:
            raise InvalidArgument(
                f"update_weights: {name!r} is {tensor.dtype}; the checkpoint's is "
                f"{dst.dtype} (nothing was copied)"
            )
        plan.append((dst, tensor, shards.get(name)))
    return plan


def copy_update(plan: list[tuple[torch.Tensor, Any, Any]]) -> None:
    """Copies a checked update into T1 (on the current stream; a file's
    tensor is read when its turn comes)."""
    for dst, src, shard in plan:
        if isinstance(src, FileTensor):
            src = src.load()
        if shard is not None:
            src = src.narrow(shard.dim, shard.start, shard.stop - shard.start)
        dst.copy_(src, non_blocking=src.is_cuda)
