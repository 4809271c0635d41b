"""Paged decode attention on the GPU: our Triton kernel over KV pages in place
against torch SDPA over a contiguous cache of the same tokens (issue 13).

Shape of a Qwen3-0.6B decode step: 16 query / 8 KV heads, head_dim 128,
bf16, 16-token pages scattered in a pool laid out as the engine's
(``[blocks, layers, 2, 16, 8, 128]``), one query token per sequence. Both
sides run inside CUDA graphs (``--calls`` launches per graph, as a decode
step replays them), so launch overhead is not measured; the time per call
is printed with the HBM roofline (K and V bytes read ÷ ``--hbm-tbs``) and
the ratio ours ÷ SDPA. SPEC (H200): roofline 31 µs, SDPA 36.6 µs at batch
32 x 1 024.

``python benches/bench_paged_attention.py [--batch 32,128] [--context 1024]
[--window 256] [--sweep]``; ``--sweep`` times kernel configurations (split
size, tile, warps, stages) and prints the best ones, to choose
``kernels.paged``'s defaults on a new GPU.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from imp_mem.engine.kernels import paged as paged_kernel
from imp_mem.engine.model.attention import contiguous_decode_sdpa, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def graph_time_us(fn, calls: int, replays: int) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `calls`
    calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def paged_pool(
    batch: int,
    context: int,
    layers: int,
    *,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    seed: int = 0,
):
    """A pool in the engine's layout with `batch` sequences of `context`
    tokens on scattered pages (block 0 unused, as the engine's padding
    block), their tables and positions, and one query per sequence."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-context // BLOCK)
    blocks = batch * width + 1
    kv = torch.randn(
        (blocks, layers, 2, BLOCK, kv_heads, HEAD_DIM),
        generator=gen,
        device="cuda",
        dtype=torch.bfloat16,
    )
    perm = torch.randperm(blocks - 1, generator=gen, device="cuda").int() + 1
    tables = perm[: batch * width].view(batch, width).contiguous()
    positions = torch.full((batch,), context - 1, device="cuda")
    q = torch.randn(batch, heads, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, kv, tables, positions


def setup(batch: int, context: int, layers: int, seed: int = 0):
    q, kv, tables, positions = paged_pool(batch, context, layers, seed=seed)
    width = tables.shape[1]
    # The same tokens, contiguous: [B, kv_heads, L, D] for SDPA.
    layer = 0
    pages = kv[tables.long(), layer]  # [B, width, 2, BLOCK, H, D]
    keys = pages[:, :, 0].reshape(batch, width * BLOCK, KV_HEADS, HEAD_DIM)[:, :context]
    values = pages[:, :, 1].reshape(batch, width * BLOCK, KV_HEADS, HEAD_DIM)[:, :context]
    keys = keys.transpose(1, 2).contiguous()
    values = values.transpose(1, 2).contiguous()
    return q, kv, tables, positions, keys, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="32,128")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=28, help="layers per block in the pool")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--hbm-tbs", type=float, default=4.3, help="HBM bandwidth, TB/s")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'batch':>5} {'ctx':>5} {'window':>6} {'roofline':>9} {'ours':>8} {'SDPA':>8} "
        f"{'ours/SDPA':>9} {'ours TB/s':>9} {'max|Δ|':>7}"
    )
    for batch in (int(b) for b in args.batch.split(",")):
        q, kv, tables, positions, keys, values = setup(batch, args.context, args.layers)
        attended = args.context if args.window is None else min(args.window, args.context)
        nbytes = 2 * batch * attended * KV_HEADS * HEAD_DIM * 2
        roofline = nbytes / (args.hbm_tbs * 1e12) * 1e6

        def ours(q=q, kv=kv, tables=tables, positions=positions):
            return paged_decode_attention(q, kv, 0, tables, positions, window=args.window)

        k_att, v_att = keys[:, :, -attended:], values[:, :, -attended:]

        def sdpa(q=q, k=k_att, v=v_att):
            return contiguous_decode_sdpa(q, k, v)

        diff = (ours().float() - sdpa().float()).abs().max().item()
        t_ours = graph_time_us(ours, args.calls, args.replays)
        t_sdpa = graph_time_us(sdpa, args.calls, args.replays)
        print(
            f"{batch:>5} {args.context:>5} {args.window or '-':>6} {roofline:>7.1f}µs "
            f"{t_ours:>6.1f}µs {t_sdpa:>6.1f}µs {t_ours / t_sdpa:>9.2f} "
            f"{nbytes / t_ours / 1e6:>9.2f} {diff:>7.4f}"
        )
        if args.sweep:
            sweep(q, kv, tables, positions, args, roofline)
        del kv, keys, values
        torch.cuda.empty_cache()


def sweep(q, kv, tables, positions, args, roofline) -> None:
    results = []
    for splits, tile, warps, stages in itertools.product(
        (1, 2, 4, 8), (16, 32, 64), (1, 2, 4), (3, 4, 5)
    ):

        def fn(splits=splits, tile=tile, warps=warps, stages=stages):
            return paged_kernel.paged_decode(
                q,
                kv,
                0,
                tables,
                positions,
                window=args.window,
                scale=HEAD_DIM**-0.5,
                splits=splits,
                tile=tile,
                num_warps=warps,
                num_stages=stages,
            )

        try:
            results.append((graph_time_us(fn, args.calls, 10), splits, tile, warps, stages))
        except Exception as err:  # a configuration that does not compile or fit
            print(f"  splits={splits} tile={tile} warps={warps} stages={stages}: {err}")
    results.sort()
    sms = paged_kernel._sm_count(q.device.index or 0)
    kv_heads = kv.shape[4]
    default = paged_kernel.choose_splits(q.shape[0], kv_heads, tables.shape[1], BLOCK, sms)
    tile, warps, stages = paged_kernel.launch_defaults(q.shape[0] * kv_heads * default, sms)
    print(f"  defaults: splits={default} tile={tile} warps={warps} stages={stages}")
    for t, splits, tile, warps, stages in results[:8]:
        print(
            f"  {t:6.1f}µs ({roofline / t:4.0%} of roofline) splits={splits} tile={tile} "
            f"warps={warps} stages={stages}"
        )


if __name__ == "__main__":
    main()
