"""What the engine's warm-up leaves on the device outside imp-mem's tiers,
measured once and planned from then on (issue 25).

The warm-up (the largest batched prefill, a prefill of the longest chunk,
the decode at every batch bucket), the CUDA-graph capture and the compiles they trigger leave two
things on the device that no tier holds: torch's caching allocator's
segments (the prefill's working set, the graphs' private pool, cuBLAS's
workspace) when torch's own allocator serves the forward pass, and the
kernel modules that CUDA loads lazily on a kernel's first launch (torch's,
cuBLAS's, Triton's). Both depend on the model's shapes, the limits, the
buckets and the software, not on the KV pool's size or the weights'
values; both are invisible to the planner until something runs.

So the engine plans them as one line, ``warmup`` (`Features.warmup_bytes`):

* the figure is remembered in a JSON cache keyed by a fingerprint of what
  decides it (`fingerprint`: the model's config, the limits, the buckets,
  the kernels and the torch / Triton / CUDA / driver versions and the GPU),
  beside the library reserve's cache (`imp_mem.reserve`);
* on a boot that finds no figure (cold), the engine measures it first, in a
  child process that boots the same engine over the checkpoint's layout
  with its weights left unread (`probe`; the bytes do not depend on their
  values), so the plan that sizes the KV pool already has the line: no
  guess, no second boot, and a cold boot's KV pool is the warm one's;
* or, with ``Engine(warmup_probe="inline")``, in the cold boot itself: the
  line planned at 0, the KV pool opened growable, the figure measured
  across this boot's warm-up, the plan made again with it and the pool
  grown to it before serving (`boot.grow_to_plan`); on the CPU the
  figure is `cpu_meter`'s (nothing outside the tiers);
* on every boot the engine measures the same quantities across its own
  warm-up (`Meter`) and charges them against the line, so the report shows
  the figure planned next to the one measured.

Measurement. ``torch`` is torch's reserved bytes after the capture (its
cache emptied of the warm-up's transients first); ``modules`` is what the
device's used memory grew by from the system's opening to the first token,
less what torch's reserved bytes (outside the activations tier, where torch
is routed into it), imp-mem's committed bytes and what the
backend's source holds past them (a VMM handle cache, chunk rounding) grew
by in the same interval, and less the library reserve (cuBLAS claims it at
the first GEMM, and the report charges it on its own line): what CUDA took
for code and library handles.

Needs torch with CUDA for the measurement; the cache and the fingerprint
are plain Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import imp_mem
from imp_mem import _jsonfile
from imp_mem._frameworks import source_held

# The cache's layout version: a change to what is measured bumps it.
VERSION = 1
# Set in the probe's child process: the engine lays the weights out in T1
# and leaves them unread, and probes nothing itself.
CHILD_ENV = "IMP_MEM_WARMUP_CHILD"
# ``IMP_MEM_WARMUP_PROBE=0`` turns the cold-boot probe off where an engine
# was not told (`Engine(warmup_probe=...)`): the warm-up is still measured
# and remembered, and planned from the next boot.
DEFAULT_ENV = "IMP_MEM_WARMUP_PROBE"


def probe_by_default() -> bool:
    return os.environ.get(DEFAULT_ENV, "1") != "0"


def cache_path() -> Path:
    """``$IMP_MEM_WARMUP_CACHE``, else ``warmup.json`` beside the library
    reserve's cache."""
    env = os.environ.get("IMP_MEM_WARMUP_CACHE")
    if env:
        return Path(env)
    from imp_mem.reserve import default_cache_path

    return default_cache_path().parent / "warmup.json"


def _software() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "imp_mem": imp_mem.__version__ if hasattr(imp_mem, "__version__") else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = list(torch.cuda.get_device_capability())
    try:
        from imp_mem.reserve import _driver_version

        out["driver"] = _driver_version()
    except Exception:  # no driver to ask: the key simply lacks it
        out["driver"] = None
    return out


def fingerprint(config: dict[str, Any], decides: dict[str, Any]) -> dict[str, Any]:
    """What decides the warm-up's bytes: the model's config (hashed), the
    engine's `decides` (limits, buckets, block size, kernels, TP degree) and
    the software (`_software`). Two boots with equal fingerprints lay out
    the same warm-up."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return {"version": VERSION, "config": digest[:32], **decides, **_software()}


def _key(fp: dict[str, Any]) -> str:
    return json.dumps(fp, sort_keys=True, default=str)


def lookup(fp: dict[str, Any], path: Path | None = None) -> dict[str, int] | None:
    """The remembered figures for `fp` (``{"torch", "modules"}`` bytes), or
    None. A missing or unreadable cache is a miss."""
    entries = _jsonfile.read(path or cache_path())
    got = entries.get(_key(fp)) if isinstance(entries, dict) else None
    if not isinstance(got, dict):
        return None
    try:
        return {"torch": int(got["torch"]), "modules": int(got["modules"])}
    except (KeyError, TypeError, ValueError):
        return None


def store(fp: dict[str, Any], measured: dict[str, int], path: Path | None = None) -> None:
    """Remembers `measured` under `fp`, under the cache's lock (two engines
    booting at once keep both figures), written to a temporary file and
    renamed over the cache (a reader sees the old or the new)."""
    figures = {"torch": int(measured["torch"]), "modules": int(measured["modules"])}

    def change(entries: Any) -> dict[str, Any]:
        entries = entries if isinstance(entries, dict) else {}
        entries[_key(fp)] = figures
        return entries

    target = path or cache_path()
    try:
        _jsonfile.update(target, change, prefix=".warmup-")
    except OSError as exc:
        _jsonfile.warn_not_remembered(
            f"the warm-up's figures (at {target})",
            exc,
            "IMP_MEM_WARMUP_CACHE (or IMP_MEM_CACHE_DIR)",
        )


def total(measured: dict[str, int] | None) -> int:
    return 0 if measured is None else int(measured["torch"]) + int(measured["modules"])


class Meter:
    """Readings across a warm-up (module doc). `start()` when the system
    has opened; `stop()` after the capture; `measured` is then
    ``{"torch", "modules"}``. `torch_outside`: torch's own allocator serves
    the forward pass (its reserved bytes are outside the tiers)."""

    def __init__(
        self,
        device: Any,
        backend: Any,
        *,
        torch_outside: bool,
        system: Any = None,
        library_reserve: int = 0,
    ) -> None:
        self.device = device
        self.backend = backend
        self.system = system
        self.torch_outside = torch_outside
        # cuBLAS claims its reserve at the warm-up's first GEMM; the report
        # charges it on its own line, so it is no kernel module.
        self.library_reserve = library_reserve
        self.measured: dict[str, int] | None = None

    def _reading(self) -> tuple[int, int, int]:
        import torch

        torch.cuda.synchronize(self.device)
        free, whole = torch.cuda.mem_get_info(self.device)
        held = int(self.backend.stats()["committed"])
        reserved = torch.cuda.memory_reserved(self.device)
        if self.system is not None:
            report = self.system.mem_report()
            # What the source holds past its ledger (a VMM backend's handle
            # cache and chunk rounding): the report charges it by name.
            held += source_held(report)
            if not self.torch_outside:
                # Routed into the activations tier, torch's segments are the
                # tier's blocks (committed at open, counted in `held`), not
                # device growth: only torch's reserve outside the tier counts.
                reserved -= sum(
                    int(t["in_use"]) for t in report.get("tiers", ()) if t["key"] == "activations"
                )
        return whole - free, reserved, held

    def start(self) -> None:
        self._before = self._reading()

    def stop(self) -> dict[str, int]:
        used0, reserved0, committed0 = self._before
        used, reserved, committed = self._reading()
        modules = (
            (used - used0)
            - (reserved - reserved0)
            - (committed - committed0)
            - self.library_reserve
        )
        self.measured = {
            "torch": reserved if self.torch_outside else 0,
            "modules": max(0, modules),
        }
        return self.measured


class FixedMeter:
    """A meter that reads no device: `stop()` returns `figure`. The CPU's
    (`cpu_meter`), and a test's stand-in."""

    def __init__(self, figure: dict[str, int]) -> None:
        self.figure = {"torch": int(figure["torch"]), "modules": int(figure["modules"])}
        self.measured: dict[str, int] | None = None

    def start(self) -> None:
        pass

    def stop(self) -> dict[str, int]:
        self.measured = dict(self.figure)
        return self.measured


def cpu_meter() -> FixedMeter:
    """The meter of an inline cold boot on the CPU (``warmup_probe="inline"``
    over a fake backend): the warm-up leaves nothing outside the tiers."""
    return FixedMeter({"torch": 0, "modules": 0})


def probe(
    model_dir: str | Path | dict[str, Any],
    engine_kw: dict[str, Any],
    *,
    timeout: float = 600,
    boot: dict[str, float] | None = None,
) -> dict:
    """Boots the engine in a child process over `model_dir`'s layout with
    its weights unread and returns what its warm-up measured
    (``{"torch", "modules"}``). `boot`, when given, is filled with the
    child's `Engine.boot_seconds` and ``"exit"``, the seconds from its boot
    to its end (the tiers given back, the interpreter's exit). Raises
    RuntimeError with the child's output when it fails."""
    t0 = time.perf_counter()
    env = dict(os.environ, **{CHILD_ENV: "1"})
    source = model_dir if isinstance(model_dir, dict) else str(model_dir)
    args = json.dumps({"model_dir": source, "engine_kw": engine_kw})
    proc = subprocess.run(
        [sys.executable, "-m", "imp_mem.engine.warmup", args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"the warm-up probe failed (exit {proc.returncode}):\n"
            + (proc.stderr or proc.stdout)[-4000:]
        )
    got = json.loads(lines[-1])
    if boot is not None:
        child = {str(k): float(v) for k, v in got.get("boot", {}).items()}
        booted = child.get("process", 0.0) + float(got.get("open_seconds", 0.0))
        boot.update(child, exit=max(0.0, time.perf_counter() - t0 - booted))
    return {"torch": int(got["torch"]), "modules": int(got["modules"])}


# ------------------------------------------------------- the engine's figure


def figure(
    engine: Any, block_size: int, library_reserve: int | None = None
) -> dict[str, int] | None:
    """The warm-up's bytes for `engine`'s plan (its ``warmup`` line):
    remembered under the engine's fingerprint, else measured by a probe
    child (cold boot), where the engine can re-run itself there (a GPU,
    torch's own allocator, TP = 1, no caller's backend or features); None
    where there is no figure to plan. The child is given the engine's
    `library_reserve`, so that its meter leaves out the same bytes as the
    engine's (the report charges them on their own line). An inline cold
    boot (``warmup_probe="inline"``) sets `engine._inline_cold` and plans
    no figure: it measures its own warm-up (`boot.grow_to_plan`)."""
    memory, args = engine.memory, engine.args
    inline = args.inline_probe
    if (not memory.on_gpu and not inline) or os.environ.get(CHILD_ENV):
        return None
    kw = args.probe_kwargs()
    decides = {
        "max_batch": engine.max_batch,
        "max_seq_len": engine.max_seq_len,
        "prefill_chunk": engine.prefill_chunk,
        "prefill_batch_tokens": engine.prefill_batch_tokens,
        "block_size": block_size,
        "buckets": kw["buckets"],
        "graphs": kw["graphs"],
        "attention_backend": kw["attention_backend"],
        "fused": engine.fused,
        "keep_logits": engine.keep_logits,
        "tp": engine.tp.tp,
        "torch_outside": memory.torch_pool is None,
    }
    if kw["attention_backend"] == "flashinfer":
        # Its kernels are its version's (modules loaded in the warm-up).
        import flashinfer

        decides["flashinfer"] = str(getattr(flashinfer, "__version__", "?"))
    engine._warmup_fp = fingerprint(engine.config_dict, decides)
    got = lookup(engine._warmup_fp)
    booted = getattr(engine, "_booted", False)
    if got is None and inline and not booted:
        if not getattr(memory.backend, "growable", False):
            raise imp_mem.InvalidArgument(
                f"warmup_probe='inline' grows the KV pool after the warm-up, and this "
                f"{memory.backend.kind} backend has no growable regions; pass a VmmBackend "
                "(or a FakeBackend), or warmup_probe=True (a probe child)"
            )
        # Planned at 0 for now (the largest KV any figure gives: the
        # pool's reservation covers the final plan's), measured in this
        # boot's warm-up and re-planned before serving.
        engine._inline_cold = True
        return None
    want = args.warmup_probe
    if want is None:
        want = (
            probe_by_default()
            and memory.torch_pool is None
            and engine.group is None
            and args.backend is None
            # A child outside a shared GPU's ledger would take memory
            # the other tenants were granted.
            and getattr(engine, "shared", None) is None
        )
    # A swap plans with the system open: a probe child could not fit beside it.
    if got is None and want and not booted:
        t0 = time.perf_counter()
        if library_reserve is not None:
            kw["library_reserve"] = library_reserve
        got = probe(args.probe_source, kw, boot=engine.probe_boot_seconds)
        if memory.torch_pool is not None:
            # A caller's own torch_pool (a callable) does not travel to
            # the child, which then ran torch on its own allocator; here
            # torch's segments are the pool's, planned on its own line:
            # only the modules are the warm-up's.
            got = {"torch": 0, "modules": got["modules"]}
        store(engine._warmup_fp, got)
        engine.boot_seconds["probe"] = time.perf_counter() - t0
    return got


def measured_charges(engine: Any) -> tuple[int, int] | None:
    """The CUDA context's cost and the library reserve as this machine
    measured them (`imp_mem.reserve`'s cache; on a miss, measured now
    where the engine probes its warm-up), so that the report attributes
    them; None to keep the plan's defaults."""
    from imp_mem import reserve

    if not engine.memory.on_gpu or os.environ.get(CHILD_ENV):
        return None
    try:
        got = reserve.lookup()
        if got is None and engine.args.warmup_probe is not False and probe_by_default():
            t0 = time.perf_counter()
            got = reserve.load_or_measure(samples=1)
            engine.boot_seconds["reserve"] = time.perf_counter() - t0
    except Exception:  # no driver to ask, a child that failed: the defaults
        return None
    if not got:
        return None
    return int(got["context_bytes"]), int(got["library_reserve_bytes"])


def engine_meter(engine: Any) -> Meter | FixedMeter | None:
    """The meter across `engine`'s warm-up, started (the system open): a
    GPU's `Meter`, an inline cold boot's `cpu_meter` on the CPU, else
    None."""
    memory = engine.memory
    meter: Meter | FixedMeter | None = None
    if engine._inline_cold and not memory.on_gpu:
        meter = cpu_meter()
    elif memory.on_gpu:
        meter = Meter(
            memory.device,
            memory.backend,
            torch_outside=memory.torch_pool is None,
            system=memory.system,
            # The plan's line, measured or its default: the bytes the
            # report charges as the library reserve.
            library_reserve=int(memory.plan.library_reserve),
        )
    if meter is not None:
        meter.start()
    return meter


def _child(args: str) -> int:
    from imp_mem.engine import Engine

    spec = json.loads(args)
    with Engine(spec["model_dir"], **spec["engine_kw"]) as engine:
        # Nothing outside the tiers where the engine is not on a GPU.
        measured = engine.warmup_measured or {"torch": 0, "modules": 0}
        boot = dict(engine.boot_seconds)
        opened = engine.open_seconds
    print(json.dumps({**measured, "boot": boot, "open_seconds": opened}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1]))
