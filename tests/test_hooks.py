"""The exported C entry points (torch's pluggable-allocator pair and CuPy's
CFunctionAllocator pair), driven through ctypes on the fake backend: misuse
never crashes, each kind is counted exactly, the pool's invariants hold
afterwards, and good calls hand out memory that can be written and read."""

from __future__ import annotations

import ctypes

import pytest
from hypothesis import given
from hypothesis import strategies as st

import imp_mem
from imp_mem import _core

MIB = 1 << 20
c_void_p, c_ssize_t, c_size_t, c_int = (
    ctypes.c_void_p,
    ctypes.c_ssize_t,
    ctypes.c_size_t,
    ctypes.c_int,
)


def _lib():
    lib = ctypes.CDLL(_core.hook_library_path())
    tm = getattr(lib, _core.TORCH_MALLOC_SYMBOL)
    tm.restype, tm.argtypes = c_void_p, [c_ssize_t, c_int, c_void_p]
    tf = getattr(lib, _core.TORCH_FREE_SYMBOL)
    tf.restype, tf.argtypes = None, [c_void_p, c_ssize_t, c_int, c_void_p]
    cm = getattr(lib, _core.CUPY_MALLOC_SYMBOL)
    cm.restype, cm.argtypes = c_void_p, [c_void_p, c_size_t, c_int]
    cf = getattr(lib, _core.CUPY_FREE_SYMBOL)
    cf.restype, cf.argtypes = None, [c_void_p, c_void_p, c_int]
    crm = getattr(lib, _core.CUPY_REGION_MALLOC_SYMBOL)
    crm.restype, crm.argtypes = c_void_p, [c_void_p, c_size_t, c_int]
    return tm, tf, cm, cf, crm


TORCH_MALLOC, TORCH_FREE, CUPY_MALLOC, CUPY_FREE, CUPY_REGION_MALLOC = _lib()


@pytest.fixture(autouse=True)
def clean_hooks():
    _core.uninstall_hooks()
    _core.set_hook_route("activations")
    _core.reset_hook_stats()
    yield
    _core.uninstall_hooks()
    _core.set_hook_route("activations")


def misuse(stats: dict) -> dict:
    """The non-zero counters, without the call totals."""
    skip = {
        "mallocs",
        "frees",
        "malloc_ok",
        "free_ok",
        "installed",
        "route",
        "retired_pools",
        "retired_arenas",
    }
    return {k: v for k, v in stats.items() if k not in skip and v}


def test_symbols_and_path():
    assert _core.TORCH_MALLOC_SYMBOL == "imp_mem_torch_malloc"
    assert _core.TORCH_FREE_SYMBOL == "imp_mem_torch_free"
    assert _core.CUPY_MALLOC_SYMBOL == "imp_mem_cupy_malloc"
    assert _core.CUPY_FREE_SYMBOL == "imp_mem_cupy_free"
    assert _core.hook_library_path() == _core.__file__
    addresses = _core.hook_addresses()
    assert addresses[_core.TORCH_MALLOC_SYMBOL] == ctypes.cast(TORCH_MALLOC, c_void_p).value
    assert addresses[_core.CUPY_FREE_SYMBOL] == ctypes.cast(CUPY_FREE, c_void_p).value


def test_nothing_installed_returns_null_and_counts():
    assert TORCH_MALLOC(4096, 0, None) is None
    TORCH_FREE(0x1000, 4096, 0, None)
    assert CUPY_MALLOC(None, 4096, 0) is None
    CUPY_FREE(None, 0x1000, 0)
    stats = _core.hook_stats()
    assert stats["installed"] is False
    assert misuse(stats) == {"not_installed": 2, "free_not_installed": 2}


def test_good_calls_give_memory_that_reads_back(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    pool.install(device=0)
    assert pool.installed and _core.hook_stats()["installed"]
    p = TORCH_MALLOC(1000, 0, 7)
    q = CUPY_MALLOC(None, 3000, 0)
    assert p % 512 == 0 and q % 512 == 0
    ctypes.memmove(p, b"torch" * 200, 1000)
    ctypes.memmove(q, b"cupy" * 750, 3000)
    assert ctypes.string_at(p, 1000) == b"torch" * 200
    assert fake.read(q, 3000) == b"cupy" * 750
    assert pool.size_of(p) == 1000
    TORCH_FREE(p, 1000, 0, 7)
    CUPY_FREE(None, q, 0)
    stats = _core.hook_stats()
    assert (stats["mallocs"], stats["malloc_ok"], stats["frees"], stats["free_ok"]) == (2, 2, 2, 2)
    assert misuse(stats) == {}
    assert pool.stats()["live"] == 0
    pool.check_invariants()


def test_cupys_region_malloc_keeps_to_its_tier_whatever_is_installed(fake):
    """imp_mem.cupy names its tier in each call (a hook region), so torch's
    installed tier and CuPy's stay apart, in either order."""
    torch_tier = imp_mem.ActivationPool(fake, MIB)
    cupy_tier = imp_mem.ActivationPool(fake, MIB)
    torch_tier.install(device=0)
    _core.add_hook_region(cupy_tier, device=0)
    try:
        c = CUPY_REGION_MALLOC(cupy_tier.id, 3000, 0)
        t = TORCH_MALLOC(1000, 0, None)
        assert cupy_tier.size_of(c) == 3000 and torch_tier.size_of(t) == 1000
        assert CUPY_REGION_MALLOC(cupy_tier.id, 0, 0) is None
        assert CUPY_REGION_MALLOC(123456789, 64, 0) is None  # no such region
        assert CUPY_REGION_MALLOC(cupy_tier.id, 64, 1) is None  # its device is 0
        CUPY_FREE(None, c, 0)
        TORCH_FREE(t, 1000, 0, None)
        assert cupy_tier.stats()["live"] == 0 and torch_tier.stats()["live"] == 0
        stats = _core.hook_stats()
        assert misuse(stats) == {"zero_size": 1, "not_installed": 1, "wrong_device": 1}
    finally:
        _core.remove_hook_region(cupy_tier)


def test_every_misuse_is_counted_exactly(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    pool.install(device=0)
    good = TORCH_MALLOC(4096, 0, None)
    assert TORCH_MALLOC(0, 0, None) is None
    assert TORCH_MALLOC(-1, 0, None) is None
    assert TORCH_MALLOC(-(1 << 62), 0, None) is None
    assert TORCH_MALLOC(1 << 62, 0, None) is None  # larger than the device
    assert CUPY_MALLOC(None, 0, 0) is None
    assert CUPY_MALLOC(None, (1 << 64) - 1, 0) is None
    assert TORCH_MALLOC(512, 1, None) is None  # wrong device
    assert TORCH_MALLOC(2 * MIB, 0, None) is None  # strict pool exhausted
    TORCH_FREE(None, 0, 0, None)
    TORCH_FREE(0xDEAD0000, 64, 0, None)  # never ours
    CUPY_FREE(None, 0x10, 0)
    TORCH_FREE(good + 512, 4096, 0, None)  # interior
    TORCH_FREE(good, 4096, 3, None)  # wrong device: refused, still live
    assert pool.stats()["live"] == 1
    TORCH_FREE(good, 4095, 0, None)  # freed by its real size, counted
    TORCH_FREE(good, 4096, 0, None)  # double
    CUPY_FREE(None, good, 0)  # double again
    TORCH_FREE(TORCH_MALLOC(512, 0, None), 512, 0, -1)  # the reserved stream
    assert misuse(_core.hook_stats()) == {
        "zero_size": 2,
        "negative_size": 2,
        "absurd_size": 2,
        "wrong_device": 2,
        "ooms": 1,
        "null_frees": 1,
        "foreign_frees": 2,
        "double_frees": 3,
        "size_mismatches": 1,
        "bad_stream_frees": 1,
    }
    s = pool.stats()
    assert s["live"] == 1  # the one freed on the reserved stream stays live
    assert s["refused_frees"] == 6
    pool.check_invariants()
    _core.reset_hook_stats()
    assert misuse(_core.hook_stats()) == {}


def test_uninstall_stops_routing_and_a_new_install_replaces(fake):
    first = imp_mem.ActivationPool(fake, MIB)
    second = imp_mem.ActivationPool(fake, MIB)
    kept = _core.hook_stats()["retired_pools"]  # earlier tests' live blocks
    first.install()
    p = TORCH_MALLOC(512, 0, None)
    assert first.size_of(p) == 512
    second.install()
    assert not first.installed and second.installed
    # The replaced pool had a live block: it is retired, and the block's
    # free still reaches it (torch keeps blocks, its cuBLAS workspace, past
    # any pool's life).
    assert _core.hook_stats()["retired_pools"] == kept + 1
    q = TORCH_MALLOC(512, 0, None)
    assert second.size_of(q) == 512
    TORCH_FREE(p, 512, 0, None)
    stats = _core.hook_stats()
    assert (stats["retired_frees"], stats["retired_pools"], stats["foreign_frees"]) == (
        1,
        kept,
        0,
    )
    assert first.stats()["live"] == 0
    TORCH_FREE(p, 512, 0, None)  # gone from the hooks now: foreign
    assert _core.hook_stats()["foreign_frees"] == 1
    assert _core.uninstall_hooks() is True
    assert _core.hook_stats()["retired_pools"] == kept + 1  # q is live
    assert _core.uninstall_hooks() is False
    assert TORCH_MALLOC(512, 0, None) is None
    assert _core.hook_stats()["not_installed"] == 1
    TORCH_FREE(q, 512, 0, None)
    assert _core.hook_stats()["retired_pools"] == kept
    first.check_invariants()
    second.check_invariants()
    assert second.stats()["live"] == 0


def test_install_checks_its_arguments(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    with pytest.raises(imp_mem.InvalidArgument, match="device"):
        pool.install(device=-1)
    with pytest.raises(TypeError):
        pool.install(weights_arena="T1")
    with pytest.raises(imp_mem.InvalidArgument, match="route"):
        _core.set_hook_route("kv")
    assert _core.hook_route() == "activations"


def test_the_weights_route_takes_from_t1_and_counts_stranded_frees(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    arena = imp_mem.Arena(fake, MIB)
    pool.install(weights_arena=arena)
    _core.set_hook_route("weights")
    w = TORCH_MALLOC(1000, 0, None)
    t = TORCH_MALLOC(3000, 0, None)
    assert w % 512 == 0 and arena.used >= 4000
    ctypes.memmove(w, b"w" * 1000, 1000)
    assert fake.read(w, 1000) == b"w" * 1000
    assert TORCH_MALLOC(2 * MIB, 0, None) is None  # the arena cannot serve it
    _core.set_hook_route("activations")
    a = TORCH_MALLOC(1000, 0, None)
    assert pool.size_of(a) == 1000
    TORCH_FREE(t, 3000, 0, None)  # a loading temporary: stranded in T1
    TORCH_FREE(t, 3000, 0, None)  # a second free of it is foreign
    TORCH_FREE(a, 1000, 0, None)
    stats = _core.hook_stats()
    assert (stats["weights_takes"], stats["weights_bytes"]) == (2, 4000)
    assert misuse(stats) == {
        "weights_takes": 2,
        "weights_bytes": 4000,
        "weights_refused": 1,
        "stranded_frees": 1,
        "stranded_bytes": 3000,
        "foreign_frees": 1,
    }
    assert _core.hook_stats()["route"] == "activations"
    pool.check_invariants()


def test_the_weights_route_is_the_calling_threads(fake):
    """A loading thread's route leaves another thread's mallocs (a forward
    running meanwhile) in the activations, as torch's MemPool scopes are per
    thread too."""
    import threading

    pool = imp_mem.ActivationPool(fake, MIB)
    arena = imp_mem.Arena(fake, MIB)
    pool.install(weights_arena=arena)
    _core.set_hook_route("weights")
    seen = {}

    def forward():
        seen["route"] = _core.hook_route()
        seen["block"] = TORCH_MALLOC(1000, 0, None)

    worker = threading.Thread(target=forward)
    worker.start()
    worker.join()
    w = TORCH_MALLOC(1000, 0, None)
    assert _core.hook_route() == "weights"
    _core.set_hook_route("activations")
    assert seen["route"] == "activations"
    assert pool.size_of(seen["block"]) == 1000, "the other thread's block went to T1"
    assert pool.size_of(w) is None and arena.used >= 1000
    TORCH_FREE(seen["block"], 1000, 0, None)
    TORCH_FREE(w, 1000, 0, None)
    assert pool.stats()["live"] == 0


def test_a_t1_arena_with_live_takes_outlives_the_hooks(fake):
    """Tensors loaded through the weights route (a model's) keep their T1
    arena after the hooks let go of it, until the last is freed."""
    pool = imp_mem.ActivationPool(fake, MIB)
    arena = imp_mem.Arena(fake, MIB)
    kept = _core.hook_stats()["retired_arenas"]
    pool.install(weights_arena=arena)
    _core.set_hook_route("weights")
    w = TORCH_MALLOC(1000, 0, None)
    _core.set_hook_route("activations")
    ctypes.memmove(w, b"w" * 1000, 1000)
    assert _core.uninstall_hooks()
    assert _core.hook_stats()["retired_arenas"] == kept + 1
    del arena
    assert fake.stats()["tags"]["weights"]["live"] == MIB
    assert fake.read(w, 1000) == b"w" * 1000
    TORCH_FREE(w, 1000, 0, None)
    stats = _core.hook_stats()
    assert stats["retired_arenas"] == kept
    assert (stats["stranded_frees"], stats["retired_frees"]) == (1, 1)
    assert fake.stats()["tags"]["weights"]["live"] == 0


def test_the_weights_route_without_an_arena_refuses(fake):
    pool = imp_mem.ActivationPool(fake, MIB)
    pool.install()
    _core.set_hook_route("weights")
    assert TORCH_MALLOC(512, 0, None) is None
    assert _core.hook_stats()["weights_refused"] == 1


@given(
    calls=st.lists(
        st.one_of(
            st.tuples(st.just("malloc"), st.integers(-(1 << 40), 1 << 21), st.integers(-1, 1)),
            st.tuples(st.just("free"), st.integers(0, 40), st.integers(-2, 2)),
            st.tuples(st.just("bogus"), st.integers(0, 1 << 48), st.integers(0, 1)),
        ),
        max_size=50,
    )
)
def test_random_calls_never_break_the_pool(calls):
    _core.uninstall_hooks()
    _core.reset_hook_stats()
    kept = _core.hook_stats()["retired_pools"]
    fake = imp_mem.FakeBackend(capacity=4 * MIB)
    pool = imp_mem.ActivationPool(fake, MIB)
    pool.install()
    live: list[tuple[int, int]] = []
    expected_ok = 0
    for kind, a, b in calls:
        if kind == "malloc":
            p = TORCH_MALLOC(a, b, None)
            if p is not None:
                assert a > 0 and b == 0
                live.append((p, a))
                expected_ok += 1
        elif kind == "free" and live:
            p, size = live.pop(a % len(live))
            TORCH_FREE(p, size + (b if b > 0 else 0), 0, None)
        elif kind == "bogus":
            if not any(p <= a < p + size for p, size in live):
                TORCH_FREE(a or None, 0, b, None)
    assert pool.stats()["live"] == len(live)
    assert _core.hook_stats()["malloc_ok"] == expected_ok
    pool.check_invariants()
    # Uninstalled with blocks live, the pool is retired until their frees.
    _core.uninstall_hooks()
    assert _core.hook_stats()["retired_pools"] == kept + (1 if live else 0)
    for p, size in live:
        TORCH_FREE(p, size, 0, None)
    stats = _core.hook_stats()
    assert (stats["retired_frees"], stats["retired_pools"]) == (len(live), kept)
    assert pool.stats()["live"] == 0
    pool.check_invariants()


def test_hooks_race_install_and_uninstall_without_harm():
    """ctypes drops the GIL around a foreign call, so these threads really
    run the hooks at once while another installs and uninstalls pools: the
    read lock must keep every call on a whole pool."""
    import threading
    import time

    fake = imp_mem.FakeBackend(capacity=64 * MIB)
    pools = [imp_mem.ActivationPool(fake, 4 * MIB) for _ in range(2)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(stream: int) -> None:
        try:
            while not stop.is_set():
                ptrs = [TORCH_MALLOC(4096 + 512 * i, 0, stream) for i in range(8)]
                for i, p in enumerate(ptrs):
                    if p is not None:
                        ctypes.memset(p, stream, 64)
                        TORCH_FREE(p, 4096 + 512 * i, 0, stream)
        except BaseException as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=churn, args=(s,)) for s in (1, 2, 3)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 0.5
    i = 0
    while time.monotonic() < deadline:
        pools[i % 2].install()
        if i % 3 == 0:
            _core.uninstall_hooks()
        i += 1
    stop.set()
    for w in workers:
        w.join()
    _core.uninstall_hooks()
    assert errors == []
    stats = _core.hook_stats()
    assert stats["malloc_ok"] > 100 and i > 100, (stats, i)
    assert stats["panics"] == 0 and stats["double_frees"] == 0
    # Every free reached its block's pool, whatever was installed by then
    # (the pool that left the slot is listed as retired before it leaves).
    assert stats["foreign_frees"] == 0 and stats["free_not_installed"] == 0, stats
    for pool in pools:
        pool.check_invariants()
        assert pool.stats()["live"] == 0


def test_free_owned_takes_the_hooks_blocks_from_any_thread_and_leaves_the_rest(fake):
    """``imp_mem_hooks_free_owned``, the LD_PRELOAD interposer's free: 1 for a
    block the hooks handed out (a region's, freed on a thread outside it), 0
    and nothing counted for any other pointer."""
    import threading

    lib = ctypes.CDLL(_core.hook_library_path())
    free_owned = getattr(lib, _core.FREE_OWNED_SYMBOL)
    free_owned.restype, free_owned.argtypes = c_int, [c_void_p, c_void_p]
    assert _core.FREE_OWNED_SYMBOL == "imp_mem_hooks_free_owned"
    assert (
        _core.hook_addresses()[_core.FREE_OWNED_SYMBOL] == ctypes.cast(free_owned, c_void_p).value
    )
    region = imp_mem.ActivationPool(fake, MIB)
    _core.add_hook_region(region, device=0)
    try:
        _core.set_hook_region(region)
        p = TORCH_MALLOC(3000, 0, None)
        _core.set_hook_region(None)
        assert region.size_of(p) == 3000
        _core.reset_hook_stats()
        foreign = ctypes.create_string_buffer(64)
        assert free_owned(ctypes.addressof(foreign), None) == 0
        assert free_owned(None, None) == 0
        assert misuse(_core.hook_stats()) == {}, "a foreign pointer is not misuse here"
        taken: list[int] = []
        t = threading.Thread(target=lambda: taken.append(free_owned(p, None)))
        t.start()
        t.join()
        assert taken == [1]
        assert region.stats()["live"] == 0
        assert free_owned(p, None) == 1, "still the hooks' pointer"
        assert misuse(_core.hook_stats()) == {"double_frees": 1}
    finally:
        _core.set_hook_region(None)
        _core.remove_hook_region(region)
