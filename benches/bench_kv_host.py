"""The KV host tier on a GPU, in one run (issue 17):

* a prefix-heavy workload whose working set of shared prefixes is 4x the
  device pool, served without and with a host tier behind it: prefix hit
  rate and recomputed tokens (prompt tokens not served from either tier);
* onboarding bandwidth: blocks brought back from the host tier into device
  blocks (``admit`` + ``wait_onboarding``), against a raw pinned
  ``cudaMemcpyAsync`` of the same bytes through torch (one copy of the whole
  buffer), and the ratio (goal >= 0.9); offload bandwidth the same way.

The engine is simulated: a request's computed blocks are written with a
kernel before it is freed, so evictions copy real bytes; nothing else runs
on the GPU.

Usage: ``python benches/bench_kv_host.py [--json out.json] [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bench_json import write_json

import imp_mem

BS = 16


def _torch():
    try:
        import torch
    except ImportError:
        sys.exit("bench_kv_host needs torch with CUDA")
    if not torch.cuda.is_available() or not imp_mem.cuda_available():
        sys.exit("bench_kv_host needs a CUDA device")
    return torch


class _View:
    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "strides": None,
            "data": (address, False),
            "version": 3,
            "stream": None,
        }


def workload(torch, host: bool, args) -> dict:
    """Requests over ``prefixes`` shared prefixes of ``prefix_blocks`` blocks
    each, plus a unique suffix; the prefixes' blocks are 4x the pool."""
    device_blocks = args.device_blocks
    prefix_blocks = 8
    prefixes = 4 * device_blocks // prefix_blocks
    host_blocks = 5 * device_blocks if host else 0
    kv = imp_mem.KVCacheManager(
        device_blocks,
        BS,
        backend=imp_mem.CudaBackend(device=0),
        block_bytes=args.block_bytes,
        host_blocks=host_blocks,
    )
    rng = random.Random(7)
    prompt_tokens = cached_tokens = 0
    t0 = time.perf_counter()
    for r in range(args.requests):
        p = rng.randrange(prefixes)
        prompt = list(range(p * 10_000, p * 10_000 + prefix_blocks * BS))
        prompt += list(range(10**7 + r * 64, 10**7 + r * 64 + BS // 2))
        cached = kv.admit(r, prompt)
        kv.wait_onboarding(r)
        # The engine computes the rest: one kernel per new block.
        for i in range(cached // BS, len(prompt) // BS):
            address, nbytes = kv.block_span(r, i)
            torch.as_tensor(_View(address, nbytes), device="cuda").fill_(p % 251)
        kv.free(r)
        kv.poll_copies()
        prompt_tokens += len(prompt)
        cached_tokens += cached
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    s = kv.stats()
    return {
        "host_tier": host,
        "device_blocks": device_blocks,
        "host_blocks": host_blocks,
        "working_set_blocks": prefixes * prefix_blocks,
        "requests": args.requests,
        "prefix_hit_rate": cached_tokens / prompt_tokens,
        "recomputed_tokens": prompt_tokens - cached_tokens,
        "host_hit_blocks": s["host_hit_blocks"],
        "offload_bytes": s["offload_bytes"],
        "onboard_bytes": s["onboard_bytes"],
        "seconds": elapsed,
    }


def bandwidth(torch, args) -> dict:
    """GB/s of onboarding (host tier -> device) and offloading, against a
    raw pinned copy of the same bytes, best of ``rounds``."""
    n = args.bw_blocks
    bb = args.block_bytes
    kv = imp_mem.KVCacheManager(
        n + 2,
        BS,
        backend=imp_mem.CudaBackend(device=0),
        block_bytes=bb,
        host_blocks=n + 2,
    )
    prompt = list(range(n * BS + 1))
    kv.admit(0, prompt)
    for i in range(n):
        address, nbytes = kv.block_span(0, i)
        torch.as_tensor(_View(address, nbytes), device="cuda").fill_(i % 251)
    torch.cuda.synchronize()
    kv.free(0)
    total = n * bb
    ours_in, ours_out = [], []
    for r in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kv.evict(n)
        kv.poll_copies(wait=True)
        ours_out.append(total / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        got = kv.admit(r + 1, prompt)
        kv.wait_onboarding(r + 1)
        ours_in.append(total / (time.perf_counter() - t0) / 1e9)
        assert got == n * BS, got
        kv.free(r + 1)
        kv.poll_copies(wait=True)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    raw_in, raw_out = [], []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()
        raw_in.append(total / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            host.copy_(dev, non_blocking=True)
        stream.synchronize()
        raw_out.append(total / (time.perf_counter() - t0) / 1e9)
    best = max
    return {
        "blocks": n,
        "block_bytes": bb,
        "bytes": total,
        "onboard_gbps": best(ours_in),
        "raw_h2d_gbps": best(raw_in),
        "onboard_ratio": best(ours_in) / best(raw_in),
        "offload_gbps": best(ours_out),
        "raw_d2h_gbps": best(raw_out),
        "offload_ratio": best(ours_out) / best(raw_out),
        "onboard_gbps_median": statistics.median(ours_in),
        "raw_h2d_gbps_median": statistics.median(raw_in),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="a smaller, shorter run")
    args = ap.parse_args()
    args.block_bytes = 2 << 20  # 16 tokens of a Llama-3-8B-shaped KV in bf16
    args.device_blocks = 64 if args.quick else 256
    args.requests = 400 if args.quick else 3000
    args.bw_blocks = 64 if args.quick else 256
    args.rounds = 3 if args.quick else 7
    torch = _torch()

    rows = [workload(torch, False, args), workload(torch, True, args)]
    print(
        f"prefix-heavy workload: {rows[0]['working_set_blocks']} prefix blocks over a pool of "
        f"{args.device_blocks} ({args.block_bytes >> 20} MiB blocks), {args.requests} requests"
    )
    print(f"{'':18}{'hit rate':>10}{'recomputed tokens':>20}{'host hits':>11}{'s':>8}")
    for row in rows:
        name = "with host tier" if row["host_tier"] else "device only"
        print(
            f"{name:18}{row['prefix_hit_rate']:>10.3f}{row['recomputed_tokens']:>20}"
            f"{row['host_hit_blocks']:>11}{row['seconds']:>8.2f}"
        )
    bw = bandwidth(torch, args)
    print(
        f"\nbandwidth, {bw['blocks']} blocks of {bw['block_bytes'] >> 20} MiB "
        f"({bw['bytes'] >> 20} MiB), best of {args.rounds}:"
    )
    print(
        f"  onboard  {bw['onboard_gbps']:6.1f} GB/s   raw pinned H2D {bw['raw_h2d_gbps']:6.1f} GB/s"
        f"   ratio {bw['onboard_ratio']:.2f} (goal >= 0.9)"
    )
    print(
        f"  offload  {bw['offload_gbps']:6.1f} GB/s   raw pinned D2H {bw['raw_d2h_gbps']:6.1f} GB/s"
        f"   ratio {bw['offload_ratio']:.2f}"
    )
    write_json(args.json, {"workload": rows, "bandwidth": bw}, indent=2)


if __name__ == "__main__":
    main()
