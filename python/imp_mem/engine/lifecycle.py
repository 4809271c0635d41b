"""The engine's memory over its life once it serves: sleep and wake (issue
19's RL colocation), weight updates in place, and the model swap.

Sleep. The engine sleeps by group (`MemorySystem.sleep_groups`, the
core's table: ``weights`` is T1, ``kv_cache`` the KV pool and the
sliding-window pool, ``activations`` torch's tier when torch is routed
into it) and passes each group's tier keys to the memory system, which
checks the level, the backend and a tier already asleep (once, in the
core: `MemorySystem.check_sleep` asks before the engine drains its
requests, so a refusal changes nothing). What sleeps is the system's
state, read back through the same table (`asleep`) after every sleep
and wake (`Engine._asleep`, so that a step need not ask); the engine
remembers only that a level-2 sleep dropped the weights
(`Engine._weights_dropped`), until they are updated or reloaded.

Updates. `update_weights` copies a trainer's tensors into T1 in place,
checked whole first (`weights.check_update`); every update empties the
prefix cache, so no KV computed with the old weights is served again.

Swap. `swap_model` plans the new checkpoint with the engine's arguments
against the same budget and hands the plan to `MemorySystem.swap_model`
inside the backend's replanning bracket; the boot's `boot.load` and
`boot.serve` then run again (no new SERVING phase: the bracket returns
to it). A failed swap serves the old checkpoint on.

Each function takes the `Engine` whose public method delegates to it.
Thread safety: none; the engine's one thread drives it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import imp_mem
from imp_mem.engine import boot
from imp_mem.engine.config import ModelConfig, read_config_json
from imp_mem.engine.tensor_parallel import TensorParallel
from imp_mem.engine.weights import check_update, copy_update
from imp_mem.errors import InvalidArgument

# ---------------------------------------------------------------- sleep / wake


def groups(engine: Any) -> dict[str, list[str]]:
    """The engine's sleep groups and their tier keys (the core's table)."""
    return dict(engine.memory.system.sleep_groups())


def asleep(engine: Any) -> dict[str, int]:
    """The groups asleep now, ``{group: level}``: the system's state."""
    system = engine.memory.system
    if system is None:
        return {}
    levels = system.asleep
    out = {}
    for group, keys in system.sleep_groups().items():
        slept = [levels[k] for k in keys if k in levels]
        if slept:
            out[group] = max(slept)
    return out


def sleep(engine: Any, level: int, tags: str | Sequence[str] | None, drain: str) -> dict[str, Any]:
    """`Engine.sleep`: gives the device memory of `tags` back (default: every tag of
    `sleep_tags`), keeping every address: captured graphs replay after
    `wake` without re-capture.

    `level` 1 keeps the weights in pinned host memory (pinned at load,
    `pin_sleep_host`); 2 drops them (`update_weights` or
    `reload_weights` after the wake). The KV cache is dropped at either
    level; its prefix cache goes to the KV host tier when there is one,
    else it is emptied. `drain`: what to do with requests waiting or
    running — ``"refuse"`` (InvalidArgument naming them; nothing
    changes), ``"abort"`` (cancel them) or ``"wait"`` (serve them to the
    end first). Returns the memory system's sleep report. A refusal of
    the memory system (a backend without growable regions) changes
    nothing; the engine serves on."""
    system = engine.memory.system
    names = _tags(engine, tags, "sleep")
    table = groups(engine)
    tiers = [key for tag in names for key in table[tag]]
    # The level, the backend, a tier already asleep: the system's checks,
    # before any request is drained.
    system.check_sleep(level, tiers)
    if drain not in ("refuse", "abort", "wait"):
        raise InvalidArgument(
            f"drain={drain!r}: pass 'refuse' (raise while requests run), 'abort' (cancel "
            "them) or 'wait' (serve them to the end first)"
        )
    _drain(engine, drain)
    if engine.on_gpu:
        torch.cuda.synchronize(engine.device)
    kv = "kv_cache" in names
    if kv:
        _kv_to_sleep(engine)
    try:
        report = system.sleep(level, tiers)
    except BaseException:
        if kv:
            engine.runner.reserve_blocks()
            engine.runner.reset_inputs()
        raise
    engine._asleep = asleep(engine)
    if engine.tenancy is not None:
        engine.tenancy.tenant.set_asleep(level)
    return report


def wake(engine: Any, tags: str | Sequence[str] | None, empty_torch_cache: bool) -> list[str]:
    """`Engine.wake`: takes the memory of `tags` back at the same addresses (default:
    every sleeping tag), one tag at a time in the order given: the
    staged wake of RL colocation is ``wake("weights")``,
    `update_weights`, ``wake("kv_cache")``, so the KV cache's memory is
    taken only once the update's is free. A tag that is awake is
    skipped. Returns the tags woken.

    When the device lacks room, `OutOfMemory` says how much the wake
    needs and how much torch's caching allocator holds reserved but
    unused (a trainer's freed blocks); with `empty_torch_cache` the
    engine empties torch's cache once and retries. The tags not woken
    sleep on, and a later `wake` can take them."""
    names = _tags(engine, tags, "wake") if tags is not None else list(asleep(engine))
    woken = []
    try:
        for tag in names:
            level = engine._asleep.get(tag)
            if level is None:
                continue
            _wake_group(engine, tag, empty_torch_cache)
            if tag == "weights" and level == 2:
                engine._weights_dropped = True
            if tag == "kv_cache":
                engine.runner.reserve_blocks()
                engine.runner.reset_inputs()
            woken.append(tag)
    finally:
        engine._asleep = asleep(engine)
    if engine.tenancy is not None and not engine._asleep:
        engine.tenancy.tenant.set_asleep(0)
    return woken


def _wake_group(engine: Any, tag: str, empty_torch_cache: bool) -> None:
    """Wakes the tiers of `tag`. When the device lacks room the memory
    system's `OutOfMemory` (its arithmetic kept) also names what torch's
    caching allocator holds reserved but unused; with `empty_torch_cache`
    that cache is emptied once and the wake retried."""
    memory = engine.memory
    tiers = groups(engine)[tag]
    try:
        memory.system.wake(tiers)
        return
    except imp_mem.OutOfMemory as e:
        cached = _torch_cached(engine)
        if not (empty_torch_cache and cached):
            e.torch_cached = cached
            e.args = (
                f"wake({tag!r}): {e}; torch's caching allocator holds "
                f"{cached / 2**20:.0f} MiB reserved but unused on this device: call "
                "torch.cuda.empty_cache() (or wake(..., empty_torch_cache=True)) or free the "
                f"trainer's tensors, then wake again; {tag} still sleeps",
            )
            raise
    torch.cuda.empty_cache()
    memory.system.wake(tiers)


def _torch_cached(engine: Any) -> int:
    """Bytes torch's caching allocator reserves and does not use."""
    device = engine.memory.device
    if not engine.memory.on_gpu:
        return 0
    return int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def check_awake(engine: Any, what: str) -> None:
    """Refuses `what` while a group sleeps or a level-2 sleep's weights
    were not yet replaced (a step's check: the system's state as the last
    sleep or wake left it, `Engine._asleep`, not asked again)."""
    slept = engine._asleep
    if slept:
        shown = ", ".join(f"{t} (level {lv})" for t, lv in slept.items())
        raise InvalidArgument(f"{what}: the engine sleeps ({shown}); wake() first")
    if engine._weights_dropped:
        raise InvalidArgument(
            f"{what}: a level-2 sleep dropped the weights; update_weights(...) or "
            "reload_weights() first"
        )


def _tags(engine: Any, tags: str | Sequence[str] | None, what: str) -> list[str]:
    known = engine.sleep_tags
    if tags is None:
        return list(known)
    names = [tags] if isinstance(tags, str) else list(tags)
    for t in names:
        if not isinstance(t, str):
            raise TypeError(f"{what}: tags must be str, got {type(t).__name__}")
        if t not in known:
            raise InvalidArgument(f"{what}: tag {t!r} is not one of {list(known)}")
    if not names:
        raise InvalidArgument(f"{what}: tags is empty; name one of {list(known)} or pass None")
    return list(dict.fromkeys(names))


def _drain(engine: Any, mode: str) -> None:
    sched = engine.scheduler
    if not sched.has_work:
        return
    if mode == "refuse":
        ids = [r.seq_id for r in sched.waiting] + list(sched.running)
        shown = ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
        raise InvalidArgument(
            f"sleep: {len(ids)} requests are waiting or running (seq {shown}); finish them, "
            "or pass drain='abort' to cancel them or drain='wait' to serve them first"
        )
    if mode == "abort":
        for sid in [r.seq_id for r in sched.waiting] + list(sched.running):
            sched.cancel(sid)
    else:
        engine.run()


def _kv_to_sleep(engine: Any) -> None:
    """Leaves the KV pools without a live block: no prefix-cache block on
    the device (offloaded to the KV host tier, which keeps them for after
    the wake, or else emptied) and the runner's own blocks given back."""
    kv = engine.kv
    if kv.stats()["host_capacity"]:
        kv.evict(kv.stats()["cached"])
        kv.poll_copies(True)
        emptied = kv.stats()["cached"] == 0
    else:
        emptied = kv.reset_prefix_cache()
    if not emptied:
        raise InvalidArgument("sleep: the prefix cache has pinned blocks; unpin them first")
    engine.runner.release_blocks()


# ------------------------------------------------------------ weight updates


def _refuse_update(engine: Any, what: str, asleep_hint: str) -> None:
    if "weights" in asleep(engine):
        raise InvalidArgument(f"{what}: the weights sleep; wake('weights') first{asleep_hint}")
    if engine.scheduler.has_work:
        raise InvalidArgument(
            "update_weights: requests are waiting or running; finish them (run()) or "
            "cancel them first, so no sequence mixes two sets of weights"
        )


def update_weights(engine: Any, named_tensors: Any) -> dict[str, Any]:
    """`Engine.update_weights`: copies new weights into T1 in place: an iterable of
    ``(name, tensor)`` (or a mapping), tensors on the GPU (a trainer in
    this process) or the CPU, each the checkpoint's whole tensor (under
    tensor parallelism each rank takes its slice). Every name, shape and
    dtype is checked before the first byte is copied; a refusal
    (`InvalidArgument` naming the tensor) changes nothing. A subset of
    the checkpoint's tensors may be given. The prefix cache (device and
    host tiers) is emptied: no KV computed with the old weights is
    served again. Returns ``{"tensors", "bytes", "seconds"}``."""
    _refuse_update(engine, "update_weights", " (the staged wake: weights, update, then kv_cache)")
    if engine.kv.stats()["pinned"]:
        raise InvalidArgument(
            "update_weights: the prefix cache has pinned blocks, which would keep KV of the "
            "old weights; unpin them first"
        )
    runner = engine.runner
    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    plan = check_update(runner.weights, items, engine.config, engine.tp.shards())
    t0 = time.perf_counter()
    with torch.inference_mode(), runner.on_stream():
        copy_update(plan)
    if engine.on_gpu:
        torch.cuda.synchronize(engine.device)
    _weights_changed(engine)
    nbytes = sum(dst.numel() * dst.element_size() for dst, _, _ in plan)
    return {"tensors": len(plan), "bytes": nbytes, "seconds": time.perf_counter() - t0}


def reload_weights(engine: Any, model_dir: str | Path | None) -> dict[str, Any]:
    """`Engine.reload_weights`."""
    from imp_mem.engine.weights import checkpoint_tensors

    if model_dir is None and engine.memory.dummy is not None:
        return _refill_dummy(engine)
    directory = engine.model_dir if model_dir is None else Path(model_dir)
    return update_weights(engine, checkpoint_tensors(directory))


def _refill_dummy(engine: Any) -> dict[str, Any]:
    """`reload_weights` of a dummy engine: its seed's values drawn again in place."""
    from imp_mem.engine.dummy import fill

    _refuse_update(engine, "reload_weights", "")
    runner = engine.runner
    _, seed, scale = engine.memory.dummy
    t0 = time.perf_counter()
    with torch.inference_mode(), runner.on_stream():
        fill(runner.weights, engine.config, seed=seed, scale=scale)
    _weights_changed(engine)
    nbytes = sum(t.numel() * t.element_size() for t in runner.weights.values())
    return {"tensors": len(runner.weights), "bytes": nbytes, "seconds": time.perf_counter() - t0}


def _weights_changed(engine: Any) -> None:
    """No KV computed with the old weights is served again."""
    engine.kv.reset_prefix_cache()
    engine._weights_dropped = False
    engine.weights_version += 1


# ---------------------------------------------------------------- model swap


def swap_model(engine: Any, model_dir: str | Path) -> dict[str, Any]:
    """`Engine.swap_model`: serves the checkpoint in `model_dir` in place of this one without
    closing the memory system (issue 19). Inside the backend's
    replanning bracket it drops the model's graphs, views and KV
    manager, plans the new config with this engine's arguments, swaps
    the system's model (`MemorySystem.swap_model`: T2 kept at its
    address, T1 reset and resized at its base on a VMM backend, the KV
    pool re-laid when its geometry changes, the prefix cache dropped),
    loads the new weights into T1, warms up and captures again. Returns
    the swap's report.

    Refused with `InvalidArgument`, changing nothing, while requests are
    waiting or running, on a tensor-parallel engine, or when the new
    model needs T2 laid out differently (another vocabulary while
    logits are kept, sliding layers where there were none). When the
    swap itself fails, the old checkpoint is loaded again and serves
    on, and the error is raised."""
    if engine.group is not None:
        raise InvalidArgument(
            "swap_model: a tensor-parallel engine cannot swap its model; close it and "
            "open an engine on the new checkpoint"
        )
    if engine.memory.dummy is not None:
        raise InvalidArgument(
            "swap_model: a load_format='dummy' engine has no checkpoint to swap from; "
            "open an engine on the new checkpoint"
        )
    if engine.scheduler.has_work:
        raise InvalidArgument(
            "swap_model: requests are waiting or running; finish them (run()) or cancel them first"
        )
    new_dir = Path(model_dir)
    new_dict = read_config_json(new_dir, "model_dir")
    new_config = ModelConfig.from_hf_config(new_dict)
    if engine.max_seq_len > new_config.max_position_embeddings:
        raise InvalidArgument(
            f"swap_model: max_seq_len={engine.max_seq_len} is above {new_dir.name}'s "
            f"max_position_embeddings ({new_config.max_position_embeddings})"
        )
    old = (engine.model_dir, engine.config_dict, engine.config)
    t2 = engine.runner.groups()
    _set_model(engine, new_dir, new_dict, new_config)
    if engine.runner.groups() != t2:
        _set_model(engine, *old)
        raise InvalidArgument(
            f"swap_model: {new_dir.name} needs engine buffers (T2) laid out differently "
            "(its vocabulary or its sliding layers differ), and a swap keeps T2; open a "
            "new engine for it"
        )
    _drop_model(engine)
    system = engine.memory.system
    with engine.backend.replanning(f"model swap to {new_dir.name}"):
        try:
            boot.plan(engine, *engine._plan_args)
            report = system.swap_model(engine.plan)
        except BaseException:
            # The old model serves on: its plan again, its weights read
            # again into the (reset) T1, its KV manager and graphs.
            _set_model(engine, *old)
            boot.plan(engine, *engine._plan_args)
            system.weights_arena.reset()
            _reload(engine)
            raise
        _reload(engine)
    return report


def _set_model(engine: Any, model_dir: Path, config_dict: dict, config: ModelConfig) -> None:
    engine.model_dir, engine.config_dict, engine.config = model_dir, config_dict, config
    engine.tp = TensorParallel(config, tp=1)
    engine.runner.set_model(config, engine.runner.block_size)


def _drop_model(engine: Any) -> None:
    """Drops everything over the model's memory (graphs, weights, KV views
    and manager), so that no export of T1 and no block is alive."""
    engine.runner.drop_model()
    _drop_kv(engine)
    engine.memory.empty_torch_cache()


def _drop_kv(engine: Any) -> None:
    """Drops the scheduler and the KV manager (the engine's and the runner's)."""
    for name in ("scheduler", "kv"):
        if hasattr(engine, name):
            delattr(engine, name)
    runner = getattr(engine, "runner", None)
    if runner is not None and hasattr(runner, "kv"):
        del runner.kv
    # Exports held in a reference cycle would keep their tier alive.
    gc.collect()


def close(engine: Any) -> dict[str, Any] | None:
    """`Engine.close`: every tensor over imp-mem's memory dropped, then the
    system closed; a shared GPU's tenant leaves the device ledger once the
    system's memory is back. None when it was closed already."""
    if getattr(engine.memory, "system", None) is None:
        return None
    runner = getattr(engine, "runner", None)
    if runner is not None:
        runner.drop_model()
        runner.drop_buffers()
    _drop_kv(engine)
    report = engine.memory.close()
    if engine.tenancy is not None:
        try:
            engine.backend.detach_ledger()
        except imp_mem.ImpMemError:
            pass  # memory still held: the tenant stays with the backend
        engine.tenancy = None
    return report


def _reload(engine: Any) -> None:
    boot.load(engine)
    boot.serve(engine, begin=False)
