"""Plain-torch KV pages and block tables for the model tests: what the engine's
KV manager does, reduced to a free list, so `PagedModel` can be tested
without the engine's runtime.

Pages start, and return when freed, filled with NaN: a kernel that reads a
slot outside its context turns the logits into NaN instead of passing by
luck.
"""

from __future__ import annotations

import random

import torch

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model import KvViews
from imp_mem.engine.model.attention import cdiv


class PagedCache:
    """Full and SWA pools over torch tensors, one table row per sequence."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.window = config.sliding_window
        shape = (block_size, config.num_kv_heads, config.head_dim)
        self.pools: dict[str, torch.Tensor | None] = {}
        self.free: dict[str, list[int]] = {}
        self.refs: dict[str, dict[int, int]] = {}
        rng = random.Random(seed)
        for pool, layers in (("full", config.full_layers), ("swa", config.sliding_layers)):
            if not layers:
                self.pools[pool] = None
                continue
            self.pools[pool] = torch.full(
                (num_blocks, len(layers), 2, *shape), float("nan"), dtype=dtype, device=device
            )
            # Block 0 is the scratch block for padding rows; the rest are
            # handed out in a shuffled order so tables are not monotonic.
            ids = list(range(1, num_blocks))
            rng.shuffle(ids)
            self.free[pool] = ids
            self.refs[pool] = {}
        self.tables: dict[int, dict[str, list[int]]] = {}

    @property
    def kv(self) -> KvViews:
        return KvViews(full=self.pools["full"], swa=self.pools["swa"], block_size=self.block_size)

    def pools_present(self) -> list[str]:
        return [p for p, t in self.pools.items() if t is not None]

    def new_sequence(self, seq: int, share_from: int | None = None, shared_tokens: int = 0) -> None:
        """A sequence, optionally sharing the first `shared_tokens` (a multiple
        of the block size) of another's blocks, as a prefix hit does."""
        assert shared_tokens % self.block_size == 0
        self.tables[seq] = {p: [-1] * self.width for p in self.pools_present()}
        if share_from is None:
            return
        for pool in self.pools_present():
            for logical in range(shared_tokens // self.block_size):
                block = self.tables[share_from][pool][logical]
                if block < 0:
                    # Only an SWA block can be gone: it slid out of the window.
                    assert pool == "swa", "a shared full-attention block must be present"
                    continue
                self.tables[seq][pool][logical] = block
                self.refs[pool][block] += 1

    def ensure(self, seq: int, end: int) -> None:
        """Blocks for every position below `end`."""
        for pool in self.pools_present():
            table = self.tables[seq][pool]
            for logical in range(cdiv(end, self.block_size)):
                if table[logical] < 0:
                    block = self.free[pool].pop()
                    table[logical] = block
                    self.refs[pool][block] = 1

    def slide(self, seq: int, next_pos: int) -> None:
        """Frees the SWA blocks no query at `next_pos` or later can see."""
        if self.pools["swa"] is None or self.window is None:
            return
        table = self.tables[seq]["swa"]
        for logical in range(self.width):
            last_token = (logical + 1) * self.block_size - 1
            if table[logical] >= 0 and last_token <= next_pos - self.window:
                self._release("swa", table[logical])
                table[logical] = -1

    def release(self, seq: int) -> None:
        for pool in self.pools_present():
            for block in self.tables[seq][pool]:
                if block >= 0:
                    self._release(pool, block)
        del self.tables[seq]

    def _release(self, pool: str, block: int) -> None:
        self.refs[pool][block] -= 1
        if self.refs[pool][block] == 0:
            del self.refs[pool][block]
            self.pools[pool][block].fill_(float("nan"))
            self.free[pool].insert(0, block)

    def table(self, seq: int, pool: str, device=None) -> torch.Tensor | None:
        if self.pools[pool] is None:
            return None
        return torch.tensor(self.tables[seq][pool], dtype=torch.int32, device=device)

    def batch_tables(self, seqs: list[int | None], pool: str, device=None) -> torch.Tensor | None:
        """Rows for `seqs`; None is a padding row on the scratch block 0."""
        if self.pools[pool] is None:
            return None
        rows = [[0] + [-1] * (self.width - 1) if s is None else self.tables[s][pool] for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=device)
