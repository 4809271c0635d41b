"""Gemma-3's vision tower (SigLIP) and its multi-modal projector, written
with plain torch operations over views of T1.

The tower is transformers' ``SiglipVisionModel`` without its pooling head
(Gemma-3 reads the last hidden state): a patch convolution (stride = patch)
plus learned position embeddings, ``num_hidden_layers`` pre-norm encoder
layers (LayerNorm, bidirectional multi-head attention with biases,
LayerNorm, ``fc1`` / GeLU (tanh) / ``fc2``), and a final LayerNorm. The
projector is transformers' ``Gemma3MultiModalProjector``: the patch grid
average-pooled down to ``mm_tokens_per_image`` tokens, Gemma's ``(1 + w)``
RMSNorm, then one matrix to the language model's width; its output is cast
back to the tower's dtype (``type_as``), as transformers does.

Why plain operations rather than transformers' modules: the weights are
views of the engine's T1 arena (the loader's or the dummy fill's), used in
place with nothing registered or copied, exactly as the decoder's layers
use theirs; and the engine does not import transformers to serve.

The names are the checkpoint's (what transformers 5's ``save_pretrained``
writes: ``vision_tower.encoder.layers.{i}...``,
``multi_modal_projector...``); a Hub checkpoint's
``vision_tower.vision_model.`` prefix is read as the same tensors
(`canonical_name`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from imp_mem import _vision

TOWER = _vision.TOWER
PROJECTOR = _vision.PROJECTOR


def canonical_name(name: str) -> str:
    """A Gemma-3 checkpoint tensor's name in the engine's (transformers 5's
    saved) form: ``vision_tower.vision_model.X`` (the Hub's) is
    ``vision_tower.X``; the runtime module names ``model.language_model.X``,
    ``model.vision_tower.X``, ``model.multi_modal_projector.X`` are their
    saved names."""
    if name.startswith("vision_tower.vision_model."):
        return TOWER + name[len("vision_tower.vision_model.") :]
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model.") :]
    for prefix in (TOWER, PROJECTOR):
        if name.startswith("model." + prefix):
            return name[len("model.") :]
    return name


def is_vision_name(name: str) -> bool:
    """Whether a (canonical) tensor name belongs to the tower or the projector."""
    return name.startswith((TOWER, PROJECTOR))


def weight_names(vision: dict[str, Any], text_hidden: int) -> dict[str, tuple[int, ...]]:
    """The tower's and the projector's tensors by their checkpoint names,
    with their shapes (the projector first, as transformers saves them):
    `imp_mem._vision.tensors`, the one list, which the planner's torch-free
    sizing of the tower reads too."""
    return _vision.tensors(vision, text_hidden)


def is_layer_norm(name: str) -> bool:
    """The tower's LayerNorm weights (centred on 1, unlike Gemma's ``1 + w``)."""
    return name.startswith(TOWER) and name.endswith(
        ("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")
    )


def encode(
    w: dict[str, torch.Tensor], vision: dict[str, Any], mm_tokens: int, pixels: torch.Tensor
) -> torch.Tensor:
    """Image embeddings ``[B, mm_tokens, text_hidden]`` of `pixels`
    (``[B, channels, image_size, image_size]``), in the tower's dtype."""
    d, heads = vision["hidden_size"], vision["num_attention_heads"]
    eps = vision["layer_norm_eps"]
    patch = vision["patch_size"]
    dtype = w[TOWER + "embeddings.patch_embedding.weight"].dtype
    x = F.conv2d(
        pixels.to(dtype),
        w[TOWER + "embeddings.patch_embedding.weight"],
        w[TOWER + "embeddings.patch_embedding.bias"],
        stride=patch,
    )
    x = x.flatten(2).transpose(1, 2) + w[TOWER + "embeddings.position_embedding.weight"]
    b, n, _ = x.shape
    hd = d // heads
    for i in range(vision["num_hidden_layers"]):
        p = f"{TOWER}encoder.layers.{i}."

        def lin(t: torch.Tensor, name: str, p: str = p) -> torch.Tensor:
            return F.linear(t, w[f"{p}{name}.weight"], w[f"{p}{name}.bias"])

        h = F.layer_norm(x, (d,), w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], eps)
        q = lin(h, "self_attn.q_proj").view(b, n, heads, hd).transpose(1, 2)
        k = lin(h, "self_attn.k_proj").view(b, n, heads, hd).transpose(1, 2)
        v = lin(h, "self_attn.v_proj").view(b, n, heads, hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)
        x = x + lin(a.transpose(1, 2).reshape(b, n, d), "self_attn.out_proj")
        h = F.layer_norm(x, (d,), w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], eps)
        x = x + lin(F.gelu(lin(h, "mlp.fc1"), approximate="tanh"), "mlp.fc2")
    x = F.layer_norm(
        x, (d,), w[TOWER + "post_layernorm.weight"], w[TOWER + "post_layernorm.bias"], eps
    )
    # The projector: the patch grid pooled to mm_tokens, normed, projected.
    side = vision["image_size"] // patch
    per_side = math.isqrt(mm_tokens)
    grid = x.transpose(1, 2).reshape(b, d, side, side).contiguous()
    pooled = (
        F.avg_pool2d(grid, side // per_side, stride=side // per_side).flatten(2).transpose(1, 2)
    )
    pf = pooled.float()
    normed = pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * (1.0 + w[PROJECTOR + "mm_soft_emb_norm.weight"].float())).to(pooled.dtype)
    out = torch.matmul(normed, w[PROJECTOR + "mm_input_projection_weight"])
    return out.to(x.dtype)
