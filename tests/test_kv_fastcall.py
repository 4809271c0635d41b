"""The vectorcall entries of ``KVCacheManager.admit``, ``.free``, ``.abort``
and ``.append`` (Python 3.10+): every call must behave exactly as pyo3's own
method would — the same result, the same exception with the same message,
the same state afterwards — whichever of the two paths handles it."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import imp_mem
from imp_mem import KVCacheManager, _core

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 10), reason="METH_FASTCALL is in the stable ABI from Python 3.10"
)

METHODS = ["admit", "free", "abort", "append"]


def test_the_methods_are_replaced_and_keep_their_signature_and_doc():
    for name in METHODS:
        original = _core._fastcall_original(name)
        assert original is not None, name
        fast = KVCacheManager.__dict__[name]
        assert fast is not original
        assert fast.__doc__ == original.__doc__
        assert fast.__text_signature__ == original.__text_signature__
    assert _core._fastcall_original("probe") is None


@pytest.mark.parametrize("bad", [3, None, b"admit"])
def test_the_hook_refuses_a_name_that_is_not_a_str(bad):
    with pytest.raises(imp_mem.InvalidArgument, match="name must be a method name"):
        _core._fastcall_original(bad)


def outcome(call):
    try:
        return ("ok", call())
    except Exception as e:  # the comparison is the point: any exception
        return (type(e), str(e))


def state(m: KVCacheManager):
    return (
        m.stats(),
        {s: (m.num_tokens(s), m.block_table(s)) for s in m.sequences()},
    )


def same_on_both(fill, name: str, args: tuple, kwargs: dict) -> None:
    fast, slow = KVCacheManager(32, 4), KVCacheManager(32, 4)
    for m in (fast, slow):
        fill(m)
    original = _core._fastcall_original(name)
    got = outcome(lambda: getattr(fast, name)(*args, **kwargs))
    want = outcome(lambda: original(slow, *args, **kwargs))
    assert got == want, (name, args, kwargs)
    assert state(fast) == state(slow)


def admitted(m: KVCacheManager) -> None:
    m.admit(1, list(range(10)))
    m.admit(2, list(range(9)))


TOKENS = list(range(1, 12))
CALLS = [
    ("admit", (5, TOKENS), {}),
    ("admit", (5, np.array(TOKENS, np.int32)), {}),
    ("admit", (5, TOKENS), {"lora_id": 3}),
    ("admit", (5, TOKENS), {"lora_id": None, "cache_salt": "s", "mm": None}),
    ("admit", (5, TOKENS), {"mm": [(0, 4, 99)]}),
    ("admit", (5,), {"tokens": TOKENS}),
    ("admit", (), {"seq_id": 5, "tokens": TOKENS}),
    ("admit", (1, TOKENS), {}),  # already admitted
    ("admit", (5, TOKENS * 20), {}),  # does not fit
    ("admit", (5, TOKENS), {"lora_id": -1}),
    ("admit", (5, TOKENS), {"lora_id": "x"}),
    ("admit", (5, TOKENS), {"bogus": 1}),
    ("admit", (-5, TOKENS), {}),
    ("admit", ("5", TOKENS), {}),
    ("admit", (5, "abc"), {}),
    ("admit", (5, TOKENS, 3), {}),
    ("admit", (5,), {}),
    ("admit", (), {}),
    ("free", (1,), {}),
    ("free", (1, 4), {}),
    ("free", (1,), {"computed_tokens": 4}),
    ("free", (1, None), {}),
    ("free", (1,), {"computed_tokens": None}),
    ("free", (1, 4), {"computed_tokens": 4}),
    ("free", (1, -1), {}),
    ("free", (1,), {"computed_tokens": "x"}),
    ("free", (9,), {}),
    ("free", (), {"seq_id": 1}),
    ("free", (1, 2, 3), {}),
    ("free", (1,), {"bogus": 1}),
    ("abort", (2,), {}),
    ("abort", (9,), {}),
    ("abort", (), {"seq_id": 2}),
    ("abort", (2, 1), {}),
    ("abort", (2,), {"x": 1}),
    ("abort", (2**64,), {}),
    ("abort", (True,), {}),
    ("append", (1, [7]), {}),
    ("append", (1, np.arange(9, dtype=np.int32)), {}),
    ("append", (2, TOKENS * 20), {}),  # does not fit
    ("append", (9, [7]), {}),
    ("append", (1, [-1]), {}),
    ("append", (1, "abc"), {}),
    ("append", (1,), {"tokens": [7]}),
    ("append", (), {"seq_id": 1, "tokens": [7]}),
    ("append", (1, [7], 3), {}),
    ("append", ("1", [7]), {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), CALLS)
def test_each_call_shape_behaves_as_pyo3s_method(name, args, kwargs):
    same_on_both(admitted, name, args, kwargs)


VALUES = st.one_of(
    st.integers(-3, 12),
    st.just(2**64),
    st.none(),
    st.booleans(),
    st.text(max_size=2),
    st.lists(st.integers(-1, 40), max_size=12),
    st.floats(allow_nan=False, allow_infinity=False),
)
KEYWORDS = st.sampled_from(
    ["seq_id", "tokens", "lora_id", "cache_salt", "mm", "computed_tokens", "other"]
)


@given(
    name=st.sampled_from(METHODS),
    args=st.lists(VALUES, max_size=3).map(tuple),
    kwargs=st.dictionaries(KEYWORDS, VALUES, max_size=2),
)
def test_random_calls_behave_as_pyo3s_method(name, args, kwargs):
    same_on_both(admitted, name, args, kwargs)
