"""The measured charges: CUDA context cost and library reserve (seed A1.5,
A5.3, open question "LibraryReserve calibration").

The library reserve is the device memory the CUDA libraries (cuBLAS first)
claim on their first use, outside any allocator; the context cost is what a
CUDA context takes before anything is allocated. Neither can be seen by an
allocator, so both are *measured* and remembered in a small JSON cache keyed
by a fingerprint (GPU, driver, CUDA and library versions). The pure parts
(cache, key, arithmetic, the 10 % self-check) are Rust, in
``crates/imp-mem-cuda/src/reserve.rs``; this module drives the measurement.

Procedure (reproducible, one fresh child process per sample):

1. This process (its own context already open) reads device free memory,
   starts a child, and reads it again once the child has opened its context
   and allocated nothing (``torch.cuda.mem_get_info`` opens it):
   ``context_bytes`` is the difference.
2. The child fills two bf16 matrices (loading the element-wise kernels
   first), reads device used memory and torch's reserved bytes, runs the
   first matmul (cuBLAS), synchronises and reads both again:
   ``library_reserve_bytes`` = delta device used - delta reserved.
3. The median over the samples is stored under the fingerprint.

Re-measure after a driver, CUDA or torch/cuBLAS upgrade (the fingerprint
changes, so a lookup misses and :func:`load_or_measure` measures again). On
later starts, :func:`self_check` measures step 2 once more and reports a
divergence over 10 %.

Needs torch with CUDA; imported lazily so that ``import imp_mem`` never does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from imp_mem import _core, _jsonfile
from imp_mem.errors import ImpMemWarning, InvalidArgument

__all__ = [
    "default_cache_path",
    "device_used_by_all_processes",
    "fingerprint",
    "load_or_measure",
    "lookup",
    "measure",
    "self_check",
    "store",
]

_CHILD = r"""
import json, sys
import torch
n, device = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.set_device(device)
torch.cuda.mem_get_info()  # opens the primary context; allocates nothing
print("context", flush=True)
sys.stdin.readline()
a = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.empty_like(a)
a.fill_(1.0)
b.fill_(0.5)
torch.cuda.synchronize()
free0, total = torch.cuda.mem_get_info()
r0 = torch.cuda.memory_reserved()
c = a @ b
torch.cuda.synchronize()
free1, _ = torch.cuda.mem_get_info()
r1 = torch.cuda.memory_reserved()
print(json.dumps({
    "used_before_library": total - free0,
    "allocator_before_library": r0,
    "used_after_library": total - free1,
    "allocator_after_library": r1,
    "check": float(c[0, 0]),
}), flush=True)
"""


def default_cache_path() -> Path:
    """``$IMP_MEM_CACHE_DIR/reserve.json``, else ``~/.cache/imp-mem/reserve.json``."""
    root = os.environ.get("IMP_MEM_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "imp-mem"
    return base / "reserve.json"


def nvidia_smi_query(field: str, device: int = 0) -> str | None:
    """One ``nvidia-smi --query-gpu`` field of ``device`` (no header, no
    units), or None where nvidia-smi is missing or fails. It opens no CUDA
    context in this process."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={field}",
                "--format=csv,noheader,nounits",
                "-i",
                str(device),
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def device_used_by_all_processes(device: int = 0) -> int | None:
    """Bytes of ``device`` in use by every process (nvidia-smi), or None: read
    before this process opens a context, it is what the others hold."""
    text = nvidia_smi_query("memory.used", device)
    try:
        return int(float(text) * (1 << 20)) if text else None
    except ValueError:
        return None


def _driver_version() -> str:
    return nvidia_smi_query("driver_version") or f"cuda-driver-api-{_core.cuda_driver_version()}"


def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def fingerprint(device: int = 0) -> dict[str, Any]:
    """What the charges depend on, read from this machine."""
    import torch

    libraries = {"torch": torch.__version__}
    cublas = _dist_version("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12")
    if cublas:
        libraries["cublas"] = cublas
    return {
        "gpu_name": torch.cuda.get_device_name(device),
        "driver_version": _driver_version(),
        "cuda_version": str(torch.version.cuda),
        "libraries": libraries,
    }


def _sample(device: int, n: int) -> dict[str, int]:
    import torch

    torch.cuda.synchronize(device)
    free_before, _ = torch.cuda.mem_get_info(device)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(n), str(device)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        if child.stdout.readline().strip() != "context":
            raise RuntimeError("the measuring child did not open a context")
        free_after, _ = torch.cuda.mem_get_info(device)
        child.stdin.write("\n")
        child.stdin.flush()
        readings = json.loads(child.stdout.readline())
    finally:
        child.wait(timeout=120)
    if child.returncode != 0:
        raise RuntimeError(f"the measuring child failed ({child.returncode})")
    readings.pop("check", None)
    readings["free_before_context"] = free_before
    readings["free_after_context"] = free_after
    return _core.reserve_from_readings(readings)


def measure(samples: int = 5, device: int = 0, n: int = 4096) -> dict[str, int]:
    """Median ``context_bytes`` and ``library_reserve_bytes`` over fresh
    child processes. The GPU should be otherwise idle."""
    import torch

    torch.cuda.init()
    runs = [_sample(device, n) for _ in range(max(1, samples))]
    return {
        "context_bytes": int(statistics.median(r["context_bytes"] for r in runs)),
        "library_reserve_bytes": int(statistics.median(r["library_reserve_bytes"] for r in runs)),
        "samples": len(runs),
    }


def lookup(path: Path | str | None = None, fp: dict[str, Any] | None = None):
    """The remembered charges for this machine, or None."""
    path = Path(path) if path else default_cache_path()
    return _core.reserve_cache_lookup(str(path), fp or fingerprint())


def store(measured: dict[str, int], path: Path | str | None = None, fp=None) -> None:
    """Remembers ``measured`` for this machine (atomic write + rename), the
    cache read and written back under its file lock: processes storing at
    once keep each other's entries."""
    path = Path(path) if path else default_cache_path()
    fp = fp or fingerprint()
    with _jsonfile.locked(path):
        _core.reserve_cache_store(str(path), fp, measured, samples=int(measured.get("samples", 1)))


def load_or_measure(path: Path | str | None = None, samples: int = 5) -> dict[str, Any]:
    """The cached charges for this fingerprint, measuring (and storing) them
    first on a miss."""
    fp = fingerprint()
    try:
        hit = lookup(path, fp)
    except InvalidArgument as exc:
        # Unreadable or broken: measured again (and stored over it).
        warnings.warn(
            f"the library reserve's cache could not be read ({exc}); measuring it again",
            ImpMemWarning,
            stacklevel=2,
        )
        hit = None
    if hit is not None:
        return dict(hit, cached=True)
    measured = measure(samples)
    try:
        store(measured, path, fp)
    except (OSError, InvalidArgument) as exc:
        _jsonfile.warn_not_remembered("the measured library reserve", exc, "IMP_MEM_CACHE_DIR")
    return dict(measured, cached=False, key=_core.reserve_fingerprint_key(fp))


def self_check(path: Path | str | None = None, tolerance: float = 0.10) -> dict[str, Any]:
    """Measures once more and compares against the cache: ``diverged`` is True
    when either charge moved more than ``tolerance``. Measures and stores when
    nothing is cached yet."""
    fp = fingerprint()
    hit = lookup(path, fp)
    if hit is None:
        result = load_or_measure(path)
        return {"diverged": False, "message": "nothing cached yet; measured and stored", **result}
    observed = measure(1)
    report = _core.reserve_self_check(hit, observed, tolerance, fp)
    return {**report, "expected": hit, "observed": observed}
