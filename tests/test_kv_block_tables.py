"""What the binding adds for an engine: `KVCacheManager.block_tables` (a
whole batch's tables into a caller's int32 buffer) and `BlockPool.view` /
`span` (one typed view of a whole pool, valid across growth)."""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import InvalidArgument


def manager(swa: bool = False) -> imp_mem.KVCacheManager:
    if swa:
        return imp_mem.KVCacheManager(64, 4, swa_blocks=32, swa_window=8)
    return imp_mem.KVCacheManager(64, 4)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    extra=st.integers(0, 3),
    swa=st.booleans(),
    holes=st.booleans(),
)
def test_rows_are_the_per_sequence_tables_padded(lengths, extra, swa, holes):
    m = manager(swa)
    ids = []
    for i, n in enumerate(lengths):
        if not m.can_admit(list(range(1000 * i, 1000 * i + n))):
            break
        m.admit(i, list(range(1000 * i, 1000 * i + n)))
        if holes and n > 8:
            m.evict_middle(i, 1, 2)
        ids.append(i)
    if not ids:
        return
    pool = "swa" if swa else "full"
    table = m.swa_table if swa else m.block_table
    width = max(len(table(i)) for i in ids) + extra
    out = np.full((len(ids), width), 7, np.int32)
    assert m.block_tables(ids[::-1], out, pool=pool) == width - extra
    for row, i in zip(out, ids[::-1], strict=True):
        t = table(i)
        assert row[: len(t)].tolist() == t
        assert (row[len(t) :] == -1).all()
    fresh = m.block_tables(ids[::-1], pool=pool)
    assert fresh.dtype == np.int32 and fresh.flags.writeable
    assert (fresh == out[:, : width - extra]).all()


def test_refusals_are_typed_and_write_nothing():
    m = manager()
    m.admit(1, list(range(10)))
    m.admit(2, list(range(100, 130)))
    out = np.full((2, 8), 5, np.int32)
    with pytest.raises(InvalidArgument, match="at least 8"):
        m.block_tables([1, 2], out[:, :7].copy())
    with pytest.raises(InvalidArgument, match="no sequence 9"):
        m.block_tables([1, 9], out)
    assert (out == 5).all()
    with pytest.raises(TypeError, match="int32"):
        m.block_tables([1, 2], np.zeros((2, 8), np.int64))
    with pytest.raises(InvalidArgument, match=r"shape \[2, width\]"):
        m.block_tables([1, 2], np.zeros((3, 8), np.int32))
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        m.block_tables([1, 2], np.zeros((2, 16), np.int32)[:, ::2])
    readonly = np.zeros((2, 8), np.int32)
    readonly.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        m.block_tables([1, 2], readonly)
    with pytest.raises(TypeError, match="writable int32 buffer"):
        m.block_tables([1, 2], object())
    with pytest.raises(InvalidArgument, match="pool must be"):
        m.block_tables([1, 2], out, pool="sliding")
    with pytest.raises(InvalidArgument, match="no SWA pool"):
        m.block_tables([1, 2], out, pool="swa")
    with pytest.raises(InvalidArgument, match="seq_ids"):
        m.block_tables([1, -2], out)
    with pytest.raises(InvalidArgument, match="seq_ids"):
        m.block_tables("12", out)


def test_any_writable_int32_buffer_and_the_copying_path():
    m = manager()
    m.admit(1, list(range(9)))
    # A 1-D array('i') has the wrong shape; a 2-D memoryview of it is fine.
    raw = array.array("i", [9] * 6)
    view = memoryview(raw).cast("B").cast("i", (2, 3))
    m.admit(2, list(range(50, 54)))
    assert m.block_tables(np.array([1, 2], np.int64), view) == 3
    assert raw.tolist()[:3] == m.block_table(1)
    assert raw.tolist()[3:] == [*m.block_table(2), -1, -1]
    # The path every Python version has (through a memoryview) writes the same.
    was = imp_mem._core._set_buffer_protocol(False)
    try:
        out = np.zeros((2, 4), np.int32)
        assert m.block_tables([2, 1], out) == 3
        assert out.tolist() == [[*m.block_table(2), -1, -1, -1], [*m.block_table(1), -1]]
    finally:
        imp_mem._core._set_buffer_protocol(was)


def test_pool_view_spans_the_reservation_across_growth():
    fb = imp_mem.FakeBackend(capacity="64MiB")
    pool = imp_mem.BlockPool(fb, 4096, 4, max_blocks=32)
    view = pool.view("bfloat16", (2, 2, 8, 64))
    assert view.shape == (32, 2, 2, 8, 64)
    assert view.nbytes == 32 * 4096 == pool.span().nbytes
    base = pool.span().address
    refs = pool.allocate_many(20)  # grows past the 4 committed blocks
    assert pool.capacity >= 20
    assert pool.span().address == base
    for i, block in enumerate(refs.ids):
        assert refs.span(i).address == base + block * 4096
    arr = np.from_dlpack(pool.view("uint16", (4, 8, 64)))
    arr[refs.ids[-1]] = 0x3FC0
    assert fb.read(base + refs.ids[-1] * 4096, 4) == b"\xc0\x3f\xc0\x3f"
    with pytest.raises(InvalidArgument, match="fill a block exactly"):
        pool.view("bfloat16", (2, 8, 64))
    with pytest.raises(InvalidArgument, match="below 1"):
        pool.view("bfloat16", (0, 8))
    with pytest.raises(InvalidArgument):
        imp_mem.BlockPool.slots(4).span()
    refs.release()


def test_journal_can_be_enabled_on_any_backend():
    fb = imp_mem.FakeBackend(capacity="16MiB")
    fb.enable_journal()  # the fake keeps it already: a no-op
    region = fb.acquire(4096, tag="weights")
    fb.release(region)
    ops = [row[4] for row in fb.journal()]
    assert ops[-2:] == ["acquire", "release"]


def test_append_each_appends_a_batch_up_to_the_first_that_does_not_fit():
    m = imp_mem.KVCacheManager(4, 4, enable_prefix_caching=False)
    m.admit(1, list(range(4)))
    m.admit(2, list(range(10, 13)))
    m.admit(3, list(range(20, 28)))
    assert m.append_each([2, 1, 3], np.array([7, 8, 9], np.int32)) == 1
    assert [m.num_tokens(i) for i in (1, 2, 3)] == [4, 4, 8]
    m.free(3)
    assert m.append_each(np.array([1, 2]), [8, 8]) == 2
    with pytest.raises(InvalidArgument, match="no sequence 9"):
        m.append_each([1, 9], [1, 1])
    with pytest.raises(InvalidArgument, match="one token per sequence"):
        m.append_each([1], [1, 1])
    assert [m.num_tokens(i) for i in (1, 2)] == [5, 5]
    m.check_invariants()
