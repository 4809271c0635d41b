"""The tier allocators and their handles from Python: Arena, BlockPool /
BlockRef / BlockRefs, ScratchStack / Mark, PinnedBuffer, and the spans'
zero-copy export (DLPack, typed views), on the fake backend."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import imp_mem
from imp_mem import (
    Arena,
    BlockPool,
    CapacityError,
    InvalidArgument,
    PinnedBuffer,
    ScratchStack,
    StableSpan,
    StaleSpan,
    Tier,
)

POISON = 0xDE


# ---------------------------------------------------------------- arena


def test_arena_takes_are_aligned_and_counted(fake):
    arena = Arena(fake, 1 << 20, tier=Tier.ENGINE_PERSISTENT)
    a = arena.take(10, align=1)
    b = arena.take(100, align=512)
    assert b.address % 512 == 0
    assert b.address >= a.address + 10
    assert arena.used == b.address + 100 - a.address
    assert arena.tier == Tier.ENGINE_PERSISTENT
    assert arena.tag == "workspace"
    assert fake.stats()["tags"]["workspace"]["live"] == 1 << 20


def test_arena_reset_makes_old_spans_stale_and_frees_wholesale(fake):
    arena = Arena(fake, 1 << 16)
    span = arena.take(64)
    fake.write(span.address, b"\x07" * 64)
    arena.reset()
    assert arena.used == 0
    assert arena.generation == 1
    assert not span.valid
    with pytest.raises(StaleSpan, match="after reset"):
        _ = span.address
    with pytest.raises(StaleSpan):
        np.from_dlpack(span)
    assert arena.high_water >= 64


def test_arena_exhaustion_is_a_capacity_error_that_changes_nothing(fake):
    arena = Arena(fake, 4096)
    arena.take(4000, align=8)
    used = arena.used
    with pytest.raises(CapacityError, match="plan a larger arena"):
        arena.take(200, align=8)
    assert arena.used == used


@pytest.mark.parametrize(
    ("nbytes", "align", "needle"),
    [(0, 8, "positive"), (8, 3, "power of two"), (-1, 8, "non-negative"), ("x", 8, "byte count")],
)
def test_bad_arguments_say_what_to_change(fake, nbytes, align, needle):
    arena = Arena(fake, 4096)
    with pytest.raises(InvalidArgument, match=needle):
        arena.take(nbytes, align=align)


def test_an_arena_serves_only_t1_and_t2(fake):
    with pytest.raises(InvalidArgument, match="BlockPool"):
        Arena(fake, 4096, tier=Tier.SCRATCH)


# ---------------------------------------------------------------- pool


def test_block_refs_share_and_release_exactly_once(fake):
    pool = BlockPool(fake, 4096, 8)
    ref = pool.allocate()
    alias = ref.share()
    assert (ref.id, ref.refcount, pool.live, pool.free) == (0, 2, 1, 7)
    ref.release()
    assert pool.refcount(0) == 1
    with pytest.raises(InvalidArgument, match="already released"):
        ref.release()
    assert pool.refcount(0) == 1, "a second release must not double-free"
    with alias:
        pass
    assert alias.released
    assert pool.free == 8
    pool.check_invariants()


def test_block_ref_is_not_copyable():
    pool = BlockPool.slots(2)
    ref = pool.allocate()
    import copy

    with pytest.raises(TypeError):
        copy.copy(ref)
    ref.release()


def test_a_ref_is_refused_by_another_pool(fake):
    one, two = BlockPool.slots(4), BlockPool.slots(4)
    ref = one.allocate()
    with pytest.raises(InvalidArgument, match="pool"):
        two.release(ref)
    assert not ref.released and one.live == 1 and two.live == 0
    one.release(ref)
    assert one.free == 4


def test_allocate_many_is_all_or_nothing():
    pool = BlockPool.slots(6)
    held = pool.allocate_many(4)
    assert held.ids == [0, 1, 2, 3]
    with pytest.raises(CapacityError, match="2 free of 6"):
        pool.allocate_many(3)
    assert pool.free == 2
    refs = held.split()
    assert held.released and [r.id for r in refs] == [0, 1, 2, 3]
    for r in refs:
        r.release()
    assert pool.free == 6


def test_block_spans_sit_at_base_plus_id_times_stride(fake):
    pool = BlockPool(fake, 96, 8)
    with pool.allocate_many(3) as refs:
        spans = [refs.span(i) for i in range(3)]
        base = spans[0].address
        assert [s.address for s in spans] == [base, base + 96, base + 192]
        assert all(s.nbytes == 96 for s in spans)
    assert not spans[1].valid


def test_slots_pool_has_no_memory():
    pool = BlockPool.slots(4)
    ref = pool.allocate()
    with pytest.raises(InvalidArgument, match="slots"):
        ref.span()


# ---------------------------------------------------------------- scratch


def test_scratch_mark_rewinds_as_a_context_manager(fake):
    stack = ScratchStack(fake, 1 << 16)
    with stack.mark() as outer:
        a = outer.take(100)
        with stack.mark() as inner:
            b = inner.take(200)
            assert stack.used >= 300
        assert not b.valid and a.valid
    assert stack.used == 0 and not a.valid
    assert stack.high_water >= 300


def test_scratch_rewinds_when_the_body_raises(fake):
    stack = ScratchStack(fake, 4096)
    with pytest.raises(RuntimeError), stack.mark() as m:
        m.take(512)
        raise RuntimeError("forward pass failed")
    assert stack.used == 0


def test_out_of_order_rewind_is_a_hard_error_until_reset(fake):
    stack = ScratchStack(fake, 4096)
    outer = stack.mark()
    inner = stack.mark()
    with pytest.raises(InvalidArgument, match="LIFO"):
        outer.rewind()
    with pytest.raises(InvalidArgument, match="reset"):
        stack.mark()
    inner.rewind()
    assert stack.used == 0
    assert stack.stats()["violations"] == 1
    stack.reset()
    with stack.mark() as m:
        m.take(8)


def test_scratch_exhaustion_fails_cleanly(fake):
    stack = ScratchStack(fake, 1024)
    with stack.mark() as m:
        m.take(1000, align=8)
        with pytest.raises(CapacityError):
            m.take(100)
        assert stack.used == 1000


# ---------------------------------------------------------------- pinned


def test_pinned_buffer_frees_once_and_degrades_to_empty():
    before = imp_mem.pinned_stats()["buffers"]
    with PinnedBuffer(8192) as buf:
        view = np.from_dlpack(buf.span())
        view[:] = 3
        assert imp_mem.pinned_stats()["buffers"] == before + 1
    del view
    gc.collect()
    assert imp_mem.pinned_stats()["buffers"] == before
    with pytest.raises(InvalidArgument, match="already released"):
        buf.release()
    empty = PinnedBuffer(1 << 60, or_empty=True)
    assert empty.empty and empty.nbytes == 0
    with pytest.raises(InvalidArgument, match="empty"):
        empty.span()


# ---------------------------------------------------------------- export


def test_numpy_sees_the_written_bytes_and_the_poison_after_release(fake):
    arena = Arena(fake, 1 << 16)
    span = arena.take(64)
    fake.write(span.address, bytes(range(64)))
    array = np.from_dlpack(span)
    assert array.dtype == np.uint8 and array.shape == (64,)
    assert array.tolist() == list(range(64))
    arena.reset(unsafe_allow_live_exports=True)
    assert (array == POISON).all(), "the exported view reads the poison, not freed memory"
    del array


def test_block_export_keeps_the_block_until_the_consumer_is_done(fake):
    pool = BlockPool(fake, 256, 4)
    ref = pool.allocate()
    fake.write(ref.span().address, b"\x05" * 256)
    array = np.from_dlpack(ref.span())
    ref.release()
    assert pool.live == 1, "the export holds its own share of the block"
    assert (array == 5).all()
    del array
    gc.collect()
    assert pool.live == 0 and pool.free == 4
    assert fake.is_poisoned(pool_base(fake, pool), 256)


def pool_base(fake, pool):
    ref = pool.allocate()
    address = ref.span().address
    ref.release()
    return address


def test_export_keeps_the_arena_alive(fake):
    arena = Arena(fake, 1 << 16)
    span = arena.take(32)
    fake.write(span.address, b"\x09" * 32)
    array = np.from_dlpack(span)
    live = fake.live
    del arena, span
    gc.collect()
    assert fake.live == live, "the capsule holds the arena's region"
    assert (array == 9).all()
    del array
    gc.collect()
    assert fake.live == live - (1 << 16)


def test_typed_views_and_devices(fake):
    arena = Arena(fake, 1 << 16)
    span = arena.take(64, align=64)
    np.from_dlpack(span.view("float32"))[:] = 1.5
    view = span.view(np.float32, (4, 4))
    matrix = np.from_dlpack(view)
    assert matrix.shape == (4, 4) and matrix.dtype == np.float32
    assert (matrix == 1.5).all()
    assert view.shape == (4, 4) and view.dtype == "float32" and view.nbytes == 64
    assert span.__dlpack_device__() == (1, 0)
    assert not hasattr(span, "__cuda_array_interface__"), "CAI is for device memory"
    with pytest.raises(InvalidArgument, match="needs 128 B"):
        span.view("float64", (4, 4))
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        span.view("complex7")


def test_dlpack_capsule_names_follow_max_version(fake):
    span = Arena(fake, 4096).take(16)
    legacy = span.__dlpack__()
    versioned = span.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)
    assert "dltensor_versioned" in repr(versioned)
    del legacy, versioned  # unconsumed capsules free their tensors
    with pytest.raises(BufferError, match="zero-copy"):
        span.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="device"):
        span.__dlpack__(dl_device=(2, 0))


def test_stable_widens_to_device_never_back(fake):
    span = Arena(fake, 4096).take(64)
    device = span.as_device()
    assert device.address == span.address and device.nbytes == 64
    assert not hasattr(device, "as_stable")
    sub = span.subspan(16, 8)
    assert isinstance(sub, StableSpan) and sub.address == span.address + 16
    with pytest.raises(InvalidArgument, match="outside"):
        span.subspan(60, 8)
    with pytest.raises(TypeError):
        StableSpan()


def test_unbacked_spans_are_never_exported():
    fake = imp_mem.FakeBackend(capacity=1 << 30, backed=False)
    span = Arena(fake, 1 << 20).take(64)
    with pytest.raises(BufferError, match="unbacked"):
        np.from_dlpack(span)


def test_scratch_export_after_the_mark_closes_is_refused(fake):
    stack = ScratchStack(fake, 4096)
    with stack.mark() as m:
        span = m.take(64)
        array = np.from_dlpack(span)
        array[:] = 1
    assert (array == POISON).all()
    with pytest.raises(StaleSpan, match="mark"):
        np.from_dlpack(span)


def test_a_mark_collected_out_of_order_is_a_v6_violation(fake):
    stack = ScratchStack(fake, 4096)
    outer = stack.mark()
    inner = stack.mark()
    inner.take(64)
    del outer  # dropped while `inner` is open: the drop is the out-of-order rewind
    gc.collect()
    assert stack.stats()["violations"] == 1
    with pytest.raises(InvalidArgument, match="LIFO"):
        stack.mark()
    del inner
    gc.collect()
    assert stack.used == 0, "the early-closed mark rewinds once the inner one closes"


def test_device_spans_and_views_export_too(fake):
    span = Arena(fake, 4096).take(32)
    fake.write(span.address, b"\x02" * 32)
    assert (np.from_dlpack(span.as_device()) == 2).all()
    assert np.from_dlpack(span.as_device().view("int16")).shape == (16,)
    assert np.from_dlpack(span.view("uint8", 8)).shape == (8,)
