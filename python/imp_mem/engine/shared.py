"""The engine on a shared GPU (issue 27): its tenancy of the device ledger.

`Engine(..., shared=SharedGPU(cap=...))` (or ``shared=True``) plans the
model for its cap, joins the device's ledger with a *floor* — everything
the plan opens except the KV pool's growth, i.e. the weights, T2, T4 and
the KV blocks of one sequence (plus the engine's own), and on a GPU the
CUDA context and library reserve — and attaches the backend to it, so the
backend commits only what the ledger grants. Then, each step:

* **admission** promises room: a request is admitted only when the KV
  blocks of every running request's remaining tokens plus its own whole
  length (prompt + max_new_tokens) are committed free
  (`KVCacheManager.reserve_free`, which grows the pool as far as the ledger
  grants); otherwise it waits, and the shortfall presses on the other
  tenants. So no admitted request is ever refused a block mid-generation
  (no preemption for lack of memory). A request that could not fit even if
  every other tenant shrank to its floor raises `CapacityError` at submit;
  with the floor holding one full sequence, none within `max_seq_len` does.
* **pressure**: when the ledger asks this tenant for memory, it gives it
  back (`give_back`): free blocks above the room it promised, then
  prefix-cache blocks a chunk at a time;
* **idle**: `Engine.idle()` (the serving loop calls it when there is no
  work) shrinks the KV pool to its live blocks plus one chunk after
  `idle_trim_s`, evicts the prefix cache after `idle_cache_s`, answers
  pressure, and after `idle_sleep_s` puts the engine
  to sleep (level 1); the next `submit` wakes it, inside that request's
  time to first token.

Algorithm costs, in the steady state (the pool grown to its working size):
nothing per step but the pressure check — one ledger read (an flock and an
8 KiB pread, ~6 µs) at most every `SharedGPU.pressure_interval_s` — and a
KV-live record written only when it moved by a chunk. Admission touches the
ledger only when the pool must grow (`reserve_free`: whole chunks of
`chunk_bytes`; with free blocks it is a count compare), and `submit` consults the ledger
only for a request longer than the floor's one sequence (none within
`max_seq_len`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import imp_mem
from imp_mem._format import byte_count
from imp_mem.errors import CapacityError, InvalidArgument


@dataclass
class SharedGPU:
    """How an engine shares its GPU.

    `cap`: the most it may commit (its plan's budget; default: the
    engine's `budget`). `device_budget`: the ledger's budget, used only by
    the first tenant of the device (default: the backend's capacity).
    `key`: the ledger key (default: the GPU's UUID; ``"fake"`` on the
    fake). `name`: the tenant's name (default: the model directory's).
    `dir`: the ledgers' directory (default ``$IMP_MEM_LEDGER_DIR`` or
    ``/dev/shm/imp-mem-ledger``). `wait_s`: how long a join waits for
    the others to give elastic memory back. `idle_trim_s`: idle seconds
    before the KV pool shrinks to its live blocks plus one chunk.
    `idle_sleep_s`: idle seconds before the engine sleeps (None: never).
    `idle_cache_s`: idle seconds before the prefix cache is evicted too, a
    chunk at a time from the top, so that an idle tenant holds its live
    blocks (plus at most one chunk); None keeps it until the ledger's
    pressure asks for it. Longer than `idle_trim_s`, so that a gap between
    requests keeps the cache. `pressure_interval_s`: the least time
    between two reads of the ledger's pressure while serving.
    `chunk_bytes`: the KV pool's growth step (whole blocks, at least one),
    which an idle pool also keeps above its live blocks; on a VMM backend
    the backend's own chunk rounds it up.
    """

    cap: int | str | None = None
    device_budget: int | str | None = None
    key: str | None = None
    name: str | None = None
    dir: str | None = None
    wait_s: float = 30.0
    idle_trim_s: float = 0.05
    idle_sleep_s: float | None = None
    idle_cache_s: float | None = 2.0
    pressure_interval_s: float = 0.005
    chunk_bytes: int | str = 64 << 20

    @staticmethod
    def of(value: Any) -> SharedGPU | None:
        """``None``/``False`` → None, ``True`` → the defaults, a
        `SharedGPU` as it is, a dict as keywords."""
        if value is None or value is False:
            return None
        if value is True:
            return SharedGPU()
        if isinstance(value, SharedGPU):
            return value
        if isinstance(value, dict):
            return SharedGPU(**value)
        raise InvalidArgument(
            f"shared must be None, True, a SharedGPU or a dict of its fields; got "
            f"{type(value).__name__}"
        )


def device_key(backend: Any, on_gpu: bool) -> str:
    """The ledger key of the backend's device: its UUID on a GPU."""
    if on_gpu:
        import torch

        props = torch.cuda.get_device_properties(backend.device)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            return "GPU-" + str(uuid)
        return f"cuda{backend.device}-pid-namespace-{os.getuid()}"
    return "fake"


class Tenancy:
    """The engine's side of the ledger: its tenant, its floor, the room it
    promised, and its idle clock."""

    def __init__(
        self, cfg: SharedGPU, memory: Any, plan: Any, name: str, engine_kv_blocks: int
    ) -> None:
        backend = memory.backend
        kv = plan.kv
        self.block_bytes = int(kv["block_bytes"])
        self.block_size = int(kv["block_size"])
        # Where a VMM region rounds up to its granularity: one granule a tier.
        slack = 16 * int(backend.granularity)
        self.initial = self.initial_blocks(plan, engine_kv_blocks)
        kv_floor = self.initial * self.block_bytes
        # The KV pool's growth step, and what an idle pool keeps above its
        # live blocks: one chunk.
        chunk_bytes = byte_count(cfg.chunk_bytes, "chunk_bytes")
        self.chunk = max(1, min(int(kv["blocks"]), chunk_bytes // self.block_bytes))
        # The CUDA context, the library reserve and the warm-up line (torch's
        # graph pools, its cached activations, kernel modules) are in the
        # plan, and so in the floor, but held by no backend: charged to the
        # ledger so that its books match the plan's and the device's.
        self.outside = plan.context + plan.library_reserve + plan.warmup
        self.planned_warmup = plan.warmup
        self.floor = plan.total() - int(kv["bytes"]) + kv_floor + slack
        self.cap = plan.budget
        key = cfg.key or device_key(backend, memory.on_gpu)
        budget = cfg.device_budget if cfg.device_budget is not None else backend.capacity
        self.ledger = imp_mem.DeviceLedger(key, budget, cfg.dir)
        self.tenant = self.ledger.join(
            cfg.name or name, self.floor, max(self.cap, self.floor), wait_s=cfg.wait_s
        )
        if self.outside:
            self.tenant.grow(self.outside)
        backend.attach_ledger(self.tenant)
        self.cfg = cfg
        self.last_active = time.perf_counter()
        self.auto_slept = False
        self.steps = 0
        # The floor's blocks a request can have (the engine holds its own).
        self.floor_request_blocks = max(0, self.initial - engine_kv_blocks)
        # The KV-live figure last written, and when the pressure was read.
        self._kv_live_written = -1
        self._pressure_at = 0.0
        # What `settle_warmup` charged past the floor when the ledger could
        # not raise the floor with it (the next boot plans the measured
        # figure into the floor).
        self.outside_past_floor = 0
        # Ledger calls made by `tick` / `check_submit` (for tests and benches).
        self.ledger_reads = 0
        self.ledger_writes = 0

    def fit_floor(self) -> None:
        """Once the memory system is open (its tiers at rest, the KV pool at
        its initial blocks): the floor lowered to what the tenant holds, so
        the join's rounding slack (a granule a tier, 1 GiB at a VMM
        backend's 64 MiB chunk) is not reserved from the other tenants for
        good. A floor below the commitment (more rounding than the slack
        held) is raised to it where the others' reservations leave room, as
        those bytes are not the KV's to give back; refused, it stays."""
        committed = int(self.tenant.record()["committed"])
        if committed < self.floor:
            self.tenant.lower_floor(self.floor - committed)
            self.floor = committed
        elif committed > self.floor:
            self._raise_floor(committed - self.floor)

    def _raise_floor(self, extra: int) -> bool:
        """Raises the floor by `extra` on the ledger and here; False, and
        nothing changed, where the others' reservations leave no room."""
        try:
            self.tenant.raise_floor(extra)
        except imp_mem.OutOfMemory:
            return False
        self.floor += extra
        return True

    def settle_warmup(self, measured: int) -> None:
        """After the warm-up was measured: where it left more outside the
        tiers than the plan's ``warmup`` line, the ledger is charged the
        difference too, and the floor raised by it (torch keeps those bytes
        for good, so a tenant joining later must find them reserved). A
        refused charge leaves it as planned (the device holds it either
        way, and the floor's slack absorbs small misses); a refused raise
        leaves the charge above the floor (`outside_past_floor`)."""
        extra = int(measured) - self.planned_warmup
        if extra <= 0:
            return
        try:
            self.tenant.grow(extra)
        except imp_mem.OutOfMemory:
            return
        self.outside += extra
        self.planned_warmup += extra
        if not self._raise_floor(extra):
            self.outside_past_floor += extra

    @staticmethod
    def initial_blocks(plan: Any, engine_kv_blocks: int) -> int:
        """The KV blocks the pool opens with (and never shrinks below): one
        sequence and the engine's own blocks."""
        kv = plan.kv
        return min(int(kv["blocks"]), int(kv["blocks_per_sequence"]) + engine_kv_blocks)

    # ---------------------------------------------------------- admission

    def blocks_for(self, tokens: int) -> int:
        # The manager holds at most total - 1 tokens (the last is never fed).
        return math.ceil(max(tokens - 1, 0) / self.block_size)

    def promised(self, sched: Any, kv: Any) -> int:
        """Blocks the running requests still need to reach their full length."""
        total = 0
        for r in sched.running.values():
            full = self.blocks_for(len(r.prompt) + r.max_new_tokens)
            held = math.ceil(kv.num_tokens(r.seq_id) / self.block_size)
            total += max(full - held, 0)
        return total

    def gate(self, sched: Any, kv: Any, req: Any) -> bool:
        """Whether `req` may be admitted now: the room for it and for every
        running request is committed free (grown through the ledger)."""
        need = self.blocks_for(len(req.prompt) + req.max_new_tokens)
        return bool(kv.reserve_free(self.promised(sched, kv) + need))

    def check_submit(self, tokens: int, kv: Any) -> None:
        """`CapacityError` for a request no share of the device could hold:
        more KV blocks than this tenant could commit even if every other
        tenant shrank to its floor. (A request within `max_seq_len` always
        fits: the floor holds one full sequence. This guards a floor
        planned smaller.)"""
        need = self.blocks_for(tokens)
        if need <= self.floor_request_blocks:
            return  # the floor holds it: no ledger read
        self.ledger_reads += 1
        rows = self.ledger.tenants()
        me = self.tenant.slot
        others = sum(t["floor"] for t in rows if t["slot"] != me and t["state"] == "live")
        mine = next((t["committed"] for t in rows if t["slot"] == me), 0)
        st = kv.stats()
        kv_committed = int(st.get("capacity", 0)) * self.block_bytes
        room = min(self.ledger.budget - others, self.cap) - (mine - kv_committed)
        ceiling = min(int(st["max_blocks"]), max(room, 0) // self.block_bytes)
        if need > ceiling:
            raise CapacityError(
                f"the request needs {need} KV blocks; this tenant could hold at most {ceiling} "
                f"even if every other tenant of the device shrank to its floor (cap "
                f"{self.cap} B, others' floors {others} B); shorten it or raise the cap"
            )

    # ----------------------------------------------------------- each step

    def record_kv_live(self, live_blocks: int, force: bool = False) -> None:
        """Writes the KV-live figure when it moved by a chunk (or `force`)."""
        if force or abs(live_blocks - self._kv_live_written) >= self.chunk:
            self.ledger_writes += 1
            self.tenant.set_kv_live(live_blocks * self.block_bytes)
            self._kv_live_written = live_blocks

    def tick(self, sched: Any, kv: Any, on_gpu: bool, device: Any) -> int:
        """Once a step: every 16 steps, the KV bytes live (written when they
        moved by a chunk); the ledger's pressure, read at most every
        `pressure_interval_s`, answered. Returns the bytes given back."""
        self.steps += 1
        now = time.perf_counter()
        self.last_active = now
        if self.steps % 16 == 0:
            self.record_kv_live(int(kv.stats()["live"]))
        if now - self._pressure_at < self.cfg.pressure_interval_s:
            return 0
        self._pressure_at = now
        self.ledger_reads += 1
        asked = self.tenant.pressure()
        if not asked:
            return 0
        if on_gpu:
            import torch

            torch.cuda.synchronize(device)  # nothing in flight reads what goes
        return int(kv.give_back(asked, keep_blocks=self.promised(sched, kv)))

    def idle(self, engine: Any) -> int:
        """Called when there is no work: the fast shrink, pressure, and the
        idle sleep. Returns the bytes given back."""
        if engine.asleep:
            return 0
        kv = engine.kv
        now = time.perf_counter()
        idle_for = now - self.last_active
        given = 0
        if engine.on_gpu:
            import torch

            torch.cuda.synchronize(engine.device)
        self.ledger_reads += 1
        asked = self.tenant.pressure()
        if asked:
            given += int(kv.give_back(asked))
        cache_s = self.cfg.idle_cache_s
        if cache_s is not None and idle_for >= cache_s:
            # The free tail, then the prefix cache above the highest chunk a
            # sequence holds, a whole chunk at a time: what stays is the
            # chunks of the live blocks (never below the floor's blocks).
            given += int(kv.give_back(1 << 62))
        elif idle_for >= self.cfg.idle_trim_s:
            # The free tail above the live (and cached) blocks, a chunk kept.
            given += int(kv.give_back(0, keep_blocks=self.chunk))
        live = int(kv.stats()["live"])
        # Idle, the figure is written whenever it changed (no step to spare).
        self.record_kv_live(live, force=live != self._kv_live_written)
        sleep_s = self.cfg.idle_sleep_s
        if sleep_s is not None and idle_for >= sleep_s:
            # The prefix cache goes at the sleep anyway; without it the pool
            # shrinks to its floor, so the wake recommits only floor bytes,
            # which the ledger always grants.
            kv.reset_prefix_cache()
            given += int(kv.give_back(1 << 62))
            # What the sleep itself gave back (the weights, the pool's
            # floor): the ledger's own figure, before and after.
            before = int(self.tenant.record()["committed"])
            engine.sleep(1)
            given += max(0, before - int(self.tenant.record()["committed"]))
            self.auto_slept = True
        return given

    def wake_for_work(self, engine: Any) -> None:
        """Wakes an engine the idle clock put to sleep (before a request)."""
        if self.auto_slept and engine.asleep:
            engine.wake()
        self.auto_slept = False
        self.last_active = time.perf_counter()
