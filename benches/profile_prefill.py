"""Where a prefill's time goes (issues 25 and 27): the reference engine on
Qwen3-0.6B's numbers (random weights drawn in T1, no checkpoint), one step
that prefills ``--requests`` prompts of ``--prompt`` tokens, timed whole and
under ``torch.profiler``; prints the ms a request, the prefill tokens/s, and
the CUDA kernels and CPU ops that took the most time.

    python benches/profile_prefill.py [--requests 16] [--prompt 512] [--rows 25]

Needs a CUDA device, torch and triton.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args(argv)
    import torch

    import imp_mem
    from imp_mem.engine.config import qwen3_0_6b_config
    from imp_mem.engine.llm_engine import Engine

    if not (imp_mem.cuda_available() and torch.cuda.is_available()):
        print("profile_prefill: needs a CUDA device", file=sys.stderr)
        return 2
    rng = random.Random(0)

    def prompts():
        n = args.prompt
        return [[rng.randrange(1000, 100000) for _ in range(n)] for _ in range(args.requests)]

    with Engine(
        qwen3_0_6b_config(),
        load_format="dummy",
        backend=imp_mem.VmmBackend(device=0),
        max_batch=args.requests,
        max_seq_len=args.prompt + 32,
        keep_logits=False,
        enable_prefix_caching=False,
    ) as e:
        e.generate(prompts()[:2], 2)  # warm-up: every kernel launched once
        timed = []
        for _ in range(3):
            for p in prompts():
                e.submit(p, 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            e.step()
            torch.cuda.synchronize()
            timed.append(time.perf_counter() - t0)
            while e.scheduler.has_work:
                e.step()
        best = min(timed)
        print(
            f"{args.requests} prefills of {args.prompt} tokens in one step: {best * 1e3:.1f} ms "
            f"(best of 3), {best * 1e3 / args.requests:.2f} ms a request, "
            f"{args.requests * args.prompt / best:,.0f} prefill tokens/s"
        )
        for p in prompts():
            e.submit(p, 1)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            e.step()
            torch.cuda.synchronize()
        while e.scheduler.has_work:
            e.step()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=args.rows))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
