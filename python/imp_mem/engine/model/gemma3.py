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


class Gemma3VisionModel(Gemma3Model):
    """Gemma-3 with its vision tower (``model_type: gemma3``,
    ``Gemma3ForConditionalGeneration``): the language model above, read
    from the checkpoint's ``language_model.model.*`` tensors, and the
    SigLIP tower and projector (`siglip`) over their own views of T1.

    Images enter at prefill as transformers' ``Gemma3Model.forward`` puts
    them: the prompt's ``mm_tokens_per_image`` image tokens
    (``image_token_index``; an id at or past the vocabulary is embedded as
    token 0 first) take the projector's output in place of their scaled
    token embeddings (the image embeddings are not scaled), and, as with
    the ``token_type_ids`` transformers' processor passes, the image's
    tokens attend to each other both ways in every layer (the sliding
    layers within their window too). Decode is the text model's: an image
    token never follows the prompt. As transformers'
    ``Gemma3ForConditionalGeneration``, the logits are not soft-capped
    (its ``forward`` ignores ``final_logit_softcapping``, which Gemma-3's
    own configs leave null)."""

    family = "gemma3"

    @staticmethod
    def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors: the language model's under
        ``language_model.``, then the projector's and the tower's."""
        from imp_mem.engine.model import siglip

        names = {"language_model." + k: v for k, v in Gemma3Model.weight_names(config).items()}
        names.update(siglip.weight_names(config.extra["vision"], config.hidden_size))
        return names

    def decoder_names(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return Gemma3Model.weight_names(config)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], **kw) -> None:
        from imp_mem.engine.model import siglip

        weights = {siglip.canonical_name(k): v for k, v in weights.items()}
        vision = siglip.weight_names(config.extra["vision"], config.hidden_size)
        for name, shape in vision.items():
            if name not in weights:
                raise InvalidArgument(
                    f"weights: the vision tower's {name!r} is missing; pass every tensor of the "
                    "checkpoint by its Hugging Face name"
                )
            if tuple(weights[name].shape) != shape:
                raise InvalidArgument(
                    f"weights: {name!r} has shape {tuple(weights[name].shape)}, the config "
                    f"needs {shape}"
                )
        self.vision_weights = {name: weights[name] for name in vision}
        text = {
            k[len("language_model.") :]: v
            for k, v in weights.items()
            if k.startswith("language_model.")
        }
        super().__init__(config, text, **kw)
        v = config.extra["vision"]
        self.vision = v
        self.image_token = v["image_token_index"]
        self.mm_tokens = v["mm_tokens_per_image"]
        self.image_shape = (v["num_channels"], v["image_size"], v["image_size"])

    def setup(self, weights: dict[str, torch.Tensor]) -> None:
        super().setup(weights)
        self.softcap = None

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """The projector's output for `pixels` (``[B, channels, size,
        size]``): ``[B, mm_tokens_per_image, hidden]`` in the model's dtype."""
        from imp_mem.engine.model import siglip

        return siglip.encode(self.vision_weights, self.vision, self.mm_tokens, pixels)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.image_token >= self.config.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.image_token, 0)
        return super()._embed(input_ids)

    def _embed_image(
        self, input_ids: torch.Tensor, start_pos: int, mm: tuple[int, int, torch.Tensor]
    ) -> torch.Tensor:
        lo, hi, emb = mm
        x = self._embed(input_ids)
        end = start_pos + x.shape[0]
        a, b = max(lo, start_pos), min(hi, end)
        if a < b and hi > end:
            # The span's early tokens attend to its late ones: all must be in the pages.
            raise InvalidArgument(
                f"prefill: the image's tokens [{lo}, {hi}) end past this chunk [{start_pos}, "
                f"{end}); prefill through the image's last token in one call"
            )
        if tuple(emb.shape) != (hi - lo, x.shape[1]):
            raise InvalidArgument(
                f"mm: the image embeddings are {tuple(emb.shape)}; positions [{lo}, {hi}) need "
                f"({hi - lo}, {x.shape[1]})"
            )
        if a < b:
            x[a - start_pos : b - start_pos] = emb[a - lo : b - lo].to(x.dtype)
        return x
