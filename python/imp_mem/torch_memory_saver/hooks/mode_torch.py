"""Torch mode: a region's tensors reach imp-mem through torch's pluggable
allocator over imp-mem's own C hooks (``imp_mem_torch_malloc`` /
``imp_mem_torch_free``), in a ``torch.cuda.MemPool`` per region."""

from __future__ import annotations

from typing import Any

from imp_mem.torch_memory_saver.hooks.base import HookUtilBase


class HookUtilModeTorch(HookUtilBase):
    """The hooks are imp-mem's extension module; no LD_PRELOAD."""

    def get_path_binary(self) -> str:
        """imp-mem's extension module, which exports the torch hooks."""
        import imp_mem.torch as imt

        return imt.library_path()

    def get_allocator(self) -> Any:
        """torch's ``CUDAPluggableAllocator`` over the hooks (one per process)."""
        import imp_mem.torch as imt

        return imt.pluggable_allocator().allocator()
