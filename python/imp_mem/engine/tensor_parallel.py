"""Tensor parallelism for the reference engine: which slice of every weight a
rank holds, and the three collectives the forward pass needs.

The split (Megatron's, over a ``torch.distributed`` group of ``tp`` ranks):

* column-parallel, rows split: ``q_proj`` by query heads, ``k_proj`` and
  ``v_proj`` by KV heads, ``gate_proj`` and ``up_proj`` by the intermediate
  width. A rank computes its heads' attention and its part of the MLP alone.
* row-parallel, columns split the same way: ``o_proj`` and ``down_proj``.
  Each rank's product is a partial sum of the block's output; one
  all-reduce after each (two a layer) makes it whole on every rank.
* vocab-parallel rows: ``embed_tokens`` and ``lm_head`` in contiguous ranges
  of ``ceil(vocab / tp)`` ids (the last range shorter). The embedding masks
  the ids outside the rank's range and all-reduces (a sum of one row and
  zeros: exact); the logits are all-gathered over the vocab, so every rank
  takes the same greedy token.
* replicated: every norm (``*_layernorm``, ``q_norm``, ``k_norm``,
  ``model.norm``).

KV heads. When ``tp`` is a multiple of the KV heads rather than a divisor
(the planner accepts both), each rank keeps the one KV head its query heads
read: ``tp / num_kv_heads`` ranks hold the same rows of ``k_proj`` and
``v_proj``, and the same head's K/V in their pages, as the planner's
per-rank KV (``ceil(kv_heads / tp)`` heads) assumes.

Bytes against the plan. The planner's weights line is ``ceil(total / tp)``
rounded up to a MiB; what a rank holds beyond its even share is the
replicated norms, the duplicated KV head rows (above), the first ranks'
extra vocab row when ``tp`` does not divide the vocabulary, and the 256-byte
alignment of each tensor. The MiB rounding usually covers that (Qwen3-0.6B
at TP = 2: 64 KiB of norms a rank, plus the alignment of ~310 tensors), but
not always, so `plan_shape` lays out every rank's load as the loader will
and, when the largest passes the even split's line, plans the weights at
``tp`` times that layout instead. The engine reports what a rank holds
beyond ``ceil(checkpoint / tp)`` as `Engine.weights_over_share`; the
loader checks the layout against the plan's line as it does at TP = 1.

Collectives run on the group's backend (NCCL on GPUs, gloo on the CPU) on
the current stream, with no host syncs of their own, so a decode step that
uses them can still be captured in a CUDA graph (NCCL's graph support).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import imp_mem
from imp_mem.engine.config import ModelConfig
from imp_mem.errors import InvalidArgument


@dataclass(frozen=True)
class Shard:
    """The slice one rank holds of a tensor: indices ``[start, stop)`` of
    dimension `dim`."""

    dim: int
    start: int
    stop: int


_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")


def rank_layout_bytes(model_dir: Any, config: ModelConfig, tp: int) -> int:
    """The most T1 bytes any of `tp` ranks' loads of the checkpoint in
    `model_dir` lays out: its slices, in file order, at the loader's
    256-byte alignment (`imp_mem._safetensors.plan_layout`)."""
    from imp_mem._safetensors import plan_layout, read_header, safetensors_files, shard_entry

    entries = [t for f in safetensors_files(model_dir) for t in read_header(f)]
    worst = 0
    for rank in range(tp):
        shards = TensorParallel(config, tp=tp, rank=rank).shards()
        sliced = [
            shard_entry(t, s.dim, s.start, s.stop) if (s := shards.get(t.name)) else t
            for t in entries
        ]
        worst = max(worst, plan_layout(sliced, 1 << 62)[1])
    return worst


def plan_shape(model_dir: Any, config: ModelConfig, tp: int) -> tuple[Any, int]:
    """``(shape, need)``: the `ModelShape` to plan `tp` ranks with, and the
    largest rank's weight layout (`rank_layout_bytes`; 0 at TP = 1). The
    planner owns the rule (`ModelShape.for_rank_layout`): the checkpoint's
    own shape while its per-rank line covers `need`, else one whose weights
    are ``tp * need``, so every rank's load fits."""
    from imp_mem import ModelShape

    shape = ModelShape.from_hf_config(model_dir)
    if tp == 1:
        return shape, 0
    need = rank_layout_bytes(model_dir, config, tp)
    return shape.for_rank_layout(tp, need), need


def _check_tp(config: ModelConfig, tp: int) -> None:
    """The planner's refusal of `tp` for this model's heads: one rule and one
    message (which names the nearest valid degrees), the planner's."""
    imp_mem.ModelShape(
        model_type="llama",
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
    ).check_tp(tp)


class TensorParallel:
    """One rank's share of a model over `group` (a ``torch.distributed``
    process group; ``None``: the default group when `tp` is not given).
    With `tp` (and `rank`) instead, the split alone, without collectives
    unless ``tp`` is 1: ``TensorParallel(config, tp=1)`` is the
    single-process model."""

    def __init__(
        self, config: ModelConfig, group: Any = None, *, tp: int | None = None, rank: int = 0
    ) -> None:
        self.config = config
        self.group = group
        if tp is None:
            from imp_mem.distributed import _dist

            dist = _dist()
            self.tp = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            if not 0 <= rank < tp:
                raise InvalidArgument(f"rank: {rank} is not a rank of tp={tp}")
            self.tp, self.rank = tp, rank
        tp, rank = self.tp, self.rank
        heads, kv = config.num_heads, config.num_kv_heads
        _check_tp(config, tp)
        if config.intermediate_size % tp:
            raise InvalidArgument(
                f"tp={tp} does not divide intermediate_size ({config.intermediate_size}); "
                "use a tp that does"
            )
        self.heads = heads // tp
        self.kv_heads = max(1, kv // tp)
        # The first KV head this rank keeps (its query heads read it).
        self.kv_head0 = rank * self.kv_heads if kv >= tp else rank * kv // tp
        self.ffn = config.intermediate_size // tp
        self.vocab_part = math.ceil(config.vocab_size / tp)
        self.vocab_start = min(config.vocab_size, rank * self.vocab_part)
        self.vocab_stop = min(config.vocab_size, self.vocab_start + self.vocab_part)
        self._shards = self._split()

    # -- the split ------------------------------------------------------------

    def shards(self) -> dict[str, Shard]:
        """This rank's slice of every split tensor, by its Hugging Face name
        (the replicated ones are absent). Empty at TP = 1."""
        return dict(self._shards)

    def _split(self) -> dict[str, Shard]:
        """`shards`, computed once at construction (the split is fixed)."""
        if self.tp == 1:
            return {}
        c, d = self.config, self.config.head_dim
        q0 = self.rank * self.heads * d
        k0 = self.kv_head0 * d
        f0 = self.rank * self.ffn
        vocab = Shard(0, self.vocab_start, self.vocab_stop)
        out = {"model.embed_tokens.weight": vocab}
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = vocab
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.q_proj.weight"] = Shard(0, q0, q0 + self.heads * d)
            out[p + "self_attn.o_proj.weight"] = Shard(1, q0, q0 + self.heads * d)
            for name in _KV:
                out[p + name] = Shard(0, k0, k0 + self.kv_heads * d)
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                out[p + name] = Shard(0, f0, f0 + self.ffn)
            out[p + "mlp.down_proj.weight"] = Shard(1, f0, f0 + self.ffn)
        return out

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this rank holds of the tensor `name` of full `shape`."""
        shard = self._shards.get(name)
        if shard is None:
            return shape
        out = list(shape)
        out[shard.dim] = shard.stop - shard.start
        return tuple(out)

    # -- the collectives ------------------------------------------------------

    def reduce(self, x: Any) -> Any:
        """The sum over the ranks of a row-parallel partial output, in place."""
        if self.tp > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: Any, weight: Any) -> Any:
        """Vocab-parallel embedding: each rank looks up the ids in its range
        (zeros elsewhere), then the sum over the ranks."""
        import torch.nn.functional as F

        if self.tp == 1:
            return F.embedding(ids, weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_stop)
        if weight.shape[0] == 0:  # a rank past the end of a tiny vocabulary
            local = weight.new_zeros((*ids.shape, self.config.hidden_size))
        else:
            local = F.embedding((ids - self.vocab_start).clamp(0, weight.shape[0] - 1), weight)
        return self.reduce(local * mine.unsqueeze(-1).to(local.dtype))

    def gather_logits(self, local: Any) -> Any:
        """``[N, vocab]`` logits on every rank from each rank's ``[N, part]``
        (the last ranks' shorter parts padded with -inf past the vocab)."""
        if self.tp == 1:
            return local
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        n, part = local.shape[0], self.vocab_part
        if local.shape[1] < part:
            local = F.pad(local, (0, part - local.shape[1]), value=float("-inf"))
        out = torch.empty((self.tp * n, part), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local.contiguous(), group=self.group)
        full = out.view(self.tp, n, part).permute(1, 0, 2).reshape(n, self.tp * part)
        return full[:, : self.config.vocab_size]
