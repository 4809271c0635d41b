"""The runner's buffers: T2's layout and the host staging of its inputs.

The static decode buffers live in T2 (token ids, positions, block tables,
next tokens, logits): tensors over `StableSpan`s, whose addresses never
change, so CUDA graphs may bake them in. Three regions (a step's inputs, a
prefill chunk's inputs, the outputs), each staged in a pinned host region
of the same layout (`PinnedBuffer`), so a step costs one host-to-device
copy of its inputs. `t2_groups` is the layout; the plan sizes T2 from it
(`t2_bytes`), to the byte (the pinned staging is host memory, outside the
device plan). A prefill chunk's inputs are staged in one of
`PREFILL_SLOTS` host slots in turn and copied non-blocking (`_Slots`), so
the host stages the next chunk while the device still copies this one
(`runner.steps`, prefill pipelining).

`Buffers` is the part of `ModelRunner` that carves T2, resets its inputs
and drops it.

Thread safety: none; one thread drives the runner.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import imp_mem
from imp_mem.engine.config import ModelConfig

# Host staging slots of a prefill chunk's inputs (`_Slots`): the chunks the
# host may stage ahead of the device.
PREFILL_SLOTS = 4


def t2_groups(
    config: ModelConfig,
    *,
    max_batch: int,
    max_seq_len: int,
    prefill_chunk: int,
    block_size: int,
    keep_logits: bool,
    flashinfer: bool = False,
    prefill_batch_tokens: int = 0,
) -> dict[str, dict[str, tuple]]:
    """The static buffers in T2, by region: name -> (shape, dtype).
    `flashinfer`: FlashInfer's page table in the step's inputs and its
    workspaces in a region of their own, ``fi_work`` (`kernels.flashinfer_decode`).
    `prefill_batch_tokens` (0: no batched prefill): the prefill inputs hold
    a batch of that many tokens over `batch_rows` chunks, with their
    tables, ``cu_seqlens``, starts, and which chunks' greedy tokens go to
    which rows of ``next``."""
    B, C = max_batch, prefill_chunk
    W = math.ceil(max_seq_len / block_size)
    R = batch_rows(max_batch, prefill_batch_tokens)
    decode_in = {
        "ids": ((B,), torch.int64),
        "pos": ((B,), torch.int64),
        "tables": ((B, W), torch.int32),
    }
    prefill_in = {
        "prefill_ids": ((max(C, prefill_batch_tokens),), torch.int64),
        "prefill_table": ((R, W), torch.int32),
    }
    if prefill_batch_tokens:
        prefill_in.update(
            prefill_cu=((R + 1,), torch.int32),
            prefill_starts=((R,), torch.int64),
            prefill_pick=((R,), torch.int64),
            prefill_rows=((R,), torch.int64),
        )
    out = {"next": ((B,), torch.int64)}
    if config.sliding_layers:
        decode_in["swa_tables"] = ((B, W), torch.int32)
        prefill_in["prefill_swa"] = ((R, W), torch.int32)
    if keep_logits:
        out["logits"] = ((B, config.vocab_size), torch.float32)
    groups = {"decode_in": decode_in, "prefill_in": prefill_in, "out": out}
    if flashinfer:
        from imp_mem.engine.kernels import flashinfer_decode

        decode_in.update(flashinfer_decode.input_specs(B, W))
        groups["fi_work"] = flashinfer_decode.workspace_specs()
    return groups


def batch_rows(max_batch: int, prefill_batch_tokens: int) -> int:
    """The most chunks a batched prefill holds: one a request of the step
    (at most `max_batch`), each at least one token; 1 without batching."""
    return max(1, min(max_batch, prefill_batch_tokens))


def t2_bytes(groups: dict[str, dict[str, tuple]]) -> int:
    """T2 as the runner uses it: its regions, each 256-byte aligned."""
    return sum(_layout(specs)[1] for specs in groups.values())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layout(specs: dict[str, tuple[tuple, torch.dtype]]) -> tuple[dict[str, tuple], int]:
    """Offsets of a group of buffers in one region, each 256-byte aligned:
    `{name: (offset, nbytes, shape, dtype)}` and the region's bytes."""
    out, off = {}, 0
    for name, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * _itemsize(dtype)
        out[name] = (off, nbytes, shape, dtype)
        off = -(-(off + nbytes) // 256) * 256
    return out, max(off, 256)


def _carve(raw: torch.Tensor, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Typed views of a uint8 region at `layout`'s offsets."""
    return {
        name: raw[off : off + n].view(dtype).view(shape)
        for name, (off, n, shape, dtype) in layout.items()
    }


class _Staging:
    """A group of host staging arrays in one pinned region (imp-mem's
    `PinnedBuffer`): `raw` (uint8), and per name a torch view (`t[name]`)
    and a NumPy view (`np[name]`) of the same bytes."""

    def __init__(self, backend: Any, specs: dict[str, tuple[tuple, torch.dtype]]) -> None:
        layout, total = _layout(specs)
        self.buffer = imp_mem.PinnedBuffer(total, backend=backend)
        self.raw = torch.from_dlpack(self.buffer.span())[:total]
        self.t = _carve(self.raw, layout)
        self.np = {name: t.numpy() for name, t in self.t.items()}


class _Slots:
    """`n` stagings of one layout used in turn, so the host writes one while
    the device still copies another. On a GPU each slot's copy to the
    device is non-blocking and records the slot's event on the copy's
    stream; the host waits for that event (``synchronize``) only when it
    comes back to the slot. `event`: the event type (``torch.cuda.Event``
    on a GPU; None on the CPU, where a copy is done when it returns)."""

    def __init__(self, backend: Any, specs: dict[str, tuple], n: int, event: Any) -> None:
        self.slots = [_Staging(backend, specs) for _ in range(n)]
        self.events: list[Any] = [event() if event is not None else None for _ in range(n)]
        self.turn = 0

    def take(self) -> _Staging:
        """The current slot, once its last copy has run (the host may write it)."""
        ev = self.events[self.turn]
        if ev is not None:
            ev.synchronize()  # returns at once for an event never recorded
        return self.slots[self.turn]

    def copy_to(self, dst: torch.Tensor) -> None:
        """Copies the slot `take` gave into `dst` and moves to the next."""
        i, ev = self.turn, self.events[self.turn]
        dst.copy_(self.slots[i].raw, non_blocking=ev is not None)
        if ev is not None:
            ev.record()  # on the current stream, the copy's
        self.turn = (i + 1) % len(self.slots)


def _pad_row(width: int, block: int):
    import numpy as np

    row = np.full(width, -1, dtype=np.int32)
    row[0] = block
    return row


class Buffers:
    """T2 and its staging, as a part of `ModelRunner` (which sets the
    limits, the model's config and block size, and `memory`)."""

    def groups(self, block_size: int | None = None) -> dict[str, dict[str, tuple]]:
        """`t2_groups` for this runner's model and limits."""
        return t2_groups(
            self.config,
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            prefill_chunk=self.prefill_chunk,
            block_size=block_size or self.block_size,
            keep_logits=self.keep_logits,
            flashinfer=self.attention_backend == "flashinfer",
            prefill_batch_tokens=self.prefill_batch_tokens,
        )

    def reset_inputs(self) -> None:
        """Every row of the step's inputs on the padding block (position 0),
        staged and copied into T2."""
        W = self.width
        self._pad_row = _pad_row(W, self._pad_full)
        self._pad_swa_row = _pad_row(W, self._pad_swa)
        step_in = self.staging["decode_in"].np
        step_in["tables"][:] = self._pad_row
        step_in["ids"][:] = 0
        step_in["pos"][:] = 0
        if self.sliding:
            step_in["swa_tables"][:] = self._pad_swa_row
        self.t2_raw["decode_in"].copy_(self.staging["decode_in"].raw)

    def _carve_t2(self) -> None:
        self.width = math.ceil(self.max_seq_len / self.block_size)
        self.t2: dict[str, torch.Tensor] = {}
        self.t2_raw: dict[str, torch.Tensor] = {}
        self.staging: dict[str, _Staging] = {}
        groups = self.groups()
        backend = self.memory.backend
        for group, specs in groups.items():
            layout, total = _layout(specs)
            raw = torch.from_dlpack(self.memory.system.engine_arena.take(total, 256))
            self.t2_raw[group] = raw
            self.t2.update(_carve(raw, layout))
            if group == "prefill_in":
                event = torch.cuda.Event if self.on_gpu else None
                self.prefill_slots = _Slots(backend, specs, PREFILL_SLOTS, event)
            elif group not in ("out", "fi_work"):  # outputs and workspaces: no host copy
                self.staging[group] = _Staging(backend, specs)
        self.staging["next"] = _Staging(backend, {"next": groups["out"]["next"]})
        # A step's prefills' tables, read once from the manager (host memory).
        import numpy as np

        self._step_tables = np.full((self.max_batch, self.width), -1, dtype=np.int32)
        self._step_swa = np.full((self.max_batch, self.width), -1, dtype=np.int32)

    def drop_buffers(self) -> None:
        """Drops T2's tensors and the staging (before the system closes)."""
        for name in ("t2", "t2_raw", "staging", "prefill_slots"):
            if hasattr(self, name):
                delattr(self, name)
