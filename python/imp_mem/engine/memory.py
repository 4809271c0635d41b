"""The engine's memory (`EngineMemory`): its backend, plan, system,
weights and the charges the report names. The serving loop
(`llm_engine`), the boot (`boot`), the lifecycle (`lifecycle`: sleep,
wake, updates, swap) and the model runner (`model_runner`) call it and
never re-derive what it decides.

Order (seed A4.2; `boot` runs the steps in it):

1. `plan`: the plan for the engine's limits (`max_batch`, `max_seq_len`),
   its T2 exactly as the runner lays it out (`model_runner.t2_bytes`) and
   the KV blocks the engine holds itself (`model_runner.engine_blocks`);
   under tensor parallelism the planner's per-rank plan, the weights
   raised where a rank's slices pass the even split
   (`tensor_parallel.plan_shape`); a vision tower (Gemma-3's SigLIP and
   projector) on the plan's own ``vision_tower`` line at the bytes its
   tensors take in T1 (`dummy.vision_bytes`), the weights line the rest;
2. `open`: a `MemorySystem` on the backend (`VmmBackend` on a GPU,
   `FakeBackend` otherwise): T2, T1, the KV pools, T4; collectively with
   a group (`imp_mem.distributed.open_rank_system`), every rank learning
   whether every rank got there (`agree`);
3. `load_weights`: this rank's tensors into T1 (`load_safetensors`: views
   of the arena), timed; with ``load_format="dummy"`` random values drawn
   on the device from a seed instead (`imp_mem.engine.dummy`), the plan's
   weights line at exactly their layout;
4. `kv_manager`: the paged KV manager over the system's pools.

Charges. What imp-mem does not allocate itself but the device holds for
the engine is named in the report: NCCL's communicator (measured across
the engine's first collective), torch's caching allocator (activations,
graph pools) when torch's own allocator serves the forward pass.

Activations. A vision tower's working set (one image) is torch's like
the prefill's: the runner's warm-up encodes one image after the graph
capture and leaves its segments in torch's cache, so the measured
``warmup`` line holds them (torch's own allocator), or the activations
tier does (``torch_pool="imp_mem"``, sized by `measure_torch_high_water`,
whose warm-up encodes it too). `torch_pool` routes torch's own allocations: a callable
called once with the opened `MemorySystem` that returns a
``torch.cuda.MemPool`` (used around eager work and as the graphs' pool),
or a zero-argument factory of a context manager to enter around every
forward pass; ``"imp_mem"`` plans an activations tier of
`activation_bytes` and routes torch into it (`imp_mem.torch.pool`).

Thread safety: none; the engine's one thread drives it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import imp_mem
from imp_mem._safetensors import load_safetensors, read_header, safetensors_files
from imp_mem.engine.config import ModelConfig
from imp_mem.engine.dummy import stacks as dummy_stacks
from imp_mem.engine.tensor_parallel import TensorParallel, plan_shape
from imp_mem.errors import InvalidArgument


class EngineMemory:
    """The memory of one engine: its backend, plan, system, weights and
    charges (module doc). `group`: a ``torch.distributed`` group, or None at
    TP = 1."""

    def __init__(
        self,
        *,
        group: Any,
        torch_pool: Any,
        activation_bytes: int | None,
        scratch_bytes: int | None,
        kv_growable: bool,
    ) -> None:
        self.group = group
        self.activation_bytes = activation_bytes
        self.scratch_bytes = scratch_bytes
        self.kv_growable = kv_growable
        if torch_pool == "imp_mem":
            if activation_bytes is None:
                raise InvalidArgument(
                    "activation_bytes: torch_pool='imp_mem' plans an activations tier; give its "
                    "size (measure it with imp_mem.engine.memory.measure_torch_high_water)"
                )
            import imp_mem.torch as imt

            # The Pool itself: its scope points this thread's hooks at the
            # tier, so two engines' Pools in one process each get their own.
            torch_pool = lambda system: imt.pool(system, device=self.device)  # noqa: E731
        self.torch_pool = torch_pool
        self._torch_pool_made = False
        self.system: Any = None
        # The KV pool's initial (and floor) blocks; None: the system's rule.
        self.kv_initial_blocks: int | None = None
        # The growable KV pool's growth step in blocks (None: the system's).
        self.kv_grow_blocks: int | None = None
        self.nccl_bytes = 0
        self.load_seconds = 0.0
        self.pin_seconds = 0.0
        self.pinned_bytes = 0
        self.weights_over_share = 0
        # The vision tower's and projector's T1 bytes (the plan's
        # ``vision_tower`` line); 0 for a text model.
        self.vision_bytes = 0
        # The kernel modules the warm-up loaded (`warmup.Meter`), once measured.
        self.warmup_modules: int | None = None
        # load_format="dummy": (config.json dict, seed, scale); None loads safetensors.
        self.dummy: tuple[dict[str, Any], int, float] | None = None

    @classmethod
    def of(cls, args: Any, config_dict: dict[str, Any]) -> EngineMemory:
        """The memory of an engine of `args` (`EngineArgs`, resolved) over
        the model of `config_dict` (its ``config.json``)."""
        memory = cls(
            group=args.group,
            torch_pool=args.torch_pool,
            activation_bytes=args.activation_bytes,
            scratch_bytes=args.scratch_bytes,
            kv_growable=args.kv_growable,
        )
        if args.load_format == "dummy":
            from imp_mem.engine.checkpoint import DEFAULT_SCALE

            scale = DEFAULT_SCALE if args.dummy_scale is None else float(args.dummy_scale)
            memory.dummy = (config_dict, int(args.seed), scale)
        return memory

    # ------------------------------------------------------------- the plan

    def resolve_backend(self, backend: Any, budget: Any, tp: TensorParallel) -> None:
        """The backend (default: `VmmBackend` on a GPU, on device
        ``LOCAL_RANK`` with a group; else a backed `FakeBackend` of
        `budget`) and the torch device its memory is on."""
        if backend is None:
            if imp_mem.cuda_available() and torch.cuda.is_available():
                local = int(os.environ.get("LOCAL_RANK", tp.rank))
                backend = imp_mem.VmmBackend(local if self.group is not None else 0)
            else:
                backend = imp_mem.FakeBackend(capacity=budget or "8GiB")
        self.backend = backend
        self.on_gpu = backend.kind in ("cuda", "vmm")
        self.device = torch.device("cuda", backend.device) if self.on_gpu else torch.device("cpu")

    def make_plan(
        self,
        model_dir: Path,
        config: ModelConfig,
        tp: TensorParallel,
        *,
        limits: Any,
        budget: Any,
        context: int | None,
        library_reserve: int | None,
        features: Any,
        default_features: Any,
        engine_blocks: Sequence[int],
    ) -> Any:
        """Plans the model in `model_dir` for `limits` on this backend;
        `features` (a caller's) gains the engine's own KV blocks, else
        `default_features` is used. Returns the plan."""
        # The checkpoint's bytes; with ranks, raised where a rank's slices
        # would pass the planner's even split (`plan_shape`).
        from imp_mem.engine import dummy

        # A vision tower is its own line (`vision_tower`), not the weights'.
        self.vision_bytes = dummy.vision_bytes(config)
        if self.dummy is not None:
            shape, self.rank_weights_bytes = dummy.plan_shape(self.dummy[0], config), 0
        else:
            shape, self.rank_weights_bytes = plan_shape(model_dir, config, tp.tp)
            if self.vision_bytes:
                shape = shape.with_weights_bytes(max(1, shape.weights_bytes - self.vision_bytes))
        if not self.on_gpu:
            context = 8 << 20 if context is None else context
            library_reserve = 4 << 20 if library_reserve is None else library_reserve
        self.context, self.library_reserve = context, library_reserve
        self.plan_input = imp_mem.PlanInput(
            shape,
            limits,
            _with_engine_blocks(features, engine_blocks, self.vision_bytes)
            if features is not None
            else _with_engine_blocks(default_features, (0, 0), self.vision_bytes),
            budget=budget if budget is not None else self.backend.budget,
            tp=tp.tp,
            context=context,
            library_reserve=library_reserve,
        )
        self.plan = imp_mem.plan_memory(self.plan_input)
        return self.plan

    def features(
        self, t2_bytes: int, engine_blocks: Sequence[int], *, warmup_bytes: int = 0
    ) -> Any:
        """What the plan sizes beyond the model and its KV: T2 exactly as
        the runner uses it, and T4 (the forward-pass scratch stack) at its
        minimum unless `torch_pool` may draw activations from it or
        `scratch_bytes` says otherwise — the engine's own forward pass
        allocates through torch."""
        scratch = self.scratch_bytes
        if scratch is None and (self.torch_pool is None or self.activation_bytes):
            scratch = 1 << 20
        return imp_mem.Features(
            engine_persistent_bytes=t2_bytes,
            scratch_bytes=scratch,
            activation_bytes=self.activation_bytes,
            engine_kv_blocks=engine_blocks[0],
            engine_swa_blocks=engine_blocks[1],
            warmup_bytes=warmup_bytes,
        )

    # ------------------------------------------------------------- opening

    def agree(self, step: str, error: BaseException | None) -> None:
        """At TP = 1 re-raises `error`; with a group, every rank learns
        whether every rank got past `step`, and all raise the same
        `RankFailure` when one did not."""
        if self.group is None:
            if error is not None:
                raise error
            return
        from imp_mem.distributed import agree

        agree(step, error, group=self.group)

    def nccl_reading(self) -> tuple[int, int] | None:
        """With an NCCL group: the device's free bytes and torch's reserved
        bytes now; None otherwise."""
        if self.group is None or not getattr(self, "on_gpu", False):
            return None
        import torch.distributed as dist

        if dist.get_backend(self.group) != "nccl":
            return None
        torch.cuda.synchronize(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        return free, torch.cuda.memory_reserved(self.device)

    def nccl_lost(self, before: tuple[int, int] | None) -> int:
        """What NCCL took of the device outside every allocator across the
        engine's first collective (the communicator is created lazily,
        there): the device's loss less torch's share. 0 without an NCCL
        group, or when the communicator was created before the engine (its
        bytes then show as the report's residual)."""
        now = self.nccl_reading() if before is not None else None
        if before is None or now is None:
            return 0
        return max(0, (before[0] - now[0]) - (now[1] - before[1]))

    def open(self) -> Any:
        """Opens the memory system on the plan (collectively with a group)
        and names NCCL's bytes."""
        system_kw = dict(
            context=self.context,
            library_reserve=self.library_reserve,
            kv_growable=self.kv_growable,
            kv_initial_blocks=self.kv_initial_blocks,
            kv_grow_blocks=self.kv_grow_blocks,
            # With the tier torch's, a full tier returns null to torch, which
            # gives its pool's cached segments back and retries.
            activation_strict=True if self.activation_bytes is not None else None,
        )
        if self.group is None:
            self.system = imp_mem.MemorySystem(self.backend, self.plan, **system_kw)
        else:
            from imp_mem.distributed import open_rank_system

            self.system = open_rank_system(
                lambda _device: self.backend, self.plan, group=self.group, **system_kw
            )
        if self.nccl_bytes:
            self.system.set_charge(
                "nccl", self.nccl_bytes, "NCCL communicator (created at its first collective)"
            )
        return self.system

    def make_torch_pool(self) -> None:
        """Calls the `torch_pool` factory once, with the opened system."""
        if self.torch_pool is not None and not self._torch_pool_made:
            self.torch_pool = self.torch_pool(self.system)
            self._torch_pool_made = True

    # -------------------------------------------------------------- loading

    def load_weights(
        self, model_dir: Path, tp: TensorParallel, progress: bool | None, *, pin: bool = False
    ) -> dict[str, torch.Tensor]:
        """This rank's tensors of `model_dir` into T1, as views of the arena.
        With `pin`, the level-1 sleep buffer (T5b) of exactly the bytes the
        load lays out is pinned on a background thread while the copies run
        (`MemorySystem.pin_sleep_host`), so the first sleep copies at the
        line rate; its seconds are `pin_seconds`, inside `load_seconds`."""
        t0 = time.perf_counter()
        if self.dummy is not None:
            from imp_mem.engine.dummy import layout_bytes, load_dummy

            _, seed, scale = self.dummy
            pinner = _Pinner(self.system) if pin else None
            if pinner is not None:
                pinner.start(layout_bytes(tp.config))
            try:
                weights = load_dummy(self.system, tp.config, seed=seed, scale=scale)
            finally:
                if pinner is not None:
                    self.pin_seconds, self.pinned_bytes = pinner.join()
            self.load_seconds = time.perf_counter() - t0
            return weights
        # A warm-up probe (`warmup.probe`) needs the layout, not the values.
        read = not os.environ.get("IMP_MEM_WARMUP_CHILD")
        pinner = _Pinner(self.system) if pin and read else None
        try:
            weights = load_safetensors(
                self.system,
                model_dir,
                progress=progress,
                shards=tp.shards(),
                on_layout=pinner.start if pinner else None,
                read=read,
                stacks=None if tp.tp > 1 else dummy_stacks(tp.config),
            )
        finally:
            if pinner is not None:
                self.pin_seconds, self.pinned_bytes = pinner.join()
        self.load_seconds = time.perf_counter() - t0
        # What this rank holds beyond the plan's even split of the
        # checkpoint (replicated norms, shared KV heads, the vocab's
        # rounding); 0 at TP = 1.
        full = sum(t.nbytes for f in safetensors_files(model_dir) for t in read_header(f))
        held = sum(t.numel() * t.element_size() for t in weights.values())
        self.weights_over_share = held - -(-full // tp.tp)
        return weights

    def kv_manager(self, *, prefix_caching: bool, swa_window: int | None, fingerprint: str) -> Any:
        """The paged KV manager over the system's pools."""
        return self.system.kv_manager(
            enable_prefix_caching=prefix_caching,
            swa_window=swa_window,
            model_fingerprint=fingerprint,
        )

    # --------------------------------------------------------------- torch

    def torch_ctx(self) -> Any:
        """The context every forward pass runs in: torch's allocations into
        the routed pool, when there is one."""
        pool = self.torch_pool
        if pool is None:
            return contextlib.nullcontext()
        if self.on_gpu and _is_imp_pool(pool):
            return pool.scope()
        if self.on_gpu and isinstance(pool, torch.cuda.MemPool):
            return torch.cuda.use_mem_pool(pool)
        return pool()

    def graph_pool(self) -> Any:
        """The memory pool the decode graphs capture into."""
        pool = self.torch_pool
        if self.on_gpu and (_is_imp_pool(pool) or isinstance(pool, torch.cuda.MemPool)):
            return pool.id
        return torch.cuda.graph_pool_handle()

    def capture_ctx(self) -> Any:
        """The context the decode graphs are captured in: an imp-mem Pool's
        route (the capture's allocations reach its tier, whichever Pool
        holds the hooks), else nothing."""
        pool = self.torch_pool
        if pool is not None and self.on_gpu and _is_imp_pool(pool):
            return pool.routed()
        return contextlib.nullcontext()

    def empty_torch_cache(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def charge_torch(self) -> None:
        """Names torch's reserved bytes in the report when torch's own
        allocator serves the forward pass. Once the warm-up was measured
        (`warmup_modules` set), they are charged with the kernel modules
        against the plan's ``warmup`` line instead."""
        if self.on_gpu and self.warmup_modules is not None:
            outside = torch.cuda.memory_reserved(self.device) if self.torch_pool is None else 0
            # The line named before the warm-up was measured (a cold boot's
            # runner charged it) is in the warm-up's line now: dropped, not
            # counted twice.
            self.system.set_charge("torch", 0)
            self.system.set_charge(
                "warmup",
                outside + self.warmup_modules,
                "warm-up: graph pools, activations, kernel modules",
            )
            return
        if self.on_gpu and self.torch_pool is None:
            self.system.set_charge(
                "torch",
                torch.cuda.memory_reserved(self.device),
                "torch caching allocator (activations, graph pools)",
            )

    # ---------------------------------------------------------------- close

    def close(self) -> dict[str, Any] | None:
        """Closes the system (every tensor over its memory must be dropped
        first); its closing report."""
        system = self.system
        if system is None:
            return None
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        if self.activation_bytes is not None and self.on_gpu:
            # torch's MemPool over the activations tier: its segments go back
            # to the tier before the tier closes.
            import imp_mem.torch as imt

            self.torch_pool = None
            tier = system.activations.id
            for p in [p for p in imt._pools.values() if p._tier == tier]:
                p.close()
        self.system = None
        return system.close()


def _is_imp_pool(pool: Any) -> bool:
    """Whether `pool` is an ``imp_mem.torch.Pool`` (without importing the
    module where the engine never routed torch)."""
    import sys

    module = sys.modules.get("imp_mem.torch")
    return module is not None and isinstance(pool, module.Pool)


class _Pinner:
    """Pins the level-1 sleep buffer on a thread of its own (the binding
    releases the GIL while the driver pins). A failure to pin is a warning,
    not a failed load: the first sleep then pins, slowly."""

    def __init__(self, system: Any) -> None:
        self.system = system
        self.thread: threading.Thread | None = None
        self.seconds = 0.0
        self.pinned = 0
        self.error: BaseException | None = None

    def start(self, nbytes: int) -> None:
        def pin() -> None:
            t0 = time.perf_counter()
            try:
                self.pinned = int(self.system.pin_sleep_host(nbytes))
            except Exception as e:  # reported by join()
                self.error = e
            self.seconds = time.perf_counter() - t0

        self.thread = threading.Thread(target=pin, name="imp-mem-pin-sleep-host", daemon=True)
        self.thread.start()

    def join(self) -> tuple[float, int]:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            warnings.warn(
                f"pinning the sleep buffer failed ({self.error}); the first sleep(1) will pin "
                "it, at the cost of seconds per 16 GiB",
                RuntimeWarning,
                stacklevel=3,
            )
        return self.seconds, self.pinned


def _with_engine_blocks(features: Any, blocks: Sequence[int], vision: int = 0) -> Any:
    """`features` (a caller's `imp_mem.Features`) with the engine's own KV
    blocks added to what it already plans for, and the vision tower's line
    at least the model's tower (`dummy.vision_bytes`)."""
    # Every field Features has (its getters are its keyword arguments).
    names = [
        n
        for n, v in vars(imp_mem.Features).items()
        if type(v).__name__ == "getset_descriptor"
        and n not in ("engine_kv_blocks", "engine_swa_blocks", "vision_tower_bytes")
    ]
    return imp_mem.Features(
        **{n: getattr(features, n) for n in names},
        engine_kv_blocks=features.engine_kv_blocks + blocks[0],
        engine_swa_blocks=features.engine_swa_blocks + blocks[1],
        vision_tower_bytes=max(features.vision_tower_bytes, vision),
    )


def measure_torch_high_water(
    model_dir: str | Path | dict[str, Any], *, requests: int = 0, **engine_kw: Any
) -> int:
    """The most device memory torch's allocator holds for an engine of these
    arguments over its warm-up, graph capture and `requests` random requests
    (torch's default allocator, a fresh engine): what to plan the activations
    tier with (``Engine(torch_pool="imp_mem", activation_bytes=...)``, seed A3.3)."""
    import random

    from imp_mem.engine.llm_engine import Engine

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with Engine(model_dir, **engine_kw) as e:
        rng = random.Random(0)
        # Text only: a vision model's image token would need an image (its
        # tower's working set is in the warm-up's, which encodes one).
        image = (e.config.vision or {}).get("image_token_index")
        for _ in range(requests):
            n = rng.randint(1, max(1, e.max_seq_len // 2))
            ids = [rng.randrange(e.config.vocab_size) for _ in range(n)]
            e.submit([0 if t == image else t for t in ids], 8)
        e.run()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_reserved(dev) - base
    torch.cuda.empty_cache()
    return int(peak)
