"""Token ids as the binding reads them: Python lists and tuples, NumPy
arrays, ``array.array``, memoryviews and any other buffer. The rule itself
(which ids, which messages, int32 ids checked after the hash) is proven in
Rust (``crates/imp-mem-core/src/kv/tokens.rs``, ``block_pool/tokens.rs``);
these tests check what the binding's conversion adds, on every path it has.

Lists and tuples of ints are read directly (``crates/imp-mem-py/src/
sequence.rs``): the objects' structs on CPython 3.9-3.14 once self-checked
("direct"), the limited API's item and int calls otherwise ("api"); the
first bad item sends the sequence to a careful loop that names it
(``list_path``). A list, a tuple and a NumPy array of the same ids must give
the same hashes, block tables and errors on both list paths; what counts as
an int (subclasses, ``__index__``, not ``bool`` or ``float``), huge ids and
lists, and Python code run by ``__index__`` that cannot break the read.

Buffers are read on every path (``token_path``): int32/uint32 NumPy arrays
straight from the array ("direct"), any buffer in place through the buffer
protocol (Python 3.11+; native 4-byte ids borrowed, the rest converted from
the exporter's memory), and copied through ``tobytes()`` and a cached dtype
layout ("copy", the path before 3.11). All must read the same ids as a list
does and refuse the same inputs with the same message, and the buffer path
must release every export."""

from __future__ import annotations

import array
import enum
import gc
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import imp_mem
from imp_mem import InvalidArgument, KVCacheManager, _core

U32_MAX = 2**32 - 1
LIST_PATHS = ["direct", "api"]
INT_DTYPES = ["i1", "u1"] + [f"{o}{k}{n}" for o in "<>" for k in "iu" for n in (2, 4, 8)]
ALL_PATHS = ["direct", "buffer", "copy"] if sys.version_info >= (3, 11) else ["direct", "copy"]


def kv() -> KVCacheManager:
    return KVCacheManager(64, 4)


# ---------------------------------------------------------------- lists


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
            refusal = (
                imp_mem.InvalidArgument,
                f"tokens: token id {bad} is outside 0 to 4294967295 (ids are unsigned 32-bit)",
            )
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
            "tokens: token id -5 is outside 0 to 4294967295 (ids are unsigned 32-bit)",
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
            assert err[1].startswith("tokens: token id ") and err[1].endswith(
                " is outside 0 to 4294967295 (ids are unsigned 32-bit)"
            )

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
                f"tokens: token id {named} is outside 0 to 4294967295 (ids are unsigned 32-bit)",
            )

    def test_huge_lists_read_or_name_their_bad_id(self):
        ids = np.random.default_rng(5).integers(0, 2**32, 1_000_000, dtype=np.uint32)
        tokens = ids.tolist()
        m = KVCacheManager(300_000, 4)
        assert m.hash_blocks(tokens) == m.hash_blocks(ids)
        tokens[-1] = -1
        assert outcome(lambda: m.hash_blocks(tokens)) == (
            imp_mem.InvalidArgument,
            "tokens: token id -1 is outside 0 to 4294967295 (ids are unsigned 32-bit)",
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


@pytest.mark.parametrize("hook", ["_set_list_direct", "_set_buffer_protocol", "_set_numpy_direct"])
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_the_test_hooks_refuse_a_non_bool(hook, bad):
    with pytest.raises(InvalidArgument, match="enabled must be True or False"):
        getattr(_core, hook)(bad)


# ---------------------------------------------------------------- buffers


class _Array(np.ndarray):
    """An ndarray subclass: read through the buffer path, not the fast one."""


def ids_for(dtype) -> list[int]:
    """Twelve ids (three blocks of four) that fit `dtype`, its largest
    token-sized value among them, so byte order and width both show."""
    top = min(int(np.iinfo(dtype).max), U32_MAX)
    return [0, 1, 7, 100, 127, 3, top, top - 1, top // 2, 5, 9, 11]


def same_as_list(m: KVCacheManager, tokens, expected: list[int]) -> None:
    assert m.hash_blocks(tokens) == m.hash_blocks(expected)
    m.admit(99, tokens)
    assert m.num_tokens(99) == len(expected)
    assert m.sequence_hashes(99) == [
        int.from_bytes(h, "little") for h in _split(m.hash_blocks(expected))
    ]
    m.abort(99)


def _split(raw: bytes) -> list[bytes]:
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def refusal(call) -> str:
    with pytest.raises(imp_mem.InvalidArgument) as err:
        call()
    return str(err.value)


@pytest.mark.usefixtures("token_path")
class TestEveryPath:
    @pytest.mark.parametrize("dtype", INT_DTYPES)
    def test_every_integer_dtype_and_byte_order(self, dtype):
        ids = ids_for(np.dtype(dtype))
        values = np.array(ids, dtype=dtype)
        m = kv()
        same_as_list(m, values, ids)
        same_as_list(m, memoryview(values), ids)
        same_as_list(m, values[:-1], ids[:-1])  # a partial last block
        same_as_list(m, values.view(_Array), ids)  # not an exact ndarray
        same_as_list(m, values[::2], ids[::2])
        same_as_list(m, np.array(ids[6], dtype=dtype), ids[6:7])  # 0-d: one token

    @pytest.mark.parametrize("code", list("bBhHiIlLqQ"))
    def test_array_module(self, code):
        top = min(2 ** (8 * array.array(code).itemsize - (code.islower())) - 1, U32_MAX)
        ids = [0, 1, 2, top, 3, top - 1, 4, 5]
        same_as_list(kv(), array.array(code, ids), ids)
        same_as_list(kv(), memoryview(array.array(code, ids)), ids)

    def test_memoryview_cast_of_bytes_reads_its_format(self):
        ids = [5, 6, 7, 8, 2**31 - 1, 0, 1, 2]
        raw = np.array(ids, np.int32).tobytes()
        same_as_list(kv(), memoryview(raw).cast("i"), ids)
        same_as_list(kv(), memoryview(bytearray(raw)).cast("I"), ids)

    def test_bytearray_reads_as_unsigned_bytes(self):
        same_as_list(kv(), bytearray(b"\x01\x02\xff\x00"), [1, 2, 255, 0])

    @pytest.mark.parametrize("bad", [b"\x01\x02\x03\x04", "abcd"], ids=["bytes", "str"])
    def test_bytes_and_str_are_refused(self, bad):
        assert "not str or bytes" in refusal(lambda: kv().admit(1, bad))

    @pytest.mark.parametrize(
        "bad",
        [
            np.arange(4, dtype=np.float16),
            np.arange(4, dtype=np.float32),
            np.arange(4, dtype=np.float64),
            np.arange(8, dtype=np.float64)[::2],
            np.array([True, False]),
            array.array("d", [1.0, 2.0]),
            array.array("f", [1.0]),
            memoryview(array.array("d", [1.0])),
        ],
        ids=["f16", "f32", "f64", "f64-strided", "bool", "array-d", "array-f", "memoryview-d"],
    )
    def test_non_integers_are_refused(self, bad):
        assert "tokens must be integers; the buffer's format is" in refusal(
            lambda: kv().hash_blocks(bad)
        )

    @pytest.mark.parametrize(
        "bad",
        [
            np.zeros((2, 2), np.int32),
            np.zeros((2, 3), np.int64).T,  # not contiguous: the copying path
            memoryview(np.zeros((2, 2), np.uint8)),
            np.zeros((1, 1, 4), np.int32),
        ],
        ids=["2d", "2d-transposed", "2d-memoryview", "3d"],
    )
    def test_more_than_one_dimension_is_refused(self, bad):
        assert "tokens must be one-dimensional, got" in refusal(lambda: kv().admit(1, bad))

    @pytest.mark.parametrize("dtype", ["i1", "<u2", ">i4", "<i4", "<u4", "<i8", ">u8"])
    def test_strided_arrays_are_read_through_the_copy(self, dtype):
        base = np.array(ids_for(np.dtype(dtype)) * 2, dtype=dtype)
        for strided in (base[::2], base[::-1], base[1::3], base.reshape(4, 6)[:, 1]):
            assert not strided.flags.c_contiguous
            same_as_list(kv(), strided, [int(v) for v in strided])

    def test_a_scalar_array_is_one_token(self):
        assert kv().hash_blocks(np.int32(5)) == kv().hash_blocks([5])
        m = kv()
        m.admit(1, np.array(7, np.int32))
        assert m.num_tokens(1) == 1

    @pytest.mark.parametrize(
        ("bad", "named"),
        [
            (np.array([1, -3], np.int8), -3),
            (np.array([1, 2, -300], "<i2"), -300),
            (np.array([5, 2**31 - 1, -7, -9], np.int32), -7),
            (np.array([0, -1], ">i4"), -1),
            (np.array([3, 2**31], np.int64) * -1, -3),
            (np.array([1, 2**32], np.int64), 2**32),
            (np.array([1, 2**40], np.uint64), 2**40),
            (np.array([1, 2**40], ">u8"), 2**40),
            (array.array("i", [1, 2, 3, -4]), -4),
            (array.array("q", [2**33]), 2**33),
        ],
        ids=["i1", "i2", "i4", "i4-big", "i8-neg", "i8-big", "u8", "u8-big", "array-i", "array-q"],
    )
    def test_ids_outside_u32_are_refused_and_the_first_is_named(self, bad, named):
        message = refusal(lambda: kv().admit(1, bad))
        assert (
            message
            == f"tokens: token id {named} is outside 0 to 4294967295 (ids are unsigned 32-bit)"
        )
        assert refusal(lambda: kv().hash_blocks(memoryview(bad))) == message
        assert refusal(lambda: kv().admit(1, [int(v) for v in bad])) == message

    def test_the_full_u32_range_is_accepted(self):
        ids = [U32_MAX, 0, 2**31, 2**31 - 1]
        same_as_list(kv(), np.array(ids, np.uint32), ids)
        same_as_list(kv(), np.array(ids, np.int64), ids)

    @pytest.mark.parametrize("dtype", INT_DTYPES)
    def test_empty_arrays(self, dtype):
        m = kv()
        empty = np.empty(0, dtype=dtype)
        assert m.hash_blocks(empty) == b""
        assert m.probe(empty) == 0
        assert m.admit(1, empty) == 0
        assert m.num_tokens(1) == 0
        m.append(1, empty)
        assert m.num_tokens(1) == 0
        assert kv().hash_blocks(array.array("i")) == b""

    @pytest.mark.parametrize("dtype", ["<i4", "<u4", "<i8", "<u2", ">i4"])
    def test_unaligned_buffers(self, dtype):
        ids = ids_for(np.dtype(dtype))
        data = np.array(ids, dtype=dtype).tobytes()
        unaligned = np.frombuffer(b"\0" + data, dtype=dtype, offset=1)
        assert unaligned.ctypes.data % 2 == 1
        same_as_list(kv(), unaligned, ids)
        if np.dtype(dtype).kind == "i":
            data = np.array([1, 2, -5, 3], dtype=dtype).tobytes()
            bad = np.frombuffer(b"\0" + data, dtype=dtype, offset=1)
            message = refusal(lambda: kv().admit(1, bad))
            assert (
                message
                == "tokens: token id -5 is outside 0 to 4294967295 (ids are unsigned 32-bit)"
            )

    def test_every_call_releases_its_export(self):
        """A held export would keep a reference to the exporter and stop a
        bytearray or array.array from resizing."""
        good = array.array("i", range(64))
        good_np = np.arange(64, dtype=np.int32)
        calls = [
            (good, None),
            (good_np, None),
            (np.arange(64, dtype=np.int64), None),
            (array.array("i", [1, -2]), imp_mem.InvalidArgument),
            (array.array("d", [1.0]), imp_mem.InvalidArgument),
            (np.zeros((2, 2), np.int32), imp_mem.InvalidArgument),
            (bytearray(b"\x01\x02"), None),
        ]
        m = kv()
        for tokens, error in calls:
            before = sys.getrefcount(tokens)
            for call in (m.hash_blocks, m.probe, m.can_admit, lambda t: m.pin(1, t)):
                if error is None:
                    call(tokens)
                else:
                    with pytest.raises(error):
                        call(tokens)
            if error is None:
                m.admit(5, tokens)
                m.append(5, tokens)
                m.abort(5)
            assert sys.getrefcount(tokens) == before
            if isinstance(tokens, (array.array, bytearray)):
                tokens.extend(tokens[:1])  # BufferError while exported

    def test_the_manager_keeps_a_copy_not_the_callers_buffer(self):
        ids = list(range(1, 17))
        tokens = np.array(ids, np.int32)
        m = kv()
        m.admit(1, tokens)
        hashes = m.sequence_hashes(1)
        tokens[:] = 0
        assert m.sequence_hashes(1) == hashes
        m.free(1)
        assert m.probe(np.array(ids, np.int32)) == 12  # all blocks but the last

    def test_large_calls_release_the_gil_with_borrowed_ids(self):
        tokens = np.arange(20_000, dtype=np.int32)
        expected = kv().hash_blocks(tokens.tolist())
        results: list[bytes] = []
        m = KVCacheManager(20_000, 4)

        def work():
            for _ in range(5):
                results.append(m.hash_blocks(tokens))
                assert m.can_admit(tokens)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [expected] * 20
        m.admit(1, tokens)  # more than SMALL_TOKENS: admitted without the GIL
        assert m.num_tokens(1) == 20_000


@pytest.mark.parametrize(
    "bad",
    [
        np.arange(4, dtype=np.float64),
        np.zeros((2, 2), np.int32),
        np.array([-1], np.int32),
        np.array([-1], ">i2"),
        np.array([2**40], np.uint64),
        array.array("b", [-1]),
        b"1234",
        object(),
        3,
    ],
    ids=["f64", "2d", "neg-i4", "neg-i2-big", "u64", "array-b", "bytes", "object", "int"],
)
def test_every_path_refuses_with_the_same_message(bad, use_token_path):
    messages = set()
    for name in ALL_PATHS:
        with use_token_path(name):
            messages.add(refusal(lambda: kv().admit(1, bad)))
    assert len(messages) == 1, messages


def _token_arrays():
    def build(dtype: np.dtype):
        top = min(int(np.iinfo(dtype).max), U32_MAX)
        return arrays(dtype, st.integers(0, 40), elements=st.integers(0, top))

    dtypes = st.sampled_from([np.dtype(d) for d in INT_DTYPES])
    return dtypes.flatmap(build)


@given(
    values=_token_arrays(),
    step=st.sampled_from([1, 1, 2, -1]),
    unaligned=st.booleans(),
)
def test_every_path_hashes_like_a_list(use_token_path, values, step, unaligned):
    if unaligned:
        values = np.frombuffer(b"\0" + values.tobytes(), dtype=values.dtype, offset=1)
    values = values[::step]
    m = kv()
    expected = m.hash_blocks([int(v) for v in values])
    for name in ALL_PATHS:
        with use_token_path(name):
            assert m.hash_blocks(values) == expected
            assert m.hash_blocks(memoryview(values)) == expected


@given(
    length=st.integers(1, 3000),
    data=st.data(),
    caching=st.booleans(),
    kind=st.sampled_from(["numpy", "array"]),
)
def test_a_negative_int32_anywhere_is_refused_and_changes_nothing(
    use_token_path, length, data, caching, kind
):
    """An admission of int32 ids read in place leaves their check to the
    manager, after the hash (K21): a negative id in a hashed block or in
    the partial last block, past a cached prefix or not, is refused with
    the list's message, and nothing changes."""
    at = data.draw(st.integers(0, length - 1), label="at")
    bad = data.draw(st.integers(-(2**31), -1), label="bad")
    ids = np.arange(length, dtype=np.int32)
    ids[at] = bad
    m = KVCacheManager(1024, 16, enable_prefix_caching=caching)
    m.admit(1, np.arange(64, dtype=np.int32))
    m.free(1)
    before = m.stats()
    expected = refusal(lambda: m.admit(2, [int(v) for v in ids]))
    assert (
        expected == f"tokens: token id {bad} is outside 0 to 4294967295 (ids are unsigned 32-bit)"
    )
    tokens = ids if kind == "numpy" else array.array("i", ids.tobytes())
    for name in ALL_PATHS:
        with use_token_path(name):
            assert refusal(lambda: m.admit(2, tokens)) == expected
            assert m.stats() == before
            assert 2 not in m.sequences()
    ids[:] = np.arange(length, dtype=np.int32)
    hit = 16 * max(0, min(4, (length - 1) // 16)) if caching else 0
    assert m.probe(ids) == hit
    assert m.admit(2, ids) == hit


class TestDirectNumpyReader:
    """What the direct reader takes, and that what it passes on still reads
    (it must never read an array it does not understand)."""

    @pytest.fixture(autouse=True)
    def _direct(self, use_token_path):
        with use_token_path("direct"):
            yield

    @pytest.mark.parametrize(
        "make",
        [
            lambda a: a[::2],
            lambda a: a[::-1],
            lambda a: a.astype(">i4"),
            lambda a: a.astype(np.int64),
            lambda a: a.view(np.ndarray).view(type("Sub", (np.ndarray,), {})),
            lambda a: np.lib.stride_tricks.as_strided(a, shape=(1,), strides=(8,)),
            lambda a: np.frombuffer(b"\0" + a.tobytes(), dtype=np.int32, offset=1),
            lambda a: a[:0],
        ],
        ids=[
            "strided",
            "reversed",
            "big-endian",
            "int64",
            "subclass",
            "len1-stride8",
            "unaligned",
            "empty",
        ],
    )
    def test_arrays_it_passes_on_read_the_same(self, make):
        source = np.arange(12, dtype=np.int32)
        tokens = make(source)
        same_as_list(kv(), tokens, [int(v) for v in tokens])

    def test_a_read_only_array_reads(self):
        tokens = np.arange(12, dtype=np.uint32)
        tokens.flags.writeable = False
        same_as_list(kv(), tokens, list(range(12)))

    def test_the_reader_holds_no_reference(self):
        tokens = np.arange(64, dtype=np.int32)
        m = kv()
        before = sys.getrefcount(tokens)
        m.admit(1, tokens)
        m.free(1)
        m.hash_blocks(tokens)
        assert sys.getrefcount(tokens) == before
        tokens.resize(128, refcheck=True)  # refused if anything still held it


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
