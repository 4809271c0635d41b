"""Tier hot paths from Python, each beside a peer measured in the same run.

* block allocate + release, single and batched 16 at a time, against a plain
  Python free list with the same semantics (refcounts, all-or-nothing
  batches, release returns a block at its last ref);
* arena take and scratch take, against a Python no-op call (the floor any
  binding pays).

Run against a release build of the wheel:

    maturin build --release --out dist && pip install dist/*.whl
    python benches/bench_tiers.py
"""

from __future__ import annotations

import statistics
import sys
import time

import imp_mem

BLOCKS = 10_000
SAME = "py, same rules"
BARE = "py, bare ids"
REPEAT = 7


class PlainFreeList:
    """The bare floor: ids and refcounts in two lists, no handles. A second
    release of the same id corrupts it silently, so it is not the same
    semantics; it is printed for reference."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))
        self.refs = [0] * n

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError("pool exhausted")
        i = self.free.pop()
        self.refs[i] = 1
        return i

    def allocate_many(self, n: int) -> list[int]:
        if len(self.free) < n:
            raise MemoryError("pool exhausted")
        ids = self.free[-n:]
        del self.free[-n:]
        refs = self.refs
        for i in ids:
            refs[i] = 1
        return ids

    def release(self, i: int) -> None:
        r = self.refs[i] - 1
        self.refs[i] = r
        if r == 0:
            self.free.append(i)

    def release_many(self, ids: list[int]) -> None:
        refs, free = self.refs, self.free
        for i in ids:
            r = refs[i] - 1
            refs[i] = r
            if r == 0:
                free.append(i)


class PyRef:
    """One reference, as a Python engine would write it: released once."""

    __slots__ = ("id", "pool", "released")

    def __init__(self, pool: PyPool, i: int) -> None:
        self.pool, self.id, self.released = pool, i, False

    def release(self) -> None:
        if self.released:
            raise ValueError("already released")
        self.released = True
        self.pool._drop(self.id)


class PyRefs:
    """A batch of references, released together, once."""

    __slots__ = ("ids", "pool", "released")

    def __init__(self, pool: PyPool, ids: list[int]) -> None:
        self.pool, self.ids, self.released = pool, ids, False

    def release(self) -> None:
        if self.released:
            raise ValueError("already released")
        self.released = True
        refs, free = self.pool.refs, self.pool.free
        for i in self.ids:
            r = refs[i] - 1
            refs[i] = r
            if r == 0:
                free.append(i)


class PyPool(PlainFreeList):
    """The peer with imp-mem's semantics: refcounted blocks held through
    handles that release exactly once (a second release raises), batches
    all-or-nothing."""

    def allocate(self) -> PyRef:  # type: ignore[override]
        return PyRef(self, PlainFreeList.allocate(self))

    def allocate_many(self, n: int) -> PyRefs:  # type: ignore[override]
        return PyRefs(self, PlainFreeList.allocate_many(self, n))

    def _drop(self, i: int) -> None:
        PlainFreeList.release(self, i)


def per_op_ns(fn, ops_per_call: int, calls: int) -> float:
    """Median over REPEAT runs of ns per operation."""
    samples = []
    for _ in range(REPEAT):
        t0 = time.perf_counter_ns()
        fn(calls)
        samples.append((time.perf_counter_ns() - t0) / (calls * ops_per_call))
    return statistics.median(samples)


def main() -> int:
    fake = imp_mem.FakeBackend(capacity=1 << 30)
    n = 200_000

    plain = PlainFreeList(BLOCKS)
    peer_pool = PyPool(BLOCKS)
    slots = imp_mem.BlockPool.slots(BLOCKS)
    # Unbacked, so a release does not pay the fake's debugging poison (a
    # 4 KiB memset per block); a device backend has no such cost either.
    unbacked = imp_mem.FakeBackend(capacity=1 << 40, backed=False)
    region_pool = imp_mem.BlockPool(unbacked, 4096, BLOCKS)

    def bare_single(k):
        alloc, rel = plain.allocate, plain.release
        for _ in range(k):
            rel(alloc())

    def bare_batch(k):
        alloc, rel = plain.allocate_many, plain.release_many
        for _ in range(k):
            rel(alloc(16))

    def single(pool):
        def run(k):
            alloc = pool.allocate
            for _ in range(k):
                alloc().release()

        return run

    def batch(pool):
        def run(k):
            alloc = pool.allocate_many
            for _ in range(k):
                alloc(16).release()

        return run

    arena = imp_mem.Arena(fake, 256 << 20, tier=imp_mem.Tier.ENGINE_PERSISTENT)
    stack = imp_mem.ScratchStack(fake, 256 << 20)

    def noop(*_args):
        return None

    def peer_call(k):
        f = noop
        for _ in range(k):
            f(64)

    def arena_take(k):
        take = arena.take
        for _ in range(k):
            take(64)
        arena.reset()

    def scratch_take(k):
        with stack.mark() as m:
            take = m.take
            for _ in range(k):
                take(64)

    def scratch_mark_take_rewind(k):
        mark = stack.mark
        for _ in range(k):
            with mark() as m:
                m.take(64)

    rows = []

    def row(name, ours, peer, peer_name, goal):
        rows.append((name, ours, peer, peer_name, peer / ours, goal))

    peer = per_op_ns(single(peer_pool), 1, n)
    bare = per_op_ns(bare_single, 1, n)
    row("block alloc+release, single (slots)", per_op_ns(single(slots), 1, n), peer, SAME, "")
    row(
        "block alloc+release, single (region)", per_op_ns(single(region_pool), 1, n), peer, SAME, ""
    )
    row("block alloc+release, single (slots)", per_op_ns(single(slots), 1, n), bare, BARE, "")
    peer = per_op_ns(batch(peer_pool), 16, n // 16)
    bare = per_op_ns(bare_batch, 16, n // 16)
    ours = per_op_ns(batch(slots), 16, n // 16)
    row("block alloc+release, x16 (slots)", ours, peer, SAME, ">= 10x")
    row(
        "block alloc+release, x16 (region)",
        per_op_ns(batch(region_pool), 16, n // 16),
        peer,
        SAME,
        ">= 10x",
    )
    row("block alloc+release, x16 (slots)", ours, bare, BARE, "")

    def batch_floor(k):
        alloc = slots.allocate_many
        for _ in range(k):
            alloc(0).release()

    floor = per_op_ns(batch_floor, 16, n // 16)
    print(
        f"binding floor of one batch (allocate_many(0).release(), 2 calls + 1 object): "
        f"{floor * 16:.0f} ns, i.e. {floor:.1f} ns per block of a 16-batch before any work"
    )
    call = per_op_ns(peer_call, 1, n)
    row("arena take 64 B", per_op_ns(arena_take, 1, 100_000), call, "no-op call", "<= 300 ns")
    row("scratch take 64 B", per_op_ns(scratch_take, 1, 100_000), call, "no-op call", "<= 300 ns")
    row(
        "scratch mark+take+rewind",
        per_op_ns(scratch_mark_take_rewind, 1, n // 4),
        call,
        "no-op call",
        "",
    )

    print(
        f"imp-mem {imp_mem.__version__}, Python {sys.version.split()[0]}; ns per block / per take"
    )
    print(f"{'operation':40} {'imp-mem':>9} {'peer':>9}  {'peer':16} {'peer/ours':>9}  goal")
    for name, ours, peer, peer_name, ratio, goal in rows:
        print(f"{name:40} {ours:9.1f} {peer:9.1f}  {peer_name:16} {ratio:8.2f}x  {goal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
