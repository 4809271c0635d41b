"""GPU tier benchmarks (issue 4), each side by side with its peer in one run.

1. Tier take+release from Python on device memory against ``torch.empty`` +
   ``del`` on the warm caching allocator (goal: >= 10x faster).
2. Reserved / live at peak on one mixed-size allocation trace, replayed on
   the torch caching allocator and on the tiered layout (T1 arena for the
   weights, one KV region, a T4 scratch stack sized from a warm-up
   high-water mark). The torch caching allocator was measured at 1.085 on
   this H200; the goal for the tiers is <= 1.005.

Usage: ``python benches/bench_gpu_tiers.py [--json out.json] [--quick]``.
Needs a CUDA device, torch and the imp_mem wheel.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

from bench_json import write_json

import imp_mem

ROWS: list[dict] = []
MIB = 1 << 20


def row(name: str, ours: float, peer: str, peer_value: float, goal: str, unit: str = "us"):
    ratio = peer_value / ours if unit == "us" else ours / peer_value
    ROWS.append(
        {
            "benchmark": name,
            "ours_us": round(ours, 4),
            "peer": peer,
            "peer_us": round(peer_value, 4),
            "ratio": round(ratio, 3),
            "goal": goal,
        }
    )
    label = "x faster" if unit == "us" else "x (ours/peer)"
    print(
        f"{name:48s} ours {ours:10.4f} {unit}  {peer:34s} {peer_value:10.4f} {unit}  "
        f"{ratio:7.3f}{label}  goal {goal}"
    )


def per_op_us(fn, n: int, repeats: int) -> float:
    """Median over `repeats` of the mean cost of one call of `fn` (n calls)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(n)
        samples.append((time.perf_counter_ns() - t0) / n / 1000.0)
    return statistics.median(samples)


def bench_take_release(torch, quick: bool) -> None:
    n = 2_000 if quick else 20_000
    repeats = 5 if quick else 9
    cuda = imp_mem.CudaBackend(device=0)
    nbytes = 64 << 10
    stack = imp_mem.ScratchStack(cuda, 64 * MIB)
    pool = imp_mem.BlockPool(cuda, nbytes, 256)
    arena = imp_mem.Arena(cuda, 1 << 30, tier=imp_mem.Tier.ENGINE_PERSISTENT)
    torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # warm the cache

    def torch_loop(k):
        empty, dev = torch.empty, "cuda"
        for _ in range(k):
            t = empty(nbytes, dtype=torch.uint8, device=dev)
            del t

    def pool_loop(k):
        allocate = pool.allocate
        for _ in range(k):
            allocate().release()

    def pool_batch_loop(k):
        allocate_many = pool.allocate_many
        for _ in range(k // 16):
            allocate_many(16).release()

    def scratch_loop(k):
        mark = stack.mark
        for _ in range(k):
            m = mark()
            m.take(nbytes)
            m.rewind()

    def scratch_forward_loop(k):
        # How a forward pass uses the stack: one mark, many takes, one rewind.
        mark = stack.mark
        for _ in range(k // 16):
            m = mark()
            take = m.take
            for _ in range(16):
                take(nbytes)
            m.rewind()

    def arena_loop(k):
        take = arena.take
        for i in range(k):
            take(nbytes)
            if i % 4096 == 4095:
                arena.reset()
        arena.reset()

    torch_us = per_op_us(torch_loop, n, repeats)
    goal = ">= 10x faster"
    row(
        "BlockPool allocate+release (64 KiB block)",
        per_op_us(pool_loop, n, repeats),
        "torch.empty+del (caching allocator)",
        torch_us,
        goal,
    )
    batch_us = per_op_us(pool_batch_loop, n, repeats)
    row(
        "BlockPool allocate_many(16)+release, per block",
        batch_us,
        "torch.empty+del (caching allocator)",
        torch_us,
        goal,
    )
    row(
        "ScratchStack mark+take+rewind (64 KiB)",
        per_op_us(scratch_loop, n, repeats),
        "torch.empty+del (caching allocator)",
        torch_us,
        goal,
    )
    row(
        "ScratchStack take, 16 per mark (rewind amortized)",
        per_op_us(scratch_forward_loop, n, repeats),
        "torch.empty+del (caching allocator)",
        torch_us,
        goal,
    )
    row(
        "Arena take (64 KiB; reset every 4096)",
        per_op_us(arena_loop, n, repeats),
        "torch.empty+del (caching allocator)",
        torch_us,
        goal,
    )


def make_trace(seed: int, quick: bool):
    """A deterministic engine-shaped trace: weight tensors of mixed sizes, a
    KV pool, then decode/prefill steps whose temporaries vary with the batch."""
    rng = random.Random(seed)
    hidden, vocab = 4096, 151_936
    weights = []
    for _layer in range(24 if quick else 48):
        for rows, cols in (
            (hidden, 3 * hidden),
            (hidden, hidden),
            (hidden, 11008),
            (11008, hidden),
        ):
            weights.append(rows * cols * 2)
        weights += [hidden * 2, hidden * 2]
    weights.append(vocab * hidden * 2)
    kv = (2 if quick else 8) << 30
    steps = []
    for _ in range(40 if quick else 200):
        tokens = rng.choice([1, 3, 8, 17, 32, 64, 96, 128, 256, 512, 1000, 2048])
        sizes = [
            tokens * hidden * 2,  # hidden states
            tokens * 3 * hidden * 2,  # qkv
            tokens * 11008 * 2 * 2,  # gate/up
            tokens * hidden * 4,  # fp32 residual
            tokens * rng.randint(1, 64) * 4096,  # attention scratch of varying size
            min(tokens, 256) * vocab * 4,  # logits
        ]
        steps.append(sizes)
    return weights, kv, steps


def replay_torch(torch, weights, kv, steps) -> tuple[int, int]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_reserved = torch.cuda.memory_reserved()
    held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in weights]
    held.append(torch.empty(kv, dtype=torch.uint8, device="cuda"))
    for sizes in steps:
        temps = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        del temps
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved() - base_reserved
    live = torch.cuda.max_memory_allocated()
    del held
    torch.cuda.empty_cache()
    return reserved, live


def replay_tiers(weights, kv, steps) -> tuple[int, int]:
    align = 256
    padded = sum((n + align - 1) // align * align for n in weights)
    # Warm-up pass on a generous stack gives the high-water mark the planner
    # sizes the real stack from (seed A3.3).
    probe_backend = imp_mem.CudaBackend(device=0)
    probe = imp_mem.ScratchStack(probe_backend, sum(max(steps, key=sum)) * 2)
    for sizes in steps:
        with probe.mark() as m:
            for n in sizes:
                m.take(n)
    high_water = probe.high_water
    del probe, probe_backend
    gc.collect()

    backend = imp_mem.CudaBackend(device=0)
    arena = imp_mem.Arena(backend, padded, tier=imp_mem.Tier.MODEL_RESIDENT, tag="weights")
    spans = [arena.take(n, align) for n in weights]
    kv_region = backend.acquire(kv, tag="kv_cache")
    stack = imp_mem.ScratchStack(backend, high_water, tag="scratch")
    live_requested = sum(weights) + kv
    peak_live = live_requested
    for sizes in steps:
        with stack.mark() as m:
            for n in sizes:
                m.take(n)
        peak_live = max(peak_live, live_requested + sum(sizes))
    reserved = backend.stats()["peak"]
    del spans, arena, stack
    kv_region.release()
    return reserved, peak_live


def bench_fragmentation(torch, quick: bool) -> None:
    weights, kv, steps = make_trace(2026, quick)
    t_reserved, t_live = replay_torch(torch, weights, kv, steps)
    i_reserved, i_live = replay_tiers(weights, kv, steps)
    t_ratio = t_reserved / t_live
    i_ratio = i_reserved / i_live
    print(f"trace: {len(weights)} weight tensors, KV {kv / 2**30:.0f} GiB, {len(steps)} steps")
    print(
        f"  torch caching allocator: reserved {t_reserved / MIB:,.1f} MiB, "
        f"live at peak {t_live / MIB:,.1f} MiB, ratio {t_ratio:.4f}"
    )
    print(
        f"  imp-mem tiers:           reserved {i_reserved / MIB:,.1f} MiB, "
        f"live at peak {i_live / MIB:,.1f} MiB, ratio {i_ratio:.4f}"
    )
    ROWS.append(
        {
            "benchmark": "reserved / live at peak, mixed trace",
            "ours_us": round(i_ratio, 4),
            "peer": "torch caching allocator",
            "peer_us": round(t_ratio, 4),
            "ratio": round(i_ratio / t_ratio, 4),
            "goal": "ours <= 1.005",
        }
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    args = ap.parse_args(argv)
    if not imp_mem.cuda_available():
        print("no CUDA device: skipped")
        return 0
    import torch

    bench_take_release(torch, args.quick)
    bench_fragmentation(torch, args.quick)
    write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
