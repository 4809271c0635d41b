"""Token ids given as Python ints and NumPy arrays must read alike.

Lists and tuples of ints are read directly (``crates/imp-mem-py/src/
sequence.rs``): the objects' structs on CPython 3.9-3.14 once self-checked
("direct"), the limited API's item and int calls otherwise ("api"); the
first bad item sends the sequence to a careful loop that names it. The
rule itself (which ids, which messages) is proven in Rust
(``kv/tokens.rs``); these tests check what the binding adds: that a list,
a tuple and a NumPy array of the same ids give the same hashes, block
tables and errors on both list paths, what counts as an int (subclasses,
``__index__``, not ``bool`` or ``float``), huge ids and lists, and that
Python code run by ``__index__`` cannot break the read.

Before Python 3.11 the binding reads an exact ``numpy.ndarray`` through
``tobytes()`` and its cached dtype layout instead of a memoryview; the
NumPy tests at the end check it reads exactly what the buffer path reads
and refuses what it refuses, with the same message, on every path
(``token_path``); tests/test_kv_tokens_buffer.py covers the other
buffers."""

from __future__ import annotations

import enum
import gc
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import imp_mem
from imp_mem import KVCacheManager, _core

U32_MAX = 2**32 - 1
LIST_PATHS = ["direct", "api"]


def kv() -> KVCacheManager:
    return KVCacheManager(32, 4)


@pytest.fixture(params=LIST_PATHS)
def list_path(request):
    """Runs a test with lists read by the direct loop and by the API loop."""
    previous = _core._set_list_direct(request.param == "direct")
    try:
        yield request.param
    finally:
        _core._set_list_direct(previous)


def outcome(call, *args):
    """What ``call(*args)`` gave: ("ok", result) or (exception type, message)."""
    try:
        return ("ok", call(*args))
    except Exception as e:
        return (type(e), str(e))


def everything(tokens):
    """Every reader-visible result of `tokens` on fresh managers: the
    hashes, admission, block table and sequence hashes, or the error."""
    m = KVCacheManager(512, 4)
    hashed = outcome(lambda: m.hash_blocks(tokens))
    admitted = outcome(lambda: m.admit(1, tokens))
    table = outcome(lambda: (m.block_table(1), m.sequence_hashes(1), m.num_tokens(1)))
    appended = outcome(lambda: (m.admit(2, []), m.append(2, tokens), m.sequence_hashes(2)))
    return hashed, admitted, table, appended, outcome(lambda: m.probe(tokens))


class _Sub(int):
    pass


class _Index:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


INT_LIKE = [int, int, _Sub, _Index, np.int64]


def edgy_ids():
    return st.one_of(
        st.integers(0, 70_000),
        st.integers(U32_MAX - 2, U32_MAX + 2),
        st.integers(2**31 - 2, 2**31 + 2),
        st.integers(2**30 - 2, 2**30 + 2),
        st.integers(-70_000, -1),
        st.integers(-(2**63), 2**63 - 1),
    )


@pytest.mark.usefixtures("list_path")
class TestLists:
    @given(ids=st.lists(edgy_ids(), max_size=80))
    def test_a_list_reads_as_the_numpy_array_of_its_ids(self, ids):
        expected = everything(np.array(ids, dtype=np.int64))
        assert everything(ids) == expected
        assert everything(tuple(ids)) == expected
        if all(-(2**31) <= v < 2**31 for v in ids):
            assert everything(np.array(ids, dtype=np.int32)) == expected

    @given(ids=st.lists(st.integers(0, U32_MAX), max_size=80))
    def test_ids_in_range_are_accepted_as_uint32(self, ids):
        assert everything(ids) == everything(np.array(ids, dtype=np.uint32))

    @given(ids=st.lists(edgy_ids(), max_size=60), data=st.data())
    def test_int_like_items_read_as_their_values(self, ids, data):
        """Any mix of ints, int subclasses, ``__index__`` objects and NumPy
        scalars reads as the NumPy array of the same ids (the careful loop
        takes over at the first item that is not an exact int)."""
        kinds = data.draw(st.lists(st.sampled_from(INT_LIKE), min_size=len(ids), max_size=len(ids)))
        tokens = [kind(v) for kind, v in zip(kinds, ids, strict=True)]
        assert everything(tokens) == everything(np.array(ids, dtype=np.int64))

    @given(
        ids=st.lists(st.integers(0, U32_MAX), min_size=1, max_size=60),
        data=st.data(),
        bad=st.sampled_from([True, False, 1.0, np.float32(2), "3", None, np.True_]),
    )
    def test_a_non_integer_anywhere_is_named_by_position(self, ids, data, bad):
        at = data.draw(st.integers(0, len(ids) - 1), label="at")
        tokens = [*ids[:at], bad, *ids[at + 1 :]]
        kind = "bool" if isinstance(bad, (bool, np.bool_)) else type(bad).__name__
        refusal = (imp_mem.InvalidArgument, f"tokens must be integers; item {at} is a {kind}")
        assert outcome(kv().admit, 1, tokens) == refusal
        assert outcome(kv().hash_blocks, tuple(tokens)) == refusal

    def test_the_first_bad_id_is_named_with_numpys_message(self):
        for ids in ([1, 2, -3, -4], [5, 2**32, 7], [1, 2**63 - 1], [0, -(2**63)], [2**31 - 1, -1]):
            bad = next(v for v in ids if not 0 <= v <= U32_MAX)
            refusal = (imp_mem.InvalidArgument, f"token id {bad} is outside 0..=4294967295")
            assert outcome(kv().admit, 1, ids) == refusal
            assert outcome(kv().admit, 1, np.array(ids, np.int64)) == refusal

    @pytest.mark.parametrize(
        ("bad", "message"),
        [
            ([1, True], "tokens must be integers; item 1 is a bool"),
            ([False], "tokens must be integers; item 0 is a bool"),
            ([1, 2, 3.0], "tokens must be integers; item 2 is a float"),
            ([np.float64(1.0)], "tokens must be integers; item 0 is a float64"),
            ([np.True_], "tokens must be integers; item 0 is a bool"),
            ([1, "2"], "tokens must be integers; item 1 is a str"),
            ([None], "tokens must be integers; item 0 is a NoneType"),
            ([[1]], "tokens must be integers; item 0 is a list"),
            ((7, 1.5), "tokens must be integers; item 1 is a float"),
        ],
    )
    def test_bools_floats_and_other_objects_are_refused_by_position(self, bad, message):
        for call in (
            lambda m: m.admit(1, bad),
            lambda m: m.hash_blocks(bad),
            lambda m: m.probe(bad),
            lambda m: m.pin(1, bad),
            lambda m: m.can_admit(bad),
        ):
            assert outcome(call, kv()) == (imp_mem.InvalidArgument, message)

    def test_bool_and_float_arrays_are_refused_as_their_lists_are(self):
        for values in ([True, False], [1.0, 2.0]):
            for tokens in (values, np.array(values)):
                with pytest.raises(imp_mem.InvalidArgument, match="tokens must be integers"):
                    kv().admit(1, tokens)

    def test_an_earlier_bad_id_is_named_before_a_later_non_integer(self):
        assert outcome(lambda: kv().admit(1, [1, -5, 2.5])) == (
            imp_mem.InvalidArgument,
            "token id -5 is outside 0..=4294967295",
        )
        assert outcome(lambda: kv().admit(1, [1, 2.5, -5]))[1].endswith("item 1 is a float")

    def test_int_subclasses_and_index_objects_read_as_their_values(self):
        class Color(enum.IntEnum):
            RED = 3
            BLUE = 2**31 + 9

        class MyInt(int):
            def __index__(self):  # ignored: an int subclass is its value
                return 0

        class Indexable:
            def __init__(self, v):
                self.v = v

            def __index__(self):
                return self.v

        ids = [3, 2**31 + 9, 11, 12, 13, U32_MAX, 0, 5]
        tokens = [
            Color.RED,
            Color.BLUE,
            MyInt(11),
            np.int32(12),
            np.uint64(13),
            Indexable(U32_MAX),
            np.int8(0),
            np.uint16(5),
        ]
        expected = everything(np.array(ids, np.int64))
        assert everything(tokens) == expected
        assert everything(tuple(tokens)) == expected
        refused = {
            "neg-enum": [enum.IntEnum("E", {"A": -1}).A],
            "neg-scalar": [np.int64(-1)],
            "big-index": [Indexable(2**32)],
            "big-sub": [MyInt(2**40)],
        }
        for name, bad in refused.items():
            err = outcome(kv().admit, 1, bad)
            assert err[0] is imp_mem.InvalidArgument, name
            assert err[1].startswith("token id ") and err[1].endswith(" is outside 0..=4294967295")

    def test_index_errors_other_than_type_errors_pass_through(self):
        class Broken:
            def __index__(self):
                raise KeyError("boom")

        class NotAnInt:
            def __index__(self):
                return 1.5

        with pytest.raises(KeyError, match="boom"):
            kv().admit(1, [1, Broken()])
        assert outcome(lambda: kv().admit(1, [NotAnInt()])) == (
            imp_mem.InvalidArgument,
            "tokens must be integers; item 0 is a NotAnInt",
        )

    def test_an_index_that_changes_the_list_cannot_break_the_read(self):
        tokens: list = []

        class Shrinks:
            def __index__(self):
                tokens.clear()
                gc.collect()
                return 4

        class Grows:
            def __index__(self):
                tokens.extend(range(1000))
                return 4

        for kind, expect in ((Shrinks, [1, 4]), (Grows, [1, 4, 2, 3, *range(1000)])):
            tokens[:] = [1, kind(), 2, 3]
            m = kv()
            assert m.hash_blocks(tokens) == m.hash_blocks(np.array(expect, np.int64))

    @pytest.mark.parametrize(
        ("big", "named"),
        [
            (2**64, str(2**64)),
            (-(2**64), str(-(2**64))),
            (2**200, str(2**200)),
            (10**5000, f"of {(10**5000).bit_length()} bits"),
        ],
        ids=["2^64", "-2^64", "2^200", "10^5000"],
    )
    def test_ids_beyond_int64_are_named(self, big, named):
        for tokens in ([1, 2, big], (big,)):
            assert outcome(kv().admit, 1, tokens) == (
                imp_mem.InvalidArgument,
                f"token id {named} is outside 0..=4294967295",
            )

    def test_huge_lists_read_or_name_their_bad_id(self):
        ids = np.random.default_rng(5).integers(0, 2**32, 1_000_000, dtype=np.uint32)
        tokens = ids.tolist()
        m = KVCacheManager(300_000, 4)
        assert m.hash_blocks(tokens) == m.hash_blocks(ids)
        tokens[-1] = -1
        assert outcome(lambda: m.hash_blocks(tokens)) == (
            imp_mem.InvalidArgument,
            "token id -1 is outside 0..=4294967295",
        )
        tokens[-1] = 0.5
        assert outcome(lambda: m.hash_blocks(tuple(tokens)))[1].endswith("item 999999 is a float")

    def test_subclasses_and_empty_sequences(self):
        class MyList(list):
            def __getitem__(self, i):  # not called: the items are read directly
                return 0

        class MyTuple(tuple):
            pass

        expected = everything(np.arange(10, dtype=np.int32))
        assert everything(MyList(range(10))) == expected
        assert everything(MyTuple(range(10))) == expected
        empty = everything(np.empty(0, np.int32))
        assert everything([]) == empty
        assert everything(()) == empty

    def test_a_refused_append_changes_nothing(self):
        m = kv()
        m.admit(1, [1, 2, 3])
        before = (m.num_tokens(1), m.block_table(1), m.stats())
        for bad in ([4, 5, -1], [4, True], [4.0]):
            with pytest.raises(imp_mem.InvalidArgument):
                m.append(1, bad)
            assert (m.num_tokens(1), m.block_table(1), m.stats()) == before
        m.append(1, [4])
        m.append(1, (5, 6))
        other = kv()
        other.admit(1, np.arange(1, 7, dtype=np.int32))
        assert m.sequence_hashes(1) == other.sequence_hashes(1)
        assert m.num_tokens(1) == 6

    def test_nothing_is_leaked_or_kept(self):
        big = 10**20
        sub = enum.IntEnum("E", {"A": 70_000}).A
        for tokens in ([1, 2, 3, 70_001], [1, sub, 2], [1, big], (4, 2.5), [3, -1]):
            before = (sys.getrefcount(tokens), sys.getrefcount(big), sys.getrefcount(sub))
            m = kv()
            for _ in range(50):
                outcome(m.hash_blocks, tokens)
                outcome(m.admit, 1, tokens)
                outcome(m.append, 1, tokens)
                outcome(m.abort, 1)
            assert (sys.getrefcount(tokens), sys.getrefcount(big), sys.getrefcount(sub)) == before


def test_the_direct_list_reader_is_on_where_the_layout_is_known():
    previous = _core._set_list_direct(True)
    try:
        known = sys.implementation.name == "cpython" and (3, 9) <= sys.version_info[:2] <= (3, 14)
        assert _core._list_direct_active() == known
        _core._set_list_direct(False)
        assert not _core._list_direct_active()
    finally:
        _core._set_list_direct(previous)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_the_list_hook_refuses_a_non_bool(bad):
    with pytest.raises(imp_mem.InvalidArgument, match="enabled must be True or False"):
        _core._set_list_direct(bad)


class _Array(np.ndarray):
    """An ndarray subclass: read through the buffer path, not the fast one."""


@pytest.mark.usefixtures("token_path")
@pytest.mark.parametrize(
    "dtype", ["<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", ">i2", ">i4", ">u8", "=i4"]
)
def test_numpy_arrays_read_the_same_as_their_buffers(dtype):
    m = kv()
    values = np.array([0, 1, 7, 100, 127, 3, 9, 11, 5], dtype=dtype)
    expected = m.hash_blocks([int(v) for v in values])
    assert m.hash_blocks(values) == expected
    assert m.hash_blocks(memoryview(values)) == expected
    assert m.hash_blocks(values.view(_Array)) == expected
    assert m.hash_blocks(values[::2]) == m.hash_blocks([int(v) for v in values[::2]])
    assert m.hash_blocks(np.array(5, dtype=dtype)) == m.hash_blocks([5])
    m.admit(1, values)
    assert m.num_tokens(1) == len(values)


@pytest.mark.usefixtures("token_path")
@pytest.mark.parametrize(
    "bad",
    [
        np.arange(4, dtype=np.float64),
        np.array([True, False]),
        np.zeros((2, 2), np.int64),
        np.array([-3], np.int8),
        np.array([-1], ">i4"),
        np.array([2**40], np.uint64),
        np.array([2**31], np.int64) * -1,
    ],
    ids=["float64", "bool", "2d", "neg8", "neg-big-endian", "u64", "neg64"],
)
def test_numpy_refusals_match_the_buffer_path(bad):
    with pytest.raises(imp_mem.InvalidArgument) as fast:
        kv().admit(1, bad)
    with pytest.raises(imp_mem.InvalidArgument) as slow:
        kv().admit(1, memoryview(bad))
    assert str(fast.value) == str(slow.value)


@pytest.mark.usefixtures("token_path")
def test_int32_ids_past_int32_max_are_refused_and_the_first_is_named():
    ids = np.array([5, 2**31 - 1, -7, -9], np.int32)
    with pytest.raises(imp_mem.InvalidArgument, match="-7"):
        kv().admit(1, ids)
    assert kv().hash_blocks(ids[:2]) == kv().hash_blocks([5, 2**31 - 1])
