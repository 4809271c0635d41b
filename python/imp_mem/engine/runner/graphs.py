"""The runner's warm-up and its CUDA graphs.

`serve` warms up (the largest batched prefill, a prefill of the longest
chunk over the longest context, the decode at every batch bucket), then
captures decode in one CUDA graph per bucket over the T2 tensors only (no
graphs on the CPU); with graphs, the prefills run again after the capture,
so that what the boot measures holds both their working set and the
graphs' pool. Every kernel the runner launches, eager or captured, goes to
the runner's own stream (`on_stream`). With FlashInfer serving the decode,
its wrappers (one a bucket, over T2) are made here and given to the model.

Images (a model with a vision tower, Gemma-3). After the graph capture the
runner encodes one zero image, so the tower's working set sits in torch's
cache (or the activations tier) when the warm-up is measured: planned, not
grown while serving.

`WarmUp` is the part of `ModelRunner` that does this; the steps it runs
are `runner.steps`'.

Thread safety: none; one thread drives the runner.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from imp_mem.engine.runner.buffers import batch_rows
from imp_mem.engine.runner.kv import WARM_SEQ
from imp_mem.errors import InvalidArgument


def default_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured as graphs: powers of two up to `max_batch`, and it."""
    out = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return [*out, max_batch]


class WarmUp:
    """The warm-up and the decode graphs, as a part of `ModelRunner`."""

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
