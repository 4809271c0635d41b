"""FlashInfer's batch decode as the decode attention of full-attention
layers (``attention_backend="flashinfer"``; prefill and sliding-window
layers stay on `model.attention`'s paths).

Layout. One layer's pages, ``kv[:, layer]``, are ``[blocks, 2, block_size,
kv_heads, head_dim]``: FlashInfer's 5-D ``NHD`` paged cache, whose page
stride (the pool's layers times a layer's page) FlashInfer reads from the
tensor, so it attends over the pool in place. Its page table is CSR: for
the rows of a batch, ``indptr[b]`` the first of row b's pages in
``indices``, ``indices`` the rows' blocks back to back (int32), and
``last_page_len[b]`` the tokens in row b's last page, 1 to block_size
(`page_table` builds the three from the engine's block tables and
positions, on the host).

Memory. Everything FlashInfer reads or writes on the device is planned, in
T2 (`model_runner.t2_groups`): the three CSR arrays in the step's input
region (staged on the host with the rest and copied with them, one copy),
and its two workspaces (float: the split-K partials; int: the schedule
`plan` writes) in a region of their own, `FLOAT_WORKSPACE_BYTES` and
`INT_WORKSPACE_BYTES`. A wrapper's constructor allocates an int workspace
of its own from torch before `DecodeWrappers` swaps in T2's (transient, 8
MiB a bucket, freed before the warm-up is measured), and each wrapper
holds a pinned host copy of the int workspace (host memory, 8 MiB a
bucket).

Graphs. FlashInfer's CUDA-graph mode fixes the batch of a wrapper and the
addresses of its index buffers, so there is one wrapper per decode bucket
over prefixes of the same T2 arrays (only one bucket runs at a time). Its
``plan`` runs on the host before every step (before each replay, as before
the capture): it copies indptr and last_page_len from the staging and
writes the schedule into the int workspace, on the current stream; the
indices it is handed are the T2 array itself, which the step's input copy
fills.

Thread safety: none; the runner's thread plans and runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from imp_mem.errors import InvalidArgument

# FlashInfer's recommended float workspace and its own int workspace size.
FLOAT_WORKSPACE_BYTES = 128 << 20
INT_WORKSPACE_BYTES = 8 << 20

INSTALL = (
    "pip install flashinfer-python==0.6.1 (with apache-tvm-ffi; it compiles its "
    "kernels with nvcc on first use), or pass attention_backend='triton'"
)


def require(device: Any = None) -> Any:
    """The `flashinfer` module; `InvalidArgument` saying how to install it
    when it does not import, or that it runs on a GPU when `device` is
    another (a stand-in module that sets ``RUNS_ON_CPU``, as the CPU tests'
    does, runs anywhere)."""
    try:
        import flashinfer
    except Exception as err:  # ImportError, or a broken install (tvm-ffi, CUDA libraries)
        raise InvalidArgument(
            f"attention_backend='flashinfer' needs FlashInfer, which does not import here "
            f"({type(err).__name__}: {err}); {INSTALL}"
        ) from err
    on_cpu = device is not None and torch.device(device).type != "cuda"
    if on_cpu and not getattr(flashinfer, "RUNS_ON_CPU", False):
        raise InvalidArgument(
            f"attention_backend='flashinfer' runs on a GPU only (the engine is on {device}); "
            "pass attention_backend='torch' or None"
        )
    return flashinfer


def input_specs(max_batch: int, width: int) -> dict[str, tuple]:
    """The CSR arrays in the step's input region: name -> (shape, dtype)."""
    return {
        "fi_indptr": ((max_batch + 1,), torch.int32),
        "fi_indices": ((max_batch * width,), torch.int32),
        "fi_last": ((max_batch,), torch.int32),
    }


def workspace_specs() -> dict[str, tuple]:
    """FlashInfer's workspaces, a T2 region of their own."""
    return {
        "fi_float": ((FLOAT_WORKSPACE_BYTES,), torch.uint8),
        "fi_int": ((INT_WORKSPACE_BYTES,), torch.uint8),
    }


def page_table(
    positions: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    indptr: np.ndarray,
    indices: np.ndarray,
    last: np.ndarray,
) -> int:
    """Fills FlashInfer's CSR page table of rows whose new token is at
    ``positions[b]`` (context ``positions[b] + 1`` tokens) over
    ``tables[b]``: `indptr` (``len(positions) + 1``), `indices` (its first
    ``indptr[-1]`` entries) and `last` (``len(positions)``). Returns the
    number of pages. A row whose context reaches a -1 entry or past its
    table is refused (`InvalidArgument`): FlashInfer would read a page that
    is not there."""
    n = len(positions)
    pages = positions.astype(np.int64) // block_size + 1
    width = tables.shape[1]
    if n and (int(positions.min()) < 0 or int(pages.max()) > width):
        raise InvalidArgument(
            f"flashinfer decode: positions must be in [0, {width * block_size}) for tables "
            f"{width} blocks wide"
        )
    used = np.arange(width)[None, :] < pages[:, None]
    flat = tables[:n][used]
    if (flat < 0).any():
        row = int(np.nonzero((tables[:n] < 0) & used)[0][0])
        raise InvalidArgument(
            f"flashinfer decode: row {row}'s table has no block inside its context; "
            "FlashInfer serves full-attention tables without holes"
        )
    total = len(flat)
    indptr[0] = 0
    indptr[1 : n + 1] = np.cumsum(pages)
    indices[:total] = flat
    last[:n] = positions % block_size + 1
    return total


class DecodeWrappers:
    """One FlashInfer decode wrapper per bucket in CUDA-graph mode over T2's
    buffers (module doc). `t2` holds the `input_specs` and
    `workspace_specs` tensors; `staging` the host views of the input ones.
    `tensor_cores`: FlashInfer's tensor-core decode (its prefill kernel, one
    query a request; the benchmark's ``tc``; its wrapper also keeps a small
    index array of its own from torch), else its CUDA-core decode kernel."""

    def __init__(
        self,
        fi: Any,
        t2: dict[str, torch.Tensor],
        staging: dict[str, torch.Tensor],
        *,
        buckets: list[int],
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        tensor_cores: bool = False,
    ) -> None:
        self.t2, self.staging = t2, staging
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.block_size, self.q_dtype, self.kv_dtype = block_size, q_dtype, kv_dtype
        width = t2["fi_indices"].shape[0] // t2["fi_last"].shape[0]
        # FlashInfer asks for a zeroed float workspace at first use.
        t2["fi_float"].zero_()
        self.wrappers: dict[int, Any] = {}
        for b in buckets:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                t2["fi_float"],
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=t2["fi_indptr"][: b + 1],
                paged_kv_indices_buffer=t2["fi_indices"][: b * width],
                paged_kv_last_page_len_buffer=t2["fi_last"][:b],
            )
            w.reset_workspace_buffer(t2["fi_float"], t2["fi_int"])
            self.wrappers[b] = w

    def plan(self, b: int, positions: np.ndarray, tables: np.ndarray) -> None:
        """Builds bucket `b`'s page table in the staging from the host rows
        (``positions[:b]``, ``tables[:b]``) and plans its wrapper; the
        caller then copies the staging into T2 and runs the step."""
        host = self.staging
        total = page_table(
            positions[:b],
            tables[:b],
            self.block_size,
            host["fi_indptr"].numpy(),
            host["fi_indices"].numpy(),
            host["fi_last"].numpy(),
        )
        self.wrappers[b].plan(
            host["fi_indptr"][: b + 1],
            # The T2 array itself: the step's input copy fills it.
            self.t2["fi_indices"][:total],
            host["fi_last"][:b],
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.block_size,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
        )

    def run(self, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Decode attention of ``q[b, heads, head_dim]`` over one layer's
        pages ``[blocks, 2, block_size, kv_heads, head_dim]``, with the
        wrapper of bucket ``b`` as last planned."""
        return self.wrappers[q.shape[0]].run(q, pages)
