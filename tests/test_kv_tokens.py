"""Token ids from NumPy arrays: before Python 3.11 the binding reads an exact
``numpy.ndarray`` through ``tobytes()`` and its cached dtype layout instead
of a memoryview; it must read exactly what the buffer path reads and refuse
what it refuses, with the same message. Every test runs on both paths
(``token_path``); tests/test_kv_tokens_buffer.py covers the rest."""

from __future__ import annotations

import numpy as np
import pytest

import imp_mem
from imp_mem import KVCacheManager

pytestmark = pytest.mark.usefixtures("token_path")


def kv() -> KVCacheManager:
    return KVCacheManager(32, 4)


class _Array(np.ndarray):
    """An ndarray subclass: read through the buffer path, not the fast one."""


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


def test_int32_ids_past_int32_max_are_refused_and_the_first_is_named():
    ids = np.array([5, 2**31 - 1, -7, -9], np.int32)
    with pytest.raises(imp_mem.InvalidArgument, match="-7"):
        kv().admit(1, ids)
    assert kv().hash_blocks(ids[:2]) == kv().hash_blocks([5, 2**31 - 1])
