"""Random weights without a checkpoint (``load_format="dummy"``, as vLLM's
``--load-format dummy``): the engine plans from a ``config.json`` alone and
fills T1 on its device from a seed.

Layout. Every tensor the family reads (`imp_mem.engine.model.weight_names`)
gets a view of the weights arena, in name order, each 256-byte aligned as
the safetensors loader aligns them, except a family's *stacks*
(`model_class(config).weight_stacks`): tensors laid end to end in one span
with no gap, so that the model can read them as one stacked tensor (the
MoE's experts, for a grouped GEMM) while each keeps its checkpoint name,
and the fused projections (q/k/v, gate/up: `_safetensors.fused_groups`),
which share a span for one GEMM each, as the safetensors loader lays them.
`layout_bytes` is exactly what the load takes; the plan's weights line is
planned at it (`ModelShape.from_hf_config(config, weights_bytes=...)`).

Values. The same as `imp_mem.engine.checkpoint.random_weights` on the same
device with the same seed and scale, bit for bit: both draw by
`imp_mem.engine.weight_draw`'s rule (one generator, the tensors in name
order, matrices from N(0, scale²), norms around the family's centre).
A test or a benchmark that builds a transformers model from
`random_weights` compares it with the engine on the same weights. The
fill draws one tensor at a time in float32 on the device (transients of
the largest tensor, given back to the device before serving).
"""

from __future__ import annotations

from typing import Any

from imp_mem._safetensors import ALIGN, fused_groups
from imp_mem.engine.config import ModelConfig
from imp_mem.engine.weight_draw import DEFAULT_SCALE, draw, norm_center

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def stacks(config: ModelConfig) -> list[list[str]]:
    """The family's groups of tensors laid out end to end."""
    from imp_mem.engine.model import model_class

    fn = getattr(model_class(config), "weight_stacks", None)
    return fn(config) if fn is not None else []


def layout(config: ModelConfig) -> tuple[list[tuple[list[str], int]], int]:
    """``([(names, offset)], total)``: each span's tensors (a stack, or one
    tensor) and its offset in the arena, in name order; the bytes taken."""
    import math

    from imp_mem.engine.model import weight_names

    names = weight_names(config)
    item = DTYPE_BYTES[config.dtype]
    group_of: dict[str, list[str]] = {}
    for group in stacks(config):
        for name in group:
            group_of[name] = group
    # The fused projections share a span as the safetensors load lays them
    # (`_safetensors.fused_groups`), so the model multiplies each as one matrix.
    for group in fused_groups(list(names)):
        shapes = [names[n] for n in group]
        if not any(n in group_of for n in group) and all(
            len(x) == 2 and x[1] == shapes[0][1] for x in shapes
        ):
            for name in group:
                group_of[name] = group
    spans, cursor, placed = [], 0, set()
    for name in names:
        if name in placed:
            continue
        group = group_of.get(name, [name])
        placed.update(group)
        offset = -(-cursor // ALIGN) * ALIGN
        spans.append((group, offset))
        cursor = offset + sum(math.prod(names[n]) * item for n in group)
    return spans, cursor


def layout_bytes(config: ModelConfig) -> int:
    """The T1 bytes a dummy load takes."""
    return layout(config)[1]


def vision_bytes(config: ModelConfig) -> int:
    """The T1 bytes of a vision tower and its projector as the load lays
    them out (after the language model's tensors, from the 256-byte
    boundary past them): the plan's ``vision_tower`` line; 0 for a text
    model."""
    if config.vision is None:
        return 0
    from imp_mem.engine.model.siglip import is_vision_name

    spans, total = layout(config)
    vision = [is_vision_name(group[0]) for group, _ in spans]
    # `weight_names` lists the tower after the language model.
    first = vision.index(True)
    assert all(vision[first:]), "the tower's tensors must follow the language model's"
    return total - spans[first][1]


def plan_shape(config_dict: dict[str, Any], config: ModelConfig) -> Any:
    """The `ModelShape` a dummy engine plans with: the config's, its
    weights line at exactly the bytes the load lays out (less a vision
    tower's, which the plan's ``vision_tower`` line holds)."""
    from imp_mem import ModelShape

    text = layout_bytes(config) - vision_bytes(config)
    return ModelShape.from_hf_config(config_dict, weights_bytes=text)


def load_dummy(system: Any, config: ModelConfig, *, seed: int, scale: float) -> dict[str, Any]:
    """Views of T1 for every tensor, filled from `seed` (module doc)."""
    import math

    import torch

    from imp_mem.engine.model import weight_names
    from imp_mem.errors import InvalidArgument

    names = weight_names(config)
    spans, total = layout(config)
    from imp_mem._safetensors import _weights_room

    room = _weights_room(system)
    if total > room:
        raise InvalidArgument(
            f"load_format='dummy': the weights take {total} B; the plan gave {room} B"
        )
    arena = system.weights_arena
    dtype = getattr(torch, config.dtype)
    out: dict[str, Any] = {}
    for group, _ in spans:
        shapes = [names[n] for n in group]
        nbytes = sum(math.prod(s) for s in shapes) * DTYPE_BYTES[config.dtype]
        raw = torch.from_dlpack(arena.take(nbytes, ALIGN)).view(dtype)
        at = 0
        for name, shape in zip(group, shapes, strict=True):
            n = math.prod(shape)
            out[name] = raw[at : at + n].view(shape)
            at += n
    fill(out, config, seed=seed, scale=scale)
    return out


def fill(weights: dict[str, Any], config: ModelConfig, *, seed: int, scale: float) -> None:
    """Writes `random_weights`' values into `weights` in place."""
    import torch

    from imp_mem.engine.model import weight_names

    device = next(iter(weights.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    center = norm_center(config)
    with torch.no_grad():
        for name, shape in weight_names(config).items():
            t = draw(name, shape, gen, device, scale, center)
            weights[name].copy_(t)
            del t
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def transformers_model(
    config_dict: dict[str, Any],
    *,
    seed: int = 0,
    scale: float | None = None,
    device: Any = "cuda",
    dtype: Any = None,
) -> Any:
    """transformers' causal LM of `config_dict` holding the values a dummy
    engine of the same seed and scale draws on `device` (so the two can be
    compared on the same weights without a checkpoint on disk). Drawn
    tensor by tensor into the model's parameters: a routed expert's
    ``gate_proj`` / ``up_proj`` / ``down_proj`` go to its rows of
    transformers' fused ``gate_up_proj`` / ``down_proj``; a tied head is
    the embedding. `dtype`: the model's (default the config's)."""
    import re

    import torch
    import transformers

    from imp_mem.engine.model import weight_names

    config = ModelConfig.from_hf_config(config_dict)
    scale = DEFAULT_SCALE if scale is None else scale
    device = torch.device(device)
    dtype = dtype or getattr(torch, config.dtype)
    hf_config = transformers.AutoConfig.for_model(**config_dict)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    params = dict(model.named_parameters())
    if config.vision is not None:
        # transformers' modules under ``model.``; the checkpoint's names here.
        from imp_mem.engine.model.siglip import canonical_name

        params = {canonical_name(n): p for n, p in params.items()}
    expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    gen = torch.Generator(device=device).manual_seed(seed)
    center = norm_center(config)
    done: set[str] = set()
    with torch.no_grad():
        for name, shape in weight_names(config).items():
            t = draw(name, shape, gen, device, scale, center).to(getattr(torch, config.dtype))
            m = expert.fullmatch(name)
            if m is None:
                params[name].copy_(t)
                done.add(name)
                continue
            prefix, j, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind == "down":
                params[prefix + ".down_proj"][j].copy_(t)
                done.add(prefix + ".down_proj")
            else:
                rows = shape[0]
                at = 0 if kind == "gate" else rows
                params[prefix + ".gate_up_proj"][j, at : at + rows].copy_(t)
                done.add(prefix + ".gate_up_proj")
    untouched = [
        n
        for n in params
        if n not in done and not (n.endswith("lm_head.weight") and config.tie_word_embeddings)
    ]
    if untouched:
        raise ValueError(
            f"transformers_model: {len(untouched)} parameters not drawn, first {untouched[0]!r}"
        )
    return model.eval()
