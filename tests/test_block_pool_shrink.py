"""What the binding adds to a growable BlockPool's shrink, on the
FakeBackend: the policy and stats it shows, the fences it takes from Python
(a torch-style ``query()`` / ``synchronize()`` event or the Fence shape
``is_complete()`` / ``wait()``; anything else refused), a fence whose query
raises, a DLPack export pinning its block, and the poison of a decommitted
tail. The rules themselves (the idle window, the floor, no thrash, a
cancelled shrink, no live block decommitted) are proved in Rust
(``crates/imp-mem-core/src/block_pool/tests.rs``, ``tests/shrink_props.rs``)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import imp_mem
from imp_mem import BlockPool, InvalidArgument

BLOCK = 1024


@pytest.fixture
def fb() -> imp_mem.FakeBackend:
    # 4 KiB granules: 4 blocks a granule; chunks are the growth step (8).
    return imp_mem.FakeBackend(capacity=64 << 20, granularity=4096)


def pool_of(fb, idle=3, keep=0, blocks=8, max_blocks=64, grow=8) -> BlockPool:
    return BlockPool(
        fb,
        BLOCK,
        blocks,
        max_blocks=max_blocks,
        grow_blocks=grow,
        min_idle_steps=idle,
        keep_chunks=keep,
    )


class Event:
    """A stand-in for torch.cuda.Event: query() / synchronize()."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.queries, self.syncs = done, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


class Waitable:
    """The imp_mem.Fence shape: is_complete() / wait()."""

    def __init__(self) -> None:
        self.done = False

    def is_complete(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True


def mark(fb, ref) -> bytes:
    data = bytes([(ref.id * 7 + 1) % 251 + 1]) * BLOCK
    fb.write(ref.span().address, data)
    return data


def test_policy_and_new_stats_keys(fb):
    pool = pool_of(fb, idle=7, keep=2)
    assert pool.decommit_policy == {"min_idle_steps": 7, "keep_chunks": 2}
    pool.set_decommit_policy(keep_chunks=0)
    assert pool.decommit_policy == {"min_idle_steps": 7, "keep_chunks": 0}
    s = pool.stats()
    for key in (
        "shrinks",
        "decommitted_bytes",
        "cancelled_shrinks",
        "pending_blocks",
        "committed_bytes",
        "min_blocks",
        "chunk_blocks",
        "idle_steps",
    ):
        assert key in s
    assert (s["min_blocks"], s["chunk_blocks"], s["committed_bytes"]) == (8, 8, 8 * BLOCK)
    assert BlockPool(fb, BLOCK, 4).decommit_policy == {"min_idle_steps": 256, "keep_chunks": 1}


def test_the_decommit_waits_for_a_torch_style_event(fb):
    pool = pool_of(fb, idle=1)
    pool.allocate_many(40).release()
    pool.step()
    event = Event()
    assert pool.step(event) == 0
    s = pool.stats()
    assert (s["capacity"], s["pending_blocks"], s["committed_bytes"]) == (8, 32, 40 * BLOCK)
    # The withdrawn blocks are not handed out while the decommit waits.
    low = pool.allocate_many(8)
    assert max(low.ids) < 8
    low.release()
    for _ in range(3):
        assert pool.step() == 0
    assert event.queries >= 3, "queried on each step, never waited on"
    assert event.syncs == 0
    event.done = True
    assert pool.step() == 32 * BLOCK
    assert pool.stats()["pending_blocks"] == 0
    pool.check_invariants()


def test_flush_waits_on_the_event_and_is_complete_shape_works(fb):
    pool = pool_of(fb)
    pool.allocate_many(40).release()
    event = Event()
    assert pool.shrink(event) == 0
    assert pool.flush_decommit() == 32 * BLOCK
    assert event.syncs == 1
    assert pool.flush_decommit() == 0

    pool.allocate_many(40).release()
    waitable = Waitable()
    assert pool.shrink(waitable) == 0
    waitable.done = True
    assert pool.step() == 32 * BLOCK


def test_an_already_complete_event_decommits_in_the_same_call(fb):
    pool = pool_of(fb)
    pool.allocate_many(24).release()
    assert pool.shrink(Event(done=True)) == 16 * BLOCK


def test_a_bad_fence_is_refused(fb):
    pool = pool_of(fb)
    with pytest.raises(InvalidArgument, match="fence must be"):
        pool.step(object())
    with pytest.raises(InvalidArgument):
        pool.shrink(42)


def test_a_failing_event_query_raises_and_keeps_the_decommit_pending(fb):
    class Broken(Event):
        def query(self) -> bool:
            if self.queries:
                raise RuntimeError("driver gone")
            self.queries += 1
            return False

    pool = pool_of(fb)
    pool.allocate_many(40).release()
    pool.shrink(Broken())
    with pytest.raises(RuntimeError, match="driver gone"):
        pool.step()
    assert pool.stats()["pending_blocks"] == 32
    pool.check_invariants()


def test_live_blocks_pin_the_tail_and_keep_their_bytes(fb):
    pool = pool_of(fb)
    refs = pool.allocate_many(40).split()
    keep = [r for r in refs if r.id in (3, 21)]
    for r in refs:
        if r not in keep:
            r.release()
    data = {r.id: mark(fb, r) for r in keep}
    tail = keep[1].span().address + 8 * BLOCK  # block 29: free, above the live one
    assert pool.shrink() == 16 * BLOCK, "chunks 3 and 4 go; chunk 2 holds block 21"
    assert pool.capacity == 24
    assert fb.is_poisoned(tail, BLOCK)
    for r in keep:
        assert fb.read(r.span().address, BLOCK) == data[r.id]


def test_a_dlpack_export_keeps_its_block_and_the_tail_above_it(fb):
    pool = pool_of(fb)
    refs = pool.allocate_many(40).split()
    top = refs[-1]
    assert top.id == 39
    data = mark(fb, top)
    array = np.from_dlpack(top.span())
    for r in refs:
        r.release()
    assert pool.live == 1, "the array holds a share"
    assert pool.shrink() == 0, "block 39 is live: nothing above it to return"
    assert bytes(array) == data
    del array
    gc.collect()
    assert pool.shrink() == 32 * BLOCK
    pool.check_invariants()


def test_a_failed_decommit_retries_on_the_next_step(fb):
    pool = pool_of(fb)
    pool.allocate_many(40).release()
    fb.fail_decommits(1)
    with pytest.raises(imp_mem.ImpMemError):
        pool.shrink()
    assert pool.stats()["pending_blocks"] == 32
    assert pool.step() == 32 * BLOCK
    pool.check_invariants()
