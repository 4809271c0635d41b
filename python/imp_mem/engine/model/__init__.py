"""The models the engine serves, one file per family over shared layers.

* `layers`: what every family uses (`KvViews`, RMSNorm, RoPE);
* `attention`, `_paged_kernel`: attention over the KV pages (torch and
  Triton), shared by every family;
* `qwen3`: the Qwen3 architecture (`PagedModel`).

A model file is layers composed and nothing else: it holds no memory of
its own beyond its RoPE tables (the weights are views of T1, the KV pages
views of the KV pool) and knows nothing of plans, tiers or serving.
"""

from __future__ import annotations

from imp_mem.engine.model.layers import KvViews, rms_norm, rope_tables, rotate_half
from imp_mem.engine.model.qwen3 import PagedModel, weight_names

__all__ = ["KvViews", "PagedModel", "rms_norm", "rope_tables", "rotate_half", "weight_names"]
