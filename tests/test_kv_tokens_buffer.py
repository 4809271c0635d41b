"""Token ids from buffers, on every path (``token_path``): int32/uint32 NumPy
arrays read straight from the array ("direct"), any buffer read in place
through the buffer protocol (Python 3.11+; native 4-byte ids borrowed, the
rest converted from the exporter's memory), and copied through
``tobytes()``. All must read the same ids as a list does and refuse the same
inputs with the same message, and the buffer path must release every
export."""

from __future__ import annotations

import array
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
INT_DTYPES = ["i1", "u1"] + [f"{o}{k}{n}" for o in "<>" for k in "iu" for n in (2, 4, 8)]
ALL_PATHS = ["direct", "buffer", "copy"] if sys.version_info >= (3, 11) else ["direct", "copy"]


def kv() -> KVCacheManager:
    return KVCacheManager(64, 4)


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
        assert message == f"token id {named} is outside 0..=4294967295"
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
            assert message == "token id -5 is outside 0..=4294967295"

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
    assert expected == f"token id {bad} is outside 0..=4294967295"
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


@pytest.mark.parametrize("hook", ["_set_buffer_protocol", "_set_numpy_direct"])
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_the_test_hooks_refuse_a_non_bool(hook, bad):
    with pytest.raises(InvalidArgument, match="enabled must be True or False"):
        getattr(_core, hook)(bad)


class TestDirectNumpyReader:
    """What the direct reader takes, and that what it passes on still reads
    (it must never read an array it does not understand)."""

    @pytest.fixture(autouse=True)
    def _direct(self, use_token_path):
        with use_token_path("direct"):
            yield

    @pytest.mark.parametrize("dtype", ["=i4", "=u4", "<i4", "<u4"])
    def test_native_4_byte_arrays_read_like_a_list(self, dtype):
        ids = ids_for(np.dtype(dtype))
        same_as_list(kv(), np.array(ids, dtype=dtype), ids)

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

    def test_a_negative_int32_is_refused_with_the_usual_message(self):
        bad = np.array([1, 2, -7, 3], np.int32)
        assert refusal(lambda: kv().admit(1, bad)) == "token id -7 is outside 0..=4294967295"

    def test_the_reader_holds_no_reference(self):
        tokens = np.arange(64, dtype=np.int32)
        m = kv()
        before = sys.getrefcount(tokens)
        m.admit(1, tokens)
        m.free(1)
        m.hash_blocks(tokens)
        assert sys.getrefcount(tokens) == before
        tokens.resize(128, refcheck=True)  # refused if anything still held it
