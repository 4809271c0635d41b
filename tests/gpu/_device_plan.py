"""The plan against the device, measured in a fresh child process: the
harness the engine's GPU tests share (the families, Gemma-3 with images).

The child boots a dummy engine at the given limits with torch's activations
routed into a planned tier sized from a warm-up measured in a process before
it, serves requests (with images where the config has a vision tower), and
reports its memory report; this process keeps a CUDA context open to learn what the child's
context costs and what other processes hold."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import imp_mem

# A small Qwen3 shape (8 layers of Qwen3-0.6B's widths), for the engine
# tests that boot on the GPU in this process.
SMALL_QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def small_prompts(n: int, first: int, step: int, seed: int) -> list[list[int]]:
    """`n` random prompts over `SMALL_QWEN3`'s vocabulary, the k-th of
    ``first + step * k`` tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = SMALL_QWEN3["vocab_size"]
    return [torch.randint(0, vocab, (first + step * k,), generator=g).tolist() for k in range(n)]


CHILD = r"""
import json, sys
import torch
import imp_mem
from imp_mem.engine.llm_engine import Engine

config, max_batch, max_seq_len = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
high = int(sys.argv[4])  # torch's high-water, measured by another process
library = int(sys.argv[5])  # cuBLAS's reserve as this machine measured it
# The bare driver context, as the engine's own context measurement sees it:
# torch initialises CUDA inside the engine, after its warm-up meter starts,
# as it does in the engine's probe child. (Initialising torch here first
# charged torch's runtime to the context line, 89 MiB on the H200, and the
# probe's warm-up line planned it again.)
holder = imp_mem.CudaBackend(device=0)
print("ready", 0, flush=True)
context, other = (int(x) for x in sys.stdin.readline().split())
kw = dict(load_format="dummy", seed=3, max_batch=max_batch, max_seq_len=max_seq_len)
backend = imp_mem.VmmBackend(device=0, strict=True)
vision = config.get("vision_config")
# The warm-up's kernel modules planned on this first boot (issue 25's probe).
with Engine(config, backend=backend, context=context, library_reserve=library,
            torch_pool="imp_mem",
            activation_bytes=int(high * 1.1) + (64 << 20), warmup_probe=True, **kw) as e:
    if vision:
        size = vision["image_size"]
        image = torch.rand(3, size, size) * 2 - 1
        tokens = [config["image_token_index"]] * config["mm_tokens_per_image"]
        prompt = [5, 6, 7] * 10 + tokens + [8, 9] * 20
        e.generate([prompt] * max_batch, 16, images=[image] * max_batch)
    else:
        e.generate([[1, 2, 3] * 40] * max_batch, 16)
    torch.cuda.synchronize()
    report = e.mem_report(other_processes=other)
    text = e.mem_report_text(other_processes=other)
    steady = sum(backend.stats()["steady_state_allocations_total"].values())
    warm = {"planned": e.warmup_planned, "measured": e.warmup_measured}
print(json.dumps({"report": report, "text": text, "steady": steady, "warmup": warm}), flush=True)
"""

# torch's high-water over the same engine's warm-up and requests, measured in
# a process of its own: in the measured child, kernel modules that an earlier
# engine loaded would be on the device before its warm-up meter starts, and
# neither planned nor attributed.
MEASURE = r"""
import json, sys
from imp_mem.engine.memory import measure_torch_high_water

config, max_batch, max_seq_len = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kw = dict(load_format="dummy", seed=3, max_batch=max_batch, max_seq_len=max_seq_len)
# torch's working set needs no planned warm-up line: no probe child here.
high = measure_torch_high_water(config, requests=2 * max_batch, warmup_probe=False, **kw)
print("high", high, flush=True)
"""


def child_report(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Runs `script` in a child that prints ``ready <torch reserved>`` once
    its CUDA context is up, reads ``<context> <other>`` (its context's cost
    less torch's first segment, and what other processes hold, measured
    here while this process keeps a context open), and prints its result
    as one JSON line; returns that result."""
    holder = imp_mem.CudaBackend(device=0)  # keeps this process's context open
    free_before, total = holder.mem_get_info()
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        ready, torch_reserved = child.stdout.readline().split()
        assert ready == "ready"
        free_with_child, _ = holder.mem_get_info()
        # The child's context: what it took before the engine, less torch's
        # own first segment (which the engine names as a charge itself).
        context = free_before - free_with_child - int(torch_reserved)
        other = total - free_before
        child.stdin.write(f"{context} {other}\n")
        child.stdin.flush()
        line = child.stdout.readline()
    finally:
        child.wait(timeout=600)
    assert child.returncode == 0
    return json.loads(line)


def plan_against_device(config: dict[str, Any], max_batch: int, max_seq_len: int, label: str):
    """Boots `config` in a child at the limits and asserts: the plan's total
    within 1 % of the device memory the child uses, 99-101 % of it
    attributed, no acquisition while serving. Returns the child's report."""
    env = {k: v for k, v in os.environ.items() if k != "IMP_MEM_WARMUP_PROBE"}
    args = (json.dumps(config), str(max_batch), str(max_seq_len))
    measured = subprocess.run(
        [sys.executable, "-c", MEASURE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert measured.returncode == 0, measured.stderr[-4000:]
    high = next(ln for ln in measured.stdout.splitlines() if ln.startswith("high ")).split()[1]
    # The library reserve as measured (once per machine, cached), so the
    # report charges it as measured, not as the plan's estimate.
    from imp_mem import reserve

    library = int(reserve.load_or_measure(samples=1)["library_reserve_bytes"])
    result = child_report(CHILD, *args, high, str(library), env=env)
    report, text = result["report"], result["text"]
    device = report["device"]
    print(f"\n{label}:\n{text}\nwarm-up (torch, modules): {result.get('warmup')}")
    in_use = device["used"] - device["other_processes"]
    # The plan's total with the open's rounding of growable tiers to whole
    # granules (decided before any acquisition; named in the report).
    planned = report["plan_total"] + report["granule_rounding"]
    gap = abs(in_use - planned) / in_use
    print(f"plan {planned >> 20} MiB, in use {in_use >> 20} MiB ({100 * gap:.2f} %)")
    assert gap <= 0.01, text
    assert device["attribution_pct"] >= 99.0, text
    assert device["attribution_pct"] <= 101.0, "attributed more than is in use"
    assert result["steady"] == 0
    return report


def decisive_tokens(label: str, logits_rows, outs) -> tuple[int, int]:
    """Greedy tokens against a reference model's teacher-forced logits:
    `logits_rows` yields, per request, the reference's logits at the
    positions that chose its output tokens (float, on any device); every
    token where the reference's top-2 margin is decisive (> 0.2) must be
    the reference's argmax. Returns (decisive, checked) for the caller's
    bound on how many were decisive."""
    import torch

    checked = decisive = 0
    for rows, o in zip(logits_rows, outs, strict=True):
        top2 = rows.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]).cpu() > 0.2
        ok = rows.argmax(-1).cpu() == torch.tensor(o)
        checked += len(o)
        decisive += int(sure.sum())
        assert ok[sure].all(), f"{label}: a greedy token differs where transformers is decisive"
    print(f"\n{label}: {decisive} of {checked} tokens decisive, all equal to transformers'")
    return decisive, checked


THRESHOLDS = Path(__file__).resolve().parent / "engine_peak_thresholds.json"


def check_peak_thresholds(name: str, got: dict[str, int], config: dict[str, Any]) -> None:
    """Asserts each peak in `got` (device bytes) is within the checked-in
    threshold of engine configuration `name`; with
    ``IMP_MEM_UPDATE_THRESHOLDS=1`` first rewrites that entry as measured +
    2 % (and copies the file to ``$IMP_MEM_GPU_OUT`` where set, so a device
    run brings it back)."""
    thresholds = json.loads(THRESHOLDS.read_text())
    if os.environ.get("IMP_MEM_UPDATE_THRESHOLDS"):
        entry: dict[str, Any] = {k: int(v * 1.02) for k, v in got.items()}
        entry["config"] = config
        thresholds[name] = entry
        text = json.dumps(thresholds, indent=2, sort_keys=True) + "\n"
        THRESHOLDS.write_text(text)
        out = os.environ.get("IMP_MEM_GPU_OUT")
        if out:
            (Path(out) / THRESHOLDS.name).write_text(text)
    assert name in thresholds, (
        f"no checked-in peak for {name!r}: run with IMP_MEM_UPDATE_THRESHOLDS=1 on the GPU"
    )
    limit = thresholds[name]
    print(f"\n{name}: peak {got} against {limit}")
    for key, value in got.items():
        assert value <= limit[key], f"{name}: {key} grew: {value} B > {limit[key]} B"


def workload(e, n, seed, cancel=0.0, prompt=(8, 400), new=(1, 64)):
    """Random requests (some sharing prefixes), served to the end with
    cancellations at random points; returns the requests."""
    rng = random.Random(seed)
    vocab = e.config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(96)] for _ in range(4)]
    reqs = []
    for i in range(n):
        own = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        p = (prefixes[i % 4] + own) if i % 3 == 0 else own
        p = p[: e.max_seq_len - new[1] - 1]
        reqs.append(e.submit(p, rng.randint(*new)))
    while e.scheduler.has_work:
        e.step()
        for r in reqs:
            if cancel and not r.done and rng.random() < cancel:
                e.cancel(r.seq_id)
    return reqs


def boot_in_child(script: str, directory, tmp_path) -> dict:
    """Runs an engine boot `script` in a fresh child process (its argv: the
    checkpoint `directory` and this process's own device bytes) with the
    warm-up and reserve caches under `tmp_path`, so that successive calls
    are a cold and then a warm boot; returns the JSON of its last line."""
    import torch

    env = dict(
        os.environ,
        IMP_MEM_WARMUP_CACHE=str(tmp_path / "warmup.json"),
        IMP_MEM_CACHE_DIR=str(tmp_path / "cache"),
    )
    env.pop("IMP_MEM_WARMUP_PROBE", None)
    torch.cuda.synchronize()
    free, whole = torch.cuda.mem_get_info()
    out = subprocess.run(
        [sys.executable, "-c", script, str(directory), str(whole - free)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
