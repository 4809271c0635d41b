"""A random misuse driver over imp_mem's public API (issue 14).

Builds a handful of live objects (backends, pools, refs, arenas, scratch
marks, spans, KV managers, a memory system), then calls random public
methods of random objects with random arguments drawn from a pool that
mixes good values with bad ones: out-of-range integers, negative counts,
wrong types, odd strings, bad paths. It prints one JSON line with the
counts of outcomes. A run that aborts or hangs is seen by the caller (the
process dies or times out); an exception is *untyped* when it is not an
``ImpMemError``, a ``TypeError`` (a wrong type or arity) or a
``BufferError`` (a DLPack export a span refuses), and the driver records
the first of each kind with the call that raised it.

The address space is capped (``RLIMIT_AS``) so that a huge count meets a
refusal at once instead of swapping: the library must turn that into
``OutOfMemory``, never an abort.

    python misuse_driver.py SEED OPS
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import sys
import tempfile
import traceback

try:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
except (ImportError, ValueError, OSError):
    pass

import numpy as np
from _helpers import TINY

import imp_mem as P

INTS = [
    -(2**70),
    -(2**63),
    -1,
    0,
    1,
    2,
    3,
    7,
    16,
    64,
    255,
    4096,
    2**31,
    2**32 - 2,
    2**32 - 1,
    2**32,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
]
OTHER = [
    None,
    True,
    1.5,
    float("nan"),
    "7",
    "",
    "\ud800",
    "64MiB",
    "lots",
    b"x",
    [],
    [1, 2, 3],
    (1, 2),
    {"a": 1},
    object(),
    np.int64(3),
    np.int32(-2),
    np.arange(5, dtype=np.int32),
    np.arange(6, dtype=np.float32),
]
NAMES = ["kv_cache", "weights", "other", "nope", "scratch"]
DTYPES = ["uint8", "float32", "int64", "bfloat16", "complex", "nope"]

ALLOWED = (P.ImpMemError, TypeError, BufferError)


class World:
    """The live objects, rebuilt when too many were released."""

    def __init__(self, rng: random.Random, tmp: str):
        self.rng = rng
        self.tmp = tmp
        self.objects: list = []
        self.build()

    def build(self):
        objs = []
        fake = P.FakeBackend(capacity="256MiB")
        unbacked = P.FakeBackend(capacity="64GiB", backed=False)
        objs += [fake, unbacked]
        pool = P.BlockPool(fake, 4096, 16, max_blocks=64)
        objs += [pool, P.BlockPool.slots(32)]
        objs += [pool.allocate(), pool.allocate_many(3)]
        arena = P.Arena(fake, 1 << 20)
        span = arena.take(256)
        objs += [arena, span, span.view("float32")]
        stack = P.ScratchStack(fake, 1 << 20)
        mark = stack.mark()
        objs += [stack, mark, mark.take(128)]
        objs += [fake.acquire(4096), fake.acquire_growable("4MiB", 4096)]
        kv = P.KVCacheManager(64, 4, backend=fake, block_bytes=64)
        kv.admit(1, list(range(20)))
        kv.admit(2, list(range(9)))
        objs += [kv, P.KVCacheManager(8, 16)]
        # Main's KV tiers and events, and the activation pool (T4a).
        tiered = P.KVCacheManager(
            64, 4, backend=fake, block_bytes=64, kv_events=True, host_blocks=8
        )
        tiered.admit(3, list(range(20)))
        tiered.free(3)
        objs += [tiered, P.ActivationPool(fake, "1MiB")]
        objs += [P.PinnedBuffer(4096)]
        shape = P.ModelShape.from_hf_config(dict(TINY, max_position_embeddings=2048))
        plan = P.plan_memory(
            P.PlanInput(
                shape,
                P.Limits(2, 256, kv_policy="fit"),
                P.Features(),
                budget="128MiB",
                context=1 << 20,
                library_reserve=1 << 20,
            )
        )
        system = P.MemorySystem(P.FakeBackend(capacity="256MiB"), plan)
        objs += [shape, plan, system, P.Limits(2, 256), P.Features()]
        self.objects = objs

    def value(self):
        r = self.rng.random()
        if r < 0.45:
            return self.rng.choice(INTS)
        if r < 0.6:
            return self.rng.choice(NAMES)
        if r < 0.65:
            return self.rng.choice(DTYPES)
        if r < 0.75:
            return self.path()
        if r < 0.8 and self.objects:
            return self.rng.choice(self.objects)
        return self.rng.choice(OTHER)

    def path(self):
        name = self.rng.choice(["c.bin", "sub/c.bin", "", ".", "dir", "\0x"])
        full = os.path.join(self.tmp, name)
        return self.rng.choice([full, full.encode(), os.fspath(full)])


def public_methods(obj) -> list[str]:
    names = []
    for name in dir(obj):
        if name.startswith("_") and name not in ("__dlpack__", "__enter__", "__exit__"):
            continue
        if name in ("close",):  # a closed system is a valid state; it ends the run early
            continue
        names.append(name)
    return names


def run(seed: int, ops: int) -> dict:
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="imp-mem-misuse-")
    os.makedirs(os.path.join(tmp, "dir"), exist_ok=True)
    # A random str may be taken as a relative path: it lands here.
    os.chdir(tmp)
    world = World(rng, tmp)
    counts = {"ok": 0, "typed": 0, "untyped": 0}
    untyped: dict[str, str] = {}
    for i in range(ops):
        if i % 400 == 399:
            world.build()
            gc.collect()
        obj = rng.choice(world.objects)
        names = public_methods(obj)
        if not names:
            continue
        name = rng.choice(names)
        args = [world.value() for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
        kwargs = {}
        if rng.random() < 0.2:
            kwargs[rng.choice(["n", "tag", "align", "seq_id", "lora_id", "mm", "cache_salt"])] = (
                world.value()
            )
        call = f"{type(obj).__name__}.{name}(*{args!r:.200}, **{kwargs!r:.100})"
        try:
            attr = getattr(obj, name)
            if callable(attr):
                attr(*args, **kwargs)
            counts["ok"] += 1
        except ALLOWED as exc:
            # A TypeError about a number's size is pyo3's conversion of a
            # bad *value*: it must have been an InvalidArgument.
            text = str(exc).lower()
            sized = ("out of range", "too big", "too large", "negative", "overflow")
            if isinstance(exc, TypeError) and any(w in text for w in sized):
                counts["untyped"] += 1
                untyped.setdefault("TypeError(value)", f"{call}: {exc!r:.300}")
            else:
                counts["typed"] += 1
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            counts["untyped"] += 1
            kind = type(exc).__name__
            if kind not in untyped:
                untyped[kind] = f"{call}: {exc!r:.300}\n{traceback.format_exc(limit=3)[-600:]}"
    world.objects.clear()
    gc.collect()
    os.chdir("/")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"seed": seed, "ops": ops, **counts, "untyped_examples": untyped}


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    ops = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    print(json.dumps(run(seed, ops)), flush=True)
