"""What a hook mode is: where a region's allocations are caught."""

from __future__ import annotations

from typing import Any, Literal

HookMode = Literal["preload", "torch"]
HOOK_MODES: tuple[str, ...] = ("preload", "torch")


class HookUtilBase:
    """One hook mode's helper: the library that catches the allocations and,
    in torch mode, torch's view of it."""

    @staticmethod
    def create(hook_mode: HookMode) -> HookUtilBase:
        """The helper of ``hook_mode``."""
        from imp_mem.torch_memory_saver.hooks.mode_preload import HookUtilModePreload
        from imp_mem.torch_memory_saver.hooks.mode_torch import HookUtilModeTorch

        if hook_mode == "preload":
            return HookUtilModePreload()
        if hook_mode == "torch":
            return HookUtilModeTorch()
        from imp_mem.errors import InvalidArgument

        raise InvalidArgument(f"hook_mode: expected 'preload' or 'torch', got {hook_mode!r}")

    def get_path_binary(self) -> str:
        """The shared library that catches the allocations."""
        raise NotImplementedError

    def get_allocator(self) -> Any:
        """torch's allocator object for a ``MemPool`` (torch mode), or None."""
        return None
