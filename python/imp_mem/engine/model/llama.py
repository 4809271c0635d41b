"""The Llama family (``model_type: llama``, Llama-3.x): Qwen3's decoder
without the per-head q/k RMSNorm, with Llama-3's RoPE scaling (``llama3``,
or ``linear``), the output head tied or not as the config says. Attention
and MLP biases are off (the config refuses them).

Mirrors transformers' ``LlamaForCausalLM`` operation by operation:
RMSNorm in float32 cast back before the weight multiplies, RoPE tables
computed in float32 and cast to the model dtype, SwiGLU, logits in the
model dtype returned as float32. Attention reads the pages
(`imp_mem.engine.model.decoder.Step.attend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model.decoder import DecoderModel, Layer, Step
from imp_mem.engine.model.layers import rms_norm, rotate_half
from imp_mem.engine.model.rope import cos_sin, inv_freq


def attention_names(
    config: ModelConfig, h: int, *, qk_norm: bool = False
) -> dict[str, tuple[int, ...]]:
    """The q/k/v/o projections of one layer (no biases), and Qwen3's
    per-head q/k norms with `qk_norm`."""
    d = config.head_dim
    q_dim, kv_dim = config.num_heads * d, config.num_kv_heads * d
    names = {
        "self_attn.q_proj.weight": (q_dim, h),
        "self_attn.k_proj.weight": (kv_dim, h),
        "self_attn.v_proj.weight": (kv_dim, h),
        "self_attn.o_proj.weight": (h, q_dim),
    }
    if qk_norm:
        names.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return names


def mlp_names(prefix: str, width: int, h: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP of `width` under `prefix` (``mlp.``, ``mlp.experts.3.``)."""
    return {
        prefix + "gate_proj.weight": (width, h),
        prefix + "up_proj.weight": (width, h),
        prefix + "down_proj.weight": (h, width),
    }


def head_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Embedding, final norm and (untied) output head."""
    h = config.hidden_size
    names: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = (config.vocab_size, h)
    return names


def swiglu(h: torch.Tensor, w: dict[str, torch.Tensor], prefix: str = "mlp.") -> torch.Tensor:
    gate = F.linear(h, w[prefix + "gate_proj.weight"])
    up = F.linear(h, w[prefix + "up_proj.weight"])
    return F.linear(F.silu(gate) * up, w[prefix + "down_proj.weight"])


class LlamaModel(DecoderModel):
    """Llama-3.x over paged KV (module doc)."""

    family = "llama"
    # Qwen3's per-head RMSNorm of q and k before RoPE (the Qwen3-MoE subclass).
    qk_norm = False

    @staticmethod
    def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by its Hugging Face name, with its shape."""
        h = config.hidden_size
        names = head_names(config)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "input_layernorm.weight": (h,),
                "post_attention_layernorm.weight": (h,),
                **attention_names(config, h, qk_norm=False),
                **mlp_names("mlp.", config.intermediate_size, h),
            }
            names.update({p + k: v for k, v in layer.items()})
        return names

    def setup(self, weights: dict[str, torch.Tensor]) -> None:
        c = self.config
        freq = inv_freq(c.head_dim, c.rope_theta, c.extra.get("rope"))
        self.cos, self.sin = cos_sin(freq, self.max_positions, self.device, self.dtype)

    def rope(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at the step's positions, ``[N, 1, head_dim]``."""
        if "rope" not in step.cache:
            p = step.positions
            step.cache["rope"] = (self.cos[p].unsqueeze(1), self.sin[p].unsqueeze(1))
        return step.cache["rope"]

    def attention(self, h: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        c, w, n = self.config, layer.w, h.shape[0]
        d = c.head_dim
        q = F.linear(h, w["self_attn.q_proj.weight"]).view(n, self.heads, d)
        k = F.linear(h, w["self_attn.k_proj.weight"]).view(n, self.kv_heads, d)
        v = F.linear(h, w["self_attn.v_proj.weight"]).view(n, self.kv_heads, d)
        if self.qk_norm:
            q = rms_norm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps)
        cos, sin = self.rope(step)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = step.attend(layer, q, k, v, d**-0.5).reshape(n, self.heads * d)
        return F.linear(a, w["self_attn.o_proj.weight"])

    def _layer(self, x: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        eps, w = self.config.rms_norm_eps, layer.w
        x = x + self.attention(rms_norm(x, w["input_layernorm.weight"], eps), layer, step)
        return x + swiglu(rms_norm(x, w["post_attention_layernorm.weight"], eps), w)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
