"""The Qwen3 family (`PagedModel`): the Qwen3 architecture over paged KV, weights by their
Hugging Face names.

The forward pass mirrors transformers 5.17's ``Qwen3ForCausalLM`` operation
by operation and dtype by dtype, so that in bfloat16 the two round the same
way wherever the kernels agree: RMSNorm in float32 cast back before the
weight multiplies; per-head RMSNorm of q and k before RoPE; RoPE's cos/sin
computed in float32 from ``1 / theta^(2i/d)`` and cast to the model dtype,
applied as ``x * cos + rotate_half(x) * sin``; SwiGLU; the output head tied to
the embeddings when the config says so; logits in the model dtype, returned
as float32. Attention is the one deliberate difference: it reads K/V from
the pages (`imp_mem.engine.model.attention`), accumulating in float32.

The weights are used as given (views of imp-mem's T1 arena in the engine):
nothing is copied, registered or re-laid out. The only tensors the model
allocates itself are the RoPE tables, once, at construction.

`decode` is written for CUDA-graph capture: static shapes, no host syncs,
all index math on the device. `prefill` is not captured (its length varies)
and may check its arguments on the host. `prefill_batch` prefills several
sequences' chunks in one forward (the runner's batched prefill): the dense
layers once over all their tokens, each token's RoPE at its own position
and its K/V into its own sequence's pages, a varlen attention over the
pages (`attention.varlen_prefill_attention`), the head over each chunk's
last token only. `prefill_batch_ok` says a model serves it (the runner
asks).

Tensor parallelism. With a `TensorParallel` (``tp=``) the weights are one
rank's slices (`imp_mem.engine.tensor_parallel`: column-parallel q/k/v,
gate and up; row-parallel o and down; vocab-parallel embedding and head;
norms replicated), the pages hold the rank's KV heads, and the forward
pass adds an all-reduce after ``o_proj`` and after ``down_proj``, one in
the embedding, and an all-gather of the logits, so every rank returns the
whole vocabulary's logits. Every rank must make the same calls in the same
order (the engine's scheduler is deterministic, so ranks stay in step).

A `PagedModel` holds no per-request state; calls must not overlap on the
same pages (the engine runs one step at a time on one stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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
    fused_rows,
    prefill_batch_inputs,
    rms_norm,
    rope_tables,
    rotate_half,
)
from imp_mem.engine.tensor_parallel import TensorParallel
from imp_mem.errors import InvalidArgument


def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by its Hugging Face name, with its shape."""
    h, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_heads * d, config.num_kv_heads * d
    names: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_dim, h),
                p + "self_attn.k_proj.weight": (kv_dim, h),
                p + "self_attn.v_proj.weight": (kv_dim, h),
                p + "self_attn.o_proj.weight": (h, q_dim),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (config.intermediate_size, h),
                p + "mlp.up_proj.weight": (config.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, config.intermediate_size),
            }
        )
    return names


class PagedModel:
    """A Qwen3-architecture causal LM over paged KV.

    `weights` maps Hugging Face names (`weight_names`) to tensors already on
    the target device. `attention_backend` is ``"triton"``, ``"torch"`` or
    ``"flashinfer"`` (default: Triton on CUDA, torch elsewhere); with
    ``"flashinfer"`` the full-attention layers' decode runs FlashInfer's
    wrappers that `flashinfer` holds (`flashinfer_decode.DecodeWrappers`, set and
    planned by the runner before each step), the rest Triton. `max_positions` sizes the
    RoPE tables (default: the config's ``max_position_embeddings``). `tp`:
    this rank's share of a tensor-parallel group (`weights` then hold its
    slices, by `TensorParallel.local_shape`); default TP = 1.
    """

    # Serves `prefill_batch` (several sequences' chunks in one forward).
    prefill_batch_ok = True

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
        fused_prefill: bool = False,
    ) -> None:
        self.tp = tp = tp or TensorParallel(config, tp=1)
        self.heads, self.kv_heads = tp.heads, tp.kv_heads
        expected = {
            name: tp.local_shape(name, shape) for name, shape in weight_names(config).items()
        }
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
                    + (f" on rank {tp.rank} of tp={tp.tp}" if tp.tp > 1 else "")
                )
        self.config = config
        embed = weights["model.embed_tokens.weight"]
        self.device = embed.device
        self.dtype = embed.dtype
        if attention_backend is None:
            attention_backend = "triton" if self.device.type == "cuda" else "torch"
        if attention_backend not in ("triton", "torch", "flashinfer"):
            raise InvalidArgument(
                "attention_backend must be 'triton', 'torch' or 'flashinfer', "
                f"got {attention_backend!r}"
            )
        self.attention_backend = attention_backend
        # FlashInfer's decode wrappers (`flashinfer_decode.DecodeWrappers`), set by the runner.
        self.flashinfer: Any = None
        self.fused = self.device.type == "cuda" if fused is None else bool(fused)
        # Prefill is not captured: its torch allocations follow its shapes,
        # and the engine's warm-up is what makes serving allocation-free.
        # Fusing it changes that pattern (measured: one more cudaMalloc in a
        # serving workload, +12 % torch peak on Qwen3-0.6B) for little gain
        # (its GEMMs dominate), so only decode fuses unless asked.
        self.fused_prefill = self.fused and fused_prefill
        self.splits = splits
        self.embed = embed
        self.lm_head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            pool, index = config.pool_slot(i)
            w = {k[len(p) :]: v for k, v in weights.items() if k.startswith(p)}
            self.layers.append(
                _Layer(
                    pool=pool,
                    index=index,
                    window=None if config.layer_types[i] == FULL else config.sliding_window,
                    w=w,
                    qkv=fused_rows([w[f"self_attn.{x}_proj.weight"] for x in "qkv"]),
                    gate_up=fused_rows([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]),
                )
            )
        self.max_positions = max_positions or config.max_position_embeddings
        self.cos, self.sin = rope_tables(config, self.max_positions, self.device, self.dtype)

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
    ) -> torch.Tensor:
        """Runs the tokens at positions ``[start_pos, start_pos + T)`` of one
        sequence, whose earlier tokens are already in the pages; writes the new
        K/V. Returns float32 logits ``[T, vocab]`` (``[1, vocab]``, the last
        token's, with `last_only`)."""
        end = check_prefill_args(input_ids, start_pos, self.max_positions)
        check_tables(
            self.config, kv, block_table, swa_block_table, end, self.kv_block_shape, "prefill"
        )
        positions = torch.arange(start_pos, end, device=self.device)
        tables = {"full": block_table, "swa": swa_block_table}
        slot = {
            name: slots(table, positions, kv.block_size)
            for name, table in tables.items()
            if table is not None
        }

        def attend(q, layer, pool):
            return prefill_attention(
                q, pool, layer.index, tables[layer.pool], start_pos, window=layer.window
            )

        if self.fused_prefill:
            x = self._forward_fused(input_ids, positions, slot, kv, attend)
            return self._head(x[-1:] if last_only else x)
        cos = self.cos[start_pos:end].unsqueeze(1)
        sin = self.sin[start_pos:end].unsqueeze(1)
        x = self.tp.embed(input_ids, self.embed)
        x = self._layers(x, cos, sin, slot, kv, attend)
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
        """Prefills R chunks of R sequences in one forward: `input_ids` is
        their tokens back to back, chunk ``r`` rows ``[cu_seqlens[r],
        cu_seqlens[r + 1])`` (int32, on the device) at positions
        ``[starts[r], starts[r] + len)`` (int64) of the sequence whose
        tables are row ``r`` of `block_tables` (``[R, M]``) and
        `swa_block_tables`; `spans` is ``(start, len)`` per chunk on the
        host. The dense layers run once over every token, each token's K/V
        goes to its own sequence's slot, and attention is
        `varlen_prefill_attention`. Returns float32 logits ``[R, vocab]``,
        each chunk's last token's: what `prefill` (``last_only``) returns
        for each chunk alone."""
        positions, tables, slot = prefill_batch_inputs(
            self, input_ids, cu_seqlens, starts, block_tables, swa_block_tables, kv, spans
        )
        backend = self.attention_backend
        if backend == "flashinfer":  # FlashInfer serves decode only: ours here
            backend = "triton" if self.device.type == "cuda" else "torch"
        last = (cu_seqlens[1:] - 1).long()

        def attend(q, layer, pool):
            return varlen_prefill_attention(
                q,
                pool,
                layer.index,
                tables[layer.pool],
                cu_seqlens,
                starts,
                spans,
                window=layer.window,
                backend=backend,
            )

        if self.fused_prefill:
            x = self._forward_fused(input_ids, positions, slot, kv, attend)
            return self._head(x[last])
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x = self.tp.embed(input_ids, self.embed)
        x = self._layers(x, cos, sin, slot, kv, attend)
        return self._logits(x[last])

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        swa_block_tables: torch.Tensor | None,
        kv: KvViews,
    ) -> torch.Tensor:
        """One new token per sequence at ``positions[b]``: writes its K/V and
        attends over the pages. Returns float32 logits ``[B, vocab]``.
        Capturable in a CUDA graph (no host syncs, static shapes)."""
        tables = check_decode_args(
            {layer.pool for layer in self.layers},
            input_ids,
            positions,
            block_tables,
            swa_block_tables,
            kv,
        )
        slot = {
            name: slots(table, positions, kv.block_size)
            for name, table in tables.items()
            if table is not None
        }

        backend = self.attention_backend
        wrappers = self.flashinfer if backend == "flashinfer" else None
        if backend == "flashinfer":
            if wrappers is None:
                raise InvalidArgument(
                    "attention_backend='flashinfer': decode needs the runner's planned "
                    "wrappers (PagedModel.flashinfer)"
                )
            # The sliding-window layers: ours (torch where there is no GPU,
            # as under the CPU tests' FlashInfer stand-in).
            backend = "triton" if self.device.type == "cuda" else "torch"

        def attend(q, layer, pool):
            if wrappers is not None and layer.window is None:
                return wrappers.run(q, pool[:, layer.index])
            return paged_decode_attention(
                q,
                pool,
                layer.index,
                tables[layer.pool],
                positions,
                window=layer.window,
                backend=backend,
                splits=self.splits,
            )

        if self.fused:
            return self._head(self._forward_fused(input_ids, positions, slot, kv, attend))
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x = self.tp.embed(input_ids, self.embed)
        x = self._layers(x, cos, sin, slot, kv, attend)
        return self._logits(x)

    # -- pieces ---------------------------------------------------------------

    def _layers(self, x, cos, sin, slot, kv, attend):
        """The layers one operation at a time over hidden states `x` (the
        unfused path): each stores its K/V at `slot` and attends with
        `attend`, RoPE from `cos` / `sin` gathered at the tokens' positions."""
        for layer in self.layers:
            pages = kv.full if layer.pool == "full" else kv.swa

            def store_and_attend(q, k, v, layer=layer, pages=pages):
                store_kv(pages, layer.index, k, v, *slot[layer.pool])
                return attend(q, layer, pages)

            x = self._block(x, layer, cos, sin, store_and_attend)
        return x

    def _block(self, x, layer, cos, sin, attend):
        """One decoder layer over ``x[N, hidden]`` (N tokens of one sequence in
        prefill, N sequences in decode)."""
        c = self.config
        eps = c.rms_norm_eps
        w = layer.w
        n = x.shape[0]
        h = rms_norm(x, w["input_layernorm.weight"], eps)
        q = F.linear(h, w["self_attn.q_proj.weight"]).view(n, self.heads, c.head_dim)
        k = F.linear(h, w["self_attn.k_proj.weight"]).view(n, self.kv_heads, c.head_dim)
        v = F.linear(h, w["self_attn.v_proj.weight"]).view(n, self.kv_heads, c.head_dim)
        q = rms_norm(q, w["self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = attend(q, k, v).reshape(n, self.heads * c.head_dim)
        # Row-parallel o_proj and down_proj: partial sums, reduced over the ranks.
        x = x + self.tp.reduce(F.linear(a, w["self_attn.o_proj.weight"]))
        h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
        gate = F.linear(h, w["mlp.gate_proj.weight"])
        up = F.linear(h, w["mlp.up_proj.weight"])
        return x + self.tp.reduce(F.linear(F.silu(gate) * up, w["mlp.down_proj.weight"]))

    def _forward_fused(self, input_ids, positions, slot, kv, attend):
        """Every layer over the tokens at `positions`, with the fused kernels
        (`kernels.fused`): returns the final norm's output ``[N, hidden]``.
        Each norm takes the residual add before it; the last layer's add
        feeds the model's final norm."""
        from imp_mem.engine.kernels import fused as fk

        c = self.config
        eps = c.rms_norm_eps
        d = c.head_dim
        x = self.tp.embed(input_ids, self.embed)
        x, h = fk.add_rms_norm(x, None, self.layers[0].w["input_layernorm.weight"], eps)
        for i, layer in enumerate(self.layers):
            w = layer.w
            n = x.shape[0]
            pool = kv.full if layer.pool == "full" else kv.swa
            blocks, offsets = slot[layer.pool]
            qkv = _project(h, layer.qkv, [w[f"self_attn.{p}_proj.weight"] for p in "qkv"])
            q = fk.qkv_norm_rope_store(
                qkv,
                w["self_attn.q_norm.weight"],
                w["self_attn.k_norm.weight"],
                self.cos,
                self.sin,
                positions,
                pool[:, layer.index],
                blocks,
                offsets,
                heads=self.heads,
                kv_heads=self.kv_heads,
                eps=eps,
            )
            a = attend(q, layer, pool)
            delta = self.tp.reduce(
                F.linear(a.reshape(n, self.heads * d), w["self_attn.o_proj.weight"])
            )
            x, h = fk.add_rms_norm(x, delta, w["post_attention_layernorm.weight"], eps)
            gate_up = _project(
                h, layer.gate_up, [w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]
            )
            delta = self.tp.reduce(F.linear(fk.silu_mul(gate_up), w["mlp.down_proj.weight"]))
            following = (
                self.layers[i + 1].w["input_layernorm.weight"]
                if i + 1 < len(self.layers)
                else self.norm
            )
            x, h = fk.add_rms_norm(x, delta, following, eps)
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits from the final norm's output."""
        return self.tp.gather_logits(F.linear(h, self.lm_head)).float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return self.tp.gather_logits(F.linear(x, self.lm_head)).float()

    def kv_block_shape(self, layers: int, block_size: int) -> tuple[int, ...]:
        """One KV block of a pool of `layers` layers, as the model reads it."""
        return (layers, 2, block_size, self.kv_heads, self.config.head_dim)


def _project(h: torch.Tensor, fused: torch.Tensor | None, parts: list[torch.Tensor]):
    """``h @ W.T`` for the row-stacked `parts`: one GEMM over `fused` (their
    rows back to back in T1) when there is one, else one a part, joined."""
    if fused is not None:
        return F.linear(h, fused)
    return torch.cat([F.linear(h, p) for p in parts], dim=-1)


@dataclass
class _Layer:
    pool: str
    index: int
    window: int | None
    w: dict[str, torch.Tensor]
    # The projections' weights as one matrix each, when the loader laid them
    # out back to back (`fused_rows`); None: one GEMM each, outputs joined.
    qkv: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
