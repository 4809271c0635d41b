"""torch's allocations through a planned imp-mem tier (``pip install imp-mem[torch]``).

A torch engine allocates far more than its weights and its KV cache: every
activation, temporary and library workspace goes through torch's caching
allocator, which asks the driver for segments whenever its cache misses. This
package puts those allocations on the system's *activations* tier (T4a): a
region the plan reserved before serving, sub-allocated by the core's
general-purpose allocator (TLSF, stream-ordered, see
``crates/imp-mem-core/src/activations/``), reached by torch through C entry
points exported from imp-mem's own extension module
(``imp_mem_torch_malloc`` / ``imp_mem_torch_free``, loaded by
``torch.cuda.memory.CUDAPluggableAllocator``).

Two ways to route torch, both over the same tier:

* **Scopes** (:func:`use_pool`, :class:`Pool`): a ``torch.cuda.MemPool`` whose
  segments come from the tier, made active with ``torch.cuda.use_mem_pool``.
  torch's caching allocator still runs on top (its block cache lives inside
  the pool's segments), so a warm allocation costs what it always costs, and
  imp-mem sees only segment traffic. Code outside the scope uses torch's
  default allocator. The entry points cannot tell MemPools apart, so the
  first open Pool's tier is *installed* in them and a Pool over another
  tier (a second engine in the process) is a hook *region* that its
  :meth:`Pool.scope`, :meth:`Pool.graph` and :func:`graph_pool` select for
  their thread (:meth:`Pool.routed`); a segment freed anywhere goes back to
  its tier by address.
* **Process-wide** (:func:`install`): ``change_current_allocator`` makes the
  tier torch's only allocator. It must run before torch's first CUDA
  allocation; every tensor then reaches imp-mem directly (no caching layer).

Regions (:func:`region`, :func:`pause`, :func:`resume`; the trainer's side of
RL colocation, issue 24): ``with region(backend, "train", capacity=...):``
routes that code's torch allocations to a tier of its own (a growable
activation pool, one per tag, in a ``MemPool`` of its own);
``pause("train")`` gives its physical memory back, copying the live
segments to pinned host memory first when ``cpu_backup``, and
``resume("train")`` recommits it at the same addresses and copies them back,
so every tensor made inside is where and what it was. While paused, run no
torch code inside the region and touch none of its tensors.

**One call** (:func:`serve`): ``system = imp_mem.torch.serve(fingerprint=...)``
opens a VMM backend and a system for the device's free memory with a
*measured* activations tier and no KV pool, and makes the tier torch's
allocator process-wide; the caller's warm-up runs next (every torch
allocation commits the tier in chunks, addresses never move), and
``system.begin_serving()`` freezes the tier at its high-water plus the margin,
decommits the rest and remembers the figure under the fingerprint
(:mod:`imp_mem.measured`), so the next start plans the tier at that size and
does not measure::

    import imp_mem.torch
    system = imp_mem.torch.serve(fingerprint={"model": "Qwen3-0.6B", "batch": 32})
    model = build_model().cuda()          # every tensor is in the tier
    model.generate(**warmup_inputs)        # the warm-up: the tier grows
    system.begin_serving()                 # frozen; 0 allocations from here
    model.generate(**inputs)

Weights: :func:`to_arena` moves a module's parameters and buffers into T1
(tensors viewing the weights arena), and :meth:`Pool.loading` routes the
allocations of a loading scope into T1 as well (a later free of such a
segment cannot give bytes back to a bump arena: it is counted as stranded and
reported, never lost silently).

Known limits of torch's pluggable allocators (torch 2.11):

* One process-wide allocator per process, chosen before the first CUDA
  tensor; :func:`install` says so when it is too late. Scopes have no such
  limit.
* torch's process-wide pluggable path does not check a null return (it
  builds a tensor over address 0), so :func:`install` refuses a strict tier;
  inside a ``MemPool`` scope torch turns null into its ``OutOfMemoryError``
  after giving the pool's cached segments back and retrying.
* A custom ``MemPool`` has no expandable segments: torch asks for whole
  segments (2 MiB for small blocks, 20 MiB for 1-10 MiB ones, the rounded
  size above), and the tier serves each one as one block.
* A live ``MemPool`` keeps its free segments cached: ``torch.cuda.empty_cache()``
  does not release a private pool's segments. They go back to the tier (never
  to the driver: the tier's region stays reserved, as planned) when the pool
  is dropped (:meth:`Pool.close`).
* In process-wide mode torch keeps no statistics of its own
  (``torch.cuda.memory_stats`` raises or is empty); :func:`memory_stats`
  gives the tier's, under torch's key names.
* torch.compile: inductor's kernels and workspaces allocate through the
  current allocator, so they are blocks of the tier like any tensor (counted
  in its high-water and frozen with it); compile during the warm-up, before
  ``begin_serving()`` (``Served.reset_high_water()`` forgets the compiler's
  own peak). ``mode="reduce-overhead"`` (inductor's CUDA graph trees) needs
  the caching allocator's checkpoint state of its graph pool, which a
  process-wide pluggable allocator does not have (torch raises "does not yet
  support getCheckpointState"), so it runs in the scope mode: there
  :func:`graph_pool` makes the trees capture into a ``MemPool`` over the tier
  (``Served.scope()`` does it), so their memory is the tier's too.
* CUDA graphs: capture with ``torch.cuda.graph(g, pool=pool.id)`` *outside*
  ``use_mem_pool`` (torch refuses a capture inside it: "already recording to
  mempool_id"); :meth:`Pool.graph` does that.

The modules, one concept each (every public name is this package's; import
from ``imp_mem.torch``): ``_hooks`` (the allocator entry points, the
installed tier and the per-thread hook-region stack, the device helpers,
the counters), ``_pools`` (:class:`Pool`, :func:`pool`, :func:`use_pool`,
:func:`install`), ``_arena`` (:func:`to_arena`, :func:`arena_tensor`),
``_graphs`` (:func:`graph_pool`), ``_measure``
(:func:`measure_step_high_water`, :func:`measure_outside_charge`),
``_serve`` (:func:`serve`, :class:`Served`) and ``_region``
(:class:`Region`, :func:`region`, :func:`pause`, :func:`resume`).
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (every module of the package needs it)
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        "imp_mem.torch needs PyTorch: install it with `pip install imp-mem[torch]` "
        "(or `pip install torch`)"
    ) from exc

# Besides the public names, the private ones that the engine, the tests and
# the benches reach through the package (``name as name``): the same objects
# as the modules' (state shared, not copied). A stand-in for a name the
# modules read is set on the module that defines it
# (``imp_mem.torch._hooks.pluggable_allocator``, say), not here.
from imp_mem import _core as _core
from imp_mem.torch._arena import arena_tensor, to_arena
from imp_mem.torch._graphs import graph_pool
from imp_mem.torch._hooks import (
    FREE_SYMBOL,
    MALLOC_SYMBOL,
    hook_stats,
    installed,
    library_path,
    memory_stats,
    pluggable_allocator,
)
from imp_mem.torch._hooks import _device_index as _device_index
from imp_mem.torch._hooks import _hook_region as _hook_region
from imp_mem.torch._hooks import _install_hooks as _install_hooks
from imp_mem.torch._hooks import _installed as _installed
from imp_mem.torch._hooks import _made_lock as _made_lock
from imp_mem.torch._hooks import _region_stack as _region_stack
from imp_mem.torch._hooks import _release_dropped_pools as _release_dropped_pools
from imp_mem.torch._measure import measure_outside_charge, measure_step_high_water
from imp_mem.torch._pools import Pool, install, pool, use_pool
from imp_mem.torch._pools import _pools as _pools
from imp_mem.torch._region import Region, pause, region, regions, release_region, resume
from imp_mem.torch._region import _find_or_make_region as _find_or_make_region
from imp_mem.torch._region import _region_of as _region_of
from imp_mem.torch._region import _regions as _regions
from imp_mem.torch._region import _release_region as _release_region
from imp_mem.torch._serve import (
    DEFAULT_CHUNK,
    DEFAULT_MARGIN,
    DEFAULT_SCOPE_MARGIN,
    Served,
    default_margin,
    serve,
)
from imp_mem.torch._serve import _held_by_backend as _held_by_backend
from imp_mem.torch._serve import _placeholder_plan as _placeholder_plan
from imp_mem.torch._serve import _tier_bytes as _tier_bytes

__all__ = [
    "MALLOC_SYMBOL",
    "FREE_SYMBOL",
    "DEFAULT_CHUNK",
    "DEFAULT_MARGIN",
    "DEFAULT_SCOPE_MARGIN",
    "default_margin",
    "Pool",
    "Served",
    "graph_pool",
    "serve",
    "hook_stats",
    "install",
    "installed",
    "library_path",
    "measure_outside_charge",
    "measure_step_high_water",
    "memory_stats",
    "pause",
    "pluggable_allocator",
    "pool",
    "region",
    "regions",
    "release_region",
    "resume",
    "arena_tensor",
    "to_arena",
    "use_pool",
    "Region",
]
