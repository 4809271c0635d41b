"""A stand-in for the `flashinfer` module on the CPU, for the engine's
``attention_backend="flashinfer"`` plumbing: `BatchDecodeWithPagedKVCacheWrapper`
with FlashInfer 0.6.1's signature and CUDA-graph-mode contract, as its
source states it (decode.py):

* the constructor takes the float workspace, the layout ("NHD") and, with
  ``use_cuda_graph``, the three index buffers (indptr ``batch + 1`` long,
  last_page_len ``batch`` long), which fix the batch;
* ``plan(indptr, indices, last_page_len, heads, kv_heads, head_dim,
  page_size, ...)`` copies the three arrays into those buffers
  (``indices`` into the buffer's first ``len(indices)``) and reads
  ``indptr`` and ``last_page_len`` on the host;
* ``run(q, cache)`` attends over a 5-D ``[pages, 2, page_size, kv_heads,
  head_dim]`` cache (K at ``[:, 0]``, V at ``[:, 1]``, any page stride)
  through the *buffers*, row b's keys being its pages
  ``indices[indptr[b]:indptr[b + 1]]``, the last holding
  ``last_page_len[b]`` tokens.

The attention is float32 softmax over exactly those tokens (query head h on
KV head ``h // (heads / kv_heads)``), so the engine's output through it
must equal its torch backend's up to summation order; any mistake in the
page table, the staging or the buffers' copies shows as different tokens.
"""

from __future__ import annotations

import torch

RUNS_ON_CPU = True
__version__ = "0.6.1-cpu-stand-in"


class BatchDecodeWithPagedKVCacheWrapper:
    plans = 0
    runs = 0

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ):
        assert kv_layout == "NHD" and use_cuda_graph
        for buf in (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        ):
            assert torch.is_tensor(buf) and buf.dtype == torch.int32
        if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
            raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.batch = len(paged_kv_last_page_len_buffer)
        self.indptr = paged_kv_indptr_buffer
        self.indices = paged_kv_indices_buffer
        self.last = paged_kv_last_page_len_buffer
        self.float_ws = float_workspace_buffer
        self.int_ws = torch.empty(8 << 20, dtype=torch.uint8)
        self.planned = None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.float_ws, self.int_ws = float_workspace_buffer, int_workspace_buffer

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        **_,
    ):
        if len(last_page_len) != self.batch:
            raise ValueError("The batch size should be fixed in cudagraph mode")
        if len(indices) > len(self.indices):
            raise ValueError("The size of indices should be less than or equal to the buffer")
        self.indptr.copy_(indptr)
        self.last.copy_(last_page_len)
        self.indices[: len(indices)].copy_(indices)
        host_last = last_page_len.to("cpu")
        assert ((host_last >= 1) & (host_last <= page_size)).all()
        self.planned = (num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type)
        type(self).plans += 1

    def run(self, q, paged_kv_cache):
        assert self.planned is not None, "plan() first"
        heads, kv_heads, head_dim, page_size, q_dtype = self.planned
        assert q.shape == (self.batch, heads, head_dim) and q.dtype == q_dtype
        k_cache, v_cache = paged_kv_cache.unbind(1)
        assert k_cache.shape[1:] == (page_size, kv_heads, head_dim)
        group = heads // kv_heads
        out = torch.empty_like(q)
        indptr, indices, last = self.indptr.tolist(), self.indices, self.last.tolist()
        for b in range(self.batch):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            n = (len(pages) - 1) * page_size + last[b]
            keys = k_cache[pages].reshape(-1, kv_heads, head_dim)[:n].float()
            values = v_cache[pages].reshape(-1, kv_heads, head_dim)[:n].float()
            qb = q[b].float().view(kv_heads, group, head_dim)
            scores = torch.einsum("hgd,jhd->hgj", qb, keys) * head_dim**-0.5
            probs = torch.softmax(scores, dim=-1)
            out[b] = torch.einsum("hgj,jhd->hgd", probs, values).reshape(heads, head_dim)
        type(self).runs += 1
        return out
