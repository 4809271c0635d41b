"""The measured charges: CUDA context cost and library reserve (seed A1.5,
A5.3, open question "LibraryReserve calibration").

The library reserve is the device memory the CUDA libraries (cuBLAS first)
claim on their first use, outside any allocator; the context cost is what a
CUDA context takes before anything is allocated. Neither can be seen by an
allocator, so both are *measured* and remembered in a small JSON cache keyed
by a fingerprint (GPU, driver, CUDA and library versions). This module
drives the measurement and remembers it, beside the other remembered
measurements (`imp_mem.measured`, `imp_mem.engine.warmup`), through the same
locked JSON file (`imp_mem._jsonfile`).

The cache file is ``$IMP_MEM_CACHE_DIR/reserve.json`` (else
``~/.cache/imp-mem/reserve.json``): ``{"format": "imp-mem-reserve-cache",
"version": 1, "entries": {KEY: {"fingerprint": ..., "measurement":
{"context_bytes": ..., "library_reserve_bytes": ...}, "measured_unix_s":
..., "samples": ...}}}``, KEY being `fingerprint_key`. A file that is not such
a cache is an `InvalidArgument` on lookup (`load_or_measure` warns and
measures again) and is replaced by the next store; a file of a newer version
is never replaced.

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
import time
import warnings
from pathlib import Path
from typing import Any

from imp_mem import _core, _jsonfile
from imp_mem._format import human_bytes
from imp_mem.errors import ImpMemWarning, InvalidArgument

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "DEFAULT_TOLERANCE",
    "charges_from",
    "compare",
    "default_cache_path",
    "device_used_by_all_processes",
    "fingerprint",
    "fingerprint_key",
    "load_or_measure",
    "lookup",
    "measure",
    "self_check",
    "store",
]

CACHE_FORMAT = "imp-mem-reserve-cache"
CACHE_VERSION = 1
# A divergence over this (10 %) is reported.
DEFAULT_TOLERANCE = 0.10
# Divergences are relative to at least this many bytes, so a charge
# remembered as 0 does not make every later reading infinitely divergent.
_DIVERGENCE_FLOOR = 1 << 20
_CHARGES = ("context_bytes", "library_reserve_bytes")
_READINGS = (
    "free_before_context",
    "free_after_context",
    "used_before_library",
    "allocator_before_library",
    "used_after_library",
    "allocator_after_library",
)

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
    return charges_from(readings)


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


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{what} must be a byte count (an int >= 0), got {value!r}")
    return value


def charges_from(readings: dict[str, int]) -> dict[str, int]:
    """The charges one measurement's readings imply (bytes): the context
    is the free memory the child's context took; the library reserve is
    the device's growth over the first matmul less the allocator's."""
    r = {}
    for key in _READINGS:
        if key not in readings:
            raise InvalidArgument(f"readings: need {key!r} (all of {', '.join(_READINGS)})")
        r[key] = _count(readings[key], f"readings[{key!r}]")
    device = max(0, r["used_after_library"] - r["used_before_library"])
    allocator = max(0, r["allocator_after_library"] - r["allocator_before_library"])
    return {
        "context_bytes": max(0, r["free_before_context"] - r["free_after_context"]),
        "library_reserve_bytes": max(0, device - allocator),
    }


def fingerprint_key(fp: dict[str, Any]) -> str:
    """The cache key of a fingerprint: every field, in a stable order
    (``gpu=..;driver=..;cuda=..`` then each library by name)."""
    fields = ("gpu_name", "driver_version", "cuda_version")
    missing = [f for f in fields if fp.get(f) is None]
    if missing:
        raise InvalidArgument(
            f"fingerprint: needs {missing[0]!r} (gpu_name, driver_version, cuda_version)"
        )
    libraries = fp.get("libraries") or {}
    if not isinstance(libraries, dict):
        raise InvalidArgument("fingerprint: 'libraries' must map names to version strings")
    key = f"gpu={fp['gpu_name']};driver={fp['driver_version']};cuda={fp['cuda_version']}"
    return key + "".join(f";{name}={libraries[name]}" for name in sorted(libraries))


def _entries(data: Any, path: Path) -> dict[str, Any]:
    """The entries of a cache file's JSON; `InvalidArgument` naming `path`
    where it is not a cache this imp-mem reads."""

    def unusable(why: str) -> InvalidArgument:
        return InvalidArgument(
            f"{path} is not a usable reserve cache ({why}); delete it to re-measure"
        )

    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise unusable("not a JSON object with 'entries'")
    if data.get("format") != CACHE_FORMAT:
        raise unusable(f"format is {data.get('format')!r}, expected {CACHE_FORMAT!r}")
    version = data.get("version")
    if not isinstance(version, int) or version > CACHE_VERSION:
        raise unusable(f"version {version!r} is newer than this imp-mem understands")
    return data["entries"]


def lookup(path: Path | str | None = None, fp: dict[str, Any] | None = None):
    """The remembered charges for this machine (``context_bytes``,
    ``library_reserve_bytes``, ``measured_unix_s``, ``samples``, ``key``),
    or None. A file that is not a reserve cache is `InvalidArgument`."""
    path = Path(path) if path else default_cache_path()
    key = fingerprint_key(fp or fingerprint())
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidArgument(f"cannot read the reserve cache {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(
            f"{path} is not a usable reserve cache ({exc}); delete it to re-measure"
        ) from exc
    entry = _entries(data, path).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        charges = {k: _count(entry["measurement"][k], k) for k in _CHARGES}
        return {
            **charges,
            "measured_unix_s": int(entry.get("measured_unix_s", 0)),
            "samples": int(entry.get("samples", 1)),
            "key": key,
        }
    except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
        raise InvalidArgument(
            f"{path} is not a usable reserve cache (entry {key!r}: {exc}); delete it to re-measure"
        ) from exc


def store(measured: dict[str, int], path: Path | str | None = None, fp=None) -> None:
    """Remembers ``measured`` for this machine (atomic write + rename), the
    cache read and written back under its file lock: processes storing at
    once keep each other's entries. A file that is not a reserve cache is
    replaced; one of a newer version is `InvalidArgument`, left as it is."""
    path = Path(path) if path else default_cache_path()
    fp = fp or fingerprint()
    key = fingerprint_key(fp)
    charges = {k: _count(measured.get(k), f"measured[{k!r}]") for k in _CHARGES}
    entry = {
        "fingerprint": {**fp, "libraries": dict(fp.get("libraries") or {})},
        "measurement": charges,
        "measured_unix_s": int(time.time()),
        "samples": max(1, int(measured.get("samples", 1))),
    }

    def change(data: Any) -> dict[str, Any]:
        try:
            entries = dict(_entries(data, path))
        except InvalidArgument:
            version = data.get("version") if isinstance(data, dict) else None
            if isinstance(version, int) and version > CACHE_VERSION:
                raise
            entries = {}
        entries[key] = entry
        return {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries}

    _jsonfile.update(path, change, prefix=".reserve-")


def compare(
    expected: dict[str, int],
    observed: dict[str, int],
    tolerance: float = DEFAULT_TOLERANCE,
    fp: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compares a fresh measurement against the remembered one: each
    charge's divergence (``|observed - expected| / max(expected, 1 MiB)``),
    ``diverged`` when either is over ``tolerance``, and a one-line
    ``message`` with both charges, remembered against measured."""
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < float("inf")):
        raise InvalidArgument(
            f"tolerance must be a non-negative fraction such as 0.1, got {tolerance!r}"
        )
    e = {k: _count(expected.get(k), f"expected[{k!r}]") for k in _CHARGES}
    o = {k: _count(observed.get(k), f"observed[{k!r}]") for k in _CHARGES}
    div = {k: abs(o[k] - e[k]) / max(e[k], _DIVERGENCE_FLOOR) for k in _CHARGES}
    diverged = any(d > tolerance for d in div.values())

    def line(what: str, k: str) -> str:
        pct = div[k] * 100 if o[k] >= e[k] else -div[k] * 100
        return (
            f"{what} measured {human_bytes(o[k])} against {human_bytes(e[k])} "
            f"remembered ({pct:+.1f} %)"
        )

    body = f"{line('context', 'context_bytes')}; {line('library reserve', 'library_reserve_bytes')}"
    key = fingerprint_key(fp) if fp else "gpu=?;driver=?;cuda=?"
    if diverged:
        message = (
            f"the measured charges diverge by more than {tolerance * 100:.0f} % on {key}: "
            f"{body}; re-measure (tools/measure_reserve.py) and store the result"
        )
    else:
        message = f"the measured charges hold on {key}: {body}"
    return {
        "context_divergence": div["context_bytes"],
        "library_divergence": div["library_reserve_bytes"],
        "tolerance": float(tolerance),
        "diverged": diverged,
        "message": message,
    }


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
    return dict(measured, cached=False, key=fingerprint_key(fp))


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
    report = compare(hit, observed, tolerance, fp)
    return {**report, "expected": hit, "observed": observed}
