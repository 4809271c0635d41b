"""A multimodal model's vision tower sized from its config alone, without
torch: the bytes the reference engine's load lays out in T1 for the tower
and its projector (the plan's ``vision_tower`` line), so that
``imp-mem plan gemma-3-4b`` runs where torch is not installed.

The tensors are Gemma-3's SigLIP tower and projector, by their checkpoint
names and shapes (`tensors`: the one list, which the engine's
``imp_mem.engine.model.siglip.weight_names`` returns too). The layout is
the loader's: each tensor, or fused group of ``q/k/v`` projections
(`imp_mem._safetensors.fused_groups`: 2-D, equal columns, one span), starts
on a 256-byte boundary; the tower starts on one too, past the language
model's tensors, so its bytes do not depend on what precedes it.
"""

from __future__ import annotations

import math
from typing import Any

from imp_mem._safetensors import ALIGN, fused_groups

TOWER = "vision_tower."
PROJECTOR = "multi_modal_projector."
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def tensors(vision: dict[str, Any], text_hidden: int) -> dict[str, tuple[int, ...]]:
    """The tower's and the projector's tensors by their checkpoint names,
    with their shapes (the projector first, as transformers saves them).
    `vision`: the tower's fields as `ModelConfig.vision` holds them."""
    d, inter = vision["hidden_size"], vision["intermediate_size"]
    patch, channels = vision["patch_size"], vision["num_channels"]
    patches = (vision["image_size"] // patch) ** 2
    names: dict[str, tuple[int, ...]] = {
        PROJECTOR + "mm_input_projection_weight": (d, text_hidden),
        PROJECTOR + "mm_soft_emb_norm.weight": (d,),
        TOWER + "embeddings.patch_embedding.weight": (d, channels, patch, patch),
        TOWER + "embeddings.patch_embedding.bias": (d,),
        TOWER + "embeddings.position_embedding.weight": (patches, d),
    }
    for i in range(vision["num_hidden_layers"]):
        p = f"{TOWER}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            names[f"{p}{norm}.weight"] = (d,)
            names[f"{p}{norm}.bias"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            names[f"{p}self_attn.{proj}.weight"] = (d, d)
            names[f"{p}self_attn.{proj}.bias"] = (d,)
        names[f"{p}mlp.fc1.weight"] = (inter, d)
        names[f"{p}mlp.fc1.bias"] = (inter,)
        names[f"{p}mlp.fc2.weight"] = (d, inter)
        names[f"{p}mlp.fc2.bias"] = (d,)
    names[TOWER + "post_layernorm.weight"] = (d,)
    names[TOWER + "post_layernorm.bias"] = (d,)
    return names


def laid_out_bytes(names: dict[str, tuple[int, ...]], item: int) -> int:
    """The bytes `names` take laid out from a 256-byte boundary: each span
    (a fused group, or one tensor) aligned, in name order."""
    group_of: dict[str, list[str]] = {}
    for group in fused_groups(list(names)):
        shapes = [names[n] for n in group]
        if all(len(s) == 2 and s[1] == shapes[0][1] for s in shapes):
            for name in group:
                group_of[name] = group
    cursor, placed = 0, set()
    for name in names:
        if name in placed:
            continue
        group = group_of.get(name, [name])
        placed.update(group)
        cursor = -(-cursor // ALIGN) * ALIGN + sum(math.prod(names[n]) * item for n in group)
    return cursor


def tower_bytes(config: dict[str, Any]) -> int:
    """The T1 bytes of the vision tower and projector `config` (a
    ``config.json`` dict) declares; 0 for a text model. A tower of a
    family the engine does not read is refused (`InvalidArgument`), as
    `imp_mem.engine.config.ModelConfig.from_hf_config` refuses it."""
    if "vision_config" not in config:
        return 0
    from imp_mem.engine.config import ModelConfig

    model = ModelConfig.from_hf_config(config)
    if model.vision is None:
        return 0
    return laid_out_bytes(tensors(model.vision, model.hidden_size), DTYPE_BYTES[model.dtype])
