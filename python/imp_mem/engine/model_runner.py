"""The model runner: what runs a model over imp-mem's memory, one batch at
a time. The serving loop (`llm_engine`) hands it a prefill or a decode
batch; the memory side (`memory`) has planned and opened what it uses.

`ModelRunner` loads a model over the weights and the KV pools and drops it
(a model swap, a sleep, close); its parts, one concept each, live in
`imp_mem.engine.runner`:

* `runner.buffers`: T2's layout (`t2_groups`, sized by `t2_bytes`) and the
  pinned host staging of its inputs;
* `runner.kv`: the KV pools as tensors, the blocks the runner holds itself
  (the padding block, the SWA ring: `engine_blocks`) and the ring's
  mapping for sliding-window layers;
* `runner.steps`: a step's prefills (pipelined, batched several requests a
  forward: `default_prefill_batch_tokens`) and a decode;
* `runner.graphs`: the warm-up and the decode's CUDA graphs, one a bucket
  (`default_buckets`).

Every name this module held before those parts had modules of their own
(issue 53) is still importable from here.

Thread safety: none; one thread drives the runner.
"""

from __future__ import annotations

from typing import Any

import torch

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model import build_model
from imp_mem.engine.runner.buffers import (
    PREFILL_SLOTS,
    Buffers,
    batch_rows,
    t2_bytes,
    t2_groups,
)
from imp_mem.engine.runner.buffers import _layout as _layout  # tests read T2's layout
from imp_mem.engine.runner.graphs import WarmUp, default_buckets
from imp_mem.engine.runner.kv import PAD_SEQ, RING_SEQ, WARM_SEQ, KvSide, engine_blocks
from imp_mem.engine.runner.steps import (
    LARGE_DEVICE_BYTES,
    PREFILL_BATCH_CHUNKS,
    PREFILL_BATCH_CHUNKS_LARGE,
    Steps,
    default_prefill_batch_tokens,
)

__all__ = [
    "LARGE_DEVICE_BYTES",
    "MODEL_ATTRS",
    "PAD_SEQ",
    "PREFILL_BATCH_CHUNKS",
    "PREFILL_BATCH_CHUNKS_LARGE",
    "PREFILL_SLOTS",
    "RING_SEQ",
    "WARM_SEQ",
    "ModelRunner",
    "batch_rows",
    "default_buckets",
    "default_prefill_batch_tokens",
    "engine_blocks",
    "t2_bytes",
    "t2_groups",
]

# What holds the model's memory (weights, KV views, graphs): what a model
# swap or a sleep drops, and close() with T2's buffers.
MODEL_ATTRS = ("graphs", "model", "weights", "kv_views")


class ModelRunner(Steps, WarmUp, KvSide, Buffers):
    """Runs one model's prefills and decodes over T2 buffers, the KV pools
    and (on a GPU) CUDA graphs. `memory` is the engine's `EngineMemory`
    (the system, the torch pool, the charges). Its parts (module doc) are
    the bases; this class holds their state and the model's lifecycle."""

    def __init__(
        self,
        memory: Any,
        *,
        max_batch: int,
        max_seq_len: int,
        prefill_chunk: int,
        keep_logits: bool,
        attention_backend: str | None = None,
        prefill_batch_tokens: int = 0,
    ) -> None:
        self.memory = memory
        # The batched prefill's token budget (0: one request a forward).
        self.prefill_batch_tokens = prefill_batch_tokens
        # "flashinfer" plans FlashInfer's buffers in T2 (`t2_groups`).
        self.attention_backend = attention_backend
        self.flashinfer: Any = None
        if attention_backend == "flashinfer":
            from imp_mem.engine.kernels import flashinfer_decode

            flashinfer_decode.require(memory.device)  # before the plan: a GPU's
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.keep_logits = keep_logits
        self.device = memory.device
        self.on_gpu = memory.on_gpu
        self._stream: Any = None
        self.graphs: dict[int, Any] = {}
        self.warm_up_seconds = 0.0
        self.capture_seconds = 0.0
        # The warm-up's seconds by part (`serve`): its prefills, its
        # decodes, the prefills again after a capture.
        self.warm_up_split: dict[str, float] = {}
        # A list to time each decode's graph replay into (CUDA event pairs
        # on the runner's stream), or None (the default: no events).
        self.replay_events: list[tuple[Any, Any]] | None = None
        # Seconds spent in imp-mem calls (block tables), for EngineStats.
        self.imp_mem_seconds = 0.0

    # ---------------------------------------------------------------- setup

    def set_model(self, config: ModelConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.sliding = bool(config.sliding_layers)
        self.ring_blocks, self.engine_blocks = engine_blocks(config, self.prefill_chunk, block_size)

    def load(
        self,
        weights: dict[str, torch.Tensor],
        kv: Any,
        *,
        attention_backend: str | None,
        tp: Any,
        fused: bool | None = None,
    ) -> None:
        """The model over `weights`, the KV pools as tensors, the runner's
        own blocks from `kv` (the manager), T2 carved (once: a model swap
        keeps T2, whose layout it checks to be the same) and its inputs
        reset to padding."""
        c = self.config
        if attention_backend == "flashinfer":
            from imp_mem.engine.kernels import flashinfer_decode

            flashinfer_decode.require(self.device)
        self.weights = weights
        self.model = build_model(
            c,
            weights,
            attention_backend=attention_backend,
            max_positions=self.max_seq_len,
            tp=tp,
            fused=fused,
        )
        self.kv_views = self._kv_views(tp)
        self.kv = kv
        self.reserve_blocks()
        if not hasattr(self, "t2"):
            self._carve_t2()
        self.reset_inputs()

    def drop_model(self) -> None:
        """Drops everything over the model's memory (graphs, weights, KV
        views), so that no export of T1 or of a pool is alive."""
        for name in MODEL_ATTRS:
            if hasattr(self, name):
                delattr(self, name)
        self.graphs = {}
        self.flashinfer = None
