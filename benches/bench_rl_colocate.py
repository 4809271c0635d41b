"""The RL colocation cycle on the reference engine (issue 24), with the
peers' figures beside ours in one run.

The engine serves a model of Qwen3-8B's numbers (random weights, made on
the GPU and written once as a checkpoint), then:

1. rollout (greedy tokens T0);
2. ``sleep(1)``; a torch "trainer" takes at least 90 % of the memory freed
   and works (matrix products), then frees its tensors but keeps torch's
   cache (as a trainer's caching allocator does); ``wake()`` fails with the
   bytes missing and torch's share named, ``wake(empty_torch_cache=True)``
   succeeds; rollout (tokens equal T0);
3. a second ``sleep(1)`` / ``wake()`` round (the buffer pinned at load is
   reused: both rounds at the line rate);
4. ``sleep(2)``; the trainer makes new weights on the GPU; staged wake:
   ``wake("weights")``, ``update_weights`` from the trainer's tensors,
   ``wake("kv_cache")``; rollout (T1);
5. the same with the new weights pushed from a second process over CUDA IPC
   (``update_weights_from_ipc``); rollout (T2);
6. an engine that loads the new weights from disk: its tokens equal T1 and T2.

Printed side by side: each sleep and wake over a raw pinned copy of the
same bytes (``copy_`` D2H / H2D, goal >= 0.9 on both rounds);
torch_memory_saver 0.0.10 pausing and resuming the same bytes with a CPU
backup (in a process of its own, when it is installed); the in-place
update (same process and IPC) over a raw device-to-device copy of the same
tensors (goal >= 0.8); device memory left while asleep against context +
T2 + 256 MiB; host memory held against the weights' bytes; the staged
wake's peak against an all-at-once wake's.

Usage: ``python benches/bench_rl_colocate.py [--json out.json] [--quick]
[--layers N]`` (``--quick``: shorter rollouts). Needs a CUDA device with
VMM, torch and the imp_mem wheel; torch_memory_saver is optional.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench_json import write_json

MIB = 1 << 20
GIB = 1 << 30


ROWS: list[dict] = []


def row(name: str, ours: float, peer: str, peer_value: float, unit: str, goal: str) -> None:
    ratio = peer_value / ours if ours else float("inf")
    ROWS.append(
        {
            "benchmark": name,
            "ours": round(ours, 4),
            "peer": peer,
            "peer_value": round(peer_value, 4),
            "unit": unit,
            "ratio": round(ratio, 3),
            "goal": goal,
        }
    )
    print(
        f"{name:<46} {ours:9.3f} {unit:<4} {peer:<34} {peer_value:9.3f} {unit:<4} "
        f"ratio {ratio:6.3f}  ({goal})",
        flush=True,
    )


def fact(name: str, value: object, note: str = "") -> None:
    ROWS.append({"benchmark": name, "value": value, "note": note})
    print(f"{name:<46} {value}  {note}", flush=True)


def timed(fn, torch) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def device_used(torch) -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def raw_copy_seconds(torch, nbytes: int, host) -> tuple[float, float]:
    """A raw pinned copy of `nbytes` (D2H, then H2D), into `host` (pinned)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.fill_(1)
    d2h = timed(lambda: host[:nbytes].copy_(dev), torch)
    h2d = timed(lambda: dev.copy_(host[:nbytes]), torch)
    dev = None
    torch.cuda.empty_cache()
    return d2h, h2d


def fresh_copy_seconds(torch, nbytes: int, host) -> float:
    """A fresh ``torch.empty`` of `nbytes` (cudaMalloc from an empty cache)
    and the copy of `host` into it: any allocator's first use of memory
    another one just gave back."""
    out = []
    seconds = timed(
        lambda: out.append(
            torch.empty(nbytes, dtype=torch.uint8, device="cuda").copy_(host[:nbytes])
        ),
        torch,
    )
    out.clear()
    torch.cuda.empty_cache()
    return seconds


def raw_d2d_seconds(torch, tensors: dict) -> float:
    """Each tensor copied into a device buffer of the same bytes, as an
    update copies them into T1."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    buf = torch.empty(total, dtype=torch.uint8, device="cuda")
    views, off = [], 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        views.append((buf[off : off + n].view(t.dtype).view(t.shape), t))
        off += n

    def copy():
        for dst, src in views:
            dst.copy_(src, non_blocking=True)

    copy()  # warm
    seconds = min(timed(copy, torch) for _ in range(2))
    views.clear()
    buf = None
    torch.cuda.empty_cache()
    return seconds


TMS_SCRIPT = r"""
import os, sys, time, json, torch
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = "torch"
n = int(sys.argv[1])
with tms.region(tag="w", enable_cpu_backup=True):
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
x.fill_(3)
torch.cuda.synchronize()
out = []
for round in range(2):
    if round == 1:
        tms.retain_cpu_backup = True
    t0 = time.perf_counter()
    tms.pause("w")
    torch.cuda.synchronize()
    p = time.perf_counter() - t0
    t0 = time.perf_counter()
    tms.resume("w")
    torch.cuda.synchronize()
    r = time.perf_counter() - t0
    out.append((p, r))
ok = bool((x[:16].cpu() == 3).all())  # no device allocation outside the region
print(json.dumps({"rounds": out, "intact": ok}), flush=True)
# Its MemPool's teardown at exit frees outside the region, which the torch
# hook mode refuses: leave without it.
os._exit(0)
"""


def tms_rounds(nbytes: int) -> dict | None:
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        return None
    import json

    proc = subprocess.run(
        [sys.executable, "-c", TMS_SCRIPT, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print("torch_memory_saver failed:", proc.stderr[-2000:], flush=True)
        return None
    return json.loads(lines[-1])


def ipc_child(config: dict, seed: int, conn) -> None:
    """A trainer process: new weights on the GPU, their IPC handles sent,
    kept alive until the engine says it copied them."""
    from imp_mem.engine.checkpoint import random_weights
    from imp_mem.engine.weights import ipc_handles

    weights = random_weights(config, seed=seed, device="cuda")
    import torch

    torch.cuda.synchronize()
    conn.send(ipc_handles(weights))
    conn.recv()  # the engine copied them
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="shorter rollouts")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (default: 36)")
    ap.add_argument("--budget", default="64GiB", help="the engine's budget")
    args = ap.parse_args()

    import torch

    import imp_mem

    if not (torch.cuda.is_available() and imp_mem.cuda_available()):
        print("needs a CUDA device")
        return 0
    from imp_mem._presets import preset

    # Qwen3-8B's numbers (the `imp-mem plan` preset) and its RoPE base.
    config = preset("qwen3-8b") | {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
    if args.layers:
        config["num_hidden_layers"] = args.layers
    root = tempfile.mkdtemp(prefix="imp-mem-rl-", dir=os.environ.get("IMP_MEM_BENCH_DIR"))
    try:
        return run(args, config, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # two checkpoints of 16 GiB


def run(args, config: dict, root: str) -> int:
    import torch

    import imp_mem
    from imp_mem.engine import Engine
    from imp_mem.engine.checkpoint import random_weights, write_random_checkpoint

    batch, prompt_len, new = (32, 256, 32) if args.quick else (32, 512, 64)
    t0 = time.perf_counter()
    dir_a = write_random_checkpoint(f"{root}/a", config, seed=0, device="cuda")
    dir_b = write_random_checkpoint(f"{root}/b", config, seed=1, device="cuda")
    torch.cuda.empty_cache()
    fact("checkpoints written (2, made on the GPU)", f"{time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config["vocab_size"], (prompt_len,), generator=g).tolist()
        for _ in range(batch)
    ]

    base_used = device_used(torch)
    e = Engine(dir_a, max_batch=batch, max_seq_len=prompt_len + new + 8, budget=args.budget)
    weights_bytes = e.system.weights_arena.used
    fact(
        "engine open (plan, load + pin, warm-up, graphs)",
        f"{e.open_seconds:.2f} s",
        f"load {e.load_seconds:.2f} s, pin {e.memory.pin_seconds:.2f} s (overlapped), "
        f"{weights_bytes / GIB:.2f} GiB of weights",
    )
    row(
        "host memory pinned for sleep / weights' bytes",
        e.memory.pinned_bytes / GIB,
        "the weights' bytes",
        weights_bytes / GIB,
        "GiB",
        "= 1.0",
    )
    t0 = time.perf_counter()
    first = e.generate(prompts, new)
    fact("rollout (tokens T0)", f"{batch} x {new} in {time.perf_counter() - t0:.2f} s")
    ctx = int(e.plan.context)
    t2_bytes = int(e.plan.engine_persistent)

    host = torch.empty(weights_bytes, dtype=torch.uint8, pin_memory=True)
    tms = None
    for rnd in (1, 2, 3):
        if rnd == 2:
            # Not a timed round: the trainer's freed blocks stay in torch's
            # cache; the wake says so and, asked to, empties it once and
            # retries.
            e.sleep(1)
            x = torch.empty(torch.cuda.mem_get_info()[0] - GIB, dtype=torch.uint8, device="cuda")
            del x
            try:
                e.wake()
                fact("wake under the trainer's cache", "woke (room enough)")
            except imp_mem.OutOfMemory as err:
                fact("wake under the trainer's cache", "refused", str(err)[-420:])
            retry = timed(lambda: e.wake(empty_torch_cache=True), torch)
            fact("wake(empty_torch_cache=True) under that cache", f"{retry:.3f} s")
        slept = {}
        s = timed(lambda slept=slept: slept.update(e.sleep(1)), torch)
        released = slept["released"]
        asleep_used = device_used(torch) - base_used
        if rnd == 1:
            goal = ctx + t2_bytes + 256 * MIB
            row(
                "device memory left while asleep (GiB)",
                asleep_used / GIB,
                "context + T2 + 256 MiB",
                goal / GIB,
                "GiB",
                ">= 1.0",
            )
            fact(
                "report while asleep: what stays",
                {k: v for k, v in e.system.mem_report().items() if "stay" in k} or "n/a",
            )
            d2h, h2d = raw_copy_seconds(torch, weights_bytes, host)
            # The trainer: the device's free memory less 1 GiB (>= 90 % of
            # what the sleep freed), worked on, then its cache given back.
            take = torch.cuda.mem_get_info()[0] - GIB
            x = torch.empty(take, dtype=torch.uint8, device="cuda")
            m = x[: 8192 * 8192 * 2].view(torch.bfloat16).view(8192, 8192)
            m.normal_()
            for _ in range(4):
                m.copy_(m @ m * 1e-3)
            torch.cuda.synchronize()
            fact(
                "trainer took",
                f"{take / GIB:.2f} GiB; the sleep freed {released / GIB:.2f} GiB "
                f"({take / released:.0%} of it)",
            )
            del x, m
            torch.cuda.empty_cache()
            # Any allocator's first use of the memory the trainer just gave
            # back: a fresh cudaMalloc of the weights' bytes and the copy in.
            timed_fresh = fresh_copy_seconds(torch, weights_bytes, host)
        w = timed(lambda: e.wake(), torch)
        if rnd == 1:
            row(
                "round 1: wake() s vs fresh cudaMalloc + H2D",
                w,
                "torch.empty + copy_ after the trainer",
                timed_fresh,
                "s",
                "info",
            )
        row(
            f"round {rnd}: sleep(1) s vs raw D2H copy",
            s,
            "raw pinned copy_ D2H",
            d2h,
            "s",
            ">= 0.9",
        )
        row(f"round {rnd}: wake() s vs raw H2D copy", w, "raw pinned copy_ H2D", h2d, "s", ">= 0.9")
        out = e.generate(prompts, new)
        fact(f"round {rnd}: tokens after wake == T0", out == first)
        if rnd == 1:
            tms = tms_rounds(weights_bytes)
    del host
    if tms:
        for rnd, (p, r) in enumerate(tms["rounds"], 1):
            row(f"torch_memory_saver round {rnd}: pause", p, "raw pinned copy_ D2H", d2h, "s", "")
            row(f"torch_memory_saver round {rnd}: resume", r, "raw pinned copy_ H2D", h2d, "s", "")
        fact("torch_memory_saver bytes intact", tms["intact"])
    else:
        fact("torch_memory_saver", "not installed or failed: no side-by-side")

    # -- level 2 and an update from this process -----------------------------
    e.sleep(2)
    new_weights = random_weights(config, seed=1, device="cuda")
    torch.cuda.synchronize()
    used_before = device_used(torch)
    e.wake("weights")
    staged_peak = device_used(torch)
    up = e.update_weights(new_weights)
    raw = raw_d2d_seconds(torch, new_weights)
    row(
        "update in place (same process) vs raw D2D",
        up["seconds"],
        "raw copy_ D2D",
        raw,
        "s",
        ">= 0.8",
    )
    del new_weights
    torch.cuda.empty_cache()
    kv_bytes = int(e.plan.kv["bytes"])
    e.wake("kv_cache")
    row(
        "staged wake peak vs all-at-once (GiB)",
        (staged_peak - base_used) / GIB,
        "all at once (weights + KV + update)",
        (staged_peak - base_used + kv_bytes) / GIB,
        "GiB",
        "> 1.0",
    )
    fact("device before the staged wake", f"{(used_before - base_used) / GIB:.2f} GiB")
    t1 = e.generate(prompts, new)

    # -- level 2 and an update over CUDA IPC from a second process -----------
    e.sleep(2)
    import torch.multiprocessing as mp

    ctx_mp = mp.get_context("spawn")
    parent, child = ctx_mp.Pipe()
    proc = ctx_mp.Process(target=ipc_child, args=(config, 1, child))
    proc.start()
    handles = parent.recv()
    e.wake("weights")
    up_ipc = e.update_weights_from_ipc(handles)
    from imp_mem.engine.weights import open_ipc_handles

    try:
        mapped = dict(open_ipc_handles(handles))
        raw_ipc = raw_d2d_seconds(torch, mapped)
        mapped.clear()
    except Exception as err:  # a second mapping of the same handles
        print("raw D2D over the IPC tensors failed:", err, flush=True)
        raw_ipc = raw
    parent.send("done")
    proc.join(timeout=120)
    torch.cuda.ipc_collect()
    row(
        "update over CUDA IPC vs raw D2D (of the same)",
        up_ipc["seconds"],
        "raw copy_ D2D",
        raw_ipc,
        "s",
        ">= 0.8",
    )
    e.wake("kv_cache")
    t2_tokens = e.generate(prompts, new)
    e.close()
    gc.collect()
    torch.cuda.empty_cache()

    ref = Engine(dir_b, max_batch=batch, max_seq_len=prompt_len + new + 8, budget=args.budget)
    want = ref.generate(prompts, new)
    ref.close()
    fact("tokens after the in-process update == B from disk", t1 == want)
    fact("tokens after the IPC update == B from disk", t2_tokens == want)
    fact("B's tokens differ from A's", want != first)
    write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
