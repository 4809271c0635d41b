"""The reference engine: a model served entirely from imp-mem's memory.

Order (seed A4.2). `Engine(model_dir)`:

1. reads ``config.json`` (`ModelConfig`, and `ModelShape.from_hf_config`,
   which takes the real weight bytes from the safetensors beside it) and
   plans with the engine's limits (`max_batch`, `max_seq_len`);
2. opens a `MemorySystem` on the backend (`VmmBackend` on a GPU,
   `FakeBackend` otherwise) — T2, T1, the KV pools, T4;
3. loads the weights into T1 (`load_safetensors`: tensors viewing the arena);
4. takes the static decode buffers from T2 (token ids, positions, block
   tables, next tokens, logits): tensors over `StableSpan`s, whose addresses
   never change, so CUDA graphs may bake them in;
5. types the KV pools as tensors in the interface's layout (`BlockPool.view`,
   the whole reservation) and checks that the planner's block bytes are that
   layout's exactly;
6. warms up (a prefill of the longest chunk over the longest context, the
   decode at every batch bucket), captures decode in one CUDA graph per
   bucket over the T2 tensors only (no graphs on the CPU), and enters
   SERVING (`begin_serving`) before the first request.

Serving. A `Scheduler` batches continuously over the system's
`KVCacheManager`. Each `step()` admits what fits and prefills it (from the
first uncached token, in chunks of `prefill_chunk` tokens), then decodes
every running sequence once: the pending tokens are appended to the
manager, the whole batch's block tables are written in one call into a
pinned host buffer and copied into T2, the bucket's graph is replayed and
the greedy tokens (argmax inside the graph) are read back. Padding rows of
a bucket feed position 0 through a table whose only block is a scratch
block the engine holds, so they write only there.

Sliding-window layers. The KV manager keeps SWA blocks only for each
sequence's trailing window, while a prefill's early queries need the
window before *them*. The engine holds a ring of scratch SWA blocks and,
for each prefill chunk, maps the logical blocks the manager has not given
(below the trailing window) onto the ring (logical block ``j`` on ring
slot ``j % len(ring)``, the ring longer than any chunk's reach), so every
query sees its whole window; the K/V written there are dropped after the
prefill, as the manager would drop them. The prefix cache holds only
full-attention blocks, so a prefix hit would leave the window's SWA K/V
uncomputed: models with sliding layers run with prefix caching off, and are
planned for `max_batch` plus the ring's sequences' worth of SWA blocks.

Accounting. `EngineStats` counts the time of every imp-mem call a step
makes (admission, appends, frees: `Scheduler.kv_seconds`; block tables:
here) against the step's time, so a benchmark can report the share.

Activations. Torch's own allocations (prefill activations, graph pools) go
to torch's allocator unless `torch_pool` routes them: a callable called
once with the opened `MemorySystem` (before the weights load) that returns
a `torch.cuda.MemPool` — used around eager work (`use_mem_pool`) and as the
graphs' pool — or a zero-argument factory of a context manager to enter
around every forward pass. Without one, the engine names torch's reserved
bytes in the memory report (`set_charge`).

Tensor parallelism. `Engine(..., group=g)` serves one rank's shard of the
model over the ``torch.distributed`` group `g` (one process per device;
NCCL on GPUs, gloo on the CPU), every rank constructing its own engine
with the same arguments and submitting the same requests in the same
order. The plan is the planner's per-rank plan (``tp`` = the group's size:
its heads, KV and weights per rank; the weights raised to ``tp`` times
the largest rank's layout when replication would pass the even split,
`tensor_parallel.plan_shape`); the memory system opens collectively
(`imp_mem.distributed.open_rank_system`); the loader reads only the rank's
slice of each tensor (`imp_mem.engine.tensor_parallel`), and after the
load all ranks agree: when one failed (planning, opening or loading),
every rank closes what it opened and raises the same
`imp_mem.distributed.RankFailure`. A failure after that (warm-up,
serving) leaves the peers waiting in a collective until the group's
timeout. The model all-reduces twice a layer and gathers the logits, so
every rank samples the same greedy token and the deterministic scheduler
keeps the ranks in step. `fleet_report()` gathers every rank's report.

Thread safety: none; one thread drives an engine.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import imp_mem
from imp_mem._safetensors import load_safetensors, read_header, safetensors_files
from imp_mem.engine.config import ModelConfig, read_config_json
from imp_mem.engine.model import KvViews, PagedModel
from imp_mem.engine.scheduler import Prefill, Request, Scheduler
from imp_mem.engine.tensor_parallel import TensorParallel, plan_shape
from imp_mem.errors import InvalidArgument

# Sequence ids of the engine's own (a scheduler counts from 0).
PAD_SEQ = (1 << 63) - 2
WARM_SEQ = (1 << 63) - 1
RING_SEQ = 1 << 62

# The plan's KV dtype names -> torch's.
_KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def default_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured as graphs: powers of two up to `max_batch`, and it."""
    out = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return [*out, max_batch]


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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layout(specs: dict[str, tuple[tuple, torch.dtype]]) -> tuple[dict[str, tuple], int]:
    """Offsets of a group of buffers in one region, each 256-byte aligned:
    `{name: (offset, nbytes, shape, dtype)}` and the region's bytes."""
    out, off = {}, 0
    for name, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * _itemsize(dtype)
        out[name] = (off, nbytes, shape, dtype)
        off = -(-(off + nbytes) // 256) * 256
    return out, max(off, 256)


def _carve(raw: torch.Tensor, layout: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Typed views of a uint8 region at `layout`'s offsets."""
    return {
        name: raw[off : off + n].view(dtype).view(shape)
        for name, (off, n, shape, dtype) in layout.items()
    }


class _Staging:
    """A group of host staging arrays in one pinned region (imp-mem's
    `PinnedBuffer`): `raw` (uint8), and per name a torch view (`t[name]`)
    and a NumPy view (`np[name]`) of the same bytes."""

    def __init__(self, backend: Any, specs: dict[str, tuple[tuple, torch.dtype]]) -> None:
        layout, total = _layout(specs)
        self.buffer = imp_mem.PinnedBuffer(total, backend=backend)
        self.raw = torch.from_dlpack(self.buffer.span())[:total]
        self.t = _carve(self.raw, layout)
        self.np = {name: t.numpy() for name, t in self.t.items()}


class Engine:
    """A continuous-batching greedy decoder over one model directory (HF
    ``config.json`` + safetensors), all of whose memory is imp-mem's.

    `backend`: default `VmmBackend` when CUDA is there (torch too), else a
    backed `FakeBackend` of `budget` (CPU tensors over its host memory).
    `budget`: the plan's budget (default: the backend's). `graphs`: capture
    decode in CUDA graphs (default: on a GPU). `buckets`: the batch sizes
    captured. `torch_pool`: where torch's own allocations go (module doc).
    `prefill_chunk`: tokens per prefill call (default 512; a sliding model's
    window). `features` replaces the plan's `Features` (default: T2 sized to
    the engine's buffers, T4 at 1 MiB unless `torch_pool` or
    `scratch_bytes` is given). The plan serves `max_batch` sequences of
    `max_seq_len` plus the blocks the engine holds itself (the padding
    block; a sliding model's ring), planned as `Features.engine_kv_blocks`.
    `swap_model` serves another checkpoint in place (T2 and every address
    kept).
    `group`: a ``torch.distributed`` process group to serve a tensor-parallel
    shard over (module doc); default None, TP = 1. With a group, the default
    backend is `VmmBackend` on device ``LOCAL_RANK`` (else the group rank).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch: int = 32,
        max_seq_len: int = 2048,
        backend: Any = None,
        budget: int | str | None = None,
        block_size: int | None = None,
        prefill_chunk: int | None = None,
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
    ) -> None:
        t_open = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.config_dict = read_config_json(self.model_dir, "model_dir")
        self.config = ModelConfig.from_hf_config(self.config_dict)
        c = self.config
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
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = min(prefill_chunk, max_seq_len)
        self.keep_logits = keep_logits
        self.kv_growable = kv_growable
        self._torch_pool = torch_pool
        self._torch_pool_made = False
        self.activation_bytes = activation_bytes
        self._scratch_bytes = scratch_bytes
        if torch_pool == "imp_mem":
            if activation_bytes is None:
                raise InvalidArgument(
                    "activation_bytes: torch_pool='imp_mem' plans an activations tier; give its "
                    "size (measure it with imp_mem.engine.runtime.measure_torch_high_water)"
                )
            import imp_mem.torch as imt

            self._torch_pool = lambda system: imt.pool(system).mempool
        self.stats = EngineStats()
        self._step_imp_mem = 0.0

        # -- 1. the plan -------------------------------------------------------
        self._open_args = (enable_prefix_caching, buckets, graphs, attention_backend, progress)
        error = None
        try:
            self._plan(backend, budget, block_size, context, library_reserve, features)
            if self.on_gpu:
                # Before the first collective: NCCL binds its communicator
                # to the current device.
                torch.cuda.set_device(self.device)
        except Exception as e:  # every rank must reach the agreement below
            error = e
        before = self._nccl_reading()
        self._agree("planning", error)
        self._nccl_bytes = self._nccl_lost(before)
        # A swap plans with the same arguments, against the same budget (the
        # backend's shrinks once the system holds its context and reserve).
        self._plan_args = (self.plan.budget, block_size, context, library_reserve, features)
        context, library_reserve = self._context, self._library_reserve

        # -- 2. the memory system ---------------------------------------------
        system_kw = dict(
            context=context,
            library_reserve=library_reserve,
            kv_growable=kv_growable,
            # With the tier torch's, a full tier returns null to torch, which
            # gives its pool's cached segments back and retries.
            activation_strict=True if activation_bytes is not None else None,
        )
        if group is None:
            self.system = imp_mem.MemorySystem(self.backend, self.plan, **system_kw)
        else:
            from imp_mem.distributed import open_rank_system

            self.system = open_rank_system(
                lambda _device: self.backend, self.plan, group=group, **system_kw
            )
        if self._nccl_bytes:
            self.system.set_charge(
                "nccl", self._nccl_bytes, "NCCL communicator (created at its first collective)"
            )
        try:
            self._open(enable_prefix_caching, buckets, graphs, attention_backend, progress)
        except BaseException:
            self.close()
            raise
        self.open_seconds = time.perf_counter() - t_open

    def _nccl_reading(self) -> tuple[int, int] | None:
        """With an NCCL group: the device's free bytes and torch's reserved
        bytes now; None otherwise."""
        if self.group is None or not getattr(self, "on_gpu", False):
            return None
        import torch.distributed as dist

        if dist.get_backend(self.group) != "nccl":
            return None
        torch.cuda.synchronize(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        return free, torch.cuda.memory_reserved(self.device)

    def _nccl_lost(self, before: tuple[int, int] | None) -> int:
        """What NCCL took of the device outside every allocator across the
        engine's first collective (the communicator is created lazily,
        there): the device's loss less torch's share. 0 without an NCCL
        group, or when the communicator was created before the engine (its
        bytes then show as the report's residual)."""
        now = self._nccl_reading() if before is not None else None
        if before is None or now is None:
            return 0
        return max(0, (before[0] - now[0]) - (now[1] - before[1]))

    def _agree(self, step: str, error: BaseException | None) -> None:
        """At TP = 1 re-raises `error`; with a group, every rank learns
        whether every rank got past `step`, and all raise the same
        `RankFailure` when one did not."""
        if self.group is None:
            if error is not None:
                raise error
            return
        from imp_mem.distributed import agree

        agree(step, error, group=self.group)

    def _plan(self, backend, budget, block_size, context, library_reserve, features) -> None:
        c = self.config
        if backend is None:
            if imp_mem.cuda_available() and torch.cuda.is_available():
                local = int(os.environ.get("LOCAL_RANK", self.tp.rank))
                backend = imp_mem.VmmBackend(local if self.group is not None else 0)
            else:
                backend = imp_mem.FakeBackend(capacity=budget or "8GiB")
        self.backend = backend
        self.on_gpu = backend.kind in ("cuda", "vmm")
        self.device = torch.device("cuda", backend.device) if self.on_gpu else torch.device("cpu")
        self.sliding = bool(c.sliding_layers)
        probe_bs = block_size or imp_mem.Limits(1, 16).block_size
        self.ring_blocks = 0
        # The checkpoint's bytes; with ranks, raised where a rank's slices
        # would pass the planner's even split (`plan_shape`).
        shape, self.rank_weights_bytes = plan_shape(self.model_dir, c, self.tp.tp)
        # The blocks the engine holds through sequences of its own (see
        # `_reserve_blocks`), planned as blocks beyond max_batch sequences:
        # the padding rows' block in each pool and, for a sliding model, the
        # ring, which must be longer than a chunk's reach (chunk + window);
        # each ring sequence holds a window's blocks in both pools.
        self._engine_blocks = [1, 1 if self.sliding else 0]
        if self.sliding:
            self.ring_blocks = math.ceil((self.prefill_chunk + c.sliding_window) / probe_bs) + 2
            per_seq = math.ceil(c.sliding_window / probe_bs)
            held = math.ceil(self.ring_blocks / per_seq) * per_seq
            self._engine_blocks = [1 + held, 1 + held]
        limits = imp_mem.Limits(self.max_batch, self.max_seq_len, block_size=block_size)
        if not self.on_gpu:
            context = 8 << 20 if context is None else context
            library_reserve = 4 << 20 if library_reserve is None else library_reserve
        self._context, self._library_reserve = context, library_reserve
        self.plan_input = imp_mem.PlanInput(
            shape,
            limits,
            _with_engine_blocks(features, self._engine_blocks)
            if features is not None
            else self._features(probe_bs, self._scratch_bytes),
            budget=budget if budget is not None else backend.budget,
            tp=self.tp.tp,
            context=context,
            library_reserve=library_reserve,
        )
        self.plan = imp_mem.plan_memory(self.plan_input)
        self.block_size = int(self.plan.kv["block_size"])

    # ------------------------------------------------------------------ setup

    def _open(self, prefix_caching, buckets, graphs, attention_backend, progress) -> None:
        error = None
        try:
            self._load(prefix_caching, attention_backend, progress)
        except Exception as e:  # every rank must reach the agreement below
            error = e
        # Past here the ranks run collectives: none may be missing.
        self._agree("loading the weights", error)
        self._serve(buckets, graphs)

    def _load(self, prefix_caching, attention_backend, progress) -> None:
        c = self.config
        system = self.system
        if self._torch_pool is not None and not self._torch_pool_made:
            self._torch_pool = self._torch_pool(system)
            self._torch_pool_made = True
        # -- 3. weights into T1 (this rank's slices) ---------------------------
        t0 = time.perf_counter()
        self.weights = load_safetensors(
            system, self.model_dir, progress=progress, shards=self.tp.shards()
        )
        self.load_seconds = time.perf_counter() - t0
        # What this rank holds beyond the plan's even split of the
        # checkpoint (replicated norms, shared KV heads, the vocab's
        # rounding); 0 at TP = 1.
        full = sum(t.nbytes for f in safetensors_files(self.model_dir) for t in read_header(f))
        held = sum(t.numel() * t.element_size() for t in self.weights.values())
        self.weights_over_share = held - -(-full // self.tp.tp)
        self.model = PagedModel(
            c,
            self.weights,
            attention_backend=attention_backend,
            max_positions=self.max_seq_len,
            tp=self.tp,
        )

        # -- 5. the KV pools as tensors ---------------------------------------
        kv_dtype = getattr(torch, _KV_DTYPES[self.plan.kv["dtype"]])
        geometry = (self.block_size, self.tp.kv_heads, c.head_dim)
        full = self._pool_view(system.kv_pool, len(c.full_layers), geometry, kv_dtype, "kv")
        swa = None
        if self.sliding:
            if system.swa_pool is None:
                raise InvalidArgument("the model has sliding layers but the plan has no SWA pool")
            swa = self._pool_view(system.swa_pool, len(c.sliding_layers), geometry, kv_dtype, "swa")
        self.kv_views = KvViews(full=full, swa=swa, block_size=self.block_size)
        self.kv = system.kv_manager(
            enable_prefix_caching=prefix_caching and not self.sliding,
            swa_window=c.sliding_window if self.sliding else None,
            model_fingerprint=str(self.model_dir.name),
        )
        self._reserve_blocks()
        self.scheduler = Scheduler(self.kv, max_batch=self.max_batch, max_seq_len=self.max_seq_len)

        # -- 4. static buffers in T2, staging in pinned host memory ------------
        # Three regions of T2: a step's inputs (one host-to-device copy a
        # step), a prefill chunk's inputs, and the outputs; the inputs are
        # staged in pinned regions of the same layout. Carved once: a model
        # swap keeps T2 (its layout is checked to be the same).
        if not hasattr(self, "t2"):
            self._carve_t2()
        W = self.width
        # Padding rows: position 0 in the pad block, nothing else.
        self._pad_row = _pad_row(W, self._pad_full)
        self._pad_swa_row = _pad_row(W, self._pad_swa)
        step_in = self.staging["decode_in"].np
        step_in["tables"][:] = self._pad_row
        step_in["ids"][:] = 0
        step_in["pos"][:] = 0
        if self.sliding:
            step_in["swa_tables"][:] = self._pad_swa_row
        self._t2_raw["decode_in"].copy_(self.staging["decode_in"].raw)

    def _on_stream(self) -> Any:
        """The engine's stream: every kernel it runs, eager or captured, goes
        there, so cuBLAS keeps one workspace for it (a workspace is per
        stream) rather than one for the current stream and one for capture."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _carve_t2(self) -> None:
        self.width = math.ceil(self.max_seq_len / self.block_size)
        self.t2: dict[str, torch.Tensor] = {}
        self._t2_raw: dict[str, torch.Tensor] = {}
        self.staging: dict[str, _Staging] = {}
        for group, specs in self._t2_groups().items():
            layout, total = _layout(specs)
            raw = torch.from_dlpack(self.system.engine_arena.take(total, 256))
            self._t2_raw[group] = raw
            self.t2.update(_carve(raw, layout))
            if group != "out":
                self.staging[group] = _Staging(self.backend, specs)
        self.staging["next"] = _Staging(self.backend, {"next": self._t2_groups()["out"]["next"]})

    def _serve(self, buckets, graphs, *, begin: bool = True) -> None:
        system = self.system
        # -- 6. warm-up, graphs, serving --------------------------------------
        if self.on_gpu:
            if getattr(self, "_stream", None) is None:  # kept across a model swap
                self._stream = torch.cuda.Stream(self.device)
            # The weights and T2 were written on the current stream.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self._stream = None
        self.use_graphs = self.on_gpu if graphs is None else graphs
        if self.use_graphs and not self.on_gpu:
            raise InvalidArgument("graphs=True needs a GPU backend")
        self.buckets = sorted(set(buckets or default_buckets(self.max_batch)))
        if self.buckets[-1] < self.max_batch or self.buckets[0] < 1:
            raise InvalidArgument(
                f"buckets {self.buckets} must be at least 1 and cover max_batch={self.max_batch}"
            )
        with self._on_stream():
            self._warm_up()
        # The warm-up's transients go back to the device before the capture
        # takes its pool, so torch's peak is the larger of the two, not the sum.
        self._empty_torch_cache()
        self.graphs: dict[int, Any] = {}
        if self.use_graphs:
            self._capture()
            self._empty_torch_cache()
        self._charge_torch()
        if begin:
            system.begin_serving()
        self.stats = EngineStats()  # serving starts here

    def _features(self, block_size: int, scratch_bytes: int | None) -> Any:
        """What the plan sizes beyond the model and its KV: T2 exactly as
        the engine uses it, and T4 (the forward-pass scratch stack) at its
        minimum unless `torch_pool` may draw activations from it or
        `scratch_bytes` says otherwise — the engine's own forward pass
        allocates through torch."""
        if scratch_bytes is None and (self._torch_pool is None or self.activation_bytes):
            scratch_bytes = 1 << 20
        return imp_mem.Features(
            engine_persistent_bytes=self._t2_bytes(block_size),
            scratch_bytes=scratch_bytes,
            activation_bytes=self.activation_bytes,
            engine_kv_blocks=self._engine_blocks[0],
            engine_swa_blocks=self._engine_blocks[1],
        )

    def _reserve_blocks(self) -> None:
        """Blocks the engine holds for its life, through sequences of its own
        in the manager (which accounts for every block of its pools): the
        padding rows' block in each pool, and the SWA prefill ring."""
        kv = self.kv
        kv.admit(PAD_SEQ, [0])
        self.engine_seqs = [PAD_SEQ]
        self._pad_full = kv.block_table(PAD_SEQ)[0]
        self._pad_swa = kv.swa_table(PAD_SEQ)[0] if self.sliding else -1
        self._ring: list[int] = []
        while len(self._ring) < self.ring_blocks:
            sid = RING_SEQ + len(self.engine_seqs)
            kv.admit(sid, [1] * self.config.sliding_window)
            self.engine_seqs.append(sid)
            self._ring.extend(b for b in kv.swa_table(sid) if b >= 0)

    def _pool_view(self, pool, layers, geometry, dtype, what) -> torch.Tensor:
        shape = (layers, 2, *geometry)
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if pool.block_bytes != want:
            raise InvalidArgument(
                f"the {what} pool's blocks are {pool.block_bytes} B; the layout "
                f"[{layers}, 2, {geometry[0]}, {geometry[1]}, {geometry[2]}] x {dtype} is {want} B"
            )
        name = str(dtype).removeprefix("torch.")
        view = torch.from_dlpack(pool.view(name, shape))
        assert view.is_contiguous() and view.shape[1:] == shape
        return view

    def _t2_groups(self, block_size: int | None = None) -> dict[str, dict[str, tuple]]:
        """The static buffers in T2, by region: name -> (shape, dtype)."""
        bs = block_size or self.block_size
        B, C = self.max_batch, self.prefill_chunk
        W = math.ceil(self.max_seq_len / bs)
        decode_in = {
            "ids": ((B,), torch.int64),
            "pos": ((B,), torch.int64),
            "tables": ((B, W), torch.int32),
        }
        prefill_in = {"prefill_ids": ((C,), torch.int64), "prefill_table": ((W,), torch.int32)}
        out = {"next": ((B,), torch.int64)}
        if self.sliding:
            decode_in["swa_tables"] = ((B, W), torch.int32)
            prefill_in["prefill_swa"] = ((W,), torch.int32)
        if self.keep_logits:
            out["logits"] = ((B, self.config.vocab_size), torch.float32)
        return {"decode_in": decode_in, "prefill_in": prefill_in, "out": out}

    def _t2_bytes(self, block_size: int) -> int:
        """T2 as this engine uses it: its regions, each 256-byte aligned."""
        return sum(_layout(specs)[1] for specs in self._t2_groups(block_size).values())

    def _torch_ctx(self) -> Any:
        pool = self._torch_pool
        if pool is None:
            return contextlib.nullcontext()
        if self.on_gpu and isinstance(pool, torch.cuda.MemPool):
            return torch.cuda.use_mem_pool(pool)
        return pool()

    def _graph_pool(self) -> Any:
        pool = self._torch_pool
        if pool is not None and self.on_gpu and isinstance(pool, torch.cuda.MemPool):
            return pool.id
        return torch.cuda.graph_pool_handle()

    def _warm_up(self) -> None:
        """Prefills of the longest chunk at the end of the longest context,
        of a full chunk from the start and of one token, then the decode at
        every bucket: torch's allocator (or the activation pool) holds the
        prefill's working set before serving, and every kernel is compiled
        before any capture."""
        kv = self.kv
        sid = WARM_SEQ
        n = self.max_seq_len - 1
        tokens = [0] * n
        if kv.can_admit(tokens):
            kv.admit(sid, tokens)
            try:
                chunk = min(self.prefill_chunk, n)
                with torch.inference_mode(), self._torch_ctx():
                    for start, end in ((n - chunk, n), (0, chunk), (0, 1)):
                        self._prefill_chunk(sid, tokens, start, end, n)
            finally:
                kv.abort(sid)
        with torch.inference_mode(), self._torch_ctx():
            for b in sorted(self.buckets, reverse=True):
                self._decode_body(b)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def _empty_torch_cache(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _capture(self) -> None:
        # On the stream the warm-up ran on (its library handles and
        # workspaces exist already, as torch's graph recipe needs).
        pool, stream = self._graph_pool(), self._stream
        with torch.inference_mode():
            for b in sorted(self.buckets, reverse=True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._decode_body(b)
                self.graphs[b] = g
        torch.cuda.synchronize(self.device)

    def _charge_torch(self) -> None:
        if self.on_gpu and self._torch_pool is None:
            self.system.set_charge(
                "torch",
                torch.cuda.memory_reserved(self.device),
                "torch caching allocator (activations, graph pools)",
            )

    # ------------------------------------------------------------- the steps

    def _decode_body(self, b: int) -> None:
        """The decode of bucket `b` over the T2 buffers (what a graph holds)."""
        t2 = self.t2
        logits = self.model.decode(
            t2["ids"][:b],
            t2["pos"][:b],
            t2["tables"][:b],
            t2["swa_tables"][:b] if self.sliding else None,
            self.kv_views,
        )
        t2["next"][:b].copy_(logits.argmax(-1))
        if self.keep_logits:
            t2["logits"][:b].copy_(logits)

    def _prefill_chunk(self, sid: int, tokens, start: int, end: int, total: int) -> torch.Tensor:
        """Prefills positions [start, end) of sequence `sid`; the last
        token's logits."""
        staged, t2 = self.staging["prefill_in"], self.t2
        host = staged.np
        n = end - start
        host["prefill_ids"][:n] = tokens[start:end]
        t0 = time.perf_counter()
        self.kv.block_tables([sid], host["prefill_table"].reshape(1, -1))
        if self.sliding:
            swa = host["prefill_swa"]
            self.kv.block_tables([sid], swa.reshape(1, -1), pool="swa")
        self._count_imp_mem(time.perf_counter() - t0)
        if self.sliding:
            self._fill_ring(swa, start, end)
        # One blocking copy: the next chunk rewrites the staging region.
        self._t2_raw["prefill_in"].copy_(staged.raw)
        return self.model.prefill(
            t2["prefill_ids"][:n],
            start,
            t2["prefill_table"],
            t2["prefill_swa"] if self.sliding else None,
            self.kv_views,
            last_only=True,
        )

    def _fill_ring(self, swa, start: int, end: int) -> None:
        """Maps the logical SWA blocks a prefill of [start, end) reads and
        the manager has not given onto the scratch ring."""
        bs, ring = self.block_size, self._ring
        first = max(0, start + 1 - self.config.sliding_window) // bs
        last = (end - 1) // bs
        for j in range(first, last + 1):
            if swa[j] < 0:
                swa[j] = ring[j % len(ring)]

    def _count_imp_mem(self, seconds: float) -> None:
        self.stats.imp_mem_seconds += seconds
        self._step_imp_mem += seconds

    def step(self) -> list[tuple[int, int]]:
        """One engine step: admissions and their prefills, then one decode
        of every running sequence. Returns the `(seq_id, token)` pairs
        produced, in order."""
        sched = self.scheduler
        stats = self.stats
        t_step = time.perf_counter()
        kv0 = sched.kv_seconds
        self._step_imp_mem = 0.0
        out: list[tuple[int, int]] = []
        with torch.inference_mode(), self._on_stream(), self._torch_ctx():
            prefills = sched.admit_waiting()
            t0 = time.perf_counter()
            for p in prefills:
                tok = self._prefill(p)
                if tok is not None:
                    out.append((p.request.seq_id, tok))
            if prefills:
                stats.prefill_seconds += time.perf_counter() - t0
            t_dec = time.perf_counter()
            kv_dec = sched.kv_seconds
            imp_dec = self._step_imp_mem
            batch = sched.prepare_decode()
            if batch:
                tokens = self._decode(batch)
                sched.decoded(batch, tokens)
                out.extend((r.seq_id, t) for r, t in zip(batch, tokens, strict=True))
                dt = time.perf_counter() - t_dec
                stats.decode_seconds += dt
                stats.decode_steps += 1
                stats.decode_tokens += len(batch)
                stats.decode_imp_mem_seconds += (
                    sched.kv_seconds - kv_dec + self._step_imp_mem - imp_dec
                )
        if self.kv_growable:
            # The growable pool's hysteretic shrink, fenced after this step.
            fence = None
            if self.on_gpu:
                fence = torch.cuda.Event()
                fence.record(self._stream)
            t0 = time.perf_counter()
            self.system.step(fence)
            self._count_imp_mem(time.perf_counter() - t0)
        stats.imp_mem_seconds += sched.kv_seconds - kv0
        stats.steps += 1
        stats.step_seconds += time.perf_counter() - t_step
        return out

    def _prefill(self, p: Prefill) -> int | None:
        tokens, n = p.tokens, len(p.tokens)
        sid = p.request.seq_id
        start = p.start
        logits = None
        while start < n:
            end = min(n, start + self.prefill_chunk)
            logits = self._prefill_chunk(sid, tokens, start, end, n)
            self.stats.prefill_tokens += end - start
            start = end
        nxt = self.staging["next"]
        nxt.t["next"][:1].copy_(logits[0].argmax(-1, keepdim=True))
        tok = int(nxt.np["next"][0])
        self.scheduler.prefilled(p, tok)
        return tok

    def _decode(self, batch: list[Request]) -> list[int]:
        n = len(batch)
        b = next(x for x in self.buckets if x >= n)
        staged = self.staging["decode_in"]
        host = staged.np
        host["ids"][:n] = [r.output[-1] for r in batch]
        host["pos"][:n] = [r.computed for r in batch]
        host["ids"][n:b] = 0
        host["pos"][n:b] = 0
        seqs = [r.seq_id for r in batch]
        t0 = time.perf_counter()
        self.kv.block_tables(seqs, host["tables"][:n])
        if self.sliding:
            self.kv.block_tables(seqs, host["swa_tables"][:n], pool="swa")
        self._count_imp_mem(time.perf_counter() - t0)
        host["tables"][n:b] = self._pad_row
        if self.sliding:
            host["swa_tables"][n:b] = self._pad_swa_row
        # One copy of the whole input region (tens of KiB); it is complete
        # before the next step rewrites the staging, which the blocking
        # read of the tokens below guarantees.
        self._t2_raw["decode_in"].copy_(staged.raw, non_blocking=True)
        if self.use_graphs:
            self.graphs[b].replay()
        else:
            self._decode_body(b)
        self.stats.bucket_steps[b] = self.stats.bucket_steps.get(b, 0) + 1
        nxt = self.staging["next"]
        nxt.t["next"][:b].copy_(self.t2["next"][:b])  # blocking: waits for the step
        return nxt.np["next"][:n].tolist()

    # -------------------------------------------------------------- requests

    def submit(
        self, prompt: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = None
    ) -> Request:
        """Queues a request (served by the next `step()` calls)."""
        return self.scheduler.submit(prompt, max_new_tokens, eos_token_id=eos_token_id)

    def cancel(self, seq_id: int) -> bool:
        """Cancels a request at any point; False if it already ended."""
        return self.scheduler.cancel(seq_id)

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Serves `prompts` to the end, yielding `(prompt index, token)` as
        the tokens are produced."""
        index = {}
        for i, p in enumerate(prompts):
            index[self.submit(p, max_new_tokens, eos_token_id=eos_token_id).seq_id] = i
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
    ) -> list[list[int]]:
        """Greedy continuations of `prompts` (token ids), continuously batched."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, tok in self.stream(prompts, max_new_tokens, eos_token_id=eos_token_id):
            out[i].append(tok)
        return out

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Steps until nothing is waiting or running (or `until()` says stop)."""
        while self.scheduler.has_work and not (until and until()):
            self.step()

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
        t2 = self._t2_groups()
        self._set_model(new_dir, new_dict, new_config)
        if self._t2_groups(self.block_size) != t2:
            self._set_model(*old)
            raise InvalidArgument(
                f"swap_model: {new_dir.name} needs engine buffers (T2) laid out differently "
                "(its vocabulary or its sliding layers differ), and a swap keeps T2; open a "
                "new engine for it"
            )
        self._drop_model()
        with self.backend.replanning(f"model swap to {new_dir.name}"):
            try:
                self._plan(self.backend, *self._plan_args)
                report = self.system.swap_model(self.plan)
            except BaseException:
                # The old model serves on: its plan again, its weights read
                # again into the (reset) T1, its KV manager and graphs.
                self._set_model(*old)
                self._plan(self.backend, *self._plan_args)
                self.system.weights_arena.reset()
                self._reload()
                raise
            self._reload()
        return report

    def _set_model(self, model_dir: Path, config_dict: dict, config: ModelConfig) -> None:
        self.model_dir, self.config_dict, self.config = model_dir, config_dict, config
        self.tp = TensorParallel(config, tp=1)
        self.sliding = bool(config.sliding_layers)

    def _drop_model(self) -> None:
        """Drops everything over the model's memory (graphs, weights, KV
        views and manager), so that no export of T1 and no block is alive."""
        self._drop(_MODEL_ATTRS)
        self._empty_torch_cache()

    def _drop(self, names: Sequence[str]) -> None:
        for name in names:
            if hasattr(self, name):
                delattr(self, name)
        # Exports held in a reference cycle would keep their tier alive.
        gc.collect()

    def _reload(self) -> None:
        prefix_caching, buckets, graphs, attention_backend, progress = self._open_args
        self._load(prefix_caching, attention_backend, progress)
        self._serve(buckets, graphs, begin=False)

    # ----------------------------------------------------------------- report

    def mem_report(self, other_processes: int | None = None) -> dict[str, Any]:
        """The memory system's report (torch's reserved bytes named when
        torch's allocator holds any); `other_processes` is device memory
        other processes use, left out of the attribution."""
        self._charge_torch()
        return self.system.mem_report(other_processes=other_processes)

    def fleet_report(self, *, dst: int = 0, other_processes: int | None = None) -> Any:
        """Every rank's `mem_report` gathered on rank `dst` of the group as a
        `imp_mem.distributed.FleetReport` (None on the other ranks; every
        rank must call it). At TP = 1, this engine's report alone."""
        from imp_mem.distributed import FleetReport, gather_reports

        self._charge_torch()
        if self.group is None:
            return FleetReport([self.system.mem_report(other_processes=other_processes)])
        return gather_reports(
            self.system, group=self.group, dst=dst, other_processes=other_processes
        )

    def mem_report_text(self, other_processes: int | None = None) -> str:
        """`mem_report` as the text table."""
        self._charge_torch()
        return self.system.mem_report_text(other_processes=other_processes)

    def close(self) -> dict[str, Any] | None:
        """Drops every tensor over imp-mem's memory, then closes the system."""
        system = getattr(self, "system", None)
        if system is None:
            return None
        self._drop((*_MODEL_ATTRS, "t2", "_t2_raw", "staging"))
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        if self.activation_bytes is not None and self.on_gpu:
            # torch's MemPool over the activations tier: its segments go back
            # to the tier before the tier closes.
            import imp_mem.torch as imt

            self._torch_pool = None
            for p in [p for p in imt._pools.values() if p.activations is system.activations]:
                p.close()
            imt._core.uninstall_hooks()
        self.system = None
        return system.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()


# What holds the model's memory (weights, KV views and manager, graphs): what
# a model swap drops, and close() with T2's buffers.
_MODEL_ATTRS = ("graphs", "model", "weights", "kv_views", "scheduler", "kv")


def _with_engine_blocks(features: Any, blocks: Sequence[int]) -> Any:
    """`features` (a caller's `imp_mem.Features`) with the engine's own KV
    blocks added to what it already plans for."""
    # Every field Features has (its getters are its keyword arguments).
    names = [
        n
        for n, v in vars(imp_mem.Features).items()
        if type(v).__name__ == "getset_descriptor"
        and n not in ("engine_kv_blocks", "engine_swa_blocks")
    ]
    return imp_mem.Features(
        **{n: getattr(features, n) for n in names},
        engine_kv_blocks=features.engine_kv_blocks + blocks[0],
        engine_swa_blocks=features.engine_swa_blocks + blocks[1],
    )


def _pad_row(width: int, block: int):
    import numpy as np

    row = np.full(width, -1, dtype=np.int32)
    row[0] = block
    return row


def measure_torch_high_water(model_dir: str | Path, *, requests: int = 0, **engine_kw: Any) -> int:
    """The most device memory torch's allocator holds for an engine of these
    arguments over its warm-up, graph capture and `requests` random requests
    (torch's default allocator, a fresh engine): what to plan the activations
    tier with (``Engine(torch_pool="imp_mem", activation_bytes=...)``, seed A3.3)."""
    import random

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with Engine(model_dir, **engine_kw) as e:
        rng = random.Random(0)
        for _ in range(requests):
            n = rng.randint(1, max(1, e.max_seq_len // 2))
            e.submit([rng.randrange(e.config.vocab_size) for _ in range(n)], 8)
        e.run()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_reserved(dev) - base
    torch.cuda.empty_cache()
    return int(peak)
