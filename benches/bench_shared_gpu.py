"""Several models on one GPU through the device ledger (issue 27), against a
static split, side by side in one run.

Three engines in three processes — Qwen3-0.6B's, Qwen3-4B's and Qwen3-8B's
shapes, random weights (written once to /dev/shm) — serve one bursty trace:
each model in turn bursts (``--burst`` requests of ``--prompt-len`` +
``--new-tokens`` arriving over ``--burst-s`` seconds) while the other two
idle. Two set-ups:

* **shared**: every engine on the device ledger (``Engine(shared=...)``),
  planned for a cap of the whole budget less the others' floors; the KV
  pools grow as the ledger grants and idle tenants give back.
* **static**: the same three engines each planned for a third of the budget
  (the largest ``max_batch`` that plans in its third), no ledger.

Printed: time to first token p50/p99 per model in its burst, tokens/s,
preemptions (goal 0 in shared), p99 ratio static/shared (goal >= 5x);
the idle footprint of each idle tenant (ledger committed against floor +
KV live + one 64 MiB chunk); overhead at saturation (the 0.6B alone, on the
ledger vs without it, tokens/s; goal <= 5 %); and a tenant SIGKILLed while
another bursts: the time until its share is back in the ledger (goal < 1 s)
and whether the others kept serving.

Usage: ``python benches/bench_shared_gpu.py [--budget 60GiB] [--quick]
[--json out.json]``. Needs a CUDA device, torch, triton and the imp_mem
wheel; about 5 minutes on an H200 (``--quick``: smaller shapes).
``--smoke`` runs the whole script with three tiny models on fake backends
(CPU, ~1 minute): it checks the orchestration, not the figures.

Not in the ledger: torch's own allocations (CUDA graph pools, its caching
allocator) unless the engines route them to imp-mem (``torch_pool``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench_json import write_json

GIB = 1 << 30
MIB = 1 << 20
LEDGER_KEY_PREFIX = "bench-"


def qwen3_shape(hidden, inter, layers, heads, kv_heads, tie) -> dict:
    from imp_mem.engine.config import qwen3_0_6b_config

    c = qwen3_0_6b_config()
    c.update(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
    )
    return c


def shapes(quick: bool, smoke: bool = False) -> list[tuple[str, dict]]:
    from imp_mem.engine.config import qwen3_0_6b_config

    if smoke:
        # Three tiny shapes, to check the orchestration on a CPU.
        def tiny(h, layers):
            c = qwen3_shape(h, 2 * h, layers, 4, 2, True)
            c.update(head_dim=16, vocab_size=512, torch_dtype="float32")
            return c

        return [("a", tiny(64, 2)), ("b", tiny(64, 3)), ("c", tiny(96, 4))]

    if quick:
        return [
            ("0.6B", qwen3_0_6b_config()),
            ("1.7B", qwen3_shape(2048, 6144, 28, 16, 8, True)),
            ("4B", qwen3_shape(2560, 9728, 36, 32, 8, True)),
        ]
    return [
        ("0.6B", qwen3_0_6b_config()),
        ("4B", qwen3_shape(2560, 9728, 36, 32, 8, True)),
        ("8B", qwen3_shape(4096, 12288, 36, 32, 8, False)),
    ]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------ worker


def make_backend(opts):
    """The device: a VmmBackend, or with --smoke a FakeBackend (CPU)."""
    import imp_mem

    if opts["smoke"]:
        return imp_mem.FakeBackend(capacity=opts["budget"])
    return imp_mem.VmmBackend(device=0, strict=True)


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker(name, directory, mode, opts, trace, start_at, out, ready):
    """One engine in its own process: opens, reports ready, serves `trace`
    (``[(arrival_s, prompt, new_tokens)]``) from `start_at`, puts its
    results on `out`."""

    import imp_mem
    from imp_mem.engine import Engine
    from imp_mem.engine.shared import SharedGPU

    os.environ["IMP_MEM_LEDGER_DIR"] = opts["ledger_dir"]
    backend = make_backend(opts)
    kw = dict(
        backend=backend,
        max_seq_len=opts["max_seq_len"],
        keep_logits=False,
    )
    batch = opts["max_batch"]
    if mode == "shared":
        kw["shared"] = SharedGPU(
            cap=opts["caps"][name],
            device_budget=opts["budget"],
            key=opts["key"],
            name=name,
            idle_sleep_s=opts["idle_sleep_s"],
        )
    else:
        kw["budget"] = opts["static_budget"]
    while True:
        # Static: the largest batch (halving) whose plan fits its third.
        try:
            engine = Engine(directory, max_batch=batch, **kw)
            break
        except imp_mem.PlanFailure:
            if mode == "shared" or batch == 1:
                raise
            batch //= 2
    engine.generate([[1, 2, 3]] * 2, 2)  # warm-up
    floor = engine.tenancy.floor if engine.tenancy else None
    ready.put((name, floor, batch))
    while time.time() < start_at.value:
        engine.idle()
        time.sleep(0.002)
    t0 = start_at.value
    pending = sorted(trace)
    arrivals, first, done_at, ntok = {}, {}, {}, {}
    i = 0
    last_arrival = pending[-1][0] if pending else 0.0
    tokens = 0
    t_first_work = None
    next_report = opts["lead_s"] + opts["window_s"]

    def report(final):
        ttft = [first[s] - arrivals[s] for s in first]
        busy = (max(done_at.values()) - t_first_work) if done_at and t_first_work else 0.0
        out.put(
            {
                "name": name,
                "mode": mode,
                "batch": batch,
                "ttft": ttft,
                "tokens": tokens,
                "busy_s": busy,
                "preempted": engine.scheduler.stats.preempted,
                "finished": len(done_at),
                "requests": len(pending),
                "final": final,
            }
        )

    while True:
        now = time.time() - t0
        if now >= next_report:
            # A report at every window's end: a tenant killed later still
            # has its burst counted.
            report(False)
            next_report += opts["window_s"]
        while i < len(pending) and pending[i][0] <= now:
            arr, prompt, new = pending[i]
            req = engine.submit(prompt, new)
            arrivals[req.seq_id] = t0 + arr
            ntok[req.seq_id] = 0
            i += 1
            t_first_work = t_first_work or time.time()
        if engine.scheduler.has_work:
            for sid, _tok in engine.step():
                if sid in arrivals:
                    ntok[sid] += 1
                    tokens += 1
                    if sid not in first:
                        first[sid] = time.time()
            for sid in list(arrivals):
                if sid not in done_at and engine.scheduler.requests[sid].done:
                    done_at[sid] = time.time()
        else:
            if i >= len(pending) and now > last_arrival + opts["tail_s"]:
                break
            engine.idle()
            time.sleep(0.001)
    sync()
    report(True)
    engine.close()


def trace_for(index, n_models, args, vocab, seed):
    """Model `index` bursts in window `index`; a trickle (one request a
    window) otherwise, so idle tenants keep a small live set."""
    rng = random.Random(seed)
    out = []
    w0 = args.lead_s + index * args.window_s
    for _ in range(args.burst):
        arr = w0 + rng.random() * args.burst_s
        out.append((arr, [rng.randrange(vocab) for _ in range(args.prompt_len)], args.new_tokens))
    for w in range(n_models):
        if w != index:
            arr = args.lead_s + w * args.window_s + rng.random() * args.window_s
            n = min(64, args.prompt_len)
            out.append((arr, [rng.randrange(vocab) for _ in range(n)], min(16, args.new_tokens)))
    return out


def run_phase(mode, dirs, args, opts, kill=None):
    """Runs the three workers; returns their results and, with `kill`
    (``(victim, at_s)``), the seconds until the victim's share was back."""
    import imp_mem

    ctx = mp.get_context("spawn")
    start_at = ctx.Value("d", 1e18)
    out, ready = ctx.Queue(), ctx.Queue()
    procs = {}
    floors: dict[str, tuple] = {}
    names = [n for n, _ in dirs]
    for k, (name, d) in enumerate(dirs):
        tr = trace_for(k, len(dirs), args, opts["vocab"], seed=k)
        p = ctx.Process(target=worker, args=(name, str(d), mode, opts, tr, start_at, out, ready))
        p.start()
        procs[name] = p
        if mode == "shared":
            # One at a time: the floors join in order.
            n, f, b = ready.get(timeout=args.open_timeout)
            floors[n] = (f, b)
    if mode != "shared":
        for _ in names:
            n, f, b = ready.get(timeout=args.open_timeout)
            floors[n] = (f, b)
    start_at.value = time.time() + 1.0
    ledger = imp_mem.DeviceLedger(opts["key"], 1, opts["ledger_dir"]) if mode == "shared" else None
    footprints: dict = {}
    reclaim_s = None
    t_end = start_at.value + args.lead_s + len(dirs) * args.window_s + args.tail_s
    killed = None
    while time.time() < t_end + 30 and any(p.is_alive() for p in procs.values()):
        now = time.time() - start_at.value
        if ledger is not None:
            window = int((now - args.lead_s) // args.window_s) if now > args.lead_s else -1
            into = (now - args.lead_s) % args.window_s
            if 0 <= window < len(dirs) and into >= args.window_s * 0.9:
                for t in ledger.tenants():
                    if t["name"] != names[window]:
                        footprints[(window, t["name"])] = dict(t, window=window)
            if kill and killed is None and now >= kill[1]:
                victim = procs[kill[0]]
                killed = time.time()
                os.kill(victim.pid, signal.SIGKILL)
            if killed and reclaim_s is None:
                if all(t["name"] != kill[0] for t in ledger.tenants()):
                    reclaim_s = time.time() - killed
        time.sleep(0.01)
    last: dict[str, dict] = {}
    deadline = time.time() + 120
    while time.time() < deadline:
        finals = sum(1 for r in last.values() if r["final"])
        if finals >= len(dirs) - (1 if kill else 0) and out.empty():
            break
        try:
            r = out.get(timeout=5)
        except Exception:
            continue
        last[r["name"]] = r
    for p in procs.values():
        p.join(30)
    return list(last.values()), footprints, reclaim_s, floors


def saturation(directory, args, opts, shared):
    """Tokens/s of the 0.6B alone with a saturating batch, on the ledger or
    not (in a fresh process each)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_saturate, args=(str(directory), args.sat_batch, opts, shared, q))
    p.start()
    r = q.get(timeout=args.open_timeout + 120)
    p.join(30)
    return r


def _saturate(directory, batch, opts, shared, q):
    import random as _r

    from imp_mem.engine import Engine
    from imp_mem.engine.shared import SharedGPU

    os.environ["IMP_MEM_LEDGER_DIR"] = opts["ledger_dir"]
    kw = dict(
        backend=make_backend(opts),
        max_batch=batch,
        max_seq_len=opts["max_seq_len"],
        keep_logits=False,
        budget=opts["static_budget"],
    )
    if shared:
        kw["shared"] = SharedGPU(
            cap=opts["static_budget"],
            device_budget=opts["budget"],
            key=opts["key"] + "-sat",
            name="alone",
        )
    with Engine(directory, **kw) as e:
        rng = _r.Random(7)
        plen = 16 if opts["smoke"] else 256
        prompts = [[rng.randrange(opts["vocab"]) for _ in range(plen)] for _ in range(batch)]
        e.generate(prompts[:4], 4)
        sync()
        t0 = time.perf_counter()
        out = e.generate(prompts, opts["sat_new"])
        sync()
        dt = time.perf_counter() - t0
        q.put({"tok_s": sum(len(o) for o in out) / dt, "preempted": e.scheduler.stats.preempted})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="60GiB", help="the device budget all three share")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--burst", type=int, default=64, help="requests in a model's burst")
    ap.add_argument("--burst-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=12.0)
    ap.add_argument("--lead-s", type=float, default=1.0)
    ap.add_argument("--tail-s", type=float, default=3.0)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--max-batch", type=int, default=128, help="shared; static halves it until it plans"
    )
    ap.add_argument("--sat-batch", type=int, default=64)
    ap.add_argument("--idle-sleep-s", type=float, default=None)
    ap.add_argument("--open-timeout", type=float, default=240.0)
    ap.add_argument(
        "--smoke", action="store_true", help="tiny models on fake backends (CPU): checks the run"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.burst, args.window_s, args.prompt_len, args.max_batch = 32, 8.0, 512, 64

    import torch

    import imp_mem
    from imp_mem.engine.checkpoint import write_random_checkpoint

    if args.smoke:
        args.budget = "512MiB"
        args.burst, args.burst_s, args.window_s, args.lead_s, args.tail_s = 6, 0.5, 3.0, 0.5, 1.0
        args.prompt_len, args.new_tokens, args.max_batch, args.sat_batch = 24, 6, 8, 8
    elif not (imp_mem.cuda_available() and torch.cuda.is_available()):
        print("bench_shared_gpu: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    budget = imp_mem.parse_size(args.budget)
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    rows: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-shared-", dir=root) as tmp,
        tempfile.TemporaryDirectory(prefix="bench-ledger-", dir=root) as ledger_dir,
    ):
        t_w = time.perf_counter()
        dirs = []
        for name, cfg in shapes(args.quick, args.smoke):
            d = write_random_checkpoint(
                Path(tmp) / name, cfg, device=None if args.smoke else "cuda"
            )
            dirs.append((name, d))
        if not args.smoke:
            torch.cuda.empty_cache()
        print(f"checkpoints written in {time.perf_counter() - t_w:.1f} s")
        max_seq_len = args.prompt_len + args.new_tokens + 16
        static_budget = budget // 3
        opts = {
            "ledger_dir": ledger_dir,
            "budget": budget,
            "key": LEDGER_KEY_PREFIX + str(os.getpid()),
            "max_seq_len": max_seq_len,
            "max_batch": args.max_batch,
            "idle_sleep_s": args.idle_sleep_s,
            "static_budget": static_budget,
            "tail_s": args.tail_s,
            "lead_s": args.lead_s,
            "window_s": args.window_s,
            "smoke": args.smoke,
            "sat_new": 8 if args.smoke else 128,
            "vocab": 512 if args.smoke else 151936,
        }
        # A cap each: the budget less what the other two must always have
        # (their weights plus a margin; the ledger enforces the floors).
        weights = {n: sum(f.stat().st_size for f in Path(d).glob("*.safetensors")) for n, d in dirs}
        margin = 32 * MIB if args.smoke else 2 * GIB
        opts["caps"] = {
            n: budget - sum(w + margin for m, w in weights.items() if m != n) for n, _ in dirs
        }
        print(
            f"budget {budget / GIB:.2f} GiB; shared caps "
            f"{ {n: round(c / GIB, 1) for n, c in opts['caps'].items()} } GiB; static "
            f"{static_budget / GIB:.1f} GiB each"
        )

        # The shared run; the last model's burst sees the first model (idle
        # since its own burst) SIGKILLed.
        victim = dirs[0][0]
        kill_at = args.lead_s + (len(dirs) - 1) * args.window_s + args.burst_s * 0.5
        shared, footprints, reclaim, floors_s = run_phase(
            "shared", dirs, args, opts, kill=(victim, kill_at)
        )
        static, _, _, floors_t = run_phase("static", dirs, args, opts)
        print(
            "floors on the ledger: "
            + ", ".join(f"{n} {f / GIB:.2f} GiB" for n, (f, _b) in floors_s.items())
            + "; static max_batch: "
            + ", ".join(f"{n} {b}" for n, (_f, b) in floors_t.items())
        )
        print()
        print(
            f"{'model':6s} {'setup':7s} {'batch':>5s} {'TTFT p50 s':>11s} {'TTFT p99 s':>11s} "
            f"{'tok/s':>9s} {'preempt':>8s} {'done':>9s}"
        )
        by = {(r["name"], r["mode"]): r for r in shared + static}
        for name, _ in dirs:
            for mode in ("shared", "static"):
                r = by.get((name, mode))
                if r is None:
                    print(f"{name:6s} {mode:7s} (no report: the worker failed)")
                    continue
                tps = r["tokens"] / r["busy_s"] if r["busy_s"] else 0.0
                p50, p99 = pct(r["ttft"], 0.5), pct(r["ttft"], 0.99)
                print(
                    f"{name:6s} {mode:7s} {r['batch']:5d} {p50:11.3f} {p99:11.3f} {tps:9.1f} "
                    f"{r['preempted']:8d} {r['finished']:4d}/{r['requests']:<4d}"
                )
                rows.append(
                    {
                        "model": name,
                        "setup": mode,
                        "max_batch": r["batch"],
                        "ttft_p50": p50,
                        "ttft_p99": p99,
                        "tok_s": tps,
                        "preempted": r["preempted"],
                    }
                )
            s_, t_ = by.get((name, "shared")), by.get((name, "static"))
            if s_ and t_:
                ratio = pct(t_["ttft"], 0.99) / max(pct(s_["ttft"], 0.99), 1e-9)
                print(f"{name:6s} TTFT p99 static/shared {ratio:8.2f}x  goal >= 5x")
                rows.append({"model": name, "ttft_p99_ratio": ratio, "goal": ">= 5"})

        print()
        print("idle footprint (each idle tenant at 90 % of another model's window):")
        for (window, name), f in sorted(footprints.items()):
            over = f["committed"] - max(f["floor"], f["kv_live"])
            print(
                f"  window {window} ({dirs[window][0]} bursts): {name:6s} committed "
                f"{f['committed'] / GIB:7.2f} GiB, floor {f['floor'] / GIB:7.2f} GiB, KV live "
                f"{f['kv_live'] / GIB:6.2f} GiB, above its floor {over / MIB:8.1f} MiB "
                "(goal: live blocks + one 64 MiB chunk)"
            )
            rows.append(
                {
                    "idle": name,
                    "window": window,
                    "committed": f["committed"],
                    "floor": f["floor"],
                    "kv_live": f["kv_live"],
                }
            )

        survivors = [r for r in shared if r["name"] != victim]
        ok = all(r["finished"] == r["requests"] and r["final"] for r in survivors)
        print()
        print(
            f"SIGKILL of {victim} while {dirs[-1][0]} bursts: share back in "
            f"{reclaim if reclaim is not None else float('nan'):.3f} s (goal < 1 s); the others "
            f"{'served every request' if ok else 'did NOT serve every request'}"
        )
        rows.append({"sigkill_reclaim_s": reclaim, "survivors_ok": ok, "goal": "< 1"})

        alone = saturation(dirs[0][1], args, opts, shared=False)
        on = saturation(dirs[0][1], args, opts, shared=True)
        overhead = 1.0 - on["tok_s"] / alone["tok_s"]
        print()
        print(
            f"saturation, {dirs[0][0]} alone: {alone['tok_s']:9.1f} tok/s without the ledger, "
            f"{on['tok_s']:9.1f} on it: overhead {overhead * 100:5.1f} % (goal <= 5 %)"
        )
        rows.append(
            {
                "saturation_tok_s_plain": alone["tok_s"],
                "saturation_tok_s_ledger": on["tok_s"],
                "overhead": overhead,
                "goal": "<= 0.05",
            }
        )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
