"""The shared frame of the families after Qwen3 (`llama`, `qwen3_moe`,
`deepseek_v2`, `gemma3`): a decoder over paged KV whose layer is the
family's own.

`DecoderModel` does what every family does the same way: it checks the
weights against the family's `weight_names` (Hugging Face names and
shapes), groups each layer's tensors, builds the step's slots into the
pages, runs the embedding, the layers and the head, and exposes the same
``prefill`` / ``prefill_batch`` / ``decode`` calls as
`imp_mem.engine.model.qwen3.PagedModel`, so the runner serves any family
alike (``prefill_batch``: several sequences' chunks in one forward, the
layer run once over all their tokens; a family whose attention is its own,
MLA, sets ``prefill_batch_ok = False`` and the runner prefills it one
sequence a call). A family subclasses it and writes
`weight_names`, `_layer` (one decoder layer over a `Step`) and, where they
differ, `_embed`, `_logits` and `kv_block_shape` (the page layout of one
KV block: ``[layers, 2, block_size, kv_heads, head_dim]`` by default,
MLA's latents otherwise).

`Step` is what one layer needs of the call: the positions, the pages and
block tables, the slots the new tokens go to, and `attend`, grouped-query
attention over the pages (store, then prefill or decode attention), with
the family's softmax scale.

As in `PagedModel`, the weights are used as given (views of T1), nothing
is registered or copied, and `decode` is free of host syncs and
data-dependent shapes, so the runner can capture it in a CUDA graph.
Tensor parallelism is not served by these families (TP = 1 only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from imp_mem.engine.config import FULL, ModelConfig
from imp_mem.engine.model.attention import (
    paged_decode_attention,
    prefill_attention,
    slots,
    store_kv,
    varlen_prefill_attention,
)
from imp_mem.engine.model.layers import (
    KvViews,
    check_decode_args,
    check_prefill_args,
    check_tables,
    prefill_batch_inputs,
)
from imp_mem.engine.tensor_parallel import TensorParallel
from imp_mem.errors import InvalidArgument


@dataclass
class Layer:
    """One decoder layer: its KV pool, its index there, its window, its
    tensors by name relative to ``model.layers.{i}.``."""

    index: int
    pool: str
    slot: int
    window: int | None
    w: dict[str, torch.Tensor]


@dataclass
class Step:
    """One prefill (one sequence, positions ``[start_pos, start_pos + N)``),
    batched prefill (several sequences' chunks back to back, `varlen`) or
    decode (N sequences, one token each) call, as a layer sees it."""

    mode: str
    positions: torch.Tensor
    kv: KvViews
    tables: dict[str, torch.Tensor | None]
    slot: dict[str, tuple[torch.Tensor, torch.Tensor]]
    start_pos: int
    backend: str
    splits: int | None
    # Per-call values a family computes once and every layer reuses (its
    # RoPE's cos/sin at these positions).
    cache: dict[str, Any] = field(default_factory=dict)
    # Prefill: positions ``[s, e)`` that attend to each other both ways (an
    # image's tokens, Gemma-3's rule); None: causal only.
    bidirectional: tuple[int, int] | None = None
    # Batched prefill: ``(cu_seqlens, starts, spans)`` of its chunks
    # (`DecoderModel.prefill_batch`); `tables` then has one row a chunk.
    varlen: tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]] | None = None

    def pages(self, layer: Layer) -> torch.Tensor:
        pages = self.kv.full if layer.pool == "full" else self.kv.swa
        assert pages is not None
        return pages

    def attend(
        self, layer: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Stores `k`, `v` (``[N, kv_heads, d]``) at the step's slots and
        returns the attention of `q` (``[N, heads, d]``) over the pages."""
        pages = self.pages(layer)
        store_kv(pages, layer.slot, k, v, *self.slot[layer.pool])
        table = self.tables[layer.pool]
        if self.mode == "prefill_batch":
            assert self.varlen is not None
            cu, starts, spans = self.varlen
            return varlen_prefill_attention(
                q,
                pages,
                layer.slot,
                table,
                cu,
                starts,
                spans,
                window=layer.window,
                scale=scale,
                backend=self.backend,
            )
        if self.mode == "prefill":
            return prefill_attention(
                q,
                pages,
                layer.slot,
                table,
                self.start_pos,
                window=layer.window,
                scale=scale,
                bidirectional=self.bidirectional,
            )
        return paged_decode_attention(
            q,
            pages,
            layer.slot,
            table,
            self.positions,
            window=layer.window,
            scale=scale,
            backend=self.backend,
            splits=self.splits,
        )


class DecoderModel:
    """A causal LM over paged KV whose layer is a family's (module doc).
    The arguments are `PagedModel`'s."""

    family = "decoder"
    # Serves `prefill_batch` (a family with its own attention, MLA, does not).
    prefill_batch_ok = True

    @staticmethod
    def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        attention_backend: str | None = None,
        max_positions: int | None = None,
        splits: int | None = None,
        tp: TensorParallel | None = None,
        fused: bool | None = None,
    ) -> None:
        # `fused`: taken for the runner's one signature; the families run
        # their own operations (the fused decode kernels serve qwen3 so far).
        del fused
        if tp is not None and tp.tp > 1:
            raise InvalidArgument(
                f"the {config.model_type} model serves tp=1 only; tensor parallelism is "
                "served for qwen3"
            )
        self.tp = tp or TensorParallel(config, tp=1)
        expected = self.decoder_names(config)
        missing = [name for name in expected if name not in weights]
        if missing:
            raise InvalidArgument(
                f"weights: {len(missing)} tensors are missing, first {missing[0]!r}; "
                "pass every tensor of the checkpoint by its Hugging Face name"
            )
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise InvalidArgument(
                    f"weights: {name!r} has shape {tuple(weights[name].shape)}, "
                    f"the config needs {shape}"
                )
        self.config = config
        self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
        embed = weights["model.embed_tokens.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        if attention_backend is None:
            attention_backend = "triton" if self.device.type == "cuda" else "torch"
        if attention_backend not in ("triton", "torch"):
            raise InvalidArgument(
                f"attention_backend must be 'triton' or 'torch', got {attention_backend!r}"
            )
        self.attention_backend = attention_backend
        self.splits = splits
        self.embed = embed
        self.lm_head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            pool, slot = config.pool_slot(i)
            self.layers.append(
                Layer(
                    index=i,
                    pool=pool,
                    slot=slot,
                    window=None if config.layer_types[i] == FULL else config.sliding_window,
                    w={k[len(p) :]: v for k, v in weights.items() if k.startswith(p)},
                )
            )
        self.max_positions = max_positions or config.max_position_embeddings
        self.setup(weights)

    # -- what a family writes -------------------------------------------------

    def decoder_names(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The tensors this frame checks and groups (``model.*``, the head):
        `weight_names`, unless the family reads more (a vision tower)."""
        return self.weight_names(config)

    def setup(self, weights: dict[str, torch.Tensor]) -> None:
        """Once, after the weights are grouped: tables, stacked views."""

    def kv_block_shape(self, layers: int, block_size: int) -> tuple[int, ...]:
        """One KV block of a pool of `layers` layers, as the model reads it."""
        return (layers, 2, block_size, self.kv_heads, self.config.head_dim)

    def _layer(self, x: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_ids, self.embed)

    def _embed_image(
        self, input_ids: torch.Tensor, start_pos: int, mm: tuple[int, int, torch.Tensor]
    ) -> torch.Tensor:
        raise InvalidArgument(
            f"image: model_type {self.config.model_type!r} has no vision tower; pass no image"
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- the two entry points -------------------------------------------------

    def prefill(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        block_table: torch.Tensor,
        swa_block_table: torch.Tensor | None,
        kv: KvViews,
        *,
        last_only: bool = False,
        mm: tuple[int, int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`PagedModel.prefill`: positions ``[start_pos, start_pos + T)`` of
        one sequence; float32 logits ``[T, vocab]`` (``[1, vocab]`` with
        `last_only`). `mm` ``(s, e, embeddings)``: the sequence's image
        tokens are at positions ``[s, e)`` and take `embeddings`
        (``[e - s, hidden]``) in place of their token embeddings (a family
        with a vision tower only)."""
        end = check_prefill_args(input_ids, start_pos, self.max_positions)
        check_tables(
            self.config, kv, block_table, swa_block_table, end, self.kv_block_shape, "prefill"
        )
        positions = torch.arange(start_pos, end, device=self.device)
        step = self._step("prefill", positions, kv, block_table, swa_block_table, start_pos)
        if mm is None:
            x = self._embed(input_ids)
        else:
            x = self._embed_image(input_ids, start_pos, mm)
            step.bidirectional = (mm[0], mm[1])
        for layer in self.layers:
            x = self._layer(x, layer, step)
        if last_only:
            x = x[-1:]
        return self._logits(x)

    def prefill_batch(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        starts: torch.Tensor,
        block_tables: torch.Tensor,
        swa_block_tables: torch.Tensor | None,
        kv: KvViews,
        *,
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        """`PagedModel.prefill_batch`: R chunks of R sequences in one
        forward; float32 logits ``[R, vocab]`` of each chunk's last token."""
        if not self.prefill_batch_ok:
            raise InvalidArgument(
                f"prefill_batch: model_type {self.config.model_type!r} prefills one "
                "sequence a call; use prefill"
            )
        positions, tables, slot = prefill_batch_inputs(
            self, input_ids, cu_seqlens, starts, block_tables, swa_block_tables, kv, spans
        )
        step = Step(
            "prefill_batch",
            positions,
            kv,
            tables,
            slot,
            0,
            self.attention_backend,
            self.splits,
            varlen=(cu_seqlens, starts, spans),
        )
        x = self._embed(input_ids)
        for layer in self.layers:
            x = self._layer(x, layer, step)
        return self._logits(x[(cu_seqlens[1:] - 1).long()])

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        swa_block_tables: torch.Tensor | None,
        kv: KvViews,
    ) -> torch.Tensor:
        """`PagedModel.decode`: one token per sequence at ``positions[b]``;
        float32 logits ``[B, vocab]``. Capturable in a CUDA graph."""
        check_decode_args(
            {layer.pool for layer in self.layers},
            input_ids,
            positions,
            block_tables,
            swa_block_tables,
            kv,
        )
        step = self._step("decode", positions, kv, block_tables, swa_block_tables, 0)
        x = self._embed(input_ids)
        for layer in self.layers:
            x = self._layer(x, layer, step)
        return self._logits(x)

    # -- pieces ---------------------------------------------------------------

    def _step(self, mode, positions, kv, table, swa_table, start_pos) -> Step:
        tables = {"full": table, "swa": swa_table}
        slot = {
            name: slots(t, positions, kv.block_size) for name, t in tables.items() if t is not None
        }
        return Step(
            mode, positions, kv, tables, slot, start_pos, self.attention_backend, self.splits
        )
