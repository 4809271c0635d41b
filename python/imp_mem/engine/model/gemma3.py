"""The Gemma-3 text family (``model_type: gemma3_text``, gemma-3-4b's
language model): sliding-window and global layers (five to one by
default), each kind with its own RoPE (``rope_local_base_freq`` for the
sliding layers, ``rope_theta`` with the config's scaling for the global
ones), attention scaled by ``query_pre_attn_scalar ** -0.5``, per-head q/k
norms, four norms a layer (around attention and around the MLP), GeLU
(tanh) gating, the embedding multiplied by ``sqrt(hidden_size)`` (rounded
to the model dtype, as transformers does) and the final logits soft-capped
when ``final_logit_softcapping`` is set.

Gemma's RMSNorm is ``x * (1 + w)`` computed wholly in float32 and cast
once (`gemma_norm`), unlike Llama's; its weights centre on 0, so a dummy
load draws them around 0 (`norm_center`). Attention logit soft-capping
(Gemma-2's) is refused: Gemma-3's configs leave it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imp_mem.engine.config import FULL, ModelConfig
from imp_mem.engine.model.decoder import DecoderModel, Layer, Step
from imp_mem.engine.model.layers import rotate_half
from imp_mem.engine.model.llama import attention_names, head_names, mlp_names
from imp_mem.engine.model.rope import cos_sin, inv_freq
from imp_mem.errors import InvalidArgument


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: float32 throughout, ``* (1 + w)``, cast once."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


class Gemma3Model(DecoderModel):
    """Gemma-3's language model over paged KV (module doc)."""

    family = "gemma3_text"
    norm_center = 0.0

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
                "pre_feedforward_layernorm.weight": (h,),
                "post_feedforward_layernorm.weight": (h,),
                **attention_names(config, h, qk_norm=True),
                **mlp_names("mlp.", config.intermediate_size, h),
            }
            names.update({p + k: v for k, v in layer.items()})
        return names

    def setup(self, weights: dict[str, torch.Tensor]) -> None:
        c, x = self.config, self.config.extra
        if x.get("attn_logit_softcapping") is not None:
            raise InvalidArgument(
                "config: attn_logit_softcapping is not supported for gemma3_text; set it to null"
            )
        d = c.head_dim
        self.scaling = x["query_pre_attn_scalar"] ** -0.5
        self.softcap = x.get("final_logit_softcapping")
        glob = inv_freq(d, c.rope_theta, x.get("rope"))
        local = inv_freq(d, x["rope_local_base_freq"])
        self.tables = {
            "full": cos_sin(glob, self.max_positions, self.device, self.dtype),
            "swa": cos_sin(local, self.max_positions, self.device, self.dtype),
        }
        # transformers multiplies by sqrt(hidden) rounded to the model dtype.
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=self.dtype, device=self.device)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed) * self.embed_scale

    def _rope(self, step: Step, pool: str) -> tuple[torch.Tensor, torch.Tensor]:
        if pool not in step.cache:
            cos, sin = self.tables[pool]
            p = step.positions
            step.cache[pool] = (cos[p].unsqueeze(1), sin[p].unsqueeze(1))
        return step.cache[pool]

    def _layer(self, x: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        c, w, n = self.config, layer.w, x.shape[0]
        eps, d = c.rms_norm_eps, c.head_dim
        h = gemma_norm(x, w["input_layernorm.weight"], eps)
        q = F.linear(h, w["self_attn.q_proj.weight"]).view(n, self.heads, d)
        k = F.linear(h, w["self_attn.k_proj.weight"]).view(n, self.kv_heads, d)
        v = F.linear(h, w["self_attn.v_proj.weight"]).view(n, self.kv_heads, d)
        q = gemma_norm(q, w["self_attn.q_norm.weight"], eps)
        k = gemma_norm(k, w["self_attn.k_norm.weight"], eps)
        cos, sin = self._rope(step, "full" if c.layer_types[layer.index] == FULL else "swa")
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = step.attend(layer, q, k, v, self.scaling).reshape(n, self.heads * d)
        a = F.linear(a, w["self_attn.o_proj.weight"])
        x = x + gemma_norm(a, w["post_attention_layernorm.weight"], eps)
        h = gemma_norm(x, w["pre_feedforward_layernorm.weight"], eps)
        gate = F.gelu(F.linear(h, w["mlp.gate_proj.weight"]), approximate="tanh")
        m = F.linear(gate * F.linear(h, w["mlp.up_proj.weight"]), w["mlp.down_proj.weight"])
        return x + gemma_norm(m, w["post_feedforward_layernorm.weight"], eps)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = gemma_norm(x, self.norm, self.config.rms_norm_eps)
        logits = F.linear(x, self.lm_head)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
