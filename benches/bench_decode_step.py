"""One decode step of the reference model, fused against unfused, side by
side in one run (issue 25). No engine, no imp-mem memory: the model over
random weights and a KV pool made with torch on the GPU, each step
captured in a CUDA graph and replayed, so the figure is the kernels'.

Per shape and batch: the replay's median time, the bytes a step must read
(every weight it multiplies by, the logits' head included, the embedding
rows excluded, plus the K/V of every token of every sequence), their
fraction of the HBM peak (``--peak-tbs``, 4.8 TB/s for the H200), the
tokens/s, fused ÷ unfused, and the fused logits against the unfused ones.
Then the paged attention kernel alone at batch 64 and 1 k context, as a
fraction of the peak, and a profile of one eager fused step by kernel.

Usage: ``python benches/bench_decode_step.py [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from bench_json import write_json

SHAPES = {
    # name: (hidden, intermediate, heads, kv_heads, head_dim, vocab, layers)
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936, 36),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936, 28),
}
ROWS: list[dict] = []


def config_dict(shape: str, layers: int | None) -> dict:
    from imp_mem.engine.config import qwen3_0_6b_config

    h, i, heads, kvh, d, vocab, n = SHAPES[shape]
    c = qwen3_0_6b_config()
    c.update(
        hidden_size=h,
        intermediate_size=i,
        num_attention_heads=heads,
        num_key_value_heads=kvh,
        head_dim=d,
        vocab_size=vocab,
        num_hidden_layers=layers or n,
        max_position_embeddings=4096,
        tie_word_embeddings=shape != "qwen3-8b",
    )
    return c


def time_graph(fn, reps: int) -> float:
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del g
    return statistics.median(times)


def run_shape(shape, layers, batches, ctx, block_size, reps, peak):
    import torch

    from imp_mem.engine.checkpoint import pack_fused, random_weights
    from imp_mem.engine.config import ModelConfig
    from imp_mem.engine.model import KvViews, PagedModel

    cd = config_dict(shape, layers)
    config = ModelConfig.from_hf_config(cd)
    weights = pack_fused(random_weights(cd, seed=0, scale=0.02, device="cuda"))
    n_layers = config.num_layers
    kv_heads, d = config.num_kv_heads, config.head_dim
    width = -(-(ctx + 16) // block_size)
    blocks_total = max(batches) * width + 1
    pool = torch.randn(
        blocks_total, n_layers, 2, block_size, kv_heads, d, dtype=torch.bfloat16, device="cuda"
    )
    kv = KvViews(full=pool, swa=None, block_size=block_size)
    rng = random.Random(0)
    order = list(range(1, blocks_total))
    rng.shuffle(order)
    head = config.vocab_size * config.hidden_size * 2
    weight_bytes = sum(
        t.numel() * t.element_size() for n, t in weights.items() if "embed_tokens" not in n
    )
    if config.tie_word_embeddings:
        weight_bytes += head
    models = {f: PagedModel(config, weights, fused=f, max_positions=4096) for f in (False, True)}
    for b in batches:
        tables = torch.tensor(
            [order[r * width : (r + 1) * width] for r in range(b)], dtype=torch.int32, device="cuda"
        )
        ids = torch.randint(0, config.vocab_size, (b,), device="cuda")
        pos = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
        kv_read = b * (ctx + 1) * n_layers * 2 * kv_heads * d * 2
        step_bytes = weight_bytes + kv_read
        results = {}
        logits = {}
        for fused, model in models.items():
            out = {}

            def step(model=model, out=out, ids=ids, pos=pos, tables=tables):
                with torch.inference_mode():
                    out["x"] = model.decode(ids, pos, tables, None, kv)

            results[fused] = time_graph(step, reps)
            step()
            logits[fused] = out["x"].clone()
        diff = (logits[True] - logits[False]).abs().max().item()
        same = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
        for fused in (False, True):
            t = results[fused]
            frac = step_bytes / t / (peak * 1e12)
            name = f"{shape} L={n_layers} batch {b} ctx {ctx} {'fused' if fused else 'unfused'}"
            print(
                f"{name:48s} {t * 1e3:8.3f} ms  {b / t:9.0f} tok/s  "
                f"{step_bytes / 1e9:6.2f} GB  {frac * 100:5.1f} % of HBM peak"
            )
            ROWS.append(
                {
                    "benchmark": f"decode step {name}",
                    "ours": round(t * 1e3, 4),
                    "unit": "ms",
                    "roofline_fraction": round(frac, 4),
                    "tokens_per_s": round(b / t, 1),
                }
            )
        ratio = results[False] / results[True]
        print(
            f"  fused / unfused speed {ratio:.3f}x; max |dlogit| {diff:.4f}; "
            f"greedy agree {same * 100:.1f} %"
        )
        ROWS.append(
            {
                "benchmark": f"decode step {shape} batch {b} fused vs unfused",
                "ours": round(results[True] * 1e3, 4),
                "peer": "unfused",
                "peer_value": round(results[False] * 1e3, 4),
                "ratio": round(ratio, 3),
                "goal": ">= 60 % of HBM peak (8B, batch 64)",
                "max_abs_dlogit": round(diff, 5),
                "greedy_agree": round(same, 4),
            }
        )
    del models, weights, pool
    torch.cuda.empty_cache()


def attention_alone(batch, ctx, block_size, peak, reps):
    import torch

    from imp_mem.engine.model.attention import paged_decode_attention

    kv_heads, heads, d = 8, 32, 128
    width = -(-(ctx + 1) // block_size)
    pool = torch.randn(
        batch * width + 1, 1, 2, block_size, kv_heads, d, dtype=torch.bfloat16, device="cuda"
    )
    order = list(range(1, batch * width + 1))
    random.Random(1).shuffle(order)
    tables = torch.tensor(
        [order[r * width : (r + 1) * width] for r in range(batch)], dtype=torch.int32, device="cuda"
    )
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    pos = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    t = time_graph(lambda: paged_decode_attention(q, pool, 0, tables, pos), reps)
    nbytes = batch * (ctx + 1) * kv_heads * d * 2 * 2
    frac = nbytes / t / (peak * 1e12)
    print(
        f"paged attention batch {batch} ctx {ctx}: {t * 1e6:7.1f} us for {nbytes / 1e6:.1f} MB, "
        f"{nbytes / t / 1e12:.2f} TB/s, {frac * 100:.1f} % of peak (goal >= 85 %)"
    )
    ROWS.append(
        {
            "benchmark": f"paged attention batch {batch} ctx {ctx}",
            "ours": round(t * 1e6, 2),
            "unit": "us",
            "roofline_fraction": round(frac, 4),
            "goal": ">= 0.85",
        }
    )


def profile_step(shape, layers, batch, ctx, block_size):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from imp_mem.engine.checkpoint import pack_fused, random_weights
    from imp_mem.engine.config import ModelConfig
    from imp_mem.engine.model import KvViews, PagedModel

    cd = config_dict(shape, layers)
    config = ModelConfig.from_hf_config(cd)
    weights = pack_fused(random_weights(cd, seed=0, scale=0.02, device="cuda"))
    width = -(-(ctx + 16) // block_size)
    pool = torch.randn(
        batch * width + 1, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    kv = KvViews(full=pool, swa=None, block_size=block_size)
    tables = torch.arange(1, batch * width + 1, dtype=torch.int32, device="cuda").view(batch, width)
    ids = torch.zeros(batch, dtype=torch.int64, device="cuda")
    pos = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    for fused in (False, True):
        model = PagedModel(config, weights, fused=fused, max_positions=4096)
        with torch.inference_mode():
            model.decode(ids, pos, tables, None, kv)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.decode(ids, pos, tables, None, kv)
                torch.cuda.synchronize()
        what = "fused" if fused else "unfused"
        print(f"--- eager step by kernel, {what} ({shape}, L={config.num_layers}, batch {batch})")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--ctx", type=int, default=640)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_decode_step: needs a CUDA device", file=sys.stderr)
        return 0
    reps = 20 if args.quick else 50
    run_shape(
        "qwen3-8b",
        None,
        [64] if args.quick else [64, 128],
        args.ctx,
        args.block_size,
        reps,
        args.peak_tbs,
    )
    run_shape("qwen3-0.6b", None, [32], args.ctx, args.block_size, reps, args.peak_tbs)
    for ctx in (1024,) if args.quick else (1024, 4096):
        attention_alone(64, ctx, args.block_size, args.peak_tbs, reps)
    if args.profile:
        profile_step("qwen3-8b", 4, 64, args.ctx, args.block_size)
    if args.json:
        write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
