"""The reference engine: a model served entirely from imp-mem's memory.

Rooms. This file is the serving loop and the engine's public face
(`Engine`: submit, step, generate, sleep, swap, report, close), each
public call of the memory side a delegation. `args.EngineArgs` checks the
arguments once; the model runner (`model_runner.ModelRunner`: T2
buffers, pinned staging, KV views, warm-up, graphs, the prefill and
decode calls) runs the model; the memory side owns every byte: `memory`
(`EngineMemory`; the boot's plan, open, load and re-plan) and `lifecycle`
(sleep, wake, weight updates, model swap); `warmup` measures and
remembers what the warm-up leaves outside the tiers. The model itself is
`imp_mem.engine.model`, layers composed.

Order (seed A4.2). `Engine(model_dir)` reads ``config.json``, checks its
arguments against it, and boots (`boot.boot`): plan, open, load, warm up
and capture, then SERVING before the first request.

Serving. A `Scheduler` batches continuously over the system's
`KVCacheManager`. Each `step()` admits what fits and prefills it (from the
first uncached token, in chunks of `prefill_chunk` tokens, several
requests' chunks a forward up to `prefill_batch_tokens`; the forwards
launched back to back, their greedy tokens read in one copy), then decodes
every running sequence once: the pending tokens are appended to the
manager, the runner writes the batch's block tables into pinned staging,
copies them into T2, replays the bucket's graph and reads the greedy
tokens (argmax inside the graph) back.

Accounting. `EngineStats` counts the time of every imp-mem call a step
makes (admission, appends, frees: `Scheduler.kv_seconds`; block tables:
the runner) against the step's time, so a benchmark can report the share.

Tensor parallelism. `Engine(..., group=g)` serves one rank's shard over
the ``torch.distributed`` group `g`, every rank constructing its engine
with the same arguments and submitting the same requests in the same
order; the boot agrees across ranks (`boot.boot`), the model gathers
the logits so every rank samples the same greedy token, and the
deterministic scheduler keeps the ranks in step. `fleet_report()`
gathers every rank's report.

Thread safety: none; one thread drives an engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from imp_mem.engine import boot, lifecycle
from imp_mem.engine.args import EngineArgs
from imp_mem.engine.memory import EngineMemory, measure_torch_high_water
from imp_mem.engine.model_runner import default_buckets
from imp_mem.engine.scheduler import Request, Scheduler
from imp_mem.engine.tensor_parallel import TensorParallel
from imp_mem.errors import InvalidArgument

__all__ = ["Engine", "EngineArgs", "EngineStats", "default_buckets", "measure_torch_high_water"]


@dataclass
class EngineStats:
    """What the engine did since it started serving."""

    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    step_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    # Time inside imp-mem calls (admission, appends, frees, block tables).
    imp_mem_seconds: float = 0.0
    # The same, during the decode part of the steps only.
    decode_imp_mem_seconds: float = 0.0
    bucket_steps: dict[int, int] = field(default_factory=dict)

    @property
    def imp_mem_share(self) -> float:
        """imp-mem's share of the decode part of the steps."""
        return self.decode_imp_mem_seconds / self.decode_seconds if self.decode_seconds else 0.0


def _via(room: str, name: str, doc: str | None = None) -> Any:
    """A read-only attribute of the engine that is one of its rooms'."""
    return property(lambda self: getattr(getattr(self, room), name), doc=doc)


class Engine:
    """A continuous-batching greedy decoder over one model directory (HF
    ``config.json`` + safetensors), all of whose memory is imp-mem's.

    The keyword arguments are `EngineArgs`' (which documents each), or pass
    an `EngineArgs` itself in place of `model_dir`. `swap_model` serves
    another checkpoint in place (T2 and every address kept); `sleep` and
    `wake` give the device memory back and take it again at the same
    addresses. `boot_seconds` splits the boot: process (start to this
    call), probe, reserve, backend, plan, open, load, pin (beside the
    load), warm_up, capture, kv_grow (an inline cold boot's re-plan and
    growth), other (what no phase names) and, once served, first_step (boot
    to first token); `first_token_seconds` is the first token's time from
    process start.
    """

    def __init__(
        self,
        model_dir: str | Path | dict[str, Any] | EngineArgs,
        *,
        max_batch: int = 32,
        max_seq_len: int = 2048,
        backend: Any = None,
        budget: int | str | None = None,
        block_size: int | None = None,
        prefill_chunk: int | None = None,
        prefill_batch_tokens: int | None = None,
        buckets: Sequence[int] | None = None,
        graphs: bool | None = None,
        attention_backend: str | None = None,
        torch_pool: Any = None,
        enable_prefix_caching: bool = True,
        kv_growable: bool = False,
        context: int | None = None,
        library_reserve: int | None = None,
        keep_logits: bool = True,
        progress: bool | None = None,
        features: Any = None,
        scratch_bytes: int | None = None,
        activation_bytes: int | None = None,
        group: Any = None,
        pin_sleep_host: bool | None = None,
        fused: bool | None = None,
        warmup_probe: bool | None = None,
        load_format: str = "safetensors",
        seed: int = 0,
        dummy_scale: float | None = None,
        shared: Any = None,
    ) -> None:
        given = dict(locals())  # the keywords as passed: first, before any other name
        t_open = time.perf_counter()
        # "process": from process start to this call (the interpreter, the
        # imports and the caller's own code before the engine).
        self.boot_seconds: dict[str, float] = {"process": boot.since_process_start()}
        args = EngineArgs.of_call(given)
        # A cold boot's probe child, split the same way (plus "exit").
        self.probe_boot_seconds: dict[str, float] = {}
        self.first_token_seconds: float | None = None
        self.model_dir, self.config_dict, self.config = args.read_model()
        self.args = args = args.for_model(self.config)
        self.tp = TensorParallel(self.config, args.group, tp=None if args.group is not None else 1)
        self.tenancy: Any = None
        self.memory = EngineMemory.of(args, self.config_dict)
        self.stats = EngineStats()
        # The groups asleep as the last sleep or wake left them (`lifecycle`),
        # and whether a level-2 sleep dropped the weights (until replaced).
        self._asleep: dict[str, int] = {}
        self._weights_dropped = False
        self.weights_version = 0
        # warmup_probe="inline" on a cold boot: measured in this boot's own
        # warm-up, the KV pool grown to the re-planned size (`boot.grow_to_plan`).
        self._inline_cold = False
        self.warmup_planned: dict[str, int] | None = None
        self.warmup_measured: dict[str, int] | None = None
        boot.boot(self, t_open)  # plan, open, load, warm up, capture, serve

    # ------------------------------------------------- what the rooms hold

    group = _via("args", "group")
    shared = _via("args", "shared", "The shared GPU's settings (`SharedGPU`), or None.")
    max_batch = _via("args", "max_batch")
    max_seq_len = _via("args", "max_seq_len")
    prefill_chunk = _via("args", "prefill_chunk")
    prefill_batch_tokens = _via("args", "prefill_batch_tokens")
    keep_logits = _via("args", "keep_logits")
    kv_growable = _via("args", "kv_growable")
    activation_bytes = _via("args", "activation_bytes")
    fused = _via("args", "fused")
    load_format = _via("args", "load_format")

    backend = _via("memory", "backend")
    system = _via("memory", "system")
    plan = _via("memory", "plan")
    plan_input = _via("memory", "plan_input")
    on_gpu = _via("memory", "on_gpu")
    device = _via("memory", "device")
    load_seconds = _via("memory", "load_seconds")
    weights_over_share = _via("memory", "weights_over_share")
    block_size = _via("runner", "block_size")
    model = _via("runner", "model")
    kv_views = _via("runner", "kv_views")
    graphs = _via("runner", "graphs")
    buckets = _via("runner", "buckets")
    use_graphs = _via("runner", "use_graphs")
    engine_seqs = _via(
        "runner", "engine_seqs", "The sequence ids the engine holds blocks through (padding, ring)."
    )

    @property
    def sliding(self) -> bool:
        return bool(self.config.sliding_layers)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights by name (views of T1). Refused while the
        weights sleep: their device memory is given back then, and a read
        would fault (on the GPU a CUDA "invalid argument"); a trainer keeps
        its own copy of the policy and sends it with `update_weights`."""
        if "weights" in self.asleep:
            raise InvalidArgument(
                "engine.weights: the weights sleep (their device memory is given back); call "
                "engine.wake('weights') before reading them"
            )
        return self.runner.weights

    def new_scheduler(self) -> Scheduler:
        """A scheduler over the KV manager, for the engine's limits."""
        return Scheduler(self.kv, max_batch=self.max_batch, max_seq_len=self.max_seq_len)

    # ------------------------------------------------------------ the loop

    def step(self) -> list[tuple[int, int]]:
        """One engine step: admissions and their prefills, then one decode
        of every running sequence. Returns the `(seq_id, token)` pairs
        produced, in order."""
        lifecycle.check_awake(self, "step")
        sched, stats, runner = self.scheduler, self.stats, self.runner
        t_step = time.perf_counter()
        kv0 = sched.kv_seconds
        imp0 = runner.imp_mem_seconds
        out: list[tuple[int, int]] = []
        with torch.inference_mode(), runner.on_stream(), self.memory.torch_ctx():
            prefills = sched.admit_waiting()
            t0 = time.perf_counter()
            # Launched back to back (the host launches one while the device
            # runs the one before), batched where the model can, their
            # tokens read in one copy after them.
            if prefills:
                stats.prefill_tokens += runner.prefill_step(prefills)
                for p, tok in zip(prefills, runner.prefill_tokens(len(prefills)), strict=True):
                    sched.prefilled(p, tok)
                    out.append((p.request.seq_id, tok))
                stats.prefill_seconds += time.perf_counter() - t0
            t_dec = time.perf_counter()
            kv_dec = sched.kv_seconds
            imp_dec = runner.imp_mem_seconds
            batch = sched.prepare_decode()
            if out and self.first_token_seconds is None:
                # From the engine's boot to its first token: the caller's
                # code between, and the first prefills (their kernels'
                # first launches included). Timed here, not read from
                # /proc, whose clock counts in 10 ms ticks.
                first = time.perf_counter() - self._t_booted
                self.boot_seconds["first_step"] = first
                self.first_token_seconds = self.boot_seconds["process"] + self.open_seconds + first
            if batch:
                tokens, b = runner.decode(batch)
                stats.bucket_steps[b] = stats.bucket_steps.get(b, 0) + 1
                sched.decoded(batch, tokens)
                out.extend((r.seq_id, t) for r, t in zip(batch, tokens, strict=True))
                stats.decode_seconds += time.perf_counter() - t_dec
                stats.decode_steps += 1
                stats.decode_tokens += len(batch)
                stats.decode_imp_mem_seconds += (
                    sched.kv_seconds - kv_dec + runner.imp_mem_seconds - imp_dec
                )
        if self.tenancy is not None:
            # On a shared GPU: the ledger's pressure answered (the pool's
            # hysteretic shrink would take room promised to running requests).
            t0 = time.perf_counter()
            self.tenancy.tick(sched, self.kv, self.on_gpu, self.device)
            runner.imp_mem_seconds += time.perf_counter() - t0
        elif self.kv_growable:
            # The growable pool's hysteretic shrink, fenced after this step.
            fence = None
            if self.on_gpu:
                fence = torch.cuda.Event()
                fence.record(runner.stream)
            t0 = time.perf_counter()
            self.system.step(fence)
            runner.imp_mem_seconds += time.perf_counter() - t0
        stats.imp_mem_seconds += sched.kv_seconds - kv0 + runner.imp_mem_seconds - imp0
        stats.steps += 1
        stats.step_seconds += time.perf_counter() - t_step
        return out

    # -------------------------------------------------------------- requests

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        image: Any = None,
    ) -> Request:
        """Queues a request (served by the next `step()` calls). On a shared
        GPU an engine the idle clock put to sleep wakes first, and a request
        no share of the device could hold raises `CapacityError`.
        `image`: pixel values ``[channels, size, size]`` (or with a leading
        1) for a model with a vision tower, whose image tokens the prompt
        holds (`imp_mem.engine.images`); a bad one is `InvalidArgument`."""
        from imp_mem.engine.images import check_image

        prompt = list(prompt)
        pixels, mm = check_image(self.config, prompt, image)
        if self.tenancy is not None:
            self.tenancy.wake_for_work(self)
            if len(prompt) + max_new_tokens <= self.max_seq_len:
                self.tenancy.check_submit(len(prompt) + max_new_tokens, self.kv)
        return self.scheduler.submit(
            prompt, max_new_tokens, eos_token_id=eos_token_id, image=pixels, mm=mm
        )

    def idle(self) -> int:
        """What a serving loop calls when there is no work: on a shared GPU,
        answers the ledger's pressure, shrinks the KV pool to its live
        blocks plus one chunk once idle for `SharedGPU.idle_trim_s`, and
        sleeps (level 1) once idle for `idle_sleep_s`. Returns the bytes
        given back (0 off a shared GPU)."""
        if self.tenancy is None or self.scheduler.has_work:
            return 0
        return self.tenancy.idle(self)

    def cancel(self, seq_id: int) -> bool:
        """Cancels a request at any point; False if it already ended."""
        return self.scheduler.cancel(seq_id)

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Serves `prompts` to the end, yielding `(prompt index, token)` as
        the tokens are produced. `images`: one image or None per prompt
        (`submit`'s `image`)."""
        if images is not None and len(images) != len(prompts):
            raise InvalidArgument(
                f"images: {len(images)} given for {len(prompts)} prompts; pass one image (or "
                "None) per prompt"
            )
        if self.tenancy is not None:
            self.tenancy.wake_for_work(self)
        lifecycle.check_awake(self, "generate")
        from imp_mem.engine.images import check_image

        # Every request is checked before any is queued.
        each = list(images) if images is not None else [None] * len(prompts)
        for p, image in zip(prompts, each, strict=True):
            check_image(self.config, list(p), image)
        index = {}
        for i, p in enumerate(prompts):
            req = self.submit(p, max_new_tokens, eos_token_id=eos_token_id, image=each[i])
            index[req.seq_id] = i
        live = set(index)
        while live:
            for sid, tok in self.step():
                if sid in index:
                    yield index[sid], tok
            for sid in [s for s in live if self.scheduler.requests[s].done]:
                live.discard(sid)
                self.scheduler.reap(sid)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> list[list[int]]:
        """Greedy continuations of `prompts` (token ids), continuously
        batched; `images`: one image or None per prompt (`submit`)."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, tok in self.stream(
            prompts, max_new_tokens, eos_token_id=eos_token_id, images=images
        ):
            out[i].append(tok)
        return out

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Steps until nothing is waiting or running (or `until()` says stop)."""
        while self.scheduler.has_work and not (until and until()):
            self.step()

    # ------------------------------------------------------------- lifecycle

    @property
    def asleep(self) -> dict[str, int]:
        """The engine's tags asleep now, ``{tag: level}``."""
        return lifecycle.asleep(self)

    @property
    def sleep_tags(self) -> tuple[str, ...]:
        """The tags this engine can sleep: ``weights`` (T1), ``kv_cache``
        (the KV pools) and, when torch's allocations are routed into the
        activations tier, ``activations`` (its graph pools)."""
        return tuple(lifecycle.groups(self))

    def sleep(
        self, level: int = 1, tags: str | Sequence[str] | None = None, *, drain: str = "refuse"
    ) -> dict[str, Any]:
        """Gives the device memory of `tags` back (default: every tag of
        `sleep_tags`) at `level` 1 (the weights kept in pinned host memory)
        or 2 (dropped), every address kept: graphs replay after `wake`.
        `drain`: requests waiting or running are ``"refuse"``d, ``"abort"``ed
        or served first (``"wait"``). Returns the memory system's sleep
        report; `lifecycle.sleep` tells the rest."""
        return lifecycle.sleep(self, level, tags, drain)

    def wake(
        self, tags: str | Sequence[str] | None = None, *, empty_torch_cache: bool = False
    ) -> list[str]:
        """Takes the memory of `tags` back at the same addresses (default:
        every sleeping tag), one tag at a time in the order given (the
        staged wake: ``"weights"``, `update_weights`, ``"kv_cache"``); an
        awake tag is skipped. `empty_torch_cache`: empty torch's cache and
        retry when the device lacks room. Returns the tags woken;
        `lifecycle.wake` tells the rest."""
        return lifecycle.wake(self, tags, empty_torch_cache)

    def update_weights(self, named_tensors: Any) -> dict[str, Any]:
        """Copies new weights into T1 in place: ``(name, tensor)`` pairs (or
        a mapping) of the checkpoint's whole tensors, every one checked
        before the first byte is copied (a refusal changes nothing); the
        prefix cache is emptied. Returns ``{"tensors", "bytes", "seconds"}``;
        `lifecycle.update_weights` tells the rest."""
        return lifecycle.update_weights(self, named_tensors)

    def update_weights_from_ipc(self, handles: Any) -> dict[str, Any]:
        """`update_weights` from another process on the same GPU: `handles`
        is what `imp_mem.engine.weights.ipc_handles` made there (CUDA IPC,
        no host round trip). The sender must keep its tensors alive until
        this returns."""
        from imp_mem.engine.weights import open_ipc_handles

        return self.update_weights(open_ipc_handles(handles))

    def reload_weights(self, model_dir: str | Path | None = None) -> dict[str, Any]:
        """Reads the weights of `model_dir` (default: this engine's) into T1
        in place, checked as `update_weights` checks (a checkpoint of this
        model's shapes and dtypes); after a level-2 sleep, or to load a
        trainer's checkpoint from disk."""
        return lifecycle.reload_weights(self, model_dir)

    def swap_model(self, model_dir: str | Path) -> dict[str, Any]:
        """Serves the checkpoint in `model_dir` in place of this one without
        closing the memory system (issue 19): T2 and every address kept.
        Refused with `InvalidArgument`, changing nothing, while requests run,
        on a tensor-parallel engine or when T2 would change; a failed swap
        serves the old checkpoint on. Returns the swap's report;
        `lifecycle.swap_model` tells the rest."""
        return lifecycle.swap_model(self, model_dir)

    # ----------------------------------------------------------------- report

    def mem_report(self, other_processes: int | None = None) -> dict[str, Any]:
        """The memory system's report (torch's reserved bytes named when
        torch's allocator holds any); `other_processes` is device memory
        other processes use, left out of the attribution."""
        self.memory.charge_torch()
        return self.system.mem_report(other_processes=other_processes)

    def fleet_report(self, *, dst: int = 0, other_processes: int | None = None) -> Any:
        """Every rank's `mem_report` gathered on rank `dst` of the group as a
        `imp_mem.distributed.FleetReport` (None on the other ranks; every
        rank must call it). At TP = 1, this engine's report alone."""
        from imp_mem.distributed import FleetReport, gather_reports

        self.memory.charge_torch()
        if self.group is None:
            return FleetReport([self.system.mem_report(other_processes=other_processes)])
        return gather_reports(
            self.system, group=self.group, dst=dst, other_processes=other_processes
        )

    def mem_report_text(self, other_processes: int | None = None) -> str:
        """`mem_report` as the text table."""
        self.memory.charge_torch()
        return self.system.mem_report_text(other_processes=other_processes)

    def close(self) -> dict[str, Any] | None:
        """Drops every tensor over imp-mem's memory, then closes the system
        (and leaves a shared GPU's ledger); the system's closing report."""
        return lifecycle.close(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()
