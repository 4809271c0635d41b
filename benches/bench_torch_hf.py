"""A Hugging Face model on imp-mem's activations tier, side by side with
torch's own caching allocator (issue 12; GPU).

A Qwen3-0.6B-shaped model (the numbers of its config.json, random weights
from a fixed seed, bf16) generates ``batch x prompt`` tokens plus ``new``
greedy tokens, twice, in two fresh processes:

* ``default``: torch's caching allocator, as a new user runs it;
* ``imp``: a ``MemorySystem`` on the VMM backend, weights moved into T1
  (``imp_mem.torch.to_arena``), every other torch allocation in the
  activations tier through ``imp_mem.torch.Pool``; the first ``generate()``
  is the warm-up (before ``begin_serving()``: it measures the charge outside
  every allocator), the second runs while SERVING and is the one counted.

Both run with torch's deterministic mode on (``CUBLAS_WORKSPACE_CONFIG``
``:4096:8``), so their greedy tokens must be identical. Printed, as ratios of
the same run: generate tokens/s, imp ÷ default; device reserved ÷ (weights +
the KV the batch needs), each side; and the counts: backend acquisitions and
driver allocations while serving (imp-mem's counters, torch's
``num_device_alloc`` and the device's free memory), attribution of the memory
report.

    python benches/bench_torch_hf.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

from bench_json import write_json

MIB = 1 << 20

QWEN3_0_6B = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def _model_and_prompts(batch: int, prompt: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B)
    config._attn_implementation = "sdpa"
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, QWEN3_0_6B["vocab_size"] - 1000, (batch, prompt), generator=gen)
    return model, ids


def _generate(model, ids, new: int):
    import torch

    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    torch.cuda.synchronize()
    return out[:, ids.shape[1] :].cpu()


def _kv_needed(batch: int, tokens: int) -> int:
    layers, kv_heads, head_dim = 28, 8, 128
    return batch * tokens * layers * 2 * kv_heads * head_dim * 2


def child_default(args) -> dict:
    import torch

    model, ids = _model_and_prompts(args.batch, args.prompt)
    model.to("cuda")
    ids = ids.cuda()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    first = _generate(model, ids, args.new)
    peak = torch.cuda.max_memory_allocated() - weights
    s0 = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    second = _generate(model, ids, args.new)
    dt = time.perf_counter() - t0
    s1 = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {
        "tokens": second.tolist(),
        "first_equals_second": bool(torch.equal(first, second)),
        "seconds": dt,
        "weights_bytes": weights,
        "activation_high_water": peak,
        "reserved": torch.cuda.memory_reserved(),
        "device_used": total - free,
        "allocator_calls": s1["allocation.all.allocated"] - s0["allocation.all.allocated"],
        "driver_allocs_serving": s1.get("num_device_alloc", 0) - s0.get("num_device_alloc", 0),
    }


def _torch_stats() -> dict:
    import torch

    try:
        return torch.cuda.memory_stats()
    except RuntimeError:  # a pluggable allocator installed process-wide keeps none
        return {}


def child_imp(args) -> dict:

    import imp_mem
    import imp_mem.torch as imt

    # Nothing of torch's CUDA side runs before imp_mem.torch.install (the
    # process-wide mode must come before torch initialises its allocator):
    # the backend opens the primary context, the driver reads the device.
    model, ids = _model_and_prompts(args.batch, args.prompt)
    backend = imp_mem.VmmBackend(0)
    free_start, total = imp_mem.cuda_mem_get_info(0)
    # This process's context: what the device holds now, less what was there
    # before the process started (the parent read it with nvidia-smi).
    context = max(0, total - free_start - args.other_processes)
    unique = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    shape = imp_mem.ModelShape.from_hf_config(QWEN3_0_6B).with_weights_bytes(weight_bytes)
    features = imp_mem.Features(
        activation_bytes=args.activation_bytes,
        scratch_bytes=2 * MIB,
        engine_persistent_bytes=2 * MIB,
    )
    # The HF model keeps its KV in torch tensors (the activations tier), so the
    # plan's own KV pool is one block's worth.
    limits = imp_mem.Limits(1, 16)
    plan = imp_mem.plan_memory(imp_mem.PlanInput(shape, limits, features, budget=total))
    # Scope mode is strict: when the tier is full the hook returns null, and
    # torch gives its pool's cached free segments back and retries before it
    # reports an OOM.
    # torch's process-wide pluggable path does not check for a null return, so
    # there the tier falls back to the backend (counted) instead of refusing.
    strict = args.mode == "scope"
    system = imp_mem.MemorySystem(backend, plan, context=context, activation_strict=strict)
    if args.mode == "process":
        # Before torch's first CUDA allocation: every tensor from here on is a
        # block of the tier (no torch cache on top).
        imt.install(system)
        scope = contextlib.nullcontext
    else:
        scope = imt.pool(system).scope
    loaded = {}

    def load_and_warm_up():
        # LOADING: the weights into T1 (torch initialises here); PLANNING:
        # the warm-up generate(). Everything the device gains over both,
        # less what the backend committed, is the charge outside every
        # allocator (torch's runtime, lazily loaded kernels, library handles).
        loaded["t1"] = imt.to_arena(model, system.weights_arena)
        loaded["ids"] = ids.cuda()
        system.begin_planning()
        with scope():
            _generate(model, loaded["ids"], args.new)

    charge = imt.measure_outside_charge(system, load_and_warm_up)
    t1_bytes, ids = loaded["t1"], loaded["ids"]
    system.begin_serving()
    b0 = backend.stats()
    h0 = imt.hook_stats()
    t0_stats = _torch_stats()
    free0, _ = imp_mem.cuda_mem_get_info(0)
    with scope():
        t0 = time.perf_counter()
        second = _generate(model, ids, args.new)
        dt = time.perf_counter() - t0
    free1, _ = imp_mem.cuda_mem_get_info(0)
    b1 = backend.stats()
    h1 = imt.hook_stats()
    t1_stats = _torch_stats()
    report = system.mem_report(device=True, other_processes=args.other_processes)
    text = system.mem_report_text(device=True, other_processes=args.other_processes)
    stats = imt.memory_stats(system)
    committed = int(b1["committed"])
    return {
        "tokens": second.tolist(),
        "seconds": dt,
        "weights_bytes": t1_bytes,
        "plan_activations": int(plan.activations),
        "committed": committed,
        "outside_charge": charge,
        "steady_state_allocations": sum(b1["steady_state_allocations_total"].values())
        - sum(b0["steady_state_allocations_total"].values()),
        "backend_acquisitions_serving": int(b1["acquisitions"]) - int(b0["acquisitions"]),
        # torch keeps no counters of its own in process-wide mode.
        "driver_allocs_serving": t1_stats["num_device_alloc"] - t0_stats["num_device_alloc"]
        if "num_device_alloc" in t1_stats
        else None,
        "device_free_delta": free0 - free1,
        "hook_calls_serving": {k: h1[k] - h0.get(k, 0) for k in h1 if k in h0},
        "attribution_pct": report["device"]["attribution_pct"] if report.get("device") else None,
        "pool_stats": stats,
        "report": text,
        "context_bytes": context,
        "retries": t1_stats.get("num_alloc_retries", 0) - t0_stats.get("num_alloc_retries", 0),
    }


def device_used_now() -> int:
    """Device memory in use by every process (nvidia-smi), in bytes; 0 if unknown."""
    from imp_mem.reserve import device_used_by_all_processes

    return device_used_by_all_processes() or 0


def run_child(kind: str, args, extra: list[str]) -> dict:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    others = device_used_now()
    cmd = [sys.executable, __file__, "--child", kind, *extra, "--other-processes", str(others)]
    cmd += ["--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(
        f"{kind} child failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )


def run_ladder(mode: str, args, default: dict) -> dict:
    """The imp child in `mode` with the tier planned from the default run's
    measured high-water (A3.3) times the smallest margin of a ladder that
    serves the workload (torch fragments its cache inside a MemPool)."""
    ladder = [float(x) for x in getattr(args, f"ladder_{mode}").split(",")]
    failures = []
    for margin in ladder:
        act = int(default["activation_high_water"] * margin) + args.slack_mib * MIB
        extra = ["--activation-bytes", str(act), "--mode", mode]
        try:
            imp = run_child("imp", args, extra)
        except RuntimeError as exc:
            failures.append(margin)
            print(
                f"[{mode}] activations at {margin}x the high-water did not serve: "
                f"{str(exc).splitlines()[-1][:200]}"
            )
            continue
        fallbacks = imp["pool_stats"].get("imp_mem.fallbacks_total", 0)
        if fallbacks:
            failures.append(margin)
            print(f"[{mode}] activations at {margin}x the high-water fell back {fallbacks} times")
            continue
        imp["margin"], imp["refused"] = margin, failures
        return imp
    raise RuntimeError(f"[{mode}] no margin of {ladder} served the workload")


def summarize(args, default: dict, imp: dict, needed: int) -> dict:
    rows = {
        "workload": f"{args.batch} x {args.prompt} + {args.new} greedy, Qwen3-0.6B shape, bf16",
        "tokens_identical": default["tokens"] == imp["tokens"],
        "default_run_to_run_identical": default["first_equals_second"],
        "tokens_per_s_default": args.batch * args.new / default["seconds"],
        "tokens_per_s_imp": args.batch * args.new / imp["seconds"],
        "needed_bytes": needed,
        "reserved_over_needed_default": default["reserved"] / needed,
        "reserved_over_needed_imp": imp["committed"] / needed,
        # The floor any allocator has on this workload: HF's own live bytes
        # at its peak (weights, its KV cache and the step's activations).
        "live_peak_over_needed_default": (
            default["weights_bytes"] + default["activation_high_water"]
        )
        / needed,
        "reserved_over_live_peak_imp": imp["committed"]
        / (default["weights_bytes"] + default["activation_high_water"]),
        "activation_high_water": default["activation_high_water"],
        "plan_activations": imp["plan_activations"],
        "allocator_calls_default": default["allocator_calls"],
        "imp_steady_state_allocations": imp["steady_state_allocations"],
        "imp_backend_acquisitions_serving": imp["backend_acquisitions_serving"],
        "imp_driver_allocs_serving_torch_counter": imp["driver_allocs_serving"],
        "imp_device_free_delta_serving": imp["device_free_delta"],
        "imp_hook_calls_serving": imp["hook_calls_serving"],
        "imp_attribution_pct": imp["attribution_pct"],
        "imp_outside_charge_mib": imp["outside_charge"] / MIB,
        "imp_context_mib": imp["context_bytes"] / MIB,
        "imp_activation_margin": imp["margin"],
        "imp_margins_refused": imp["refused"],
        "imp_torch_alloc_retries": imp["retries"],
    }
    rows["generate_ratio"] = rows["tokens_per_s_imp"] / rows["tokens_per_s_default"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["default", "imp"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--activation-bytes", type=int, default=0)
    ap.add_argument("--other-processes", type=int, default=0)
    ap.add_argument("--mode", choices=["scope", "process"], default="scope")
    ap.add_argument(
        "--modes", default="process,scope", help="imp-mem modes to measure, the first reported"
    )
    ap.add_argument("--slack-mib", type=int, default=96)
    ap.add_argument("--ladder-process", default="1.0,1.03,1.1,1.3,1.6,2.0", help="margins tried")
    ap.add_argument("--ladder-scope", default="1.03,1.3,1.6,2.0", help="margins tried")
    ap.add_argument("--quick", action="store_true", help="batch 8 x 256 + 16")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.child:
        import torch

        torch.use_deterministic_algorithms(True)
        fn = child_default if args.child == "default" else child_imp
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return 0
    if args.quick:
        args.batch, args.prompt, args.new = 8, 256, 16

    default = run_child("default", args, [])
    needed = default["weights_bytes"] + _kv_needed(args.batch, args.prompt + args.new)
    modes, reports, failed = {}, {}, {}
    for mode in args.modes.split(","):
        try:
            imp = run_ladder(mode, args, default)
        except RuntimeError as exc:  # the other mode's figures still count
            failed[mode] = str(exc)
            print(f"[{mode}] FAILED: {exc}")
            continue
        modes[mode] = summarize(args, default, imp, needed)
        reports[mode] = imp["report"]
    if not modes:
        raise RuntimeError(f"no mode served the workload: {failed}")
    first = next(iter(modes))
    rows = {"mode": first, **modes[first], "by_mode": modes, "failed_modes": failed}
    for mode, text in reports.items():
        print(f"-- the memory report of the {mode} run while serving\n{text}")
    for m, r in rows["by_mode"].items():
        print(
            f"RATIOS [{m}] generate tokens/s imp/default = {r['generate_ratio']:.3f}x "
            f"(goal >= 0.98); reserved/needed imp = {r['reserved_over_needed_imp']:.3f} "
            f"(default {r['reserved_over_needed_default']:.3f}; goal <= 1.05); margin "
            f"{r['imp_activation_margin']} (refused {r['imp_margins_refused']})"
        )
    width = max(len(k) for k in rows)
    for k, v in modes[first].items():
        print(f"{k.ljust(width)}  {v:.4f}" if isinstance(v, float) else f"{k.ljust(width)}  {v}")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
