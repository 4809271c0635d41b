"""The runner's side of the KV pools: the pools typed as tensors, and the
blocks the runner holds itself.

KV views. The KV pools are typed as tensors in the attention's layout
(`BlockPool.view`, the whole reservation), their block bytes checked
against that layout; a family with its own page layout (MLA's latents)
names its block's shape (``kv_block_shape``).

The runner's own blocks, held through sequences of its own in the manager
(which accounts for every block of its pools): the padding rows' block in
each pool (a decode bucket's padding rows feed position 0 through a table
whose only block is this one, so they write only there) and, for a model
with sliding layers, the SWA ring.

Sliding-window layers. The KV manager keeps SWA blocks only for each
sequence's trailing window, while a prefill's early queries need the
window before *them*. The runner holds a ring of scratch SWA blocks and,
for each prefill chunk, maps the logical blocks the manager has not given
(below the trailing window) onto the ring (logical block ``j`` on ring
slot ``j % len(ring)``, the ring longer than any chunk's reach), so every
query sees its whole window; the K/V written there are dropped after the
prefill, as the manager would drop them. The prefix cache holds only
full-attention blocks, so a prefix hit would leave the window's SWA K/V
uncomputed: models with sliding layers run with prefix caching off, and are
planned for `max_batch` plus the ring's sequences' worth of SWA blocks
(`engine_blocks`).

`KvSide` is the part of `ModelRunner` that does this.

Thread safety: none; one thread drives the runner.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model import KvViews
from imp_mem.errors import InvalidArgument

# Sequence ids of the runner's own (a scheduler counts from 0).
PAD_SEQ = (1 << 63) - 2
WARM_SEQ = (1 << 63) - 1
RING_SEQ = 1 << 62

# The plan's KV dtype names -> torch's.
_KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def engine_blocks(config: ModelConfig, prefill_chunk: int, block_size: int) -> tuple[int, list]:
    """``(ring_blocks, [full, swa])``: the SWA ring's length and the blocks
    the runner holds through sequences of its own (`reserve_blocks`), planned
    as blocks beyond max_batch sequences: the padding rows' block in each
    pool and, for a sliding model, the ring, which must be longer than a
    chunk's reach (chunk + window); each ring sequence holds a window's
    blocks in both pools."""
    if not config.sliding_layers:
        return 0, [1, 0]
    ring = math.ceil((prefill_chunk + config.sliding_window) / block_size) + 2
    per_seq = math.ceil(config.sliding_window / block_size)
    held = math.ceil(ring / per_seq) * per_seq
    return ring, [1 + held, 1 + held]


class KvSide:
    """The KV views and the runner's own blocks, as a part of `ModelRunner`
    (which sets the model's config and block size, `memory` and `kv`, the
    manager)."""

    def _kv_views(self, tp: Any) -> KvViews:
        """The KV pools as tensors in the model's page layout."""
        c = self.config
        system = self.memory.system
        kv_dtype = getattr(torch, _KV_DTYPES[self.memory.plan.kv["dtype"]])
        geometry = (self.block_size, tp.kv_heads, c.head_dim)
        # A family with its own page layout (MLA's latents) names its block's shape.
        block_shape = getattr(self.model, "kv_block_shape", None)
        shape = block_shape(len(c.full_layers), self.block_size) if block_shape else None
        full = self._pool_view(
            system.kv_pool, len(c.full_layers), geometry, kv_dtype, "kv", block=shape
        )
        swa = None
        if self.sliding:
            if system.swa_pool is None:
                raise InvalidArgument("the model has sliding layers but the plan has no SWA pool")
            shape = block_shape(len(c.sliding_layers), self.block_size) if block_shape else None
            swa = self._pool_view(
                system.swa_pool, len(c.sliding_layers), geometry, kv_dtype, "swa", block=shape
            )
        return KvViews(full=full, swa=swa, block_size=self.block_size)

    def reserve_blocks(self) -> None:
        """Blocks the runner holds while serving, through sequences of its
        own in the manager (which accounts for every block of its pools):
        the padding rows' block in each pool, and the SWA prefill ring."""
        kv = self.kv
        kv.admit(PAD_SEQ, [0])
        self.engine_seqs = [PAD_SEQ]
        self._pad_full = kv.block_table(PAD_SEQ)[0]
        self._pad_swa = kv.swa_table(PAD_SEQ)[0] if self.sliding else -1
        self._ring: list[int] = []
        while len(self._ring) < self.ring_blocks:
            sid = RING_SEQ + len(self.engine_seqs)
            kv.admit(sid, [1] * self.config.sliding_window)
            self.engine_seqs.append(sid)
            self._ring.extend(b for b in kv.swa_table(sid) if b >= 0)

    def release_blocks(self) -> None:
        """Gives the runner's own blocks back to the manager (the padding
        block, the ring): a pool that sleeps must hold no live block."""
        for sid in getattr(self, "engine_seqs", ()):
            self.kv.abort(sid)
        self.engine_seqs = []

    def _pool_view(self, pool, layers, geometry, dtype, what, block=None) -> torch.Tensor:
        # `block`: a whole block's shape, where the model lays its pages out itself.
        shape = (layers, 2, *geometry) if block is None else tuple(block)
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if pool.block_bytes != want:
            raise InvalidArgument(
                f"the {what} pool's blocks are {pool.block_bytes} B; the layout "
                f"[{', '.join(map(str, shape))}] x {dtype} is {want} B"
            )
        name = str(dtype).removeprefix("torch.")
        view = torch.from_dlpack(pool.view(name, shape))
        assert view.is_contiguous() and view.shape[1:] == shape
        return view

    def _needs_ring(self, swa, start: int, end: int) -> bool:
        """Whether a chunk ``[start, end)`` reads SWA blocks the manager has
        not given (`_fill_ring`)."""
        first = max(0, start + 1 - self.config.sliding_window) // self.block_size
        return bool((swa[first : (end - 1) // self.block_size + 1] < 0).any())

    def _fill_ring(self, swa, start: int, end: int) -> None:
        """Maps the logical SWA blocks a prefill of [start, end) reads and
        the manager has not given onto the scratch ring."""
        bs, ring = self.block_size, self._ring
        first = max(0, start + 1 - self.config.sliding_window) // bs
        last = (end - 1) // bs
        for j in range(first, last + 1):
            if swa[j] < 0:
                swa[j] = ring[j % len(ring)]
