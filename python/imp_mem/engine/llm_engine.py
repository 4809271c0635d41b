"""The reference engine: a model served entirely from imp-mem's memory.

Three rooms. This file is the serving loop and the engine's public face
(`Engine`: submit, step, generate, swap, report, close); the model runner
(`model_runner.ModelRunner`: T2 buffers, pinned staging, KV views,
warm-up, graphs, the prefill and decode calls) runs the model; the memory
side (`memory.EngineMemory`: plan, open, load, charges) owns every byte.
The model itself is `imp_mem.engine.model`, layers composed.

Order (seed A4.2). `Engine(model_dir)`:

1. reads ``config.json`` (`ModelConfig`; `ModelShape.from_hf_config`
   takes the real weight bytes from the safetensors beside it) and plans
   with the engine's limits (`max_batch`, `max_seq_len`);
2. opens a `MemorySystem` on the backend (`VmmBackend` on a GPU,
   `FakeBackend` otherwise): T2, T1, the KV pools, T4;
3. loads the weights into T1 (tensors viewing the arena);
4. takes the static decode buffers from T2 and types the KV pools as
   tensors (the runner);
5. warms up, captures decode in one CUDA graph per batch bucket, and
   enters SERVING (`begin_serving`) before the first request.

Serving. A `Scheduler` batches continuously over the system's
`KVCacheManager`. Each `step()` admits what fits and prefills it (from the
first uncached token, in chunks of `prefill_chunk` tokens, several
requests' chunks a forward up to `prefill_batch_tokens`; the forwards
launched back to back, their greedy tokens read in one copy), then decodes
every running sequence once: the pending tokens are appended to the
manager, the runner writes the batch's block tables into pinned staging,
copies them into T2, replays the bucket's graph and reads the greedy
tokens (argmax inside the graph) back.

Accounting. `EngineStats` counts the time of every imp-mem call a step
makes (admission, appends, frees: `Scheduler.kv_seconds`; block tables:
the runner) against the step's time, so a benchmark can report the share.

Tensor parallelism. `Engine(..., group=g)` serves one rank's shard of the
model over the ``torch.distributed`` group `g` (one process per device;
NCCL on GPUs, gloo on the CPU), every rank constructing its own engine
with the same arguments and submitting the same requests in the same
order. The plan is the planner's per-rank plan; the memory system opens
collectively; the loader reads only the rank's slice of each tensor
(`imp_mem.engine.tensor_parallel`), and after the load all ranks agree:
when one failed (planning, opening or loading), every rank closes what it
opened and raises the same `imp_mem.distributed.RankFailure`. A failure
after that (warm-up, serving) leaves the peers waiting in a collective
until the group's timeout. The model all-reduces twice a layer and
gathers the logits, so every rank samples the same greedy token and the
deterministic scheduler keeps the ranks in step. `fleet_report()` gathers
every rank's report.

Thread safety: none; one thread drives an engine.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import imp_mem
from imp_mem.engine.config import ModelConfig, read_config_json
from imp_mem.engine.memory import EngineMemory, measure_torch_high_water
from imp_mem.engine.model_runner import (
    PREFILL_BATCH_CHUNKS,
    ModelRunner,
    default_buckets,
    default_prefill_batch_tokens,
    t2_bytes,
)
from imp_mem.engine.scheduler import Request, Scheduler
from imp_mem.engine.shared import SharedGPU, Tenancy
from imp_mem.engine.tensor_parallel import TensorParallel
from imp_mem.engine.weights import check_update, copy_update
from imp_mem.errors import InvalidArgument

__all__ = ["Engine", "EngineStats", "default_buckets", "measure_torch_high_water"]


@dataclass
class EngineStats:
    """What the engine did since it started serving."""

    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    step_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    # Time inside imp-mem calls (admission, appends, frees, block tables).
    imp_mem_seconds: float = 0.0
    # The same, during the decode part of the steps only.
    decode_imp_mem_seconds: float = 0.0
    bucket_steps: dict[int, int] = field(default_factory=dict)

    @property
    def imp_mem_share(self) -> float:
        """imp-mem's share of the decode part of the steps."""
        return self.decode_imp_mem_seconds / self.decode_seconds if self.decode_seconds else 0.0


def _since_process_start() -> float:
    """Seconds since this process started (Linux's /proc; elsewhere since
    this module was imported)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


class Engine:
    """A continuous-batching greedy decoder over one model directory (HF
    ``config.json`` + safetensors), all of whose memory is imp-mem's.

    `backend`: default `VmmBackend` when CUDA is there (torch too), else a
    backed `FakeBackend` of `budget` (CPU tensors over its host memory).
    `budget`: the plan's budget (default: the backend's). `graphs`: capture
    decode in CUDA graphs (default: on a GPU). `buckets`: the batch sizes
    captured. `attention_backend`: ``"triton"`` (a GPU's default),
    ``"torch"`` (the CPU's) or ``"flashinfer"`` (Qwen3's decode on a GPU
    through FlashInfer, its buffers planned in T2: `kernels.flashinfer_decode`;
    `InvalidArgument` here when it does not import). `torch_pool`: where torch's own allocations go
    (`imp_mem.engine.memory`). `prefill_chunk`: tokens per prefill call
    (default 512; a sliding model's window). `prefill_batch_tokens`: the
    tokens of one batched prefill forward, which runs one chunk of each of
    several requests at once (`model_runner`'s module doc); default
    4 x `prefill_chunk`, 16 x on a device of 70 GiB or more
    (`default_prefill_batch_tokens`); 0 prefills one request a forward;
    otherwise at least `prefill_chunk`. `features` replaces the plan's
    `Features` (default: T2 sized to the engine's buffers, T4 at 1 MiB
    unless `torch_pool` or `scratch_bytes` is given). The plan serves
    `max_batch` sequences of `max_seq_len` plus the blocks the engine holds
    itself (the padding block; a sliding model's ring), planned as
    `Features.engine_kv_blocks`. `swap_model` serves another checkpoint in
    place (T2 and every address kept).
    `fused`: the fused decode kernels (`kernels.fused`; default: on
    a GPU). `warmup_probe`: on a cold boot (no remembered figure for this
    engine's fingerprint), measure what the warm-up leaves outside the tiers
    in a child process before planning, so the plan's ``warmup`` line and
    the KV pool are exact on the first boot (`imp_mem.engine.warmup`;
    default: on a GPU with torch's own allocator, TP = 1 and the default
    backend). ``warmup_probe="inline"`` measures it in this process
    instead, no child (issue 25): a cold boot plans the line at 0 (the
    largest KV pool any figure gives), opens the KV pool growable with the
    warm-up's blocks committed, warms up and captures under the meter,
    re-plans with the measured figure, caps the pool at the re-planned
    blocks and grows it to them before serving (the graphs stay valid: the
    pool's base never moves), and remembers the figure; a warm boot plans it
    directly. It needs a backend with growable regions (`InvalidArgument`
    otherwise), TP = 1 and no shared GPU; on the CPU the warm-up leaves
    nothing outside the tiers (`warmup.cpu_meter`). `boot_seconds` splits
    the boot: process (start to this call), probe, reserve, backend, plan,
    open, load, pin (beside the load), warm_up, capture, kv_grow (an inline
    cold boot's re-plan and growth), other (what no phase names) and, once
    served, first_step (boot to first token); `first_token_seconds` is the
    first token's time from process start.
    `load_format`: ``"safetensors"`` (default: the checkpoint in `model_dir`)
    or ``"dummy"``: random weights drawn in T1 from `seed` (scale
    `dummy_scale`, default `checkpoint.DEFAULT_SCALE`), planned from the
    config alone; `model_dir` is then a checkpoint directory, a
    ``config.json`` path or a config dict (`imp_mem.engine.dummy`).
    `group`: a ``torch.distributed`` process group to serve a tensor-parallel
    shard over (module doc); default None, TP = 1. With a group, the default
    backend is `VmmBackend` on device ``LOCAL_RANK`` (else the group rank).
    """

    def __init__(
        self,
        model_dir: str | Path | dict[str, Any],
        *,
        max_batch: int = 32,
        max_seq_len: int = 2048,
        backend: Any = None,
        budget: int | str | None = None,
        block_size: int | None = None,
        prefill_chunk: int | None = None,
        prefill_batch_tokens: int | None = None,
        buckets: Sequence[int] | None = None,
        graphs: bool | None = None,
        attention_backend: str | None = None,
        torch_pool: Any = None,
        enable_prefix_caching: bool = True,
        kv_growable: bool = False,
        context: int | None = None,
        library_reserve: int | None = None,
        keep_logits: bool = True,
        progress: bool | None = None,
        features: Any = None,
        scratch_bytes: int | None = None,
        activation_bytes: int | None = None,
        group: Any = None,
        pin_sleep_host: bool | None = None,
        fused: bool | None = None,
        warmup_probe: bool | None = None,
        load_format: str = "safetensors",
        seed: int = 0,
        dummy_scale: float | None = None,
        shared: Any = None,
    ) -> None:
        t_open = time.perf_counter()
        before = _since_process_start()
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be True, False or None, got {fused!r}")
        if warmup_probe is not None and not isinstance(warmup_probe, bool):
            if not isinstance(warmup_probe, str):
                raise TypeError(
                    f"warmup_probe must be True, False, None or 'inline', got {warmup_probe!r}"
                )
            if warmup_probe != "inline":
                raise InvalidArgument(
                    f"warmup_probe={warmup_probe!r}: pass True (a cold boot measures the "
                    "warm-up in a probe child), False (no probe), None (the default) or "
                    "'inline' (a cold boot measures it in its own warm-up and grows the KV pool "
                    "to the re-planned size)"
                )
            if group is not None or shared not in (None, False):
                raise InvalidArgument(
                    "warmup_probe='inline' serves tp=1 outside a shared GPU (a shared engine "
                    "settles its warm-up with the ledger); pass group=None and shared=None, or "
                    "warmup_probe=True"
                )
        # "process": from process start to this call (the interpreter, the
        # imports and the caller's own code before the engine).
        self.boot_seconds: dict[str, float] = {"process": before}
        # A cold boot's probe child, split the same way (plus "exit").
        self.probe_boot_seconds: dict[str, float] = {}
        self.first_token_seconds: float | None = None
        self.fused = fused
        if load_format not in ("safetensors", "dummy"):
            raise InvalidArgument(
                f"load_format={load_format!r}: pass 'safetensors' (the checkpoint in model_dir) "
                "or 'dummy' (random weights from `seed`, planned from the config alone)"
            )
        self.load_format = load_format
        if isinstance(model_dir, dict):
            if load_format != "dummy":
                raise InvalidArgument(
                    "model_dir: a config dict has no weights; pass load_format='dummy' or a "
                    "checkpoint directory"
                )
            self.config_dict = dict(model_dir)
            self.config = ModelConfig.from_hf_config(self.config_dict)
            self.model_dir = Path(f"dummy-{self.config.model_type}")
        else:
            self.model_dir = Path(model_dir)
            self.config_dict = read_config_json(self.model_dir, "model_dir")
            self.config = ModelConfig.from_hf_config(self.config_dict)
        if load_format == "dummy" and group is not None:
            raise InvalidArgument(
                "load_format='dummy' serves tp=1; open a tensor-parallel engine on a checkpoint"
            )
        c = self.config
        if attention_backend == "flashinfer" and c.model_type != "qwen3":
            raise InvalidArgument(
                f"attention_backend='flashinfer' serves the qwen3 family; {c.model_type!r} "
                "runs attention_backend='triton'"
            )
        if attention_backend == "flashinfer":
            from imp_mem.engine.kernels import flashinfer_decode as _flashinfer

            _flashinfer.require()  # before any planning: says how to install it
        self.group = group
        self.tp = TensorParallel(c, group) if group is not None else TensorParallel(c, tp=1)
        if max_seq_len > c.max_position_embeddings:
            raise InvalidArgument(
                f"max_seq_len={max_seq_len} is above the model's max_position_embeddings "
                f"({c.max_position_embeddings})"
            )
        if prefill_chunk is None:
            # A sliding model's ring grows with the chunk: keep it a window.
            prefill_chunk = c.sliding_window if c.sliding_layers else 512
        if prefill_chunk < 1:
            raise InvalidArgument(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        if c.vision is not None and prefill_chunk < c.vision["mm_tokens_per_image"]:
            # An image's tokens are prefilled in one call (they attend both ways).
            raise InvalidArgument(
                f"prefill_chunk={prefill_chunk} is below the model's mm_tokens_per_image "
                f"({c.vision['mm_tokens_per_image']}); an image is prefilled in one chunk"
            )
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = min(prefill_chunk, max_seq_len)
        if prefill_batch_tokens is not None and (
            isinstance(prefill_batch_tokens, bool)
            or not isinstance(prefill_batch_tokens, int)
            or (prefill_batch_tokens != 0 and prefill_batch_tokens < self.prefill_chunk)
        ):
            raise InvalidArgument(
                f"prefill_batch_tokens={prefill_batch_tokens!r}: pass 0 (one request a prefill "
                f"forward) or an int of at least prefill_chunk={self.prefill_chunk} (the tokens "
                "one batched prefill forward holds)"
            )
        self.prefill_batch_tokens = prefill_batch_tokens
        self.keep_logits = keep_logits
        self.shared = SharedGPU.of(shared)
        self.tenancy: Tenancy | None = None
        if self.shared is not None:
            if group is not None:
                raise InvalidArgument(
                    "shared: a tensor-parallel engine cannot share its GPUs yet; pass group=None"
                )
            # Elastic KV: the pool grows as the ledger grants.
            kv_growable = True
            if self.shared.cap is not None:
                budget = self.shared.cap
        self.kv_growable = kv_growable
        self.activation_bytes = activation_bytes
        self.memory = EngineMemory(
            group=group,
            torch_pool=torch_pool,
            activation_bytes=activation_bytes,
            scratch_bytes=scratch_bytes,
            kv_growable=kv_growable,
        )
        if load_format == "dummy":
            from imp_mem.engine.checkpoint import DEFAULT_SCALE

            scale = DEFAULT_SCALE if dummy_scale is None else float(dummy_scale)
            self.memory.dummy = (self.config_dict, int(seed), scale)
        self.stats = EngineStats()
        self._pin_sleep_host = pin_sleep_host
        # The lifecycle: tag -> the level it sleeps at; whether a level-2
        # sleep dropped the weights (they must be updated or reloaded).
        self._asleep: dict[str, int] = {}
        self._weights_dropped = False
        self.weights_version = 0

        # -- 1. the plan -------------------------------------------------------
        self._open_args = (enable_prefix_caching, buckets, graphs, attention_backend, progress)
        memory = self.memory
        # What the warm-up leaves outside the tiers, planned (`warmup`): the
        # engine arguments a probe child re-runs, and what decides the bytes.
        self._warmup_kw = dict(
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            budget=budget if isinstance(budget, (int, str)) else None,
            block_size=block_size,
            prefill_chunk=self.prefill_chunk,
            prefill_batch_tokens=self.prefill_batch_tokens,
            buckets=list(buckets) if buckets is not None else None,
            graphs=graphs,
            attention_backend=attention_backend,
            enable_prefix_caching=enable_prefix_caching,
            context=context,
            library_reserve=library_reserve,
            keep_logits=keep_logits,
            fused=fused,
            progress=False,
            load_format=load_format,
            seed=seed,
            dummy_scale=dummy_scale,
            # torch routed into the activations tier: the child routes it
            # too, so it measures only what stays outside (the modules).
            torch_pool="imp_mem" if torch_pool == "imp_mem" else None,
            activation_bytes=activation_bytes if torch_pool == "imp_mem" else None,
        )
        # What the probe child boots: the caller's model_dir (a dummy
        # engine's may be a config dict).
        self._probe_source = model_dir if isinstance(model_dir, dict) else str(model_dir)
        self._warmup_probe = warmup_probe
        # warmup_probe="inline" on a cold boot: measured in this boot's own
        # warm-up, the KV pool grown to the re-planned size (`_grow_to_plan`).
        self._inline_cold = False
        self.warmup_planned: dict[str, int] | None = None
        self.warmup_measured: dict[str, int] | None = None
        error = None
        try:
            self._own_backend = backend is None
            t0 = time.perf_counter()
            memory.resolve_backend(backend, budget, self.tp)
            self.boot_seconds["backend"] = time.perf_counter() - t0
            if self.prefill_batch_tokens is None:
                # The default follows the device's size (its backend's capacity).
                self.prefill_batch_tokens = default_prefill_batch_tokens(
                    self.prefill_chunk, memory.backend.capacity
                )
                self._warmup_kw["prefill_batch_tokens"] = self.prefill_batch_tokens
            self.runner = ModelRunner(
                memory,
                max_batch=max_batch,
                max_seq_len=max_seq_len,
                prefill_chunk=self.prefill_chunk,
                keep_logits=keep_logits,
                attention_backend=attention_backend,
                prefill_batch_tokens=self.prefill_batch_tokens,
            )
            t0 = time.perf_counter()
            self._plan(budget, block_size, context, library_reserve, features)
            self.boot_seconds["plan"] = (
                time.perf_counter()
                - t0
                - self.boot_seconds.get("probe", 0.0)
                - self.boot_seconds.get("reserve", 0.0)
            )
            if memory.on_gpu:
                # Before the first collective: NCCL binds its communicator
                # to the current device.
                torch.cuda.set_device(memory.device)
        except Exception as e:  # every rank must reach the agreement below
            error = e
        before = memory.nccl_reading()
        memory.agree("planning", error)
        memory.nccl_bytes = memory.nccl_lost(before)
        # A swap plans with the same arguments, against the same budget (the
        # backend's shrinks once the system holds its context and reserve).
        self._plan_args = (
            self.plan.budget,
            block_size,
            memory.context,
            memory.library_reserve,
            features,
        )

        # -- 2. the memory system ---------------------------------------------
        if self.shared is not None:
            self.tenancy = Tenancy(
                self.shared,
                memory,
                self.plan,
                self.model_dir.name,
                self.runner.engine_blocks[0],
            )
            memory.kv_initial_blocks = self.tenancy.initial
            # The pool grows by a chunk, or by a whole sequence where that is more.
            memory.kv_grow_blocks = max(
                self.tenancy.chunk, int(self.plan.kv["blocks_per_sequence"])
            )
        elif self._inline_cold:
            # Address space for the provisional plan's KV; committed, the
            # blocks the warm-up admits (one sequence and the runner's own).
            memory.kv_growable = True
            memory.kv_initial_blocks = Tenancy.initial_blocks(
                self.plan, self.runner.engine_blocks[0]
            )
        t0 = time.perf_counter()
        memory.open()
        self.boot_seconds["open"] = time.perf_counter() - t0
        if self.tenancy is not None:
            self.tenancy.fit_floor()
        self._meter = None
        if self._inline_cold and not memory.on_gpu:
            from imp_mem.engine import warmup

            self._meter = warmup.cpu_meter()
            self._meter.start()
        elif memory.on_gpu:
            from imp_mem.engine.warmup import Meter

            self._meter = Meter(
                memory.device,
                memory.backend,
                torch_outside=memory.torch_pool is None,
                system=memory.system,
                # The plan's line, measured or its default: the bytes the
                # report charges as the library reserve.
                library_reserve=int(memory.plan.library_reserve),
            )
            self._meter.start()
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        self._t_booted = time.perf_counter()
        self.open_seconds = self._t_booted - t_open
        # The pinning runs beside the copies: its seconds overlap the load's.
        self.boot_seconds["load"] = memory.load_seconds
        self.boot_seconds["pin"] = memory.pin_seconds
        # What no phase above names (the pinning overlaps the load).
        timed = sum(v for k, v in self.boot_seconds.items() if k not in ("process", "pin"))
        self.boot_seconds["other"] = max(0.0, self.open_seconds - timed)
        self._booted = True

    # ------------------------------------------------- what the rooms hold

    @property
    def backend(self) -> Any:
        return self.memory.backend

    @property
    def system(self) -> Any:
        return self.memory.system

    @property
    def plan(self) -> Any:
        return self.memory.plan

    @property
    def plan_input(self) -> Any:
        return self.memory.plan_input

    @property
    def on_gpu(self) -> bool:
        return self.memory.on_gpu

    @property
    def device(self) -> torch.device:
        return self.memory.device

    @property
    def load_seconds(self) -> float:
        return self.memory.load_seconds

    @property
    def weights_over_share(self) -> int:
        return self.memory.weights_over_share

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def sliding(self) -> bool:
        return bool(self.config.sliding_layers)

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights by name (views of T1). Refused while the
        weights sleep: their device memory is given back then, and a read
        would fault (on the GPU a CUDA "invalid argument"); a trainer keeps
        its own copy of the policy and sends it with `update_weights`."""
        if "weights" in self._asleep:
            raise InvalidArgument(
                "engine.weights: the weights sleep (their device memory is given back); call "
                "engine.wake('weights') before reading them"
            )
        return self.runner.weights

    @property
    def kv_views(self) -> Any:
        return self.runner.kv_views

    @property
    def graphs(self) -> dict[int, Any]:
        return self.runner.graphs

    @property
    def buckets(self) -> list[int]:
        return self.runner.buckets

    @property
    def use_graphs(self) -> bool:
        return self.runner.use_graphs

    @property
    def engine_seqs(self) -> list[int]:
        """The sequence ids the engine holds blocks through (padding, ring)."""
        return self.runner.engine_seqs

    # --------------------------------------------------------------- setup

    def _warmup_figure(
        self, block_size: int, library_reserve: int | None = None
    ) -> dict[str, int] | None:
        """The warm-up's bytes for the plan's `warmup` line (`warmup`
        module): remembered under this engine's fingerprint, else measured
        by a probe child (cold boot), where the engine can re-run itself
        there (a GPU, torch's own allocator, TP = 1, no caller's backend or
        features); None where there is no figure to plan. The child is given
        this engine's `library_reserve`, so that its meter leaves out the
        same bytes as this one's (the report charges them on their own
        line)."""
        from imp_mem.engine import warmup

        memory = self.memory
        inline = self._warmup_probe == "inline"
        if (not memory.on_gpu and not inline) or os.environ.get(warmup.CHILD_ENV):
            return None
        decides = {
            "max_batch": self.max_batch,
            "max_seq_len": self.max_seq_len,
            "prefill_chunk": self.prefill_chunk,
            "prefill_batch_tokens": self.prefill_batch_tokens,
            "block_size": block_size,
            "buckets": self._warmup_kw["buckets"],
            "graphs": self._warmup_kw["graphs"],
            "attention_backend": self._warmup_kw["attention_backend"],
            "fused": self.fused,
            "keep_logits": self.keep_logits,
            "tp": self.tp.tp,
            "torch_outside": memory.torch_pool is None,
        }
        if self._warmup_kw["attention_backend"] == "flashinfer":
            # Its kernels are its version's (modules loaded in the warm-up).
            import flashinfer

            decides["flashinfer"] = str(getattr(flashinfer, "__version__", "?"))
        self._warmup_fp = warmup.fingerprint(self.config_dict, decides)
        got = warmup.lookup(self._warmup_fp)
        if got is None and inline and not getattr(self, "_booted", False):
            if not getattr(memory.backend, "growable", False):
                raise InvalidArgument(
                    f"warmup_probe='inline' grows the KV pool after the warm-up, and this "
                    f"{memory.backend.kind} backend has no growable regions; pass a VmmBackend "
                    "(or a FakeBackend), or warmup_probe=True (a probe child)"
                )
            # Planned at 0 for now (the largest KV any figure gives: the
            # pool's reservation covers the final plan's), measured in this
            # boot's warm-up and re-planned before serving.
            self._inline_cold = True
            return None
        probe = self._warmup_probe
        if probe is None:
            probe = (
                warmup.probe_by_default()
                and memory.torch_pool is None
                and self.group is None
                and self._own_backend
                # A child outside a shared GPU's ledger would take memory
                # the other tenants were granted.
                and getattr(self, "shared", None) is None
            )
        # A swap plans with the system open: a probe child could not fit beside it.
        if got is None and probe and not getattr(self, "_booted", False):
            t0 = time.perf_counter()
            kw = dict(self._warmup_kw)
            if library_reserve is not None:
                kw["library_reserve"] = library_reserve
            got = warmup.probe(self._probe_source, kw, boot=self.probe_boot_seconds)
            if memory.torch_pool is not None:
                # A caller's own torch_pool (a callable) does not travel to
                # the child, which then ran torch on its own allocator; here
                # torch's segments are the pool's, planned on its own line:
                # only the modules are the warm-up's.
                got = {"torch": 0, "modules": got["modules"]}
            warmup.store(self._warmup_fp, got)
            self.boot_seconds["probe"] = time.perf_counter() - t0
        return got

    def _measured_charges(self) -> tuple[int, int] | None:
        """The CUDA context's cost and the library reserve as this machine
        measured them (`imp_mem.reserve`'s cache; on a miss, measured now
        where the engine probes its warm-up), so that the report attributes
        them; None to keep the plan's defaults."""
        from imp_mem import reserve
        from imp_mem.engine import warmup

        if not self.memory.on_gpu or os.environ.get(warmup.CHILD_ENV):
            return None
        try:
            got = reserve.lookup()
            if got is None and self._warmup_probe is not False and warmup.probe_by_default():
                t0 = time.perf_counter()
                got = reserve.load_or_measure(samples=1)
                self.boot_seconds["reserve"] = time.perf_counter() - t0
        except Exception:  # no driver to ask, a child that failed: the defaults
            return None
        if not got:
            return None
        return int(got["context_bytes"]), int(got["library_reserve_bytes"])

    def _plan(self, budget, block_size, context, library_reserve, features) -> None:
        c, memory, runner = self.config, self.memory, self.runner
        if context is None and library_reserve is None and self._own_backend:
            measured = self._measured_charges()
            if measured is not None:
                context, library_reserve = measured
        probe_bs = block_size or imp_mem.Limits(1, 16).block_size
        runner.set_model(c, probe_bs)
        limits = imp_mem.Limits(self.max_batch, self.max_seq_len, block_size=block_size)
        default = None
        engine_blocks = runner.engine_blocks
        if features is None:
            self.warmup_planned = self._warmup_figure(probe_bs, library_reserve)
            from imp_mem.engine.warmup import total

            t2 = t2_bytes(runner.groups(probe_bs))
            default = memory.features(t2, engine_blocks, warmup_bytes=total(self.warmup_planned))
        try:
            memory.make_plan(
                self.model_dir,
                c,
                self.tp,
                limits=limits,
                budget=budget,
                context=context,
                library_reserve=library_reserve,
                features=features,
                default_features=default,
                engine_blocks=engine_blocks,
            )
        except imp_mem.PlanFailure as e:
            self._note_prefill_lever(e)
            raise
        runner.set_model(c, int(self.plan.kv["block_size"]))
        if features is not None:
            return
        # An inline cold boot plans again with the measured figure, the
        # same inputs against the same budget (`_grow_to_plan`).
        self._replan = lambda warmup_bytes: memory.make_plan(
            self.model_dir,
            c,
            self.tp,
            limits=limits,
            budget=self.plan.budget,
            context=memory.context,
            library_reserve=memory.library_reserve,
            features=None,
            default_features=memory.features(t2, engine_blocks, warmup_bytes=warmup_bytes),
            engine_blocks=engine_blocks,
        )

    def _note_prefill_lever(self, failure: BaseException) -> None:
        """Names `prefill_batch_tokens` on a plan that did not fit, where
        the warm-up line it sizes (one prefill forward's activations, which
        the planner's own levers do not reach) holds more than the small
        default would: the large default on a 70 GiB device can tip a
        tight budget over."""
        from imp_mem.engine.warmup import total

        small = PREFILL_BATCH_CHUNKS * self.prefill_chunk
        warm = total(self.warmup_planned) if self.warmup_planned else 0
        if warm and self.prefill_batch_tokens > small:
            failure.add_note(
                f"the plan's warm-up line holds {warm / (1 << 20):.0f} MiB outside the tiers "
                f"(graph pools and one prefill forward of prefill_batch_tokens="
                f"{self.prefill_batch_tokens}); prefill_batch_tokens={small} shrinks it"
            )

    def _open(self) -> None:
        prefix_caching, buckets, graphs, attention_backend, progress = self._open_args
        error = None
        try:
            self._load(prefix_caching, attention_backend, progress)
        except Exception as e:  # every rank must reach the agreement below
            error = e
        # Past here the ranks run collectives: none may be missing.
        self.memory.agree("loading the weights", error)
        self._serve(buckets, graphs)

    def _load(self, prefix_caching, attention_backend, progress) -> None:
        memory, c = self.memory, self.config
        memory.make_torch_pool()
        pin = self._pin_sleep_host
        if pin is None:  # on a backend whose T1 can sleep, for its first load
            pin = bool(getattr(self.backend, "growable", False)) and not hasattr(self, "kv")
        weights = memory.load_weights(self.model_dir, self.tp, progress, pin=pin)
        self.kv = memory.kv_manager(
            prefix_caching=prefix_caching and not self.sliding,
            swa_window=c.sliding_window if self.sliding else None,
            fingerprint=str(self.model_dir.name),
        )
        self.runner.load(
            weights, self.kv, attention_backend=attention_backend, tp=self.tp, fused=self.fused
        )
        self.scheduler = Scheduler(self.kv, max_batch=self.max_batch, max_seq_len=self.max_seq_len)
        tenancy = self.tenancy
        if tenancy is not None:
            sched, kv = self.scheduler, self.kv
            sched.gate = lambda req: tenancy.gate(sched, kv, req)

    def _serve(self, buckets, graphs, *, begin: bool = True) -> None:
        self.runner.serve(buckets, graphs)
        self.boot_seconds["warm_up"] = self.runner.warm_up_seconds
        self.boot_seconds["capture"] = self.runner.capture_seconds
        meter = getattr(self, "_meter", None)
        if meter is not None and meter.measured is None:
            from imp_mem.engine import warmup

            self.warmup_measured = meter.stop()
            self.memory.warmup_modules = self.warmup_measured["modules"]
            self.memory.charge_torch()
            if self.tenancy is not None:
                self.tenancy.settle_warmup(warmup.total(self.warmup_measured))
            fp = getattr(self, "_warmup_fp", None)
            if fp is not None and self.warmup_planned is None:
                warmup.store(fp, self.warmup_measured)  # planned from the next boot
            if self._inline_cold:
                self._grow_to_plan()
        elif self.memory.kv_growable and not self.kv_growable and self.tenancy is None:
            # An inline-booted engine after a model swap, whose KV pool the
            # system re-laid growable: whole before serving, as at the boot.
            pool = self.system.kv_pool.stats()
            self.kv.reserve_free(int(self.plan.kv["blocks"]) - int(pool["live"]))
        if begin:
            self.system.begin_serving()
        self.stats = EngineStats()  # serving starts here

    def _grow_to_plan(self) -> None:
        """An inline cold boot's last step before serving
        (``warmup_probe="inline"``): the plan again with the figure this
        boot's warm-up measured, the KV pool capped at the re-planned blocks
        and grown to them (the block manager's capacity with it; the
        address space and every captured address stay), and the backend's
        budget lowered by the new line, as opening on that plan would have
        set it. The pool then holds a warm boot's blocks."""
        from imp_mem.engine import warmup

        t0 = time.perf_counter()
        self._inline_cold = False
        memory, measured = self.memory, self.warmup_measured or {"torch": 0, "modules": 0}
        provisional = memory.plan
        final = self._replan(warmup.total(measured))
        kv0, kv1 = provisional.kv, final.kv
        if kv1["block_bytes"] != kv0["block_bytes"] or kv1["blocks"] > kv0["blocks"]:
            raise imp_mem.ImpMemError(
                f"the re-planned KV pool ({kv1['blocks']} blocks of {kv1['block_bytes']} B) does "
                f"not fit the provisional one ({kv0['blocks']} of {kv0['block_bytes']} B)"
            )
        blocks = int(kv1["blocks"])
        pool = self.system.kv_pool
        if blocks < int(kv0["blocks"]):
            # The reservation stays; the pool grows no further than the plan.
            pool.limit_blocks(blocks)
        if not self.kv_growable:
            # Committed whole before serving: nothing is acquired while serving.
            if not self.kv.reserve_free(blocks - int(pool.stats()["live"])):
                raise imp_mem.OutOfMemory(
                    f"growing the KV pool to the re-planned {blocks} blocks was refused"
                )
        backend = memory.backend
        for_tiers = final.budget - final.context - final.library_reserve - final.warmup
        if for_tiers < backend.budget:
            backend.set_budget(for_tiers)
        # The scheduler refuses a request by the pool's maximum: now the plan's.
        self.scheduler = Scheduler(self.kv, max_batch=self.max_batch, max_seq_len=self.max_seq_len)
        self.warmup_planned = dict(measured)
        self.boot_seconds["kv_grow"] = time.perf_counter() - t0

    # ------------------------------------------------------------ the loop

    def step(self) -> list[tuple[int, int]]:
        """One engine step: admissions and their prefills, then one decode
        of every running sequence. Returns the `(seq_id, token)` pairs
        produced, in order."""
        self._check_awake("step")
        sched, stats, runner = self.scheduler, self.stats, self.runner
        t_step = time.perf_counter()
        kv0 = sched.kv_seconds
        imp0 = runner.imp_mem_seconds
        out: list[tuple[int, int]] = []
        with torch.inference_mode(), runner.on_stream(), self.memory.torch_ctx():
            prefills = sched.admit_waiting()
            t0 = time.perf_counter()
            # Launched back to back (the host launches one while the device
            # runs the one before), batched where the model can, their
            # tokens read in one copy after them.
            if prefills:
                stats.prefill_tokens += runner.prefill_step(prefills)
                for p, tok in zip(prefills, runner.prefill_tokens(len(prefills)), strict=True):
                    sched.prefilled(p, tok)
                    out.append((p.request.seq_id, tok))
                stats.prefill_seconds += time.perf_counter() - t0
            t_dec = time.perf_counter()
            kv_dec = sched.kv_seconds
            imp_dec = runner.imp_mem_seconds
            batch = sched.prepare_decode()
            if out and self.first_token_seconds is None:
                # From the engine's boot to its first token: the caller's
                # code between, and the first prefills (their kernels'
                # first launches included). Timed here, not read from
                # /proc, whose clock counts in 10 ms ticks.
                first = time.perf_counter() - self._t_booted
                self.boot_seconds["first_step"] = first
                self.first_token_seconds = self.boot_seconds["process"] + self.open_seconds + first
            if batch:
                tokens, b = runner.decode(batch)
                stats.bucket_steps[b] = stats.bucket_steps.get(b, 0) + 1
                sched.decoded(batch, tokens)
                out.extend((r.seq_id, t) for r, t in zip(batch, tokens, strict=True))
                stats.decode_seconds += time.perf_counter() - t_dec
                stats.decode_steps += 1
                stats.decode_tokens += len(batch)
                stats.decode_imp_mem_seconds += (
                    sched.kv_seconds - kv_dec + runner.imp_mem_seconds - imp_dec
                )
        if self.tenancy is not None:
            # On a shared GPU: the ledger's pressure answered (the pool's
            # hysteretic shrink would take room promised to running requests).
            t0 = time.perf_counter()
            self.tenancy.tick(sched, self.kv, self.on_gpu, self.device)
            runner.imp_mem_seconds += time.perf_counter() - t0
        elif self.kv_growable:
            # The growable pool's hysteretic shrink, fenced after this step.
            fence = None
            if self.on_gpu:
                fence = torch.cuda.Event()
                fence.record(runner.stream)
            t0 = time.perf_counter()
            self.system.step(fence)
            runner.imp_mem_seconds += time.perf_counter() - t0
        stats.imp_mem_seconds += sched.kv_seconds - kv0 + runner.imp_mem_seconds - imp0
        stats.steps += 1
        stats.step_seconds += time.perf_counter() - t_step
        return out

    # -------------------------------------------------------------- requests

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        image: Any = None,
    ) -> Request:
        """Queues a request (served by the next `step()` calls). On a shared
        GPU an engine the idle clock put to sleep wakes first, and a request
        no share of the device could hold raises `CapacityError`.
        `image`: pixel values ``[channels, size, size]`` (or with a leading
        1) for a model with a vision tower, whose image tokens the prompt
        holds (`imp_mem.engine.images`); a bad one is `InvalidArgument`."""
        from imp_mem.engine.images import check_image

        prompt = list(prompt)
        pixels, mm = check_image(self.config, prompt, image)
        if self.tenancy is not None:
            self.tenancy.wake_for_work(self)
            if len(prompt) + max_new_tokens <= self.max_seq_len:
                self.tenancy.check_submit(len(prompt) + max_new_tokens, self.kv)
        return self.scheduler.submit(
            prompt, max_new_tokens, eos_token_id=eos_token_id, image=pixels, mm=mm
        )

    def idle(self) -> int:
        """What a serving loop calls when there is no work: on a shared GPU,
        answers the ledger's pressure, shrinks the KV pool to its live
        blocks plus one chunk once idle for `SharedGPU.idle_trim_s`, and
        sleeps (level 1) once idle for `idle_sleep_s`. Returns the bytes
        given back (0 off a shared GPU)."""
        if self.tenancy is None or self.scheduler.has_work:
            return 0
        return self.tenancy.idle(self)

    def cancel(self, seq_id: int) -> bool:
        """Cancels a request at any point; False if it already ended."""
        return self.scheduler.cancel(seq_id)

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Serves `prompts` to the end, yielding `(prompt index, token)` as
        the tokens are produced. `images`: one image or None per prompt
        (`submit`'s `image`)."""
        if images is not None and len(images) != len(prompts):
            raise InvalidArgument(
                f"images: {len(images)} given for {len(prompts)} prompts; pass one image (or "
                "None) per prompt"
            )
        if self.tenancy is not None:
            self.tenancy.wake_for_work(self)
        self._check_awake("generate")
        from imp_mem.engine.images import check_image

        # Every request is checked before any is queued.
        each = list(images) if images is not None else [None] * len(prompts)
        for p, image in zip(prompts, each, strict=True):
            check_image(self.config, list(p), image)
        index = {}
        for i, p in enumerate(prompts):
            req = self.submit(p, max_new_tokens, eos_token_id=eos_token_id, image=each[i])
            index[req.seq_id] = i
        live = set(index)
        while live:
            for sid, tok in self.step():
                if sid in index:
                    yield index[sid], tok
            for sid in [s for s in live if self.scheduler.requests[s].done]:
                live.discard(sid)
                self.scheduler.reap(sid)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> list[list[int]]:
        """Greedy continuations of `prompts` (token ids), continuously
        batched; `images`: one image or None per prompt (`submit`)."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, tok in self.stream(
            prompts, max_new_tokens, eos_token_id=eos_token_id, images=images
        ):
            out[i].append(tok)
        return out

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Steps until nothing is waiting or running (or `until()` says stop)."""
        while self.scheduler.has_work and not (until and until()):
            self.step()

    # ------------------------------------------------------------- lifecycle

    @property
    def asleep(self) -> dict[str, int]:
        """The engine's tags asleep now, ``{tag: level}``."""
        return dict(self._asleep)

    @property
    def sleep_tags(self) -> tuple[str, ...]:
        """The tags this engine can sleep: ``weights`` (T1), ``kv_cache``
        (the KV pools) and, when torch's allocations are routed into the
        activations tier, ``activations`` (its graph pools)."""
        return self.memory.sleep_tags()

    def sleep(
        self, level: int = 1, tags: str | Sequence[str] | None = None, *, drain: str = "refuse"
    ) -> dict[str, Any]:
        """Gives the device memory of `tags` back (default: every tag of
        `sleep_tags`), keeping every address: captured graphs replay after
        `wake` without re-capture.

        `level` 1 keeps the weights in pinned host memory (pinned at load,
        `pin_sleep_host`); 2 drops them (`update_weights` or
        `reload_weights` after the wake). The KV cache is dropped at either
        level; its prefix cache goes to the KV host tier when there is one,
        else it is emptied. `drain`: what to do with requests waiting or
        running — ``"refuse"`` (InvalidArgument naming them; nothing
        changes), ``"abort"`` (cancel them) or ``"wait"`` (serve them to the
        end first). Returns the memory system's sleep report. A refusal of
        the memory system (a backend without growable regions) changes
        nothing; the engine serves on."""
        tags = self._tags(tags, "sleep")
        if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
            raise InvalidArgument(
                f"level={level!r}: a sleep level is 1 (weights kept in pinned host memory) or 2 "
                "(weights dropped)"
            )
        if drain not in ("refuse", "abort", "wait"):
            raise InvalidArgument(
                f"drain={drain!r}: pass 'refuse' (raise while requests run), 'abort' (cancel "
                "them) or 'wait' (serve them to the end first)"
            )
        slept = [t for t in tags if t in self._asleep]
        if slept:
            raise InvalidArgument(
                f"sleep: {', '.join(slept)} already sleep{'s' if len(slept) == 1 else ''}; "
                "wake() first"
            )
        self._drain(drain)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        kv = "kv_cache" in tags
        if kv:
            self._kv_to_sleep()
        try:
            report = self.system.sleep(
                level, [t for tag in tags for t in self.memory.tiers_of(tag)]
            )
        except BaseException:
            if kv:
                self.runner.reserve_blocks()
                self.runner.reset_inputs()
            raise
        for tag in tags:
            self._asleep[tag] = level
        if self.tenancy is not None:
            self.tenancy.tenant.set_asleep(level)
        return report

    def wake(
        self, tags: str | Sequence[str] | None = None, *, empty_torch_cache: bool = False
    ) -> list[str]:
        """Takes the memory of `tags` back at the same addresses (default:
        every sleeping tag), one tag at a time in the order given: the
        staged wake of RL colocation is ``wake("weights")``,
        `update_weights`, ``wake("kv_cache")``, so the KV cache's memory is
        taken only once the update's is free. A tag that is awake is
        skipped. Returns the tags woken.

        When the device lacks room, `OutOfMemory` says how much the wake
        needs and how much torch's caching allocator holds reserved but
        unused (a trainer's freed blocks); with `empty_torch_cache` the
        engine empties torch's cache once and retries. The tags not woken
        sleep on, and a later `wake` can take them."""
        names = self._tags(tags, "wake") if tags is not None else list(self._asleep)
        woken = []
        for tag in names:
            level = self._asleep.get(tag)
            if level is None:
                continue
            self.memory.wake(tag, empty_torch_cache=empty_torch_cache)
            del self._asleep[tag]
            if tag == "weights" and level == 2:
                self._weights_dropped = True
            if tag == "kv_cache":
                self.runner.reserve_blocks()
                self.runner.reset_inputs()
            woken.append(tag)
        if self.tenancy is not None and not self._asleep:
            self.tenancy.tenant.set_asleep(0)
        return woken

    def update_weights(self, named_tensors: Any) -> dict[str, Any]:
        """Copies new weights into T1 in place: an iterable of
        ``(name, tensor)`` (or a mapping), tensors on the GPU (a trainer in
        this process) or the CPU, each the checkpoint's whole tensor (under
        tensor parallelism each rank takes its slice). Every name, shape and
        dtype is checked before the first byte is copied; a refusal
        (`InvalidArgument` naming the tensor) changes nothing. A subset of
        the checkpoint's tensors may be given. The prefix cache (device and
        host tiers) is emptied: no KV computed with the old weights is
        served again. Returns ``{"tensors", "bytes", "seconds"}``."""
        if "weights" in self._asleep:
            raise InvalidArgument(
                "update_weights: the weights sleep; wake('weights') first (the staged wake: "
                "weights, update, then kv_cache)"
            )
        if self.scheduler.has_work:
            raise InvalidArgument(
                "update_weights: requests are waiting or running; finish them (run()) or "
                "cancel them first, so no sequence mixes two sets of weights"
            )
        if self.kv.stats()["pinned"]:
            raise InvalidArgument(
                "update_weights: the prefix cache has pinned blocks, which would keep KV of the "
                "old weights; unpin them first"
            )
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        plan = check_update(self.runner.weights, items, self.config, self.tp.shards())
        t0 = time.perf_counter()
        with torch.inference_mode(), self.runner.on_stream():
            copy_update(plan)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        self._weights_changed()
        nbytes = sum(dst.numel() * dst.element_size() for dst, _, _ in plan)
        return {"tensors": len(plan), "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def update_weights_from_ipc(self, handles: Any) -> dict[str, Any]:
        """`update_weights` from another process on the same GPU: `handles`
        is what `imp_mem.engine.weights.ipc_handles` made there (CUDA IPC,
        no host round trip). The sender must keep its tensors alive until
        this returns."""
        from imp_mem.engine.weights import open_ipc_handles

        return self.update_weights(open_ipc_handles(handles))

    def reload_weights(self, model_dir: str | Path | None = None) -> dict[str, Any]:
        """Reads the weights of `model_dir` (default: this engine's) into T1
        in place, checked as `update_weights` checks (a checkpoint of this
        model's shapes and dtypes); after a level-2 sleep, or to load a
        trainer's checkpoint from disk."""
        from imp_mem.engine.weights import checkpoint_tensors

        if model_dir is None and self.memory.dummy is not None:
            return self._refill_dummy()
        directory = self.model_dir if model_dir is None else Path(model_dir)
        return self.update_weights(checkpoint_tensors(directory))

    def _refill_dummy(self) -> dict[str, Any]:
        """`reload_weights` of a dummy engine: its seed's values drawn again in place."""
        from imp_mem.engine.dummy import fill

        if "weights" in self._asleep:
            raise InvalidArgument("reload_weights: the weights sleep; wake('weights') first")
        if self.scheduler.has_work:
            raise InvalidArgument(
                "update_weights: requests are waiting or running; finish them (run()) or "
                "cancel them first, so no sequence mixes two sets of weights"
            )
        _, seed, scale = self.memory.dummy
        t0 = time.perf_counter()
        with torch.inference_mode(), self.runner.on_stream():
            fill(self.runner.weights, self.config, seed=seed, scale=scale)
        self._weights_changed()
        nbytes = sum(t.numel() * t.element_size() for t in self.runner.weights.values())
        return {
            "tensors": len(self.runner.weights),
            "bytes": nbytes,
            "seconds": time.perf_counter() - t0,
        }

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            slept = ", ".join(f"{t} (level {lv})" for t, lv in self._asleep.items())
            raise InvalidArgument(f"{what}: the engine sleeps ({slept}); wake() first")
        if self._weights_dropped:
            raise InvalidArgument(
                f"{what}: a level-2 sleep dropped the weights; update_weights(...) or "
                "reload_weights() first"
            )

    def _tags(self, tags: str | Sequence[str] | None, what: str) -> list[str]:
        known = self.sleep_tags
        if tags is None:
            return list(known)
        names = [tags] if isinstance(tags, str) else list(tags)
        for t in names:
            if not isinstance(t, str):
                raise TypeError(f"{what}: tags must be str, got {type(t).__name__}")
            if t not in known:
                raise InvalidArgument(f"{what}: tag {t!r} is not one of {list(known)}")
        if not names:
            raise InvalidArgument(f"{what}: tags is empty; name one of {list(known)} or pass None")
        return list(dict.fromkeys(names))

    def _drain(self, mode: str) -> None:
        sched = self.scheduler
        if not sched.has_work:
            return
        if mode == "refuse":
            ids = [r.seq_id for r in sched.waiting] + list(sched.running)
            shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
            raise InvalidArgument(
                f"sleep: {len(ids)} requests are waiting or running (seq {shown}); finish them, "
                "or pass drain='abort' to cancel them or drain='wait' to serve them first"
            )
        if mode == "abort":
            for sid in [r.seq_id for r in sched.waiting] + list(sched.running):
                sched.cancel(sid)
        else:
            self.run()

    def _kv_to_sleep(self) -> None:
        """Leaves the KV pools without a live block: the prefix cache out of
        the device (the memory side) and the runner's own blocks given back."""
        self.memory.prefix_cache_off_device(self.kv)
        self.runner.release_blocks()

    def _weights_changed(self) -> None:
        """No KV computed with the old weights is served again."""
        kv = self.kv
        kv.reset_prefix_cache()
        self._weights_dropped = False
        self.weights_version += 1

    # ------------------------------------------------------------ model swap

    def swap_model(self, model_dir: str | Path) -> dict[str, Any]:
        """Serves the checkpoint in `model_dir` in place of this one without
        closing the memory system (issue 19). Inside the backend's
        replanning bracket it drops the model's graphs, views and KV
        manager, plans the new config with this engine's arguments, swaps
        the system's model (`MemorySystem.swap_model`: T2 kept at its
        address, T1 reset and resized at its base on a VMM backend, the KV
        pool re-laid when its geometry changes, the prefix cache dropped),
        loads the new weights into T1, warms up and captures again. Returns
        the swap's report.

        Refused with `InvalidArgument`, changing nothing, while requests are
        waiting or running, on a tensor-parallel engine, or when the new
        model needs T2 laid out differently (another vocabulary while
        logits are kept, sliding layers where there were none). When the
        swap itself fails, the old checkpoint is loaded again and serves
        on, and the error is raised."""
        if self.group is not None:
            raise InvalidArgument(
                "swap_model: a tensor-parallel engine cannot swap its model; close it and "
                "open an engine on the new checkpoint"
            )
        if self.memory.dummy is not None:
            raise InvalidArgument(
                "swap_model: a load_format='dummy' engine has no checkpoint to swap from; "
                "open an engine on the new checkpoint"
            )
        if self.scheduler.has_work:
            raise InvalidArgument(
                "swap_model: requests are waiting or running; finish them (run()) or cancel "
                "them first"
            )
        new_dir = Path(model_dir)
        new_dict = read_config_json(new_dir, "model_dir")
        new_config = ModelConfig.from_hf_config(new_dict)
        if self.max_seq_len > new_config.max_position_embeddings:
            raise InvalidArgument(
                f"swap_model: max_seq_len={self.max_seq_len} is above {new_dir.name}'s "
                f"max_position_embeddings ({new_config.max_position_embeddings})"
            )
        old = (self.model_dir, self.config_dict, self.config)
        t2 = self.runner.groups()
        self._set_model(new_dir, new_dict, new_config)
        if self.runner.groups() != t2:
            self._set_model(*old)
            raise InvalidArgument(
                f"swap_model: {new_dir.name} needs engine buffers (T2) laid out differently "
                "(its vocabulary or its sliding layers differ), and a swap keeps T2; open a "
                "new engine for it"
            )
        self._drop_model()
        with self.backend.replanning(f"model swap to {new_dir.name}"):
            try:
                self._plan(*self._plan_args)
                report = self.system.swap_model(self.plan)
            except BaseException:
                # The old model serves on: its plan again, its weights read
                # again into the (reset) T1, its KV manager and graphs.
                self._set_model(*old)
                self._plan(*self._plan_args)
                self.system.weights_arena.reset()
                self._reload()
                raise
            self._reload()
        return report

    def _set_model(self, model_dir: Path, config_dict: dict, config: ModelConfig) -> None:
        self.model_dir, self.config_dict, self.config = model_dir, config_dict, config
        self.tp = TensorParallel(config, tp=1)
        self.runner.set_model(config, self.runner.block_size)

    def _drop_model(self) -> None:
        """Drops everything over the model's memory (graphs, weights, KV
        views and manager), so that no export of T1 and no block is alive."""
        self.runner.drop_model()
        for name in ("scheduler", "kv"):
            if hasattr(self, name):
                delattr(self, name)
        if hasattr(self.runner, "kv"):
            del self.runner.kv
        # Exports held in a reference cycle would keep their tier alive.
        gc.collect()
        self.memory.empty_torch_cache()

    def _reload(self) -> None:
        prefix_caching, buckets, graphs, attention_backend, progress = self._open_args
        self._load(prefix_caching, attention_backend, progress)
        self._serve(buckets, graphs, begin=False)

    # ----------------------------------------------------------------- report

    def mem_report(self, other_processes: int | None = None) -> dict[str, Any]:
        """The memory system's report (torch's reserved bytes named when
        torch's allocator holds any); `other_processes` is device memory
        other processes use, left out of the attribution."""
        self.memory.charge_torch()
        return self.system.mem_report(other_processes=other_processes)

    def fleet_report(self, *, dst: int = 0, other_processes: int | None = None) -> Any:
        """Every rank's `mem_report` gathered on rank `dst` of the group as a
        `imp_mem.distributed.FleetReport` (None on the other ranks; every
        rank must call it). At TP = 1, this engine's report alone."""
        from imp_mem.distributed import FleetReport, gather_reports

        self.memory.charge_torch()
        if self.group is None:
            return FleetReport([self.system.mem_report(other_processes=other_processes)])
        return gather_reports(
            self.system, group=self.group, dst=dst, other_processes=other_processes
        )

    def mem_report_text(self, other_processes: int | None = None) -> str:
        """`mem_report` as the text table."""
        self.memory.charge_torch()
        return self.system.mem_report_text(other_processes=other_processes)

    def close(self) -> dict[str, Any] | None:
        """Drops every tensor over imp-mem's memory, then closes the system."""
        if getattr(self.memory, "system", None) is None:
            return None
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.drop_model()
            runner.drop_buffers()
            if hasattr(runner, "kv"):
                del runner.kv
        for name in ("scheduler", "kv"):
            if hasattr(self, name):
                delattr(self, name)
        # Exports held in a reference cycle would keep their tier alive.
        gc.collect()
        report = self.memory.close()
        # The system's memory is back: leave the device ledger.
        if self.tenancy is not None:
            try:
                self.backend.detach_ledger()
            except imp_mem.ImpMemError:
                pass  # memory still held: the tenant stays with the backend
            self.tenancy = None
        return report

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()
