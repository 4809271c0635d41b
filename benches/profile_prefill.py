"""Where a prefill's time goes (issues 25 and 27): the reference engine on
Qwen3-0.6B's numbers (random weights drawn in T1, no checkpoint), one step
that prefills ``--requests`` prompts of ``--prompt`` tokens, timed whole,
side by side with batching off (one forward a request's chunk) and on (one
forward over several requests' chunks, ``--batch-tokens`` a forward), one
engine after the other in one run; prints the ms a request and the prefill
tokens/s of each and the ratio, then (``--rows`` > 0) the CUDA kernels and
CPU ops that took the most time in the batched step under
``torch.profiler``.

    python benches/profile_prefill.py [--requests 16] [--prompt 512] \\
        [--batch-tokens 2048 [8192 ...]] [--rows 25] [--device cpu]

Several ``--batch-tokens`` run one batched engine each after the unbatched
one (the budget's trade: fewer forwards against the step's activation peak,
printed on a GPU as torch's allocated bytes above those live before it).

Needs a CUDA device, torch and triton; ``--device cpu`` runs a tiny Qwen3
on the CPU instead (the torch path, the fake backend: a smoke run, not a
measurement of the GPU's case).
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def tiny_config() -> dict:
    from imp_mem.engine.config import qwen3_0_6b_config

    return {
        **qwen3_0_6b_config(),
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "torch_dtype": "float32",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument(
        "--batch-tokens",
        type=int,
        nargs="*",
        default=None,
        help="tokens of one batched forward, one engine each (default: the engine's, "
        "4 x prefill_chunk)",
    )
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args(argv)
    import torch

    import imp_mem
    from imp_mem.engine.config import qwen3_0_6b_config
    from imp_mem.engine.llm_engine import Engine

    gpu = args.device == "cuda"
    if gpu and not (imp_mem.cuda_available() and torch.cuda.is_available()):
        print("profile_prefill: needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def prompts(seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        n, vocab = args.prompt, (100000 if gpu else 4000)
        return [[rng.randrange(1000, vocab) for _ in range(n)] for _ in range(args.requests)]

    def engine(budget: int | None) -> Engine:
        return Engine(
            qwen3_0_6b_config() if gpu else tiny_config(),
            load_format="dummy",
            backend=imp_mem.VmmBackend(device=0) if gpu else imp_mem.FakeBackend(capacity="4GiB"),
            max_batch=args.requests,
            max_seq_len=args.prompt + 32,
            keep_logits=False,
            enable_prefix_caching=False,
            prefill_batch_tokens=budget,
        )

    results = {}
    prof = None
    runs = [("off", 0)] + [("on", b) for b in (args.batch_tokens or [None])]
    for n, (label, budget) in enumerate(runs):
        label = label if len(runs) == 2 or not n else f"on#{n}"
        with engine(budget) as e:
            e.generate(prompts(1)[:2], 2)  # warm-up: every kernel launched once
            timed, peak = [], 0
            for rep in range(3):
                for p in prompts(2 + rep):
                    e.submit(p, 1)
                sync()
                if gpu:
                    # What the step's forwards allocate beyond what is live
                    # (torch's own allocator serves them: the activations).
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                e.step()
                sync()
                timed.append(time.perf_counter() - t0)
                if gpu:
                    peak = max(peak, torch.cuda.max_memory_allocated() - base)
                while e.scheduler.has_work:
                    e.step()
            best = min(timed)
            results[label] = best
            tokens = args.requests * args.prompt
            print(
                f"batching {label:>3} (prefill_batch_tokens={e.prefill_batch_tokens}): "
                f"{args.requests} prefills of {args.prompt} tokens in one step: "
                f"{best * 1e3:.1f} ms (best of 3), {best * 1e3 / args.requests:.2f} ms a "
                f"request, {tokens / best:,.0f} prefill tokens/s"
                + (f", step's activation peak {peak / 2**20:,.0f} MiB" if gpu else ""),
                flush=True,
            )
            if n == len(runs) - 1 and args.rows > 0:
                for p in prompts(9):
                    e.submit(p, 1)
                acts = [torch.profiler.ProfilerActivity.CPU]
                if gpu:
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts) as prof:
                    e.step()
                    sync()
                while e.scheduler.has_work:
                    e.step()
    for label, best in results.items():
        if label != "off":
            print(
                f"batched ({label}) / unbatched: {results['off'] / best:.2f}x the prefill "
                f"tokens/s ({results['off'] * 1e3 / args.requests:.2f} -> "
                f"{best * 1e3 / args.requests:.2f} ms a request)"
            )
    if prof is not None:
        ka = prof.key_averages()
        if gpu:
            print(ka.table(sort_by="cuda_time_total", row_limit=args.rows))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
