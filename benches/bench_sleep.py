"""Sleep / wake timings (issue 19) beside a raw pinned copy of the same bytes.

For a T1 of 1 GiB and one of 15 GiB on the VMM backend, filled: the time of
``sleep(1)`` (T1 copied to pinned host memory with ``cuMemcpyDtoH``, then
T1's and the KV pool's physical memory given back) and of ``wake()`` (the
memory recommitted at the same addresses, the bytes copied back with
``cuMemcpyHtoD``), beside the raw copy of the same bytes between the same
device memory and a pinned torch tensor (``copy_``: ``cudaMemcpy`` D2H and
H2D), in the same run. The ratio is the raw copy's time over ours: 1.0 is
the copy's bandwidth, the goal is >= 0.9. The first sleep pins its host
buffer (``cuMemHostAlloc``: printed as the cold sleep, no goal); the timed
ones reuse it, as the planned T5b charge is meant to be held. Issue 24: a
first sleep whose buffer ``pin_sleep_host()`` pinned ahead (goal >= 0.9),
and that pinning beside torch's pinned allocation of the same bytes.

Usage: ``python benches/bench_sleep.py [--json out.json] [--quick]``
(``--quick``: the 1 GiB size only, fewer rounds). Needs a CUDA device with
VMM, torch and the imp_mem wheel.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time

from bench_json import write_json

import imp_mem

MIB = 1 << 20
GIB = 1 << 30
ROWS: list[dict] = []

SHAPE = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
}


def row(name: str, ours_ms: float, peer: str, peer_ms: float, nbytes: int, goal: str) -> None:
    ratio = peer_ms / ours_ms if ours_ms > 0 else float("inf")
    gbps = nbytes / (ours_ms / 1e3) / 1e9
    peer_gbps = nbytes / (peer_ms / 1e3) / 1e9
    ROWS.append(
        {
            "benchmark": name,
            "ours_ms": round(ours_ms, 3),
            "ours_gb_s": round(gbps, 2),
            "peer": peer,
            "peer_ms": round(peer_ms, 3),
            "peer_gb_s": round(peer_gbps, 2),
            "ratio": round(ratio, 3),
            "goal": goal,
        }
    )
    print(
        f"{name:26s} ours {ours_ms:9.2f} ms ({gbps:6.1f} GB/s)  {peer:28s} "
        f"{peer_ms:9.2f} ms ({peer_gbps:6.1f} GB/s)  {ratio:6.3f}x of the copy  goal {goal}"
    )


def timed(fn, torch) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def bench_size(torch, size: int, repeats: int) -> None:
    label = f"{size // GIB} GiB"
    plan = imp_mem.plan_memory(
        imp_mem.PlanInput(
            imp_mem.ModelShape.from_hf_config(SHAPE).with_weights_bytes(size),
            imp_mem.Limits(8, 4096),
            imp_mem.Features(scratch_bytes=64 * MIB, engine_persistent_bytes=64 * MIB),
            budget=size + 4 * GIB,
            context=512 * MIB,
            library_reserve=0,
        )
    )
    backend = imp_mem.VmmBackend(device=0)
    system = imp_mem.MemorySystem(backend, plan)
    t1 = system.weights_arena
    span = t1.take(t1.capacity)
    device = torch.from_dlpack(span.view(torch.uint8, (t1.capacity,)))
    device.random_(0, 255)
    nbytes = t1.capacity

    sleep = functools.partial(system.sleep, 1)
    cold = timed(sleep, torch)
    system.wake()
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(timed(sleep, torch))
        wakes.append(timed(system.wake, torch))
    check = device[:: max(1, nbytes // 4096)].clone()
    system.release_sleep_host()

    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch_pin = (time.perf_counter() - t0) * 1e3
    d2h, h2d = [], []
    for _ in range(repeats):
        d2h.append(timed(functools.partial(host.copy_, device), torch))
        h2d.append(timed(functools.partial(device.copy_, host), torch))
    assert torch.equal(device[:: max(1, nbytes // 4096)], check)
    del host
    gc.collect()

    # Issue 24: the first sleep at the line rate, its buffer pinned ahead
    # (at load, where an engine overlaps it with the weight load).
    t0 = time.perf_counter()
    pinned = system.pin_sleep_host()
    pin = (time.perf_counter() - t0) * 1e3
    first = timed(sleep, torch)
    system.wake()
    assert torch.equal(device[:: max(1, nbytes // 4096)], check)
    system.release_sleep_host()

    row(
        f"sleep(1) {label}",
        statistics.median(sleeps),
        "copy_ D2H into pinned",
        statistics.median(d2h),
        nbytes,
        ">= 0.9",
    )
    row(
        f"wake() {label}",
        statistics.median(wakes),
        "copy_ H2D from pinned",
        statistics.median(h2d),
        nbytes,
        ">= 0.9",
    )
    row(
        f"sleep(1) {label}, cold",
        cold,
        "copy_ D2H into pinned",
        statistics.median(d2h),
        nbytes,
        "(pins its buffer)",
    )
    row(
        f"sleep(1) {label}, first",
        first,
        "copy_ D2H into pinned",
        statistics.median(d2h),
        nbytes,
        ">= 0.9 (pinned ahead)",
    )
    row(
        f"pin_sleep_host {label}",
        pin,
        "torch.empty(pin_memory=True)",
        torch_pin,
        pinned,
        "(load time)",
    )
    print(f"{'':26s} host bytes pinned ahead {pinned} for T1's {nbytes} (no rounding)")
    del device, span, t1
    gc.collect()
    system.close()
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="1 GiB only, fewer rounds")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_sleep needs torch", file=sys.stderr)
        return 2
    if not imp_mem.cuda_available():
        print("bench_sleep needs a CUDA device", file=sys.stderr)
        return 2
    sizes = [GIB] if args.quick else [GIB, 15 * GIB]
    repeats = 2 if args.quick else 5
    for size in sizes:
        bench_size(torch, size, repeats)
    write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
