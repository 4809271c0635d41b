"""The Qwen3-MoE family (``model_type: qwen3_moe``, Qwen3-30B-A3B): Qwen3's
attention (per-head q/k RMSNorm before RoPE) and a sparse MoE block in
every layer but ``mlp_only_layers`` (and off the ``decoder_sparse_step``):
a router (``mlp.gate``) picks ``num_experts_per_tok`` of ``num_experts``
SwiGLU experts per token by softmax top-k, renormalised with
``norm_topk_prob`` (`imp_mem.engine.model.moe`).

Weights by their checkpoint names: ``mlp.experts.{j}.{gate,up,down}_proj``
per expert, as Qwen's checkpoints store them (transformers fuses them
into ``gate_up_proj`` / ``down_proj`` stacks at load; the planner counts
them as the expert weights). When the experts lie end to end in T1 (the
dummy loader lays them so: `weight_stacks`), the model views them as
stacks and runs the grouped-GEMM path; otherwise the masked loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model.decoder import Layer, Step
from imp_mem.engine.model.layers import rms_norm
from imp_mem.engine.model.llama import LlamaModel, attention_names, head_names, mlp_names, swiglu
from imp_mem.engine.model.moe import (
    experts_grouped,
    experts_masked,
    grouped_mm_available,
    route_softmax_topk,
    stack_views,
)


def expert_names(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """One MoE layer's routed experts, expert by expert (gate, up, down)."""
    h, i = config.hidden_size, config.extra["moe_intermediate_size"]
    names: dict[str, tuple[int, ...]] = {}
    for j in range(config.extra["num_experts"]):
        names.update(mlp_names(f"model.layers.{layer}.mlp.experts.{j}.", i, h))
    return names


def expert_stacks(config: ModelConfig, layer: int) -> list[list[str]]:
    """``[gate_0, up_0, gate_1, up_1, ...]`` and ``[down_0, down_1, ...]``:
    laid end to end they are transformers' ``gate_up_proj`` ``[E, 2I, H]``
    and ``down_proj`` ``[E, H, I]``."""
    p = f"model.layers.{layer}.mlp.experts."
    experts = range(config.extra["num_experts"])
    gate_up = [p + f"{j}.{n}_proj.weight" for j in experts for n in ("gate", "up")]
    down = [p + f"{j}.down_proj.weight" for j in experts]
    return [gate_up, down]


class MoeMixin:
    """The MoE block over a layer's tensors (shared with `deepseek_v2`)."""

    config: ModelConfig
    layers: list[Layer]
    device: torch.device
    # "auto": the grouped GEMM where the stacks exist and torch has it, on
    # a GPU; "grouped" / "masked" force one (tests).
    moe_backend = "auto"

    @staticmethod
    def weight_stacks(config: ModelConfig) -> list[list[str]]:
        """Each MoE layer's expert tensors, in the groups the loaders lay
        end to end in one span (viewed as stacks without a copy)."""
        return [s for i in config.extra["moe_layers"] for s in expert_stacks(config, i)]

    def setup_experts(self) -> None:
        c = self.config
        e, i, h = c.extra["num_experts"], c.extra["moe_intermediate_size"], c.hidden_size
        self.stacks: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.experts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for layer in self.layers:
            if layer.index not in c.extra["moe_layers"]:
                continue
            w = layer.w
            per = [
                tuple(w[f"mlp.experts.{j}.{n}_proj.weight"] for n in ("gate", "up", "down"))
                for j in range(e)
            ]
            self.experts[layer.index] = per  # type: ignore[assignment]
            gate_up = stack_views([per[0][0]], (e, 2 * i, h), [[g, u] for g, u, _ in per])
            down = stack_views([per[0][2]], (e, h, i), [[d] for _, _, d in per])
            self.stacks[layer.index] = (
                (gate_up, down) if gate_up is not None and down is not None else None
            )

    def use_grouped(self, index: int) -> bool:
        if self.moe_backend == "masked" or self.stacks.get(index) is None:
            return False
        if self.moe_backend == "grouped":
            return True
        return self.device.type == "cuda" and grouped_mm_available()

    def routed(self, h: torch.Tensor, layer: Layer, weights: torch.Tensor, ids: torch.Tensor):
        if self.use_grouped(layer.index):
            gate_up, down = self.stacks[layer.index]  # type: ignore[misc]
            return experts_grouped(h, ids, weights, gate_up, down)
        return experts_masked(h, ids, weights, self.experts[layer.index])


class Qwen3MoeModel(MoeMixin, LlamaModel):
    """Qwen3-MoE over paged KV (module doc)."""

    family = "qwen3_moe"
    qk_norm = True

    @staticmethod
    def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by its Hugging Face name, with its shape."""
        h, extra = config.hidden_size, config.extra
        names = head_names(config)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            names.update(
                {
                    p + k: v
                    for k, v in {
                        "input_layernorm.weight": (h,),
                        "post_attention_layernorm.weight": (h,),
                        **attention_names(config, h, qk_norm=True),
                    }.items()
                }
            )
            if i in extra["moe_layers"]:
                names[p + "mlp.gate.weight"] = (extra["num_experts"], h)
                names.update(expert_names(config, i))
            else:
                names.update(mlp_names(p + "mlp.", config.intermediate_size, h))
        return names

    def setup(self, weights: dict[str, torch.Tensor]) -> None:
        super().setup(weights)
        self.setup_experts()

    def _layer(self, x: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        c, w = self.config, layer.w
        eps = c.rms_norm_eps
        x = x + self.attention(rms_norm(x, w["input_layernorm.weight"], eps), layer, step)
        h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
        if layer.index not in c.extra["moe_layers"]:
            return x + swiglu(h, w)
        weights, ids = route_softmax_topk(
            F.linear(h, w["mlp.gate.weight"]),
            c.extra["top_k"],
            norm_topk_prob=c.extra["norm_topk_prob"],
        )
        return x + self.routed(h, layer, weights, ids)
