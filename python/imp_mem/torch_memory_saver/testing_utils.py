"""The helpers torch_memory_saver's own test suite imports from its package,
so that suite runs unchanged against imp-mem (only for tests)."""

from __future__ import annotations

from imp_mem.torch_memory_saver.utils import is_xpu

__all__ = ["empty_cache", "get_and_print_gpu_memory", "get_device", "is_xpu"]


def get_device() -> str:
    """The device string tests allocate on."""
    return "xpu" if is_xpu() else "cuda"


def empty_cache() -> None:
    """torch's cache emptied on the test device."""
    import torch

    (torch.xpu if is_xpu() else torch.cuda).empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Device memory in use now (the driver's figure, every process's), printed
    with ``message``; returned in bytes."""
    import torch

    free, total = torch.cuda.mem_get_info(gpu_id)
    used = total - free
    print(f"GPU {gpu_id} memory: {used / 1024**3:.2f} GB ({message})")
    return used
