"""Paged decode attention on the GPU, side by side: our Triton kernel against
FlashInfer's batch decode (issue 25), over the same pages in the engine's
layout, at Qwen3-8B's numbers (32 query / 8 KV heads, head_dim 128, bf16,
16-token pages).

Layout. The engine's pool is ``kv[blocks, layers, 2, 16, kv_heads, 128]``;
one layer's pages ``kv[:, layer]`` are ``[blocks, 2, 16, kv_heads, 128]``
with a page stride of ``layers`` pages, which is FlashInfer's 5-D ``NHD``
paged cache with a larger page stride. FlashInfer takes the strides of the
tensor it is given (``paged_kv_t`` is built from them), so both read the
same bytes in place, nothing copied; ``--layers 1`` is FlashInfer's own
contiguous layout. FlashInfer runs as the engine runs it
(`flashinfer_decode.DecodeWrappers` over buffers laid out as T2's): the block
tables become its CSR page table on the host (`page_table`), then its
``plan``.

Timing. Each side runs inside a CUDA graph of ``--calls`` calls (as a decode
step replays them). FlashInfer's wrapper is built with ``use_cuda_graph``
and fixed index buffers; its ``plan()`` (host work every step: CSR copies,
the split schedule, our page table built before it and the input copy
after) runs before the capture and is timed on its own, on the host, as
the engine pays it before each replay. ``cuda`` is FlashInfer's CUDA-core
decode kernel (what the engine runs), ``tc`` its tensor-core path (the
prefill kernel with one query per request); each variant is one JIT
compile with nvcc on first use, timed and printed. Reported: µs per call,
GB/s of K and V read, the fraction of ``--hbm-tbs`` and the largest
absolute difference of each output against the torch reference
(`paged_decode_attention_reference`, float32 softmax).

``python benches/bench_flashinfer_decode.py [--batch 64,128] [--context
1024,4096] [--variants cuda,tc] [--layers 8]``. Without FlashInfer it says
so and reports ours alone (exit 0).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_paged_attention import graph_time_us, paged_pool  # the same timer and pool

from imp_mem.engine.kernels import flashinfer_decode
from imp_mem.engine.model.attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def setup(batch: int, context: int, layers: int, seed: int = 0):
    """`bench_paged_attention.paged_pool` at this bench's heads."""
    return paged_pool(batch, context, layers, heads=HEADS, kv_heads=KV_HEADS, seed=seed)


class FlashInferDecode:
    """The engine's FlashInfer decode (`flashinfer_decode.DecodeWrappers`) for one
    bucket, over buffers laid out as T2's (device) and the staging's
    (pinned host)."""

    def __init__(self, batch: int, width: int, tensor_cores: bool) -> None:
        specs = flashinfer_decode.input_specs(batch, width)
        self.t2 = {
            name: torch.zeros(shape, dtype=dtype, device="cuda")
            for name, (shape, dtype) in {**specs, **flashinfer_decode.workspace_specs()}.items()
        }
        self.staging = {
            name: torch.zeros(shape, dtype=dtype).pin_memory()
            for name, (shape, dtype) in specs.items()
        }
        self.batch = batch
        self.wrappers = flashinfer_decode.DecodeWrappers(
            flashinfer_decode.require(),
            self.t2,
            self.staging,
            buckets=[batch],
            heads=HEADS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK,
            q_dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16,
            tensor_cores=tensor_cores,
        )

    def plan(self, positions, tables) -> None:
        """What the engine does on the host before a replay: the page table
        built and planned, then the input copy (here the three arrays)."""
        self.wrappers.plan(self.batch, positions, tables)
        for name in ("fi_indptr", "fi_indices", "fi_last"):
            self.t2[name].copy_(self.staging[name], non_blocking=True)

    def run(self, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        return self.wrappers.run(q, pages)


def import_flashinfer():
    """FlashInfer's module, or None with a line saying why."""
    try:
        import flashinfer
    except Exception as err:  # ImportError, or a broken install (tvm-ffi, CUDA)
        print(f"flashinfer: not importable ({type(err).__name__}: {err}); reporting ours only")
        return None
    print(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
    return flashinfer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="64,128")
    parser.add_argument("--context", default="1024,4096")
    parser.add_argument("--layers", type=int, default=8, help="layers per block in the pool")
    parser.add_argument("--variants", default="cuda,tc", help="FlashInfer kernels: cuda, tc")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--plan-calls", type=int, default=200)
    parser.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    fi = import_flashinfer()
    variants = [v for v in args.variants.split(",") if v] if fi is not None else []
    for v in variants:
        if v not in ("cuda", "tc"):
            raise SystemExit(f"--variants: {v!r} is not 'cuda' or 'tc'")
    compiled: set[str] = set()
    print(
        f"{'batch':>5} {'ctx':>5} {'kernel':>10} {'µs':>8} {'GB/s':>7} {'of HBM':>6} "
        f"{'vs ours':>7} {'max|Δ|':>7} {'plan µs':>8}"
    )
    layer = 0
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            q, kv, tables, positions = setup(batch, context, args.layers)
            nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
            ref = paged_decode_attention_reference(q, kv, layer, tables, positions).float()

            def ours(q=q, kv=kv, tables=tables, positions=positions):
                return paged_decode_attention(q, kv, layer, tables, positions)

            t_ours = graph_time_us(ours, args.calls, args.replays)
            diff = (ours().float() - ref).abs().max().item()

            def row(name, t, d, plan_us=None, t_ours=t_ours, nbytes=nbytes, b=batch, c=context):
                gbs = nbytes / t / 1e3
                plan = f"{plan_us:8.1f}" if plan_us is not None else f"{'-':>8}"
                print(
                    f"{b:>5} {c:>5} {name:>10} {t:>8.1f} {gbs:>7.0f} "
                    f"{gbs / (args.hbm_tbs * 1e3):>6.1%} {t_ours / t:>7.2f} {d:>7.4f} {plan}",
                    flush=True,
                )

            row("triton", t_ours, diff)
            pages = kv[:, layer]  # [blocks, 2, BLOCK, KV_HEADS, HEAD_DIM]: NHD, strided
            host_pos, host_tables = positions.cpu().numpy(), tables.cpu().numpy()
            for v in variants:
                dec = FlashInferDecode(batch, tables.shape[1], tensor_cores=v == "tc")
                t0 = time.perf_counter()
                dec.plan(host_pos, host_tables)
                out = dec.run(q, pages)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                if v not in compiled:
                    compiled.add(v)
                    print(f"  flashinfer {v}: first plan + run {first:.1f} s (JIT compile)")
                d = (out.float() - ref).abs().max().item()
                t0 = time.perf_counter()
                for _ in range(args.plan_calls):
                    dec.plan(host_pos, host_tables)
                torch.cuda.synchronize()
                plan_us = (time.perf_counter() - t0) * 1e6 / args.plan_calls

                def fi_run(dec=dec, q=q, pages=pages):
                    return dec.run(q, pages)

                row(f"fi-{v}", graph_time_us(fi_run, args.calls, args.replays), d, plan_us)
                del dec
            del kv, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
