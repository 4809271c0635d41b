"""The DeepSeek-V2 family (``model_type: deepseek_v2``, DeepSeek-V2-Lite):
multi-head latent attention (MLA) over a latent KV cache, and MoE layers
with shared experts after the first ``first_k_dense_replace`` dense ones.

The latent cache. A token's K and V of a layer are not stored: its
compressed latent is, ``kv_a_layernorm(c)`` (``kv_lora_rank`` values) and
its RoPE'd shared key ``k_pe`` (``qk_rope_head_dim``), side by side: a KV
block of a pool of L layers is ``[L, block_size, kv_lora_rank +
qk_rope_head_dim]`` (`kv_block_shape`), which is the planner's MLA line
(``kv_lora_rank + qk_rope_head_dim`` elements per token per layer, one
"head", no separate V).

Attention is computed with the up-projection absorbed: each head's
``q_nope`` is carried into the latent space through its rows of
``kv_b_proj`` (``W_uk``), scored against the latents plus ``q_pe`` against
``k_pe``, softmax in float32, the probabilities applied to the latents and
the result carried out through the head's ``W_uv``: the same attention as
transformers' (which up-projects every cached latent into per-head K and
V) without materialising them. Decode gathers each sequence's latents
through its block table (static shapes, no host syncs: capturable).

RoPE is DeepSeek's interleaved form (pairs of channels as complex
numbers), in float32 as transformers computes it, with DeepSeek-V2's YaRN
scaling (`imp_mem.engine.model.rope`: the frequencies, cos/sin scaled by
the attention factor, the softmax scale by ``mscale_all_dim``'s square). Queries come from
``q_proj`` or, with ``q_lora_rank``, from ``q_a_proj`` → ``q_a_layernorm``
→ ``q_b_proj``. The MoE (`imp_mem.engine.model.moe`): float32 router
logits, softmax, greedy top-k, scaled by ``routed_scaling_factor``; the
routed experts plus the shared experts (one SwiGLU of
``n_shared_experts * moe_intermediate_size``) on the same input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model.decoder import DecoderModel, Layer, Step
from imp_mem.engine.model.layers import rms_norm
from imp_mem.engine.model.llama import head_names, mlp_names, swiglu
from imp_mem.engine.model.moe import route_softmax_topk
from imp_mem.engine.model.qwen3_moe import MoeMixin, expert_names
from imp_mem.engine.model.rope import attention_factor, inv_freq, softmax_mscale
from imp_mem.errors import InvalidArgument


def latent_dim(config: ModelConfig) -> int:
    """Elements one token's latent takes in one layer (the planner's MLA line)."""
    return config.extra["kv_lora_rank"] + config.extra["qk_rope_head_dim"]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE: channel pairs ``(2i, 2i+1)`` rotated by angle i, in
    float32, cast back to x's dtype. `cos`/`sin`: float32 ``[N, 1, d/2]``."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class DeepseekV2Model(MoeMixin, DecoderModel):
    """DeepSeek-V2 over a paged latent KV cache (module doc)."""

    family = "deepseek_v2"
    # MLA's attention is its own (latents, absorbed heads): one sequence a prefill.
    prefill_batch_ok = False

    @staticmethod
    def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by its Hugging Face name, with its shape."""
        h, x = config.hidden_size, config.extra
        heads = config.num_heads
        qk = x["qk_nope_head_dim"] + x["qk_rope_head_dim"]
        names = head_names(config)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn: dict[str, tuple[int, ...]] = {}
            if x["q_lora_rank"] is None:
                attn["self_attn.q_proj.weight"] = (heads * qk, h)
            else:
                r = x["q_lora_rank"]
                attn["self_attn.q_a_proj.weight"] = (r, h)
                attn["self_attn.q_a_layernorm.weight"] = (r,)
                attn["self_attn.q_b_proj.weight"] = (heads * qk, r)
            attn.update(
                {
                    "self_attn.kv_a_proj_with_mqa.weight": (latent_dim(config), h),
                    "self_attn.kv_a_layernorm.weight": (x["kv_lora_rank"],),
                    "self_attn.kv_b_proj.weight": (
                        heads * (x["qk_nope_head_dim"] + x["v_head_dim"]),
                        x["kv_lora_rank"],
                    ),
                    "self_attn.o_proj.weight": (h, heads * x["v_head_dim"]),
                    "input_layernorm.weight": (h,),
                    "post_attention_layernorm.weight": (h,),
                }
            )
            names.update({p + k: v for k, v in attn.items()})
            if i in x["moe_layers"]:
                names[p + "mlp.gate.weight"] = (x["num_experts"], h)
                names.update(expert_names(config, i))
                shared = x["shared_experts"] * x["moe_intermediate_size"]
                if shared:
                    names.update(mlp_names(p + "mlp.shared_experts.", shared, h))
            else:
                names.update(mlp_names(p + "mlp.", config.intermediate_size, h))
        return names

    def setup(self, weights: dict[str, torch.Tensor]) -> None:
        c, x = self.config, self.config.extra
        if x["moe_layers"] and list(x["moe_layers"]) != list(
            range(x["moe_layers"][0], c.num_layers)
        ):
            raise InvalidArgument(
                "config: deepseek_v2 serves moe_layer_freq 1 (every layer from "
                "first_k_dense_replace on is MoE), as transformers does"
            )
        self.nope, self.rope_dim = x["qk_nope_head_dim"], x["qk_rope_head_dim"]
        self.v_dim, self.rank = x["v_head_dim"], x["kv_lora_rank"]
        rope = x.get("rope")
        self.scaling = (self.nope + self.rope_dim) ** -0.5 * softmax_mscale(rope)
        freq = inv_freq(self.rope_dim, c.rope_theta, rope)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float), freq)
        # YaRN scales cos and sin (transformers: polar(1, angle) * factor).
        factor = attention_factor(rope)
        self.cos = (angles.cos() * factor).to(self.device)
        self.sin = (angles.sin() * factor).to(self.device)
        # Each head's rows of kv_b_proj: W_uk [heads, nope, rank], W_uv [heads, v, rank].
        self.w_uk: dict[int, torch.Tensor] = {}
        self.w_uv: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            kv_b = layer.w["self_attn.kv_b_proj.weight"].view(
                self.heads, self.nope + self.v_dim, self.rank
            )
            self.w_uk[layer.index] = kv_b[:, : self.nope]
            self.w_uv[layer.index] = kv_b[:, self.nope :]
        self.setup_experts()

    def kv_block_shape(self, layers: int, block_size: int) -> tuple[int, ...]:
        return (layers, block_size, latent_dim(self.config))

    # -- attention --------------------------------------------------------------

    def _rope(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        if "rope" not in step.cache:
            p = step.positions
            step.cache["rope"] = (self.cos[p].unsqueeze(1), self.sin[p].unsqueeze(1))
        return step.cache["rope"]

    def _gather(self, pages, slot, table, key_pos):
        """Latents at `key_pos` through `table` (``[M]`` with ``[L]``, or
        ``[B, M]`` with ``[B, L]``), zero where there is no block; and
        whether each has one."""
        bs = pages.shape[2]
        logical = torch.div(key_pos, bs, rounding_mode="floor")
        width = table.shape[-1]
        in_table = logical < width
        logical = logical.clamp(max=width - 1)
        blocks = table[logical] if table.dim() == 1 else torch.gather(table, 1, logical)
        present = in_table & (blocks >= 0)
        offsets = key_pos - logical * bs
        lat = pages[:, slot][blocks.clamp(min=0).long(), offsets]
        zero = torch.zeros((), dtype=lat.dtype, device=lat.device)
        return torch.where(present.unsqueeze(-1), lat, zero), present

    def _attention(self, h: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        c, w, n = self.config, layer.w, h.shape[0]
        eps = c.rms_norm_eps
        if "self_attn.q_proj.weight" in w:
            q = F.linear(h, w["self_attn.q_proj.weight"])
        else:
            qa = F.linear(h, w["self_attn.q_a_proj.weight"])
            qa = rms_norm(qa, w["self_attn.q_a_layernorm.weight"], eps)
            q = F.linear(qa, w["self_attn.q_b_proj.weight"])
        q = q.view(n, self.heads, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        ckv = F.linear(h, w["self_attn.kv_a_proj_with_mqa.weight"])
        latent = rms_norm(ckv[:, : self.rank], w["self_attn.kv_a_layernorm.weight"], eps)
        cos, sin = self._rope(step)
        q_pe = rope_interleaved(q_pe, cos, sin)
        k_pe = rope_interleaved(ckv[:, None, self.rank :], cos, sin)[:, 0]
        pages = step.pages(layer)
        blocks, offsets = step.slot[layer.pool]
        pages[:, layer.slot].index_put_(
            (blocks, offsets), torch.cat((latent, k_pe), dim=-1).to(pages.dtype)
        )
        table = step.tables[layer.pool]
        assert table is not None
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk[layer.index])
        if step.mode == "prefill":
            # One sequence: every query reads the same latents [L, D].
            key_pos = torch.arange(step.start_pos + n, device=h.device)
            lat, present = self._gather(pages, layer.slot, table, key_pos)
            allowed = present.unsqueeze(0) & (key_pos.unsqueeze(0) <= step.positions.unsqueeze(1))
            lat = lat.to(h.dtype)
            c_kv, k_rope = lat[:, : self.rank], lat[:, self.rank :]
            scores = torch.einsum("nhr,lr->nhl", q_lat, c_kv)
            scores = scores + torch.einsum("nhd,ld->nhl", q_pe, k_rope)
        else:
            # One query per sequence, each over its own table's latents [B, L, D].
            key_pos = torch.arange(table.shape[1] * pages.shape[2], device=h.device)
            key_pos = key_pos.unsqueeze(0).expand(n, -1)
            lat, present = self._gather(pages, layer.slot, table, key_pos)
            allowed = present & (key_pos <= step.positions.unsqueeze(1))
            # A block's slots past the position hold anything (NaN included):
            # a zero probability times NaN is still NaN.
            zero = torch.zeros((), dtype=lat.dtype, device=lat.device)
            lat = torch.where(allowed.unsqueeze(-1), lat, zero).to(h.dtype)
            c_kv, k_rope = lat[..., : self.rank], lat[..., self.rank :]
            scores = torch.einsum("nhr,nlr->nhl", q_lat, c_kv)
            scores = scores + torch.einsum("nhd,nld->nhl", q_pe, k_rope)
        scores = scores.float() * self.scaling
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(h.dtype)
        if step.mode == "prefill":
            out_lat = torch.einsum("nhl,lr->nhr", probs, c_kv)
        else:
            out_lat = torch.einsum("nhl,nlr->nhr", probs, c_kv)
        out = torch.einsum("nhr,hvr->nhv", out_lat, self.w_uv[layer.index])
        return F.linear(out.reshape(n, self.heads * self.v_dim), w["self_attn.o_proj.weight"])

    # -- the layer ----------------------------------------------------------------

    def _layer(self, x: torch.Tensor, layer: Layer, step: Step) -> torch.Tensor:
        c, w = self.config, layer.w
        eps = c.rms_norm_eps
        x = x + self._attention(rms_norm(x, w["input_layernorm.weight"], eps), layer, step)
        h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
        if layer.index not in c.extra["moe_layers"]:
            return x + swiglu(h, w)
        logits = F.linear(h.float(), w["mlp.gate.weight"].float())
        weights, ids = route_softmax_topk(
            logits,
            c.extra["top_k"],
            norm_topk_prob=False,
            scale=c.extra["routed_scaling_factor"],
        )
        out = self.routed(h, layer, weights, ids)
        if c.extra["shared_experts"]:
            out = out + swiglu(h, w, "mlp.shared_experts.")
        return x + out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
