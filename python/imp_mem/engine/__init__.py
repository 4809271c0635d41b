"""A reference engine on imp-mem: continuous batching, paged KV over the
KV pool, weights in T1, decode in CUDA graphs over T2 buffers; at TP = 1, or
tensor-parallel over a ``torch.distributed`` group (``Engine(group=...)``,
`TensorParallel`: one process per device, each serving its rank's slices).

The rooms: `llm_engine` (the serving loop, `Engine`), `args` (its
arguments, checked once: `EngineArgs`), `model_runner` (the runner, its
parts in `runner/`: T2 buffers and staging, the KV views and its own
blocks, the steps, warm-up and graphs), the memory side — `memory`
(`EngineMemory`: plan, open, load, charges), `boot` (the boot order over
it, the inline re-plan), `lifecycle` (sleep, wake, weight updates, model
swap), `warmup` (the warm-up's figure, measured and remembered) —
`scheduler` (continuous batching over the KV manager), `model/` (one file
per family over shared layers), `kernels/` (the Triton kernels and the
FlashInfer binding the models call), `tensor_parallel` (the weight split
and the collectives).

`imp_mem.engine` imports without torch: the scheduler is pure Python over a
`KVCacheManager`, and the names that run a model (`Engine`, `KvViews`,
`PagedModel`, `ModelConfig`'s checkpoint writer) import torch only when first
used.
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
    "EngineArgs",
    "EngineMemory",
    "EngineStats",
    "KvViews",
    "ModelConfig",
    "ModelRunner",
    "PagedModel",
    "Prefill",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerStats",
    "SharedGPU",
    "TensorParallel",
    "qwen3_0_6b_config",
    "swa_config",
    "write_random_checkpoint",
]

# Names that need torch, and the module each lives in.
_LAZY = {
    "Engine": "imp_mem.engine.llm_engine",
    "EngineArgs": "imp_mem.engine.args",
    "EngineStats": "imp_mem.engine.llm_engine",
    "KvViews": "imp_mem.engine.model",
    "ModelRunner": "imp_mem.engine.model_runner",
    "EngineMemory": "imp_mem.engine.memory",
    "SharedGPU": "imp_mem.engine.shared",
    "PagedModel": "imp_mem.engine.model",
    "TensorParallel": "imp_mem.engine.tensor_parallel",
    "ModelConfig": "imp_mem.engine.config",
    "qwen3_0_6b_config": "imp_mem.engine.config",
    "swa_config": "imp_mem.engine.config",
    "write_random_checkpoint": "imp_mem.engine.checkpoint",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'imp_mem.engine' has no attribute {name!r}")
    import importlib

    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != "torch" and "torch" not in str(exc):
            raise
        # As `import imp_mem.torch` says it: what to install, not a traceback
        # into the engine's layers.
        raise ImportError(
            f"imp_mem.engine.{name} needs PyTorch: install it with `pip install imp-mem[torch]` "
            "(or `pip install torch`); the scheduler and the planner run without it"
        ) from exc
    return getattr(loaded, name)
