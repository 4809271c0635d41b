"""torch_memory_saver's API on imp-mem's tiers (issue 51): a drop-in for
``torch_memory_saver`` 0.0.10, the library SGLang (``--enable-memory-saver``),
verl and slime call to pause and resume their GPU memory.

``from imp_mem.torch_memory_saver import torch_memory_saver`` gives the same
singleton their code uses::

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = build_model().cuda()
    torch_memory_saver.pause("weights")   # device memory given back, addresses kept
    torch_memory_saver.resume("weights")  # same addresses, same bytes

One switch makes their unchanged code reach it: ``imp_mem.torch_memory_saver.install()``
in the process, or ``IMP_MEM_TORCH_MEMORY_SAVER=1`` in the environment (read at
interpreter start by the ``imp_mem_torch_memory_saver.pth`` file the wheel
installs, so spawned workers follow), after which ``import torch_memory_saver``
and its submodules (``.entrypoint``, ``.hooks.mode_preload``, ``.utils``,
``.testing_utils``, ...) resolve to this package (:mod:`._switch`).

How it maps. Each ``(tag, backup kind, device)`` is an :func:`imp_mem.torch.region`
(a growable strict VMM activation pool reserving the device's total memory as
address space, committed only as used); ``pause`` gives its physical memory
back keeping the addresses (CUDA graphs replay after ``resume`` without
re-capture), copying the live segments to pinned host memory first when the
region has a CPU backup. The host buffer is pinned ahead, on a thread of its
own, when a region with a pinned backup is left, so the first pause copies at
the line rate; after ``resume`` it is kept or given back as
``retain_cpu_backup`` says. ``hook_mode="torch"`` routes torch's allocations
through a ``torch.cuda.MemPool`` over the region; ``hook_mode="preload"``
(the default, as in torch_memory_saver) routes every ``cudaMalloc`` of the
thread, any library's, through imp-mem's LD_PRELOAD interposer
(:mod:`imp_mem._preload`) into the region. Bad input and faults raise typed
errors (``InvalidArgument``, ``OutOfMemory``) where the original exits the
process, and a pause or resume of several regions is all or nothing.
"""

from __future__ import annotations

from imp_mem.torch_memory_saver._switch import ENV_SWITCH, install, installed, uninstall
from imp_mem.torch_memory_saver.entrypoint import TorchMemorySaver
from imp_mem.torch_memory_saver.hooks.mode_preload import configure_subprocess

__all__ = [
    "ENV_SWITCH",
    "TorchMemorySaver",
    "configure_subprocess",
    "install",
    "installed",
    "torch_memory_saver",
    "uninstall",
]

# The process's one saver, as torch_memory_saver's own module makes it.
torch_memory_saver = TorchMemorySaver()
