"""The engine's GPU kernels, apart from the models that call them.

* `paged`: Triton paged decode attention (split-K flash-decoding over the
  KV pages in place);
* `prefill`: Triton varlen prefill attention over the KV pages (several
  sequences' chunks in one launch);
* `fused`: Triton kernels that fuse a decoder layer's small decode
  operations (add + RMSNorm; q/k norm, RoPE and the KV store; SiLU times up);
* `flashinfer_decode`: FlashInfer's batch decode bound to the engine's
  pages and T2 (``attention_backend="flashinfer"``).

The models reach them through `imp_mem.engine.model.attention` (the
attention kernels) and `imp_mem.engine.model.qwen3` (the fused ones); the
runner plans FlashInfer's buffers. This package imports none of them: a
Triton module reads ``TRITON_INTERPRET`` when its kernels are decorated,
so each is imported where it is first used.
"""
