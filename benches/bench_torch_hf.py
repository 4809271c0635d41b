"""A Hugging Face model on imp-mem in one process, side by side with torch's
own caching allocator (issues 12 and 28; GPU).

A Qwen3-0.6B-shaped model (the numbers of its config.json, random weights
from a fixed seed, built on the GPU, bf16) generates ``batch x prompt``
tokens plus ``new`` greedy tokens. Every run is a fresh process (torch's
process-wide allocator is chosen before its first CUDA tensor):

* ``default``: torch's caching allocator, as a new user runs it;
* ``imp``: the one-call path, :func:`imp_mem.torch.serve`, then the user's
  own code (the lines between ``# --- user code`` markers, at most ten):
  build the model, one warm-up ``generate()``, ``begin_serving()``, the
  counted ``generate()``. No calibration run, no margin ladder, no KV pool:
  the activations tier is *measured* while the warm-up runs and frozen at
  its high-water plus 0.2 % by ``begin_serving()``;
* ``imp`` again with the same fingerprint and cache: the second start plans
  the tier at the remembered figure and does not measure;
* the same pairs under ``torch.compile`` (``default`` and
  ``reduce-overhead``, HF's static cache so the shapes are fixed): inductor's
  workspaces are blocks of the tier; ``reduce-overhead`` runs in the scope
  mode (its CUDA graph trees need the caching allocator's checkpoint state,
  which torch's process-wide pluggable path lacks), its graphs captured into a
  MemPool over the tier (``imp_mem.torch.graph_pool``);
* the scope mode (``serve(mode="scope")``: a ``MemPool`` over a measured
  tier, kept as the warm-up left it, torch's cache inside it).

Both sides run with torch's deterministic mode (``CUBLAS_WORKSPACE_CONFIG``
``:4096:8``), so their greedy tokens must be identical. Printed, per variant:
reserved ÷ HF's own live peak (imp: what the backend committed while serving;
HF's peak: weights + KV + activations on torch's allocator, goal <= 1.02),
backend acquisitions / driver allocations / fallbacks while serving (goal 0),
the report's attribution (goal 100 %), tokens identical, tokens/s imp ÷
default (goal >= 0.98); for the scope mode reserved ÷ needed (weights + the
KV the batch needs, goal <= 1.2); for the second start whether it measured.

``--record-trace PATH`` also writes the torch side's allocation trace,
from torch's own memory history: every block its caching allocator handed
out and took back while the model was built and its first ``generate()``
ran (compiled: its second too, as ``PATH``'s stem + ``.MODE``), in
``tools/record_hf_trace.py``'s format, for ``bench_measured_replay.py --trace``
to replay the real sequence through the tier on the CPU.

    python benches/bench_torch_hf.py [--quick] [--compile none,default,reduce-overhead]
        [--json out.json] [--record-trace trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def build(batch: int, prompt: int, compile_mode: str, kv_cache: str = "lazy", new: int = 0):
    """The model (random weights, fixed seed) and the prompts, on the GPU;
    compiled when ``compile_mode`` is not ``none``. ``kv_cache="early"``
    (compiled only): one ``StaticCache`` for ``prompt + new`` tokens, its
    layers made now, outside any graph, and reset before each generate()
    (``model.bench_cache``); "lazy" leaves it to generate(), which makes a
    static cache per call, a layer at a time, inside the compiled forward."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B)
    config._attn_implementation = "sdpa"
    # Built in bfloat16, as from_pretrained(dtype=torch.bfloat16) loads a
    # checkpoint: an fp32 build cast after left the cast's frees as holes
    # among the weights (64 MiB of the tier's 1.9 % over the live peak,
    # measured on the H200 on 2026-12-03), which no user load makes.
    with torch.device("cuda"):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, QWEN3_0_6B["vocab_size"] - 1000, (batch, prompt), generator=gen)
    model.bench_cache = None
    if compile_mode != "none" and kv_cache == "early":
        from transformers import StaticCache

        cache = StaticCache(config=config, max_cache_len=prompt + new)
        cache.early_initialization(
            batch, config.num_key_value_heads, config.head_dim, torch.bfloat16, torch.device("cuda")
        )
        model.bench_cache = cache
    if compile_mode != "none":
        compiled = torch.compile(model.forward, mode=compile_mode)
        model.forward = compiled
        if compile_mode == "reduce-overhead":
            # CUDA graph trees reuse their outputs' memory at the next replay;
            # a new step each forward tells them the last one's outputs are
            # done with (transformers 4.57 refused without it: "accessing
            # tensor output of CUDAGraphs that has been overwritten").
            def forward(*args, **kwargs):
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(*args, **kwargs)

            model.forward = forward
    return model, ids.cuda()


def generate(model, ids, new: int, compile_mode: str = "none"):
    import torch

    extra = {"cache_implementation": "static"} if compile_mode != "none" else {}
    cache = getattr(model, "bench_cache", None)
    if cache is not None:
        cache.reset()
        extra = {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
    torch.cuda.synchronize()
    return out[:, ids.shape[1] :].cpu()


def _median_seconds(first: tuple[float, float], args, again) -> dict:
    """The median of `first` (wall and CPU seconds of one generate()) and
    ``--reps - 1`` more timings of `again`: a single run's time moved
    511-858 tokens/s between identical children on the H200 (2026-12-03, issue 28).
    Every run's wall and CPU seconds are kept (``seconds_runs``,
    ``cpu_seconds_runs``): HF's generate() is host-bound at these shapes,
    so a slow run with its CPU time up is the host's, not the GPU's."""
    walls, cpus = [first[0]], [first[1]]
    for _ in range(args.reps - 1):
        t0, c0 = time.perf_counter(), time.process_time()
        again()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {
        "seconds": statistics.median(walls),
        "seconds_runs": [round(w, 4) for w in walls],
        "cpu_seconds_runs": [round(c, 4) for c in cpus],
    }


def _profiled(args, again) -> dict | None:
    """``--profile``: one more generate() under torch's profiler, summed:
    the kernels' device time, the host's self time, and the host ops that
    took the most (a slow child's time found on the GPU or on the host)."""
    if not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        again()
        wall = time.perf_counter() - t0
    rows = prof.key_averages()
    device = sum(getattr(r, "self_device_time_total", 0) for r in rows) / 1e3
    host = sorted(rows, key=lambda r: r.self_cpu_time_total, reverse=True)
    return {
        "wall_ms": round(wall * 1e3, 1),
        "device_self_ms": round(device, 1),
        "host_self_ms": round(sum(r.self_cpu_time_total for r in rows) / 1e3, 1),
        "top_host": [
            (r.key[:60], r.count, round(r.self_cpu_time_total / 1e3, 1)) for r in host[:8]
        ],
    }


def _kv_needed(batch: int, tokens: int) -> int:
    layers, kv_heads, head_dim = 28, 8, 128
    return batch * tokens * layers * 2 * kv_heads * head_dim * 2


def trace_of(events: list[dict], marks: int, meta: dict, second: int | None = None) -> dict:
    """torch's memory history (``device_traces`` of one device) as a
    replayable trace: ``["a", id, bytes]`` at each ``alloc``, ``["f", id]``
    at each ``free_requested`` (when the tensor died; the block is reused
    from then on a single stream); ``model_ops``: the ops of the first
    `marks` events; ``second_ops`` (with `second`, a compiled run's trace):
    where the second ``generate()`` begins, the pass after the warm-up's
    ``reset_high_water()``. Segment events (the cache's own driver calls)
    are not the work's and are left out; so are frees of blocks allocated
    before the history began."""
    ops: list[list] = []
    live: dict[int, int] = {}
    model_ops, second_ops, count = None, None, 0
    for k, ev in enumerate(events):
        if k == marks:
            model_ops = len(ops)
        if k == second:
            second_ops = len(ops)
        action = ev.get("action")
        if action == "alloc":
            count += 1
            live[ev["addr"]] = count
            ops.append(["a", count, int(ev["size"])])
        elif action == "free_requested" and ev["addr"] in live:
            ops.append(["f", live.pop(ev["addr"])])
    out = dict(meta, ops=ops, model_ops=len(ops) if model_ops is None else model_ops)
    if second is not None:
        out["second_ops"] = len(ops) if second_ops is None else second_ops
    return out


def child_default(args) -> dict:
    import torch

    if args.record_trace:
        # No stacks: only the blocks' order and sizes are wanted.
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=4_000_000
        )
    model, ids = build(args.batch, args.prompt, args.compile, args.kv_cache, args.new)
    weights = torch.cuda.memory_allocated()
    marks = None
    if args.record_trace:
        marks = len(torch.cuda.memory._snapshot()["device_traces"][0])
    first = generate(model, ids, args.new, args.compile)
    meta = {"batch": args.batch, "prompt": args.prompt, "new": args.new, "source": "H200",
            "compile": args.compile}  # fmt: skip
    second_mark = None
    if args.record_trace:
        events = torch.cuda.memory._snapshot()["device_traces"][0]
        if args.compile == "none":
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(args.record_trace, "w") as f:
                json.dump(trace_of(events, marks, meta), f)
        else:
            # Compiled: the second generate() too, the pass ours measures
            # after reset_high_water() (the compile's own blocks are live or
            # gone by then).
            second_mark = len(events)
    torch.cuda.reset_peak_memory_stats()
    s0 = torch.cuda.memory_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    second = generate(model, ids, args.new, args.compile)
    dt = (time.perf_counter() - t0, time.process_time() - c0)
    s1 = torch.cuda.memory_stats()
    again = lambda: generate(model, ids, args.new, args.compile)  # noqa: E731
    if second_mark is not None:
        events = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(args.record_trace, "w") as f:
            json.dump(trace_of(events, marks, meta, second_mark), f)
    return {
        "tokens": second.tolist(),
        "first_equals_second": bool(torch.equal(first, second)),
        **_median_seconds(dt, args, again),
        "profile": _profiled(args, again),
        "weights_bytes": weights,
        # HF's own live peak while serving: weights, its KV, the activations.
        "live_peak": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
        "driver_allocs_serving": s1.get("num_device_alloc", 0) - s0.get("num_device_alloc", 0),
    }


def _imp_figures(system, tokens, dt) -> dict:
    import torch

    import imp_mem.torch as imt

    backend = system.backend
    b = backend.stats()
    report = system.report()
    pool = imt.memory_stats(system)
    # Scope mode: every tensor of the run was made inside the scope, so the
    # MemPool's segments are the tier's (torch's memory_reserved counts them
    # too); what torch's default pool holds outside it is added.
    outside = 0
    if system.mode == "scope":
        outside = max(0, torch.cuda.memory_reserved() - int(b["committed"]))
    mempool_reserved = outside
    return {
        "tokens": tokens.tolist(),
        "seconds": dt,
        "measured_this_start": system.measuring,
        "recalled": system.recalled,
        "measured": system.measured(),
        "committed": int(b["committed"]),
        "torch_default_reserved": mempool_reserved,
        "tier_in_use_peak": pool["allocated_bytes.all.peak"],
        "steady_state_allocations": sum(b["steady_state_allocations_total"].values()),
        "fallbacks": pool.get("imp_mem.fallbacks_total", 0),
        "ooms": pool.get("imp_mem.ooms", 0),
        # The recorded warm-up pass laid out (compiled runs), and how the
        # served passes followed it.
        "pass_plan": system.pass_plan,
        "pass_hints": system.activations.pass_hints,
        "attribution_pct": report["device"]["attribution_pct"] if report.get("device") else None,
        "outside_charge": system.outside_charge,
        "report": system.report_text(),
    }


def child_imp(args) -> dict:
    """The one-call path. Only the lines between the markers are the user's;
    the rest reads the counts around the served generate()."""
    import imp_mem
    import imp_mem.torch

    fingerprint = {"model": "Qwen3-0.6B/random", "batch": args.batch, "prompt": args.prompt,
                   "new": args.new, "compile": args.compile, "mode": args.mode,
                   "vmm_chunk_mib": args.vmm_chunk_mib, "margin": args.margin,
                   "plan_passes": args.plan_passes, "kv_cache": args.kv_cache}  # fmt: skip
    # Not the user's: the bench's knobs (the backend's handle size, the margin).
    knobs = {"margin": args.margin} if args.margin is not None else {}
    if args.plan_passes == "off":
        knobs["plan_passes"] = False
    if args.vmm_chunk_mib:
        knobs["backend"] = imp_mem.VmmBackend(0, chunk_bytes=args.vmm_chunk_mib << 20)
    # --- user code (ten lines at most)
    system = imp_mem.torch.serve(fingerprint=fingerprint, mode=args.mode, **knobs)
    with system.scope():
        model, ids = build(args.batch, args.prompt, args.compile, args.kv_cache, args.new)
        generate(model, ids, args.new, args.compile)  # the warm-up (compiles, if asked)
    if args.compile != "none":  # forget the compiler's own peak, then warm up once more
        system.reset_high_water()
        with system.scope():
            generate(model, ids, args.new, args.compile)
    system.begin_serving()
    # --- (the user's serving generate() is the timed one below)
    b0 = system.backend.stats()
    # A second start's warm-up runs in the tier sized for the served pass
    # (the compile's peak forgotten): what it took past the tier is counted
    # apart from the served runs'.
    warm_fallbacks = imp_mem.torch.memory_stats(system).get("imp_mem.fallbacks_total", 0)
    free0, _ = imp_mem.cuda_mem_get_info(system.device)
    with system.scope():
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = generate(model, ids, args.new, args.compile)
        dt = (time.perf_counter() - t0, time.process_time() - c0)
    free1, _ = imp_mem.cuda_mem_get_info(system.device)
    b1 = system.backend.stats()
    out = _imp_figures(system, tokens, dt[0])
    again = lambda: generate(model, ids, args.new, args.compile)  # noqa: E731
    with system.scope():
        out.update(_median_seconds(dt, args, again))
        out["profile"] = _profiled(args, again)
    total = imp_mem.torch.memory_stats(system).get("imp_mem.fallbacks_total", 0)
    out["fallbacks"], out["fallbacks_warmup"] = total - warm_fallbacks, warm_fallbacks
    # The pool's and the hooks' counters at the end (cross-stream reuses,
    # reclaims, refusals): what a start's allocations cost besides the search.
    stats = imp_mem.torch.memory_stats(system)
    out["pool_counters"] = {k[8:]: v for k, v in stats.items() if k.startswith("imp_mem.")}
    out["hook_stats"] = imp_mem.torch.hook_stats()
    out["backend_acquisitions_serving"] = int(b1["acquisitions"]) - int(b0["acquisitions"])
    out["committed_delta_serving"] = int(b1["committed"]) - int(b0["committed"])
    out["device_free_delta_serving"] = free0 - free1
    return out


def parse_cpus(text: str | None) -> set[int]:
    """``--cpus``: CPU ids and ranges (``0-3,8``); empty: no pinning."""
    cpus: set[int] = set()
    for part in filter(None, (text or "").split(",")):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise SystemExit(f"--cpus: expected ids and ranges such as 0-3; got {text!r}") from None
        if first < 0 or last < first:
            raise SystemExit(f"--cpus: {part!r} is not a range of CPU ids")
        cpus.update(range(first, last + 1))
    return cpus


def run_child(kind: str, args, extra: list[str], cache: str, record: bool = True) -> dict:
    env = dict(
        os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1", IMP_MEM_CACHE_DIR=cache
    )
    cmd = [sys.executable, __file__, "--child", kind, *extra]
    cmd += ["--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new)]
    cmd += ["--reps", str(args.reps), "--kv-cache", getattr(args, "kv_cache", "lazy")]
    if getattr(args, "profile", False):
        cmd += ["--profile"]
    if kind == "imp":
        cmd += ["--plan-passes", getattr(args, "plan_passes", "on")]
    if kind == "default" and record and args.record_trace:
        # One trace a compile mode: trace.json, trace.default.json, ...
        mode = extra[extra.index("--compile") + 1] if "--compile" in extra else "none"
        root, ext = os.path.splitext(args.record_trace)
        cmd += ["--record-trace", args.record_trace if mode == "none" else f"{root}.{mode}{ext}"]
    cpus = parse_cpus(args.cpus)
    # Every child on the same cores (HF's generate() is host-bound at these
    # shapes, and identical children's tokens/s moved by ±20 %).
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, preexec_fn=pin)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(
        f"{kind} {extra} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}"
    )


def compare(args, default: dict, imp: dict, needed: int) -> dict:
    committed = imp["committed"] + imp["torch_default_reserved"]
    return {
        "tokens_identical": default["tokens"] == imp["tokens"],
        "default_run_to_run_identical": default["first_equals_second"],
        "reserved_over_live_peak": committed / default["live_peak"],
        "reserved_over_needed": committed / needed,
        "default_reserved_over_live_peak": default["reserved"] / default["live_peak"],
        "default_reserved_over_needed": default["reserved"] / needed,
        "tokens_per_s_ratio": default["seconds"] / imp["seconds"],
        "tokens_per_s_imp": args.batch * args.new / imp["seconds"],
        "tokens_per_s_default": args.batch * args.new / default["seconds"],
        "backend_acquisitions_serving": imp.get("backend_acquisitions_serving"),
        "committed_delta_serving": imp.get("committed_delta_serving"),
        "device_free_delta_serving_mib": (imp.get("device_free_delta_serving") or 0) / MIB,
        "steady_state_allocations": imp["steady_state_allocations"],
        "fallbacks": imp["fallbacks"],
        "fallbacks_warmup": imp["fallbacks_warmup"],
        "default_driver_allocs_serving": default["driver_allocs_serving"],
        "attribution_pct": imp["attribution_pct"],
        "measured_this_start": imp["measured_this_start"],
        "measured": imp["measured"],
        "tier_in_use_peak_over_live_peak": imp["tier_in_use_peak"] / default["live_peak"],
        "outside_charge_mib": (imp["outside_charge"] or 0) / MIB,
        "imp_seconds_runs": imp.get("seconds_runs"),
        "imp_cpu_seconds_runs": imp.get("cpu_seconds_runs"),
        "imp_profile": imp.get("profile"),
        "default_profile": default.get("profile"),
        "default_seconds_runs": default.get("seconds_runs"),
        "default_cpu_seconds_runs": default.get("cpu_seconds_runs"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["default", "imp"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--mode", choices=["scope", "process"], default="process")
    ap.add_argument("--compile", default="none", help="child: none, default, reduce-overhead")
    ap.add_argument("--compiles", default="none,default,reduce-overhead", help="variants run")
    ap.add_argument("--no-scope", action="store_true", help="skip the scope-mode run")
    ap.add_argument("--cache", help="the measured-figure cache dir (default: a fresh temp dir)")
    ap.add_argument("--quick", action="store_true", help="batch 8 x 256 + 16")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--vmm-chunk-mib", type=int, default=None, help="imp child: the VMM backend's handle MiB"
    )
    ap.add_argument("--margin", type=float, default=None, help="imp child: serve()'s margin")
    ap.add_argument(
        "--reps", type=int, default=3, help="timed generate()s a child, the median kept"
    )
    ap.add_argument(
        "--peer-runs",
        type=int,
        default=2,
        help="torch-allocator children a compile mode (before and after ours), the median kept",
    )
    ap.add_argument(
        "--cpus",
        default=None,
        help="pin every child to these CPUs (e.g. 0-3): the same cores for each side",
    )
    ap.add_argument(
        "--plan-passes",
        choices=["on", "off"],
        default="on",
        help="imp side: lay out the pass after reset_high_water() (serve(plan_passes=))",
    )
    ap.add_argument(
        "--kv-cache",
        choices=["lazy", "early"],
        default="lazy",
        help="compiled: generate()'s static cache made per call inside the graphs (lazy), or "
        "one made before, outside them, and reset each call (early)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="each child: one more generate() under torch's profiler (device vs host time)",
    )
    ap.add_argument(
        "--record-trace",
        help="write the torch side's allocation trace (build + first generate(); compiled: "
        "+ the second, to PATH's stem + .MODE) here",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="process/none again at each CHUNK_MIB:MARGIN (e.g. 2:0.01,2:0.005), side by side",
    )
    args = ap.parse_args(argv)
    parse_cpus(args.cpus)  # refused here, before any child
    for name in ("reps", "peer_runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.child:
        import torch

        torch.use_deterministic_algorithms(True)
        fn = child_default if args.child == "default" else child_imp
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return 0
    if args.quick:
        args.batch, args.prompt, args.new = 8, 256, 16
    cache = args.cache or tempfile.mkdtemp(prefix="imp-mem-bench-cache-")
    t_start = time.perf_counter()
    variants, reports, failed, alone_rows = {}, {}, {}, {}
    for mode in args.compiles.split(","):
        comp = ["--compile", mode]
        # CUDA graph trees need the caching allocator's checkpoint state,
        # which a process-wide pluggable allocator lacks: scope mode.
        where = "scope" if mode == "reduce-overhead" else "process"
        try:
            defaults = [run_child("default", args, comp, cache)]
        except RuntimeError as exc:
            # torch's own side crashed (HF generate() under reduce-overhead
            # segfaults on torch 2.11 in the default allocator): ours alone,
            # its own figures, no ratio.
            failed[f"{mode}/torch"] = tail = str(exc)[-600:]
            print(f"[{mode}] torch's allocator FAILED: {tail}")
            try:
                alone = run_child("imp", args, [*comp, "--mode", where], cache)
            except RuntimeError as exc2:
                failed[mode] = str(exc2)
                print(f"[{mode}] FAILED: {exc2}")
                continue
            alone = {k: alone[k] for k in alone if k not in ("tokens", "report")}
            alone["tokens_per_s"] = args.batch * args.new / alone["seconds"]
            alone_rows[f"{where}/{mode}"] = alone
            print(f"ALONE [{where}/{mode}] {json.dumps(alone)}")
            continue
        try:
            needed = defaults[0]["weights_bytes"] + _kv_needed(args.batch, args.prompt + args.new)
            runs: list[tuple[str, dict]] = []
            first = run_child("imp", args, [*comp, "--mode", where], cache)
            runs.append((f"{where}/{mode}", first))
            reports[f"{where}/{mode}"] = first["report"]
            if where == "process":
                # The same start again: it plans the remembered figure.
                second = run_child("imp", args, [*comp, "--mode", "process"], cache)
                runs.append((f"process/{mode}/second-start", second))
            if mode == "none":
                for variant in filter(None, args.variants.split(",")):
                    mib, margin = variant.split(":")
                    knob = ["--vmm-chunk-mib", mib, "--margin", margin]
                    extra = run_child("imp", args, [*comp, "--mode", "process", *knob], cache)
                    runs.append((f"process/none/chunk{mib}/margin{margin}", extra))
                if not args.no_scope:
                    scope = run_child("imp", args, [*comp, "--mode", "scope"], cache)
                    runs.append(("scope/none", scope))
                    reports["scope/none"] = scope["report"]
            # torch's side again after ours (a process's tokens/s moved by
            # tens of percent between identical children): the ratios are
            # against the median of its runs, each run's figure kept.
            for _ in range(args.peer_runs - 1):
                defaults.append(run_child("default", args, comp, cache, record=False))
            default = dict(defaults[0], seconds=statistics.median(d["seconds"] for d in defaults))
            peer_tps = [round(args.batch * args.new / d["seconds"], 1) for d in defaults]
            for name, imp in runs:
                row = compare(args, default, imp, needed)
                row["default_tokens_per_s_runs"] = peer_tps
                row["default_wall_cpu_runs"] = [
                    (d.get("seconds_runs"), d.get("cpu_seconds_runs")) for d in defaults
                ]
                row["tokens_identical"] = all(d["tokens"] == imp["tokens"] for d in defaults)
                if name.endswith("/second-start"):
                    row["first_start_measured"] = first["measured_this_start"]
                row["pass_plan"], row["pass_hints"] = imp["pass_plan"], imp["pass_hints"]
                variants[name] = row
        except RuntimeError as exc:  # the other variants' figures still count
            failed[mode] = str(exc)
            print(f"[{mode}] FAILED: {exc}")
    if not variants and not alone_rows:
        raise RuntimeError(f"no variant ran: {failed}")
    for name, text in reports.items():
        print(f"-- the memory report of {name} while serving\n{text}")
    for name, r in variants.items():
        print(
            f"RATIOS [{name}] reserved/live-peak {r['reserved_over_live_peak']:.3f} (goal <= 1.02; "
            f"torch {r['default_reserved_over_live_peak']:.3f}); reserved/needed "
            f"{r['reserved_over_needed']:.3f}; tokens/s imp/default {r['tokens_per_s_ratio']:.3f} "
            f"(goal >= 0.98; imp {r['tokens_per_s_imp']:.1f}, torch's runs "
            f"{r['default_tokens_per_s_runs']}); tokens identical {r['tokens_identical']}; "
            f"acquisitions while "
            f"serving {r['backend_acquisitions_serving']}, fallbacks {r['fallbacks']}, committed "
            f"+{r['committed_delta_serving']} B; attributed {r['attribution_pct']}%; measured "
            f"this start {r['measured_this_start']}; pass hints {r['pass_hints']}; "
            f"imp wall/cpu s {r['imp_seconds_runs']}/{r['imp_cpu_seconds_runs']}"
        )
        if r.get("imp_profile"):
            print(f"PROFILE [{name}] imp {r['imp_profile']}; torch {r['default_profile']}")
    rows = {
        "workload": f"{args.batch} x {args.prompt} + {args.new} greedy, Qwen3-0.6B shape, bf16",
        "variants": variants,
        "alone": alone_rows,
        "failed": failed,
        "wall_s": time.perf_counter() - t_start,
    }
    print(f"wall {rows['wall_s']:.0f} s")
    write_json(args.json, rows)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
