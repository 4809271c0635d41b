"""Measured tiers, remembered by fingerprint.

A *measured tier* is a tier whose size nobody can compute in advance (torch's
activations of a model the engine did not write, a CUDA graph pool, the
workspaces of ``torch.compile``): on a growable backend it reserves address
space and commits in chunks as the warm-up asks (addresses never move),
recording its high-water; ``begin_serving()`` freezes it at that high-water
plus a stated margin and decommits the rest (``ActivationPool(...,
measure_chunk=)`` and ``MemorySystem(..., activation_measure=)`` in the core;
``imp_mem.torch.serve`` and ``imp_mem.torch.region(..., measure_chunk=)`` for
torch).

The frozen figure is what the tier needs for *this* workload on *this*
software: this module remembers it in a small JSON cache keyed by a
fingerprint (the model identity and shapes the caller gives, plus the torch,
CUDA and driver versions and the GPU, as the library reserve's cache in
:mod:`imp_mem.reserve` is), so that the next start plans the tier at the
remembered size and does not measure.

The cache file is ``$IMP_MEM_CACHE_DIR/measured.json`` (else
``~/.cache/imp-mem/measured.json``): ``{"version": 1, "entries": {KEY:
{"fingerprint": ..., "tiers": {TIER: {"high_water": ..., "margin": ...,
"size": ...}}}}}``, written whole to a temporary file and renamed. A file that
cannot be read or parsed is a miss (and is replaced at the next store), never
an error: the cost of a miss is one measuring start.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from imp_mem import _jsonfile
from imp_mem.errors import InvalidArgument

__all__ = [
    "CACHE_VERSION",
    "default_cache_path",
    "environment",
    "fingerprint",
    "fingerprint_key",
    "recall",
    "remember",
]

CACHE_VERSION = 1
_FIGURES = ("high_water", "margin", "size")


def default_cache_path() -> Path:
    """``$IMP_MEM_CACHE_DIR/measured.json``, else ``~/.cache/imp-mem/measured.json``."""
    root = os.environ.get("IMP_MEM_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "imp-mem"
    return base / "measured.json"


def environment(device: int = 0, gpu_name: str | None = None) -> dict[str, Any]:
    """What a measured figure depends on besides the workload: the torch,
    CUDA and driver versions, the GPU and imp-mem's version. Reads no CUDA
    context where torch sees no GPU (the fields then say ``cpu``).
    `gpu_name` (a device backend's ``device_name``) spares asking torch,
    whose ``get_device_name`` initialises its CUDA allocator: after that,
    torch's allocator can no longer be swapped for the tier's."""
    import importlib.metadata

    env: dict[str, Any] = {}
    try:
        env["imp_mem"] = importlib.metadata.version("imp-mem")
    except importlib.metadata.PackageNotFoundError:
        env["imp_mem"] = "unknown"
    try:
        import torch
    except ImportError:
        env["torch"] = None
        return env
    env["torch"] = torch.__version__
    env["cuda"] = str(torch.version.cuda)
    if torch.cuda.is_available():
        from imp_mem import _core

        env["gpu"] = gpu_name if gpu_name is not None else torch.cuda.get_device_name(device)
        env["driver"] = _core.cuda_driver_version()
    else:
        env["gpu"] = "cpu"
        env["driver"] = None
    return env


def check_plain(value: Any, what: str) -> None:
    """Raises InvalidArgument naming ``what`` unless ``value`` is JSON-like
    data (what a fingerprint may hold)."""
    _plain(value, what)


def _plain(value: Any, what: str) -> Any:
    """``value`` as JSON data (str keys, lists for tuples), or InvalidArgument."""
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"{what}: expected JSON-like data (str, int, float, bool, None, lists and "
            f"dicts of them), got {type(value).__name__}: {exc}"
        ) from exc


def fingerprint(
    model: Any, shapes: Any = None, *, env: dict[str, Any] | None = None, device: int = 0
) -> dict[str, Any]:
    """The key of a measured figure: ``model`` (the caller's identity of the
    model: a name, a config dict, a hash of the weights' layout), ``shapes``
    (batch, sequence lengths, dtype: whatever changes the workload), and the
    software ``env`` (default: :func:`environment`)."""
    if model is None or model == "":
        raise InvalidArgument(
            "model: a fingerprint needs the model's identity (its name, or its config "
            "dict); pass model=..."
        )
    return {
        "model": _plain(model, "model"),
        "shapes": _plain(shapes, "shapes"),
        "env": _plain(environment(device) if env is None else env, "env"),
    }


def fingerprint_key(fp: dict[str, Any]) -> str:
    """The cache key of a fingerprint: SHA-256 of its canonical JSON."""
    text = json.dumps(_plain(fp, "fingerprint"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: Path) -> dict[str, Any]:
    return _checked(_jsonfile.read(path))


def _checked(data: Any) -> dict[str, Any]:
    """`data` if it is a cache of this version, else an empty one."""
    if (
        not isinstance(data, dict)
        or data.get("version") != CACHE_VERSION
        or not isinstance(data.get("entries"), dict)
    ):
        return {"version": CACHE_VERSION, "entries": {}}
    return data


def _figures(raw: Any) -> dict[str, int] | None:
    if not isinstance(raw, dict):
        return None
    out = {}
    for key in _FIGURES:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None
        out[key] = value
    return out if out["size"] > 0 else None


def recall(
    fp: dict[str, Any], tier: str = "activations", path: Path | str | None = None
) -> dict[str, int] | None:
    """The remembered figure of ``tier`` under ``fp`` (``high_water``,
    ``margin``, ``size`` in bytes), or None: nothing remembered, or an
    unreadable cache."""
    data = _read(Path(path) if path else default_cache_path())
    entry = data["entries"].get(fingerprint_key(fp))
    if not isinstance(entry, dict) or entry.get("fingerprint") != _plain(fp, "fingerprint"):
        return None
    tiers = entry.get("tiers")
    return _figures(tiers.get(tier)) if isinstance(tiers, dict) else None


def remember(
    fp: dict[str, Any],
    measured: dict[str, Any],
    tier: str = "activations",
    path: Path | str | None = None,
) -> Path:
    """Stores ``measured`` (a frozen line: ``high_water``, ``margin``,
    ``size``; a ``MemorySystem.measured()`` entry will do) for ``tier`` under
    ``fp``, replacing what was there; returns the cache file. Atomic: a
    reader sees the old file or the new one."""
    figures = _figures({k: measured.get(k) for k in _FIGURES})
    if figures is None:
        raise InvalidArgument(
            "measured: expected non-negative int high_water, margin and a positive size "
            f"(bytes), got {measured!r}"
        )
    if not isinstance(tier, str) or not tier:
        raise InvalidArgument(f"tier: expected a non-empty str, got {tier!r}")
    target = Path(path) if path else default_cache_path()
    key = fingerprint_key(fp)
    plain = _plain(fp, "fingerprint")

    def change(raw: Any) -> dict[str, Any]:
        data = _checked(raw)
        entry = data["entries"].get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("tiers"), dict):
            entry = {"fingerprint": plain, "tiers": {}}
        entry["tiers"][tier] = figures
        data["entries"][key] = entry
        return data

    # Under the file's lock: two processes remembering at once keep both.
    _jsonfile.update(target, change, prefix=".measured-")
    return target
