"""imp-mem: the memory architecture of an LLM inference engine, as a library.

A Rust core owns every byte of device memory an engine uses: planned before
anything is allocated, held in lifetime tiers, and reported to the byte. This
package is its Python face.

The names below are the public API; everything else is private.
"""

from __future__ import annotations

from imp_mem._core import (
    Arena,
    Backend,
    BlockPool,
    BlockRef,
    BlockRefs,
    DeviceSpan,
    FakeBackend,
    KVCacheManager,
    Mark,
    Phase,
    PinnedBuffer,
    Region,
    Replanning,
    ScratchStack,
    StableSpan,
    TensorView,
    Tier,
    __version__,
    cuda_available,
    pinned_stats,
)
from imp_mem.errors import (
    BackendUnavailable,
    CapacityError,
    DriverError,
    ImpMemError,
    ImpMemWarning,
    InvalidArgument,
    OutOfMemory,
    PhaseViolation,
    PlanFailure,
    StaleSpan,
)

__all__ = [
    "pinned_stats",
    "Tier",
    "TensorView",
    "StableSpan",
    "ScratchStack",
    "PinnedBuffer",
    "Mark",
    "DeviceSpan",
    "BlockRefs",
    "BlockRef",
    "BlockPool",
    "Arena",
    "Backend",
    "BackendUnavailable",
    "CapacityError",
    "DriverError",
    "FakeBackend",
    "ImpMemError",
    "ImpMemWarning",
    "InvalidArgument",
    "KVCacheManager",
    "OutOfMemory",
    "Phase",
    "PhaseViolation",
    "PlanFailure",
    "Region",
    "Replanning",
    "StaleSpan",
    "__version__",
    "cuda_available",
]
