"""imp-mem's vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in every one of its processes at start. It does
nothing unless the user opted in with ``IMP_MEM_VLLM_SLEEP=1``: then
``vllm.device_allocator.cumem.CuMemAllocator`` becomes
:class:`imp_mem.vllm.CuMemAllocator`, so vLLM's sleep mode
(``--enable-sleep-mode``, ``LLM.sleep`` / ``wake_up``) runs on imp-mem's tiers.
Installing imp-mem alone changes nothing in vLLM. This module imports neither
torch nor vLLM until the switch is on, so a process that never opts in pays
for nothing.
"""

from __future__ import annotations

import os

__all__ = ["ENV_SWITCH", "enabled", "register"]

#: The environment variable that turns the plugin on.
ENV_SWITCH = "IMP_MEM_VLLM_SLEEP"

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``IMP_MEM_VLLM_SLEEP`` asks for imp-mem's allocator. A value
    that is neither on nor off is refused (a typo must not silently leave
    vLLM's allocator in place)."""
    from imp_mem.errors import InvalidArgument

    env = os.environ if environ is None else environ
    value = env.get(ENV_SWITCH, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise InvalidArgument(
        f"{ENV_SWITCH}={env.get(ENV_SWITCH)!r}: expected 1 to run vLLM's sleep mode on imp-mem, "
        "or 0 (or unset) to leave vLLM's allocator in place"
    )


def register() -> None:
    """vLLM's plugin hook: with the switch on, puts
    :class:`imp_mem.vllm.CuMemAllocator` in place of vLLM's (idempotent: vLLM
    may load plugins more than once)."""
    if not enabled():
        return
    try:
        import vllm.device_allocator.cumem as cumem
    except ImportError as exc:
        # vLLM's module loads its CUDA extension at import (it needs the
        # driver's libcuda): where it cannot, vLLM has no sleep mode to
        # replace, and a plugin must not stop vLLM from starting.
        import warnings

        from imp_mem.errors import ImpMemWarning

        warnings.warn(
            f"{ENV_SWITCH}=1, but vllm.device_allocator.cumem does not import here ({exc}); "
            "vLLM's allocator is left in place",
            ImpMemWarning,
            stacklevel=2,
        )
        return
    from imp_mem.vllm import CuMemAllocator

    if cumem.CuMemAllocator is CuMemAllocator:
        return
    cumem.CuMemAllocator = CuMemAllocator  # type: ignore[misc]
    # vLLM's platforms ask this flag whether sleep mode can run; it can,
    # with or without vLLM's own cumem extension.
    cumem.cumem_available = True
