"""A reference engine on imp-mem: continuous batching, paged KV over the
KV pool, weights in T1, decode in CUDA graphs over T2 buffers.

`imp_mem.engine` imports without torch: the scheduler is pure Python over a
`KVCacheManager`; the torch-backed names (`Engine`, `KvViews`) load on first
use.
"""

from __future__ import annotations

from typing import Any

from imp_mem.engine.scheduler import (
    Prefill,
    Request,
    RequestState,
    Scheduler,
    SchedulerStats,
)

__all__ = [
    "Engine",
    "EngineStats",
    "KvViews",
    "Prefill",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerStats",
]

# Names that need torch, and the module each lives in.
_LAZY = {
    "Engine": "imp_mem.engine.runtime",
    "EngineStats": "imp_mem.engine.runtime",
    "KvViews": "imp_mem.engine.runtime",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'imp_mem.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
