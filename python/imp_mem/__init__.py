"""imp-mem: the memory architecture of an LLM inference engine, as a library.

A Rust core owns every byte of device memory an engine uses: planned before
anything is allocated, held in lifetime tiers, and reported to the byte. This
package is its Python face.

The names below are the public API; everything else is private.
"""

from __future__ import annotations

from imp_mem._core import (
    Backend,
    CudaBackend,
    FakeBackend,
    Features,
    Fence,
    Limits,
    MemoryPlan,
    ModelShape,
    Phase,
    PlanInput,
    Region,
    Replanning,
    VmmBackend,
    __version__,
    cuda_available,
    cuda_device_count,
    cuda_driver_version,
    cuda_mem_get_info,
    parse_size,
    plan_memory,
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
    "Backend",
    "BackendUnavailable",
    "CapacityError",
    "CudaBackend",
    "DriverError",
    "FakeBackend",
    "Fence",
    "Features",
    "ImpMemError",
    "ImpMemWarning",
    "InvalidArgument",
    "Limits",
    "MemoryPlan",
    "ModelShape",
    "OutOfMemory",
    "Phase",
    "PhaseViolation",
    "PlanFailure",
    "PlanInput",
    "Region",
    "Replanning",
    "StaleSpan",
    "VmmBackend",
    "__version__",
    "cuda_available",
    "cuda_device_count",
    "cuda_driver_version",
    "cuda_mem_get_info",
    "parse_size",
    "plan_memory",
]
