"""The engine's boot (seed A4.2): the steps of `memory.EngineMemory` run
in their order over an `Engine` whose arguments are checked
(`args.EngineArgs`), with the runner made between the backend and the
plan, every rank agreeing where a group serves, the warm-up measured
around the runner's warm-up (`warmup`), and, on an inline cold boot, the
plan made again with the measured figure and adopted by the open system
(`grow_to_plan`). `plan`, `load` and `serve` run again in a model swap
(`lifecycle.swap_model`).

Each function takes the `Engine` being booted. Thread safety: none; the
engine's one thread boots it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

import imp_mem
from imp_mem.engine.model_runner import (
    PREFILL_BATCH_CHUNKS,
    ModelRunner,
    default_prefill_batch_tokens,
    t2_bytes,
)


def since_process_start() -> float:
    """Seconds since this process started (Linux's /proc; elsewhere since
    this module was imported): the boot's "process" phase."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def boot(engine: Any, t_open: float) -> None:
    """`llm_engine`'s boot order (seed A4.2) on `engine`, whose arguments
    are resolved (`EngineArgs.for_model`) and whose `memory` is made: the
    backend, the runner and the plan (`plan`); the system opened
    (`open_system`); the weights loaded into T1 (`load`); the runner's
    static buffers from T2, the KV pools typed as tensors, the warm-up and
    one CUDA graph per batch bucket, then SERVING (`serve`). With a group,
    every rank learns whether every rank got past the plan and the load
    (`agree`): when one failed, every rank closes what it opened and raises
    the same `imp_mem.distributed.RankFailure`; a failure after that leaves
    the peers waiting in a collective until the group's timeout. A failed
    load or serve closes the engine. `t_open`: when the engine's call began
    (`boot_seconds`' "other" is what no phase names)."""
    args, memory = engine.args, engine.memory
    error = None
    try:
        t0 = time.perf_counter()
        memory.resolve_backend(args.backend, args.budget, engine.tp)
        engine.boot_seconds["backend"] = time.perf_counter() - t0
        if args.prefill_batch_tokens is None:
            # The default follows the device's size (its backend's capacity).
            engine.args = args = dataclasses.replace(
                args,
                prefill_batch_tokens=default_prefill_batch_tokens(
                    args.prefill_chunk, memory.backend.capacity
                ),
            )
        engine.runner = ModelRunner(
            memory,
            max_batch=args.max_batch,
            max_seq_len=args.max_seq_len,
            prefill_chunk=args.prefill_chunk,
            keep_logits=args.keep_logits,
            attention_backend=args.attention_backend,
            prefill_batch_tokens=args.prefill_batch_tokens,
        )
        t0 = time.perf_counter()
        plan(engine, args.budget, args.context, args.library_reserve)
        seconds = engine.boot_seconds
        seconds["plan"] = (
            time.perf_counter() - t0 - seconds.get("probe", 0.0) - seconds.get("reserve", 0.0)
        )
        if memory.on_gpu:
            # Before the first collective: NCCL binds its communicator
            # to the current device.
            torch.cuda.set_device(memory.device)
    except Exception as e:  # every rank must reach the agreement below
        error = e
    before = memory.nccl_reading()
    memory.agree("planning", error)
    memory.nccl_bytes = memory.nccl_lost(before)
    # A swap plans against the same budget (the backend's shrinks once the
    # system holds its context and reserve), with the same charges.
    engine._plan_args = (engine.plan.budget, memory.context, memory.library_reserve)
    open_system(engine)
    try:
        error = None
        try:
            load(engine)
        except Exception as e:  # every rank must reach the agreement below
            error = e
        # Past here the ranks run collectives: none may be missing.
        memory.agree("loading the weights", error)
        serve(engine)
    except BaseException:
        engine.close()
        raise
    engine._t_booted = time.perf_counter()
    engine.open_seconds = engine._t_booted - t_open
    seconds = engine.boot_seconds
    # The pinning runs beside the copies: its seconds overlap the load's.
    seconds["load"], seconds["pin"] = memory.load_seconds, memory.pin_seconds
    timed = sum(v for k, v in seconds.items() if k not in ("process", "pin"))
    seconds["other"] = max(0.0, engine.open_seconds - timed)
    engine._booted = True


def plan(engine: Any, budget: Any, context: int | None, library_reserve: int | None) -> None:
    """Plans `engine`'s model for its limits against `budget` (its T2 as
    the runner lays it out, its own KV blocks, the warm-up line where the
    caller gave no `features`), and keeps how to plan again with a
    measured warm-up (`grow_to_plan`)."""
    from imp_mem.engine import warmup

    args, c, memory, runner = engine.args, engine.config, engine.memory, engine.runner
    block_size, features = args.block_size, args.features
    if context is None and library_reserve is None and args.backend is None:
        measured = warmup.measured_charges(engine)
        if measured is not None:
            context, library_reserve = measured
    probe_bs = block_size or imp_mem.Limits(1, 16).block_size
    runner.set_model(c, probe_bs)
    limits = imp_mem.Limits(args.max_batch, args.max_seq_len, block_size=block_size)
    default = None
    engine_blocks = runner.engine_blocks
    t2 = t2_bytes(runner.groups(probe_bs))
    if features is None:
        engine.warmup_planned = warmup.figure(engine, probe_bs, library_reserve)
        default = memory.features(
            t2, engine_blocks, warmup_bytes=warmup.total(engine.warmup_planned)
        )
    try:
        memory.make_plan(
            engine.model_dir,
            c,
            engine.tp,
            limits=limits,
            budget=budget,
            context=context,
            library_reserve=library_reserve,
            features=features,
            default_features=default,
            engine_blocks=engine_blocks,
        )
    except imp_mem.PlanFailure as e:
        _note_prefill_lever(engine, e)
        raise
    runner.set_model(c, int(memory.plan.kv["block_size"]))
    if features is not None:
        return
    # An inline cold boot plans again with the measured figure, the same
    # inputs against the same budget (`grow_to_plan`).
    engine._replan = lambda warmup_bytes: memory.make_plan(
        engine.model_dir,
        c,
        engine.tp,
        limits=limits,
        budget=memory.plan.budget,
        context=memory.context,
        library_reserve=memory.library_reserve,
        features=None,
        default_features=memory.features(t2, engine_blocks, warmup_bytes=warmup_bytes),
        engine_blocks=engine_blocks,
    )


def _note_prefill_lever(engine: Any, failure: BaseException) -> None:
    """Names `prefill_batch_tokens` on a plan that did not fit, where the
    warm-up line it sizes (one prefill forward's activations, which the
    planner's own levers do not reach) holds more than the small default
    would: the large default on a 70 GiB device can tip a tight budget over."""
    from imp_mem.engine.warmup import total

    small = PREFILL_BATCH_CHUNKS * engine.prefill_chunk
    warm = total(engine.warmup_planned) if engine.warmup_planned else 0
    if warm and engine.prefill_batch_tokens > small:
        failure.add_note(
            f"the plan's warm-up line holds {warm / (1 << 20):.0f} MiB outside the tiers "
            f"(graph pools and one prefill forward of prefill_batch_tokens="
            f"{engine.prefill_batch_tokens}); prefill_batch_tokens={small} shrinks it"
        )


def open_system(engine: Any) -> None:
    """Opens the system on `engine`'s plan: a shared GPU's tenancy sizes
    the elastic KV pool, an inline cold boot's pool opens growable with
    the warm-up's blocks committed; then the warm-up's meter starts."""
    from imp_mem.engine import warmup
    from imp_mem.engine.shared import Tenancy

    memory, runner = engine.memory, engine.runner
    if engine.shared is not None:
        engine.tenancy = Tenancy(
            engine.shared, memory, memory.plan, engine.model_dir.name, runner.engine_blocks[0]
        )
        memory.kv_initial_blocks = engine.tenancy.initial
        # The pool grows by a chunk, or by a whole sequence where that is more.
        memory.kv_grow_blocks = max(
            engine.tenancy.chunk, int(memory.plan.kv["blocks_per_sequence"])
        )
    elif engine._inline_cold:
        # Address space for the provisional plan's KV; committed, the
        # blocks the warm-up admits (one sequence and the runner's own).
        memory.kv_growable = True
        memory.kv_initial_blocks = Tenancy.initial_blocks(memory.plan, runner.engine_blocks[0])
    t0 = time.perf_counter()
    memory.open()
    engine.boot_seconds["open"] = time.perf_counter() - t0
    if engine.tenancy is not None:
        engine.tenancy.fit_floor()
    engine._meter = warmup.engine_meter(engine)


def load(engine: Any) -> None:
    """Loads `engine`'s weights into T1 (pinning the sleep buffer beside
    them on a backend whose T1 can sleep, at the first load), makes the KV
    manager, hands both to the runner and makes the scheduler."""
    args, memory, c = engine.args, engine.memory, engine.config
    memory.make_torch_pool()
    pin = args.pin_sleep_host
    if pin is None:  # on a backend whose T1 can sleep, for its first load
        pin = bool(getattr(memory.backend, "growable", False)) and not hasattr(engine, "kv")
    weights = memory.load_weights(engine.model_dir, engine.tp, args.progress, pin=pin)
    sliding = bool(c.sliding_layers)
    engine.kv = memory.kv_manager(
        prefix_caching=args.enable_prefix_caching and not sliding,
        swa_window=c.sliding_window if sliding else None,
        fingerprint=str(engine.model_dir.name),
    )
    engine.runner.load(
        weights,
        engine.kv,
        attention_backend=args.attention_backend,
        tp=engine.tp,
        fused=engine.fused,
    )
    engine.scheduler = engine.new_scheduler()
    tenancy = engine.tenancy
    if tenancy is not None:
        sched, kv = engine.scheduler, engine.kv
        sched.gate = lambda req: tenancy.gate(sched, kv, req)


def serve(engine: Any, *, begin: bool = True) -> None:
    """Warms up and captures (the runner), takes the meter's figure (charged,
    settled with a shared GPU's ledger, remembered; an inline cold boot
    grows to its re-plan), and enters SERVING when `begin`."""
    from imp_mem.engine import warmup

    memory, args = engine.memory, engine.args
    engine.runner.serve(args.buckets, args.graphs)
    engine.boot_seconds["warm_up"] = engine.runner.warm_up_seconds
    engine.boot_seconds["capture"] = engine.runner.capture_seconds
    meter = getattr(engine, "_meter", None)
    if meter is not None and meter.measured is None:
        engine.warmup_measured = meter.stop()
        memory.warmup_modules = engine.warmup_measured["modules"]
        memory.charge_torch()
        if engine.tenancy is not None:
            engine.tenancy.settle_warmup(warmup.total(engine.warmup_measured))
        fp = getattr(engine, "_warmup_fp", None)
        if fp is not None and engine.warmup_planned is None:
            warmup.store(fp, engine.warmup_measured)  # planned from the next boot
        if engine._inline_cold:
            grow_to_plan(engine)
    elif memory.kv_growable and not engine.kv_growable and engine.tenancy is None:
        # An inline-booted engine after a model swap, whose KV pool the
        # system re-laid growable: whole before serving, as at the boot.
        pool = memory.system.kv_pool.stats()
        engine.kv.reserve_free(int(memory.plan.kv["blocks"]) - int(pool["live"]))
    if begin:
        memory.system.begin_serving()
    engine.stats = type(engine.stats)()  # serving starts here


def grow_to_plan(engine: Any) -> None:
    """An inline cold boot's last step before serving
    (``warmup_probe="inline"``): the plan again with the figure this boot's
    warm-up measured, adopted by the open system (`MemorySystem.adopt_replan`:
    the KV pool capped at the re-planned blocks, the backend's budget
    lowered by the new line, as opening on that plan would have set it; the
    address space and every captured address stay), the pool grown to its
    blocks (the block manager's capacity with it). The pool then holds a
    warm boot's blocks."""
    from imp_mem.engine import warmup

    t0 = time.perf_counter()
    engine._inline_cold = False
    memory, measured = engine.memory, engine.warmup_measured or {"torch": 0, "modules": 0}
    final = engine._replan(warmup.total(measured))
    blocks = memory.system.adopt_replan(final)
    if not engine.kv_growable:
        # Committed whole before serving: nothing is acquired while serving.
        live = int(memory.system.kv_pool.stats()["live"])
        if not engine.kv.reserve_free(blocks - live):
            raise imp_mem.OutOfMemory(
                f"growing the KV pool to the re-planned {blocks} blocks was refused"
            )
    # The scheduler refuses a request by the pool's maximum: now the plan's.
    engine.scheduler = engine.new_scheduler()
    engine.warmup_planned = dict(measured)
    engine.boot_seconds["kv_grow"] = time.perf_counter() - t0
