"""The model runner: what runs a model over imp-mem's memory, one batch at
a time. The serving loop (`llm_engine`) hands it a prefill or a decode
batch; the memory side (`memory`) has planned and opened what it uses.

Buffers. The static decode buffers live in T2 (token ids, positions, block
tables, next tokens, logits): tensors over `StableSpan`s, whose addresses
never change, so CUDA graphs may bake them in. Three regions (a step's
inputs, a prefill chunk's inputs, the outputs), each staged in a pinned
host region of the same layout (`PinnedBuffer`), so a step costs one
host-to-device copy of its inputs. `t2_groups` is the layout; the plan
sizes T2 from it (`t2_bytes`), to the byte (the pinned staging is host
memory, outside the device plan). The KV pools are typed as tensors in the
attention's layout (`BlockPool.view`, the whole reservation), their block
bytes checked against that layout.

Prefill pipelining. A step's prefills run back to back without the host
waiting for the device: a chunk's inputs are staged in one of
`PREFILL_SLOTS` host slots in turn and copied non-blocking (`_Slots`;
the single T2 region is safe, as the stream orders each copy after the
previous chunk's kernels), and each prefill's greedy token goes to its own
row of T2's ``next``, read back in one copy after the step's last prefill
(`prefill_tokens`). The host launches the next request's kernels while the
device still runs the previous one's.

Batched prefill (`prefill_step`, `prefill_batch_tokens` > 0 and a model
with ``prefill_batch_ok``). One forward runs a chunk of each of several
requests (`model.prefill_batch`): the step's prefills are packed greedily,
in admission order, into batches of at most `prefill_batch_tokens` tokens
and at most one chunk of a request (its next chunk reads this one's K/V,
so it goes in a later batch); chunk boundaries are the unbatched path's.
The requests' block tables are read from the manager once a step; a
batch's ids, tables, ``cu_seqlens``, starts, and which chunks end their
prompt (``prefill_pick``) and their rows of ``next`` (``prefill_rows``)
are staged in one slot and copied once; T2's ``prefill_in`` is sized for
the largest batch (`batch_rows` chunks, the budget's tokens) and the
warm-up runs that batch, so serving allocates nothing new. A request
whose image is still to encode is prefilled alone (`prefill`). With
sliding layers, one request at a time holds the SWA ring (below): it is
put first in every batch until its chunks read only blocks the manager
gave, and no other request's chunk that needs the ring joins meanwhile.

Warm-up and graphs. `serve` warms up (the largest batched prefill, a
prefill of the longest chunk over the longest context, the decode at every
batch bucket), then captures
decode in one CUDA graph per bucket over the T2 tensors only (no graphs on
the CPU). Padding rows of a bucket feed position 0 through a table whose
only block is a scratch block the runner holds, so they write only there.

Sliding-window layers. The KV manager keeps SWA blocks only for each
sequence's trailing window, while a prefill's early queries need the
window before *them*. The runner holds a ring of scratch SWA blocks and,
for each prefill chunk, maps the logical blocks the manager has not given
(below the trailing window) onto the ring (logical block ``j`` on ring
slot ``j % len(ring)``, the ring longer than any chunk's reach), so every
query sees its whole window; the K/V written there are dropped after the
prefill, as the manager would drop them. The prefix cache holds only
full-attention blocks, so a prefix hit would leave the window's SWA K/V
uncomputed: models with sliding layers run with prefix caching off, and are
planned for `max_batch` plus the ring's sequences' worth of SWA blocks
(`engine_blocks`).

Images (a model with a vision tower, Gemma-3). A request's image is
encoded once at its prefill, when its image tokens are not all in the
prefix cache; the image's tokens attend to each other both ways, so a
chunk ends before them rather than inside them and they are prefilled in
one call (`prefill_chunk` >= ``mm_tokens_per_image``, checked by the
engine). After the graph capture the runner encodes one zero image, so the
tower's working set sits in torch's cache (or the activations tier) when
the warm-up is measured: planned, not grown while serving.

Thread safety: none; one thread drives the runner.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

import imp_mem
from imp_mem.engine.config import ModelConfig
from imp_mem.engine.model import KvViews, build_model
from imp_mem.engine.scheduler import Prefill, Request
from imp_mem.errors import InvalidArgument

# Sequence ids of the runner's own (a scheduler counts from 0).
PAD_SEQ = (1 << 63) - 2
WARM_SEQ = (1 << 63) - 1
RING_SEQ = 1 << 62

# Host staging slots of a prefill chunk's inputs (`_Slots`): the chunks the
# host may stage ahead of the device.
PREFILL_SLOTS = 4

# The default batched prefill budget, in chunks (`Engine(prefill_batch_tokens=)`):
# 4 x 512 tokens of Qwen3-0.6B's activations are ~0.1 GiB (hidden, q/k/v,
# the MLP's 3 x 3072 columns, in bf16), small beside the KV pool, and 4
# chunks a forward cut a step's launches about fourfold. On a device of at
# least `LARGE_DEVICE_BYTES` (vLLM draws the same line at 70 GiB for its
# max_num_batched_tokens) a forward holds 16 chunks, 8 192 tokens at the
# default chunk: a burst's prefill is the queue its time to first token
# waits in, and the 0.6B prefills 171 k tokens/s at 8 192 a forward
# against 97 k at 2 048 (the H200; `bench_shared_gpu`'s burst TTFT p99,
# docs/perf/history.md, session 18). The 8B's warm-up line grows
# 854 -> 2 010 MiB with it, which a 70 GiB device can spare.
PREFILL_BATCH_CHUNKS = 4
PREFILL_BATCH_CHUNKS_LARGE = 16
LARGE_DEVICE_BYTES = 70 << 30


def default_prefill_batch_tokens(prefill_chunk: int, device_bytes: int) -> int:
    """`Engine(prefill_batch_tokens=None)`: `PREFILL_BATCH_CHUNKS` chunks a
    forward, `PREFILL_BATCH_CHUNKS_LARGE` on a device of at least
    `LARGE_DEVICE_BYTES` (`device_bytes`: the backend's capacity)."""
    large = device_bytes >= LARGE_DEVICE_BYTES
    return (PREFILL_BATCH_CHUNKS_LARGE if large else PREFILL_BATCH_CHUNKS) * prefill_chunk


# The plan's KV dtype names -> torch's.
_KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def default_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured as graphs: powers of two up to `max_batch`, and it."""
    out = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return [*out, max_batch]


def engine_blocks(config: ModelConfig, prefill_chunk: int, block_size: int) -> tuple[int, list]:
    """``(ring_blocks, [full, swa])``: the SWA ring's length and the blocks
    the runner holds through sequences of its own (`reserve_blocks`), planned
    as blocks beyond max_batch sequences: the padding rows' block in each
    pool and, for a sliding model, the ring, which must be longer than a
    chunk's reach (chunk + window); each ring sequence holds a window's
    blocks in both pools."""
    if not config.sliding_layers:
        return 0, [1, 0]
    ring = math.ceil((prefill_chunk + config.sliding_window) / block_size) + 2
    per_seq = math.ceil(config.sliding_window / block_size)
    held = math.ceil(ring / per_seq) * per_seq
    return ring, [1 + held, 1 + held]


def t2_groups(
    config: ModelConfig,
    *,
    max_batch: int,
    max_seq_len: int,
    prefill_chunk: int,
    block_size: int,
    keep_logits: bool,
    flashinfer: bool = False,
    prefill_batch_tokens: int = 0,
) -> dict[str, dict[str, tuple]]:
    """The static buffers in T2, by region: name -> (shape, dtype).
    `flashinfer`: FlashInfer's page table in the step's inputs and its
    workspaces in a region of their own, ``fi_work`` (`kernels.flashinfer_decode`).
    `prefill_batch_tokens` (0: no batched prefill): the prefill inputs hold
    a batch of that many tokens over `batch_rows` chunks, with their
    tables, ``cu_seqlens``, starts, and which chunks' greedy tokens go to
    which rows of ``next``."""
    B, C = max_batch, prefill_chunk
    W = math.ceil(max_seq_len / block_size)
    R = batch_rows(max_batch, prefill_batch_tokens)
    decode_in = {
        "ids": ((B,), torch.int64),
        "pos": ((B,), torch.int64),
        "tables": ((B, W), torch.int32),
    }
    prefill_in = {
        "prefill_ids": ((max(C, prefill_batch_tokens),), torch.int64),
        "prefill_table": ((R, W), torch.int32),
    }
    if prefill_batch_tokens:
        prefill_in.update(
            prefill_cu=((R + 1,), torch.int32),
            prefill_starts=((R,), torch.int64),
            prefill_pick=((R,), torch.int64),
            prefill_rows=((R,), torch.int64),
        )
    out = {"next": ((B,), torch.int64)}
    if config.sliding_layers:
        decode_in["swa_tables"] = ((B, W), torch.int32)
        prefill_in["prefill_swa"] = ((R, W), torch.int32)
    if keep_logits:
        out["logits"] = ((B, config.vocab_size), torch.float32)
    groups = {"decode_in": decode_in, "prefill_in": prefill_in, "out": out}
    if flashinfer:
        from imp_mem.engine.kernels import flashinfer_decode

        decode_in.update(flashinfer_decode.input_specs(B, W))
        groups["fi_work"] = flashinfer_decode.workspace_specs()
    return groups


def batch_rows(max_batch: int, prefill_batch_tokens: int) -> int:
    """The most chunks a batched prefill holds: one a request of the step
    (at most `max_batch`), each at least one token; 1 without batching."""
    return max(1, min(max_batch, prefill_batch_tokens))


def t2_bytes(groups: dict[str, dict[str, tuple]]) -> int:
    """T2 as the runner uses it: its regions, each 256-byte aligned."""
    return sum(_layout(specs)[1] for specs in groups.values())


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


class _Slots:
    """`n` stagings of one layout used in turn, so the host writes one while
    the device still copies another. On a GPU each slot's copy to the
    device is non-blocking and records the slot's event on the copy's
    stream; the host waits for that event (``synchronize``) only when it
    comes back to the slot. `event`: the event type (``torch.cuda.Event``
    on a GPU; None on the CPU, where a copy is done when it returns)."""

    def __init__(self, backend: Any, specs: dict[str, tuple], n: int, event: Any) -> None:
        self.slots = [_Staging(backend, specs) for _ in range(n)]
        self.events: list[Any] = [event() if event is not None else None for _ in range(n)]
        self.turn = 0

    def take(self) -> _Staging:
        """The current slot, once its last copy has run (the host may write it)."""
        ev = self.events[self.turn]
        if ev is not None:
            ev.synchronize()  # returns at once for an event never recorded
        return self.slots[self.turn]

    def copy_to(self, dst: torch.Tensor) -> None:
        """Copies the slot `take` gave into `dst` and moves to the next."""
        i, ev = self.turn, self.events[self.turn]
        dst.copy_(self.slots[i].raw, non_blocking=ev is not None)
        if ev is not None:
            ev.record()  # on the current stream, the copy's
        self.turn = (i + 1) % len(self.slots)


def _pad_row(width: int, block: int):
    import numpy as np

    row = np.full(width, -1, dtype=np.int32)
    row[0] = block
    return row


# What holds the model's memory (weights, KV views, graphs): what a model
# swap or a sleep drops, and close() with T2's buffers.
MODEL_ATTRS = ("graphs", "model", "weights", "kv_views")


class ModelRunner:
    """Runs one model's prefills and decodes over T2 buffers, the KV pools
    and (on a GPU) CUDA graphs. `memory` is the engine's `EngineMemory`
    (the system, the torch pool, the charges)."""

    def __init__(
        self,
        memory: Any,
        *,
        max_batch: int,
        max_seq_len: int,
        prefill_chunk: int,
        keep_logits: bool,
        attention_backend: str | None = None,
        prefill_batch_tokens: int = 0,
    ) -> None:
        self.memory = memory
        # The batched prefill's token budget (0: one request a forward).
        self.prefill_batch_tokens = prefill_batch_tokens
        # "flashinfer" plans FlashInfer's buffers in T2 (`t2_groups`).
        self.attention_backend = attention_backend
        self.flashinfer: Any = None
        if attention_backend == "flashinfer":
            from imp_mem.engine.kernels import flashinfer_decode

            flashinfer_decode.require(memory.device)  # before the plan: a GPU's
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.keep_logits = keep_logits
        self.device = memory.device
        self.on_gpu = memory.on_gpu
        self._stream: Any = None
        self.graphs: dict[int, Any] = {}
        self.warm_up_seconds = 0.0
        self.capture_seconds = 0.0
        # The warm-up's seconds by part (`serve`): its prefills, its
        # decodes, the prefills again after a capture.
        self.warm_up_split: dict[str, float] = {}
        # A list to time each decode's graph replay into (CUDA event pairs
        # on the runner's stream), or None (the default: no events).
        self.replay_events: list[tuple[Any, Any]] | None = None
        # Seconds spent in imp-mem calls (block tables), for EngineStats.
        self.imp_mem_seconds = 0.0

    # ---------------------------------------------------------------- setup

    def set_model(self, config: ModelConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.sliding = bool(config.sliding_layers)
        self.ring_blocks, self.engine_blocks = engine_blocks(config, self.prefill_chunk, block_size)

    def groups(self, block_size: int | None = None) -> dict[str, dict[str, tuple]]:
        """`t2_groups` for this runner's model and limits."""
        return t2_groups(
            self.config,
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            prefill_chunk=self.prefill_chunk,
            block_size=block_size or self.block_size,
            keep_logits=self.keep_logits,
            flashinfer=self.attention_backend == "flashinfer",
            prefill_batch_tokens=self.prefill_batch_tokens,
        )

    def load(
        self,
        weights: dict[str, torch.Tensor],
        kv: Any,
        *,
        attention_backend: str | None,
        tp: Any,
        fused: bool | None = None,
    ) -> None:
        """The model over `weights`, the KV pools as tensors, the runner's
        own blocks from `kv` (the manager), T2 carved (once: a model swap
        keeps T2, whose layout it checks to be the same) and its inputs
        reset to padding."""
        c = self.config
        system = self.memory.system
        if attention_backend == "flashinfer":
            from imp_mem.engine.kernels import flashinfer_decode

            flashinfer_decode.require(self.device)
        self.weights = weights
        self.model = build_model(
            c,
            weights,
            attention_backend=attention_backend,
            max_positions=self.max_seq_len,
            tp=tp,
            fused=fused,
        )
        kv_dtype = getattr(torch, _KV_DTYPES[self.memory.plan.kv["dtype"]])
        geometry = (self.block_size, tp.kv_heads, c.head_dim)
        # A family with its own page layout (MLA's latents) names its block's shape.
        block_shape = getattr(self.model, "kv_block_shape", None)
        shape = block_shape(len(c.full_layers), self.block_size) if block_shape else None
        full = self._pool_view(
            system.kv_pool, len(c.full_layers), geometry, kv_dtype, "kv", block=shape
        )
        swa = None
        if self.sliding:
            if system.swa_pool is None:
                raise InvalidArgument("the model has sliding layers but the plan has no SWA pool")
            shape = block_shape(len(c.sliding_layers), self.block_size) if block_shape else None
            swa = self._pool_view(
                system.swa_pool, len(c.sliding_layers), geometry, kv_dtype, "swa", block=shape
            )
        self.kv_views = KvViews(full=full, swa=swa, block_size=self.block_size)
        self.kv = kv
        self.reserve_blocks()
        if not hasattr(self, "t2"):
            self._carve_t2()
        self.reset_inputs()

    def reserve_blocks(self) -> None:
        """Blocks the runner holds while serving, through sequences of its
        own in the manager (which accounts for every block of its pools):
        the padding rows' block in each pool, and the SWA prefill ring."""
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

    def release_blocks(self) -> None:
        """Gives the runner's own blocks back to the manager (the padding
        block, the ring): a pool that sleeps must hold no live block."""
        for sid in getattr(self, "engine_seqs", ()):
            self.kv.abort(sid)
        self.engine_seqs = []

    def reset_inputs(self) -> None:
        """Every row of the step's inputs on the padding block (position 0),
        staged and copied into T2."""
        W = self.width
        self._pad_row = _pad_row(W, self._pad_full)
        self._pad_swa_row = _pad_row(W, self._pad_swa)
        step_in = self.staging["decode_in"].np
        step_in["tables"][:] = self._pad_row
        step_in["ids"][:] = 0
        step_in["pos"][:] = 0
        if self.sliding:
            step_in["swa_tables"][:] = self._pad_swa_row
        self.t2_raw["decode_in"].copy_(self.staging["decode_in"].raw)

    def _carve_t2(self) -> None:
        self.width = math.ceil(self.max_seq_len / self.block_size)
        self.t2: dict[str, torch.Tensor] = {}
        self.t2_raw: dict[str, torch.Tensor] = {}
        self.staging: dict[str, _Staging] = {}
        groups = self.groups()
        backend = self.memory.backend
        for group, specs in groups.items():
            layout, total = _layout(specs)
            raw = torch.from_dlpack(self.memory.system.engine_arena.take(total, 256))
            self.t2_raw[group] = raw
            self.t2.update(_carve(raw, layout))
            if group == "prefill_in":
                event = torch.cuda.Event if self.on_gpu else None
                self.prefill_slots = _Slots(backend, specs, PREFILL_SLOTS, event)
            elif group not in ("out", "fi_work"):  # outputs and workspaces: no host copy
                self.staging[group] = _Staging(backend, specs)
        self.staging["next"] = _Staging(backend, {"next": groups["out"]["next"]})
        # A step's prefills' tables, read once from the manager (host memory).
        import numpy as np

        self._step_tables = np.full((self.max_batch, self.width), -1, dtype=np.int32)
        self._step_swa = np.full((self.max_batch, self.width), -1, dtype=np.int32)

    def _pool_view(self, pool, layers, geometry, dtype, what, block=None) -> torch.Tensor:
        # `block`: a whole block's shape, where the model lays its pages out itself.
        shape = (layers, 2, *geometry) if block is None else tuple(block)
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if pool.block_bytes != want:
            raise InvalidArgument(
                f"the {what} pool's blocks are {pool.block_bytes} B; the layout "
                f"[{', '.join(map(str, shape))}] x {dtype} is {want} B"
            )
        name = str(dtype).removeprefix("torch.")
        view = torch.from_dlpack(pool.view(name, shape))
        assert view.is_contiguous() and view.shape[1:] == shape
        return view

    def drop_model(self) -> None:
        """Drops everything over the model's memory (graphs, weights, KV
        views), so that no export of T1 or of a pool is alive."""
        for name in MODEL_ATTRS:
            if hasattr(self, name):
                delattr(self, name)
        self.graphs = {}
        self.flashinfer = None

    def drop_buffers(self) -> None:
        """Drops T2's tensors and the staging (before the system closes)."""
        for name in ("t2", "t2_raw", "staging", "prefill_slots"):
            if hasattr(self, name):
                delattr(self, name)

    # ------------------------------------------------- warm-up and graphs

    def on_stream(self) -> Any:
        """The runner's stream: every kernel it runs, eager or captured, goes
        there, so cuBLAS keeps one workspace for it (a workspace is per
        stream) rather than one for the current stream and one for capture."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    @property
    def stream(self) -> Any:
        return self._stream

    def serve(self, buckets: Sequence[int] | None, graphs: bool | None) -> None:
        """Warms up and captures the decode graphs (module doc)."""
        memory = self.memory
        if self.on_gpu:
            if self._stream is None:  # kept across a model swap
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
        self.flashinfer = None
        t0 = time.perf_counter()
        with self.on_stream():
            if self.attention_backend == "flashinfer":
                self._flashinfer_wrappers()  # zeroes its workspace on the stream
            self._warm_up()
        self.warm_up_seconds = time.perf_counter() - t0
        self.graphs = {}
        t0 = time.perf_counter()
        if self.use_graphs:
            # The warm-up's transients go back to the device before the
            # capture takes its pool (torch.cuda.graph empties torch's cache
            # on entry anyway). Without graphs they stay: serving runs the
            # same eager work, and the boot measures what it holds.
            memory.empty_torch_cache()
            self._capture()
            memory.empty_torch_cache()
        self.capture_seconds = time.perf_counter() - t0
        if self.use_graphs:
            # Every served prefill needs its working set beside the graphs'
            # pool: the prefills run again after the capture, so that what
            # the boot measures holds both (without it, the first served
            # batch grew torch's cache 128 MiB past the plan on the H200:
            # Qwen3-0.6B, 4 x 500-token batches).
            t0 = time.perf_counter()
            with torch.inference_mode(), self.on_stream(), memory.torch_ctx():
                self._warm_prefills()
            torch.cuda.synchronize(self.device)  # graphs imply a GPU
            self.warm_up_split["prefills_again"] = time.perf_counter() - t0
            self.warm_up_seconds += time.perf_counter() - t0
        if hasattr(self.model, "encode_images"):
            # One image's working set, left in torch's cache (or the
            # activations tier) after the capture, so the warm-up's
            # measurement plans it (`memory`'s module doc).
            with torch.inference_mode(), self.on_stream(), memory.torch_ctx():
                self._warm_tower()
        memory.charge_torch()

    def _flashinfer_wrappers(self) -> None:
        """FlashInfer's decode wrappers, one a bucket, over T2 (`kernels.flashinfer_decode`),
        given to the model."""
        from imp_mem.engine.kernels import flashinfer_decode

        c = self.config
        if self.kv_views.full.stride(0) >= 1 << 32:
            # FlashInfer holds the page stride as a 32-bit element count.
            raise InvalidArgument(
                f"attention_backend='flashinfer': a KV block of {self.kv_views.full.stride(0)} "
                "elements is beyond FlashInfer's 32-bit page stride; use attention_backend='triton'"
            )
        self.flashinfer = flashinfer_decode.DecodeWrappers(
            flashinfer_decode.require(self.device),
            self.t2,
            self.staging["decode_in"].t,
            buckets=self.buckets,
            heads=self.model.heads,
            kv_heads=self.model.kv_heads,
            head_dim=c.head_dim,
            block_size=self.block_size,
            q_dtype=self.model.dtype,
            kv_dtype=self.kv_views.full.dtype,
        )
        self.model.flashinfer = self.flashinfer

    def _stage_decode(self, b: int, *, blocking: bool) -> None:
        """Plans FlashInfer's step for bucket `b` over the staged rows (when
        it serves the decode), then copies the step's inputs into T2."""
        staged = self.staging["decode_in"]
        if self.flashinfer is not None:
            self.flashinfer.plan(b, staged.np["pos"], staged.np["tables"])
        self.t2_raw["decode_in"].copy_(staged.raw, non_blocking=not blocking)

    def _warm_up(self) -> None:
        """The prefills (`_warm_prefills`), then the decode at every
        bucket: torch's allocator (or the activation pool) holds the
        prefill's working set before serving (`serve` runs the prefills
        again after a capture, which empties torch's cache), and every
        kernel is compiled before any capture."""
        t0 = time.perf_counter()
        with torch.inference_mode(), self.memory.torch_ctx():
            self._warm_prefills()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        with torch.inference_mode(), self.memory.torch_ctx():
            for b in sorted(self.buckets, reverse=True):
                if self.flashinfer is not None:
                    self._stage_decode(b, blocking=True)
                self.decode_body(b)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        self.warm_up_split = {"prefills": t1 - t0, "decodes": time.perf_counter() - t1}

    def _warm_prefills(self) -> None:
        """The warm-up's prefills (the largest batch, when batching; then
        the longest chunk at the end of the longest context, a full chunk
        from the start and one token) of a sequence admitted for them and
        aborted after, when the KV pool can hold it."""
        kv = self.kv
        sid = WARM_SEQ
        n = self.max_seq_len - 1
        tokens = [0] * n
        if not kv.can_admit(tokens):
            return
        kv.admit(sid, tokens)
        try:
            chunk = min(self.prefill_chunk, n)
            if self.batching:
                self._warm_batch(sid, tokens, n)
            for start, end in ((n - chunk, n), (0, chunk), (0, 1)):
                self.prefill_chunk_logits(sid, tokens, start, end)
        finally:
            kv.abort(sid)

    def _warm_batch(self, sid: int, tokens: list[int], n: int) -> None:
        """The largest batched prefill: the most chunks (`batch_rows`) of
        the most tokens (the budget, each chunk at most `prefill_chunk` and
        at most the `n` tokens of sequence `sid`), every chunk ending at
        the sequence's end (its tables on every row, chunks overlapping
        where the sequence is shorter than the batch: the warm-up wants the
        working set, not the values). The budget is not capped by one
        sequence's length: serving batches several (measured on the H200:
        a warm-up of 639 tokens under a 2 048-token budget left 128 MiB of
        torch's working set to the served steps, outside the plan)."""
        import numpy as np

        rows = batch_rows(self.max_batch, self.prefill_batch_tokens)
        total = min(self.prefill_batch_tokens, rows * min(self.prefill_chunk, n))
        rows = min(rows, total)
        table = np.full((1, self.width), -1, dtype=np.int32)
        swa = np.full((1, self.width), -1, dtype=np.int32)
        self.kv.block_tables([sid], table)
        if self.sliding:
            self.kv.block_tables([sid], swa, pool="swa")
        chunks = []
        for k in range(rows):
            size = total // rows + (k < total % rows)
            last = k if k + 1 == rows else None
            chunks.append((tokens, n - size, n, table[0], swa[0], last))
        self._prefill_batch(chunks)

    def _warm_tower(self) -> None:
        """Encodes one zero image (the tower's kernels loaded, its working
        set in the allocator that serves it)."""
        pixels = torch.zeros((1, *self.model.image_shape), device=self.device)
        self.model.encode_images(pixels)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def _capture(self) -> None:
        # On the stream the warm-up ran on (its library handles and
        # workspaces exist already, as torch's graph recipe needs).
        pool, stream = self.memory.graph_pool(), self._stream
        with torch.inference_mode(), self.memory.capture_ctx():
            for b in sorted(self.buckets, reverse=True):
                if self.flashinfer is not None:
                    # The plan the graph bakes in (FlashInfer's CUDA-graph
                    # mode keeps its shape for the bucket; each step re-plans).
                    with self.on_stream():
                        self._stage_decode(b, blocking=True)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.decode_body(b)
                self.graphs[b] = g
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ the steps

    def decode_body(self, b: int) -> None:
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

    def prefill(self, p: Prefill, row: int = 0) -> int:
        """Prefills a request from its first uncached token, in chunks,
        without waiting for the device; its greedy token goes to row `row`
        of T2's ``next`` (read by `prefill_tokens`, one row per prefill of
        the step). Returns the tokens prefilled. A request with an image
        runs the vision tower once (when its image tokens are not all
        cached) and ends a chunk before the image's tokens rather than
        inside them, so the image is prefilled in one call (its tokens
        attend to each other both ways)."""
        if not 0 <= row < self.max_batch:
            raise InvalidArgument(f"row={row}: a prefill's row is in [0, {self.max_batch})")
        tokens, n = p.tokens, len(p.tokens)
        sid = p.request.seq_id
        start = p.start
        mm = self._image_embeddings(p.request, start)
        logits = None
        while start < n:
            end = min(n, start + self.prefill_chunk)
            if mm is not None and start < mm[0] < end < mm[1]:
                end = mm[0]
            touches = mm is not None and start < mm[1] and mm[0] < end
            logits = self.prefill_chunk_logits(sid, tokens, start, end, mm if touches else None)
            start = end
        self.t2["next"][row : row + 1].copy_(logits[0].argmax(-1, keepdim=True))
        return n - p.start

    @property
    def batching(self) -> bool:
        """Whether this model's prefills are batched (a budget is set and
        the model serves `prefill_batch`)."""
        return bool(self.prefill_batch_tokens) and getattr(self.model, "prefill_batch_ok", False)

    def prefill_step(self, prefills: Sequence[Prefill]) -> int:
        """Prefills a step's admissions, prefill ``k`` into row ``k`` of T2's
        ``next`` (read by `prefill_tokens`), without waiting for the device;
        returns the tokens prefilled. With batching (module doc) the
        requests' chunks go in batches of at most `prefill_batch_tokens`
        tokens, one chunk of each request a batch; a request whose image
        is still to encode, or a model without `prefill_batch`, runs
        `prefill` alone."""
        if len(prefills) > self.max_batch:
            raise InvalidArgument(
                f"{len(prefills)} prefills in one step: at most max_batch={self.max_batch}"
            )
        if not self.batching:
            return sum(self.prefill(p, row) for row, p in enumerate(prefills))
        done, todo = 0, []
        for row, p in enumerate(prefills):
            req = p.request
            if req.image is not None and req.mm and req.mm[0][1] > p.start:
                done += self.prefill(p, row)
            else:
                todo.append((row, p))
        if not todo:
            return done
        n = len(todo)
        seqs = [p.request.seq_id for _, p in todo]
        tables, swa = self._step_tables[:n], self._step_swa[:n]
        t0 = time.perf_counter()
        self.kv.block_tables(seqs, tables)
        if self.sliding:
            self.kv.block_tables(seqs, swa, pool="swa")
        self.imp_mem_seconds += time.perf_counter() - t0
        at = [p.start for _, p in todo]
        left = [i for i in range(n) if at[i] < len(todo[i][1].tokens)]
        budget, chunk = self.prefill_batch_tokens, self.prefill_chunk
        # The request whose chunks map onto the SWA ring (at most one at a
        # time: the ring holds one sequence's early window).
        owner = None
        while left:
            batch, used = [], 0
            for i in sorted(left, key=lambda i: i != owner):
                row, p = todo[i]
                s, e = at[i], min(len(p.tokens), at[i] + chunk)
                if used + e - s > budget:
                    continue
                if self.sliding and self._needs_ring(swa[i], s, e):
                    if owner is None:
                        owner = i
                    elif owner != i:
                        continue
                elif owner == i:
                    owner = None
                last = row if e == len(p.tokens) else None
                batch.append((p.tokens, s, e, tables[i], swa[i] if self.sliding else None, last))
                used += e - s
                at[i] = e
            self._prefill_batch(batch)
            done += used
            left = [i for i in left if at[i] < len(todo[i][1].tokens)]
            if owner not in left:
                owner = None
        return done

    def _needs_ring(self, swa, start: int, end: int) -> bool:
        """Whether a chunk ``[start, end)`` reads SWA blocks the manager has
        not given (`_fill_ring`)."""
        first = max(0, start + 1 - self.config.sliding_window) // self.block_size
        return bool((swa[first : (end - 1) // self.block_size + 1] < 0).any())

    def _prefill_batch(self, chunks: list[tuple]) -> torch.Tensor:
        """One forward over `chunks`, each ``(tokens, start, end, table,
        swa_table, row)``: positions ``[start, end)`` of a sequence whose
        block tables are given (host rows; the SWA row mapped onto the ring
        here where the manager gave no block); a chunk with a `row` ends its
        prompt, and its greedy token goes to that row of T2's ``next``.
        Returns the logits ``[R, vocab]``."""
        slots, t2 = self.prefill_slots, self.t2
        host = slots.take().np
        r = len(chunks)
        cu, at, pick, spans = host["prefill_cu"], 0, [], []
        cu[0] = 0
        for k, (tokens, start, end, table, swa, row) in enumerate(chunks):
            host["prefill_ids"][at : at + end - start] = tokens[start:end]
            at += end - start
            cu[k + 1] = at
            host["prefill_starts"][k] = start
            host["prefill_table"][k] = table
            if self.sliding:
                host["prefill_swa"][k] = swa
                self._fill_ring(host["prefill_swa"][k], start, end)
            spans.append((start, end - start))
            if row is not None:
                pick.append((k, row))
        f = len(pick)
        host["prefill_pick"][:f] = [k for k, _ in pick]
        host["prefill_rows"][:f] = [row for _, row in pick]
        # Non-blocking: the slot is rewritten only after this copy's event.
        slots.copy_to(self.t2_raw["prefill_in"])
        logits = self.model.prefill_batch(
            t2["prefill_ids"][:at],
            t2["prefill_cu"][: r + 1],
            t2["prefill_starts"][:r],
            t2["prefill_table"][:r],
            t2["prefill_swa"][:r] if self.sliding else None,
            self.kv_views,
            spans=spans,
        )
        if f:
            tokens = logits.argmax(-1).index_select(0, t2["prefill_pick"][:f])
            t2["next"].index_copy_(0, t2["prefill_rows"][:f], tokens)
        return logits

    def prefill_tokens(self, k: int) -> list[int]:
        """The greedy tokens of the step's `k` prefills (rows ``[0, k)`` of
        T2's ``next``), in one copy that waits for them."""
        nxt = self.staging["next"]
        nxt.t["next"][:k].copy_(self.t2["next"][:k])  # blocking: waits for the prefills
        return nxt.np["next"][:k].tolist()

    def decode(self, batch: list[Request]) -> tuple[list[int], int]:
        """One decode of every sequence of `batch`; returns the greedy
        tokens and the bucket replayed."""
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
        self.imp_mem_seconds += time.perf_counter() - t0
        host["tables"][n:b] = self._pad_row
        if self.sliding:
            host["swa_tables"][n:b] = self._pad_swa_row
        # One copy of the whole input region (tens of KiB; FlashInfer's page
        # table planned first, when it serves); it is complete before the
        # next step rewrites the staging, which the blocking read of the
        # tokens below guarantees.
        self._stage_decode(b, blocking=False)
        if self.use_graphs:
            if self.replay_events is None:
                self.graphs[b].replay()
            else:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                self.graphs[b].replay()
                end.record()
                self.replay_events.append((start, end))
        else:
            self.decode_body(b)
        nxt = self.staging["next"]
        nxt.t["next"][:b].copy_(self.t2["next"][:b])  # blocking: waits for the step
        return nxt.np["next"][:n].tolist(), b

    def _image_embeddings(self, req: Request, start: int) -> Any:
        """``(s, e, embeddings)`` of a request's image when a prefill from
        `start` reaches its tokens ``[s, e)``; None otherwise."""
        if req.image is None or not req.mm:
            return None
        lo, hi, _ = req.mm[0]
        if hi <= start:
            return None
        pixels = req.image.to(self.device, non_blocking=True)
        return lo, hi, self.model.encode_images(pixels)[0]

    def prefill_chunk_logits(
        self, sid: int, tokens, start: int, end: int, mm: Any = None
    ) -> torch.Tensor:
        """Prefills positions [start, end) of sequence `sid`; the last
        token's logits. `mm`: the image's ``(s, e, embeddings)`` when the
        chunk holds its tokens."""
        slots, t2 = self.prefill_slots, self.t2
        host = slots.take().np
        n = end - start
        host["prefill_ids"][:n] = tokens[start:end]
        t0 = time.perf_counter()
        self.kv.block_tables([sid], host["prefill_table"][:1])
        if self.sliding:
            swa = host["prefill_swa"][0]
            self.kv.block_tables([sid], host["prefill_swa"][:1], pool="swa")
        self.imp_mem_seconds += time.perf_counter() - t0
        if self.sliding:
            self._fill_ring(swa, start, end)
        # Non-blocking: the slot is rewritten only after this copy's event.
        slots.copy_to(self.t2_raw["prefill_in"])
        return self.model.prefill(
            t2["prefill_ids"][:n],
            start,
            t2["prefill_table"][0],
            t2["prefill_swa"][0] if self.sliding else None,
            self.kv_views,
            last_only=True,
            **({"mm": mm} if mm is not None else {}),
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
