"""The models the engine serves, one file per family over shared layers.

* `layers`: what every family uses (`KvViews`, RMSNorm, RoPE);
* `attention`: attention over the KV pages, shared by every family (torch,
  and the Triton kernels of `imp_mem.engine.kernels`, which hold no model);
* `qwen3`: the Qwen3 architecture (`PagedModel`);
* `decoder`: the frame the other families share (`DecoderModel`, `Step`);
  `rope`: RoPE's scaled frequencies; `moe`: routing and the experts;
* `llama`, `qwen3_moe`, `deepseek_v2` (MLA), `gemma3`: one family each
  (`gemma3` also serves Gemma-3 with its vision tower, `siglip`).

`model_class(config)` is the class that serves a config, `build_model` one
over its weights, `weight_names(config)` every tensor it reads by its
Hugging Face name with its shape.

A model file is layers composed and nothing else: it holds no memory of
its own beyond its RoPE tables (the weights are views of T1, the KV pages
views of the KV pool) and knows nothing of plans, tiers or serving.
"""

from __future__ import annotations

from typing import Any

from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model.layers import KvViews, rms_norm, rope_tables, rotate_half
from imp_mem.engine.model.qwen3 import PagedModel
from imp_mem.engine.model.qwen3 import weight_names as qwen3_weight_names


def model_class(config: ModelConfig) -> Any:
    """The model class of `config`'s family."""
    family = config.model_type
    if family == "qwen3":
        return PagedModel
    if family == "llama":
        from imp_mem.engine.model.llama import LlamaModel

        return LlamaModel
    if family == "qwen3_moe":
        from imp_mem.engine.model.qwen3_moe import Qwen3MoeModel

        return Qwen3MoeModel
    if family == "deepseek_v2":
        from imp_mem.engine.model.deepseek_v2 import DeepseekV2Model

        return DeepseekV2Model
    if family == "gemma3_text":
        from imp_mem.engine.model.gemma3 import Gemma3Model

        return Gemma3Model
    if family == "gemma3":
        from imp_mem.engine.model.gemma3 import Gemma3VisionModel

        return Gemma3VisionModel
    raise ValueError(f"no model file serves model_type {family!r}")


def weight_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `config`'s model reads, by its Hugging Face name, with its shape."""
    if config.model_type == "qwen3":
        return qwen3_weight_names(config)
    return model_class(config).weight_names(config)


def build_model(config: ModelConfig, weights: dict[str, Any], **kw: Any) -> Any:
    """`config`'s model over `weights` (the keyword arguments are `PagedModel`'s)."""
    return model_class(config)(config, weights, **kw)


__all__ = [
    "KvViews",
    "PagedModel",
    "build_model",
    "model_class",
    "rms_norm",
    "rope_tables",
    "rotate_half",
    "weight_names",
]
