"""`imp-mem demo` on a GPU: the reference engine serving a random-weight
Qwen3-0.6B for a few seconds, then the memory report.

The checkpoint is written once to a temporary directory (no hub access).
Requests of random prompts arrive continuously (a new one whenever a
sequence slot is free), so admission, prefill, decode and frees all run;
a progress bar counts the seconds. Needs torch with CUDA.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from typing import Any


def run_engine_demo(
    backend: Any = None,
    out: Callable[[str], Any] = print,
    *,
    seconds: float = 5.0,
    max_batch: int = 16,
    max_seq_len: int = 1024,
    prompt_len: tuple[int, int] = (16, 256),
    max_new_tokens: tuple[int, int] = (16, 256),
    seed: int = 0,
    config: dict[str, Any] | None = None,
    other_processes: int | None = None,
    load_format: str = "safetensors",
) -> int:
    """Serves random requests for `seconds`; prints throughput and the
    memory report. `config`: the model (default Qwen3-0.6B's).
    `other_processes`: device memory in use before this process made its
    CUDA context (read before the backend was opened; default: read here,
    correct only if no context exists yet). `load_format`: ``"dummy"``
    serves random weights drawn in T1 from `seed` (no checkpoint written);
    ``"safetensors"`` writes a random checkpoint and loads it. Returns 0."""
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import qwen3_0_6b_config
    from imp_mem.engine.llm_engine import Engine

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="imp-mem-demo-") as tmp:
        source: Any
        extra: dict[str, Any] = {}
        if load_format == "dummy":
            out("random weights drawn in T1 from the seed (load_format='dummy') ...")
            source = dict(config or qwen3_0_6b_config())
            extra = {"load_format": "dummy", "seed": seed}
        else:
            out("writing a random-weight checkpoint ...")
            source = write_random_checkpoint(tmp, config or qwen3_0_6b_config(), seed=seed)
        directory = source
        import torch

        import imp_mem
        from imp_mem.engine.memory import measure_torch_high_water
        from imp_mem.reserve import device_used_by_all_processes

        pooled: dict[str, Any] = {}
        others, retained = None, 0
        on_gpu = torch.cuda.is_available() and imp_mem.cuda_available()
        if on_gpu and (backend is None or backend.kind in ("cuda", "vmm")):
            # What the device held before this process made its context, then
            # the context itself: both measured, so the report names them.
            others = other_processes
            if others is None:
                others = device_used_by_all_processes()
            torch.cuda.init()
            free0, total = torch.cuda.mem_get_info()
            pooled["context"] = max(0, total - free0 - others) if others is not None else None
            # torch's own allocations go to the activations tier (imp_mem.torch),
            # planned from a measured warm-up of the same engine (seed A3.3).
            out("measuring torch's high-water over a warm-up ...")
            high = measure_torch_high_water(
                directory,
                requests=2 * max_batch,
                max_batch=max_batch,
                max_seq_len=max_seq_len,
                **extra,
            )
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            # What the warm-up left on the device outside every allocator
            # (kernels loaded lazily, library handles and their workspaces):
            # measured once, remembered, charged by name (issue 12).
            retained = max(0, free0 - torch.cuda.mem_get_info()[0])
            activations = int(high * 1.1) + (64 << 20)
            out(f"activations tier: {activations >> 20} MiB (torch's high-water {high >> 20} MiB)")
            pooled.update(torch_pool="imp_mem", activation_bytes=activations)
        with Engine(
            directory,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            backend=backend,
            **pooled,
            **extra,
        ) as e:
            if retained:
                e.system.set_charge(
                    "torch_runtime", retained, "torch kernels + library handles (measured warm-up)"
                )
            out(
                f"engine: {e.backend!r}; opened in {e.open_seconds:.1f} s "
                f"(weights {e.load_seconds:.1f} s), buckets {e.buckets}, "
                f"graphs {'on' if e.use_graphs else 'off'}"
            )
            vocab = e.config.vocab_size
            budget = max_seq_len - 1

            vision = e.config.vision
            # A vision model's prompts: every other one holds an image (one of
            # four random ones) after its first token, where it fits.
            pictures = []
            if vision is not None:
                import torch

                side, ch = vision["image_size"], vision["num_channels"]
                g = torch.Generator().manual_seed(0)
                pictures = [torch.rand(ch, side, side, generator=g) * 2 - 1 for _ in range(4)]

            def top_up() -> None:
                while len(e.scheduler.waiting) + len(e.scheduler.running) < 2 * max_batch:
                    n = rng.randint(*prompt_len)
                    new = min(rng.randint(*max_new_tokens), budget - n)
                    ids = [rng.randrange(vocab) for _ in range(n)]
                    image = None
                    if vision is not None:
                        token, mm = vision["image_token_index"], vision["mm_tokens_per_image"]
                        ids = [0 if t == token else t for t in ids]
                        if n > mm and rng.random() < 0.5:
                            ids[1 : 1 + mm] = [token] * mm
                            image = rng.choice(pictures)
                    e.submit(ids, max(1, new), image=image)

            fmt = "{l_bar}{bar}| {n:.1f}/{total:.1f} s"
            bar = tqdm(total=seconds, desc="serving", bar_format=fmt) if tqdm else None
            t0 = time.perf_counter()
            done = 0
            while (now := time.perf_counter()) - t0 < seconds:
                top_up()
                e.step()
                for sid in [s for s, r in e.scheduler.requests.items() if r.done]:
                    e.scheduler.reap(sid)
                    done += 1
                if bar is not None:
                    bar.n = min(seconds, now - t0)
                    bar.refresh()
            if bar is not None:
                bar.close()
            for sid in list(e.scheduler.requests):
                e.cancel(sid)
            s = e.stats
            out(
                f"served {done} requests: {s.decode_tokens} decode tokens in {s.decode_steps} "
                f"steps ({s.decode_tokens / max(s.decode_seconds, 1e-9):,.0f} tok/s decoding), "
                f"{s.prefill_tokens} prefill tokens; imp-mem calls "
                f"{100 * s.imp_mem_share:.2f} % of the decode time"
            )
            stats = e.backend.stats()
            out(
                "acquisitions while serving: "
                f"{sum(stats['steady_state_allocations_total'].values())}"
            )
            out(e.mem_report_text(other_processes=others))
    return 0
