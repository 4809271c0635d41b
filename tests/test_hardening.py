"""Regression and class tests for issue 14 (hardening): aborts, GC
re-entrancy, the GIL while waiting for the manager, count truncation, one
manager per pool, stale temps of killed saves, loading with prefix caching
off, stale spans and exports across a reset, and typed errors for bad
values."""

from __future__ import annotations

import gc
import hashlib
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial

import numpy as np
import pytest
from _helpers import make_plan, open_system

import imp_mem as P
from imp_mem import InvalidArgument, StaleSpan

MIB = 1 << 20


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------- no aborts


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_sizes_the_docs_allow_are_refused_not_aborted_when_the_host_cannot():
    # A 4 GiB address-space cap makes the bookkeeping of 4294967294 blocks
    # (tens of GB) impossible on any host: it must be OutOfMemory, not SIGABRT.
    r = run_python(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import imp_mem as P
        calls = [
            lambda: P.KVCacheManager(4294967294, 16),
            lambda: P.BlockPool.slots(4294967294),
            lambda: P.BlockPool(P.FakeBackend(capacity="1TiB", backed=False), 1, 4294967294),
        ]
        for call in calls:
            try:
                call()
            except P.OutOfMemory as e:
                assert "host" in str(e) and e.asked > 0, e
            else:
                raise SystemExit("not refused")
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ----------------------------------------------------------- GC re-entrancy


def _gc_storm(callback):
    """Runs with a GC callback that calls `callback` and a threshold of 1,
    so every allocation inside a method may collect."""
    old = gc.get_threshold()

    def hook(phase, info):
        if phase == "start":
            try:
                callback()
            except Exception:
                pass

    gc.callbacks.append(hook)
    gc.set_threshold(1)
    return old, hook


def _end_storm(state):
    old, hook = state
    gc.callbacks.remove(hook)
    gc.set_threshold(*old)


def _in_subprocess_with_timeout(code: str) -> None:
    r = run_python(code, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done" in r.stdout


def test_block_refs_ids_under_a_gc_callback_that_releases_them_returns():
    # The reproducer, which used to hang forever.
    _in_subprocess_with_timeout(
        """
        import gc
        import imp_mem as P
        refs = P.BlockPool(P.FakeBackend(capacity="64MiB"), 256, 64).allocate_many(4)
        hold = [[] for _ in range(200)]
        gc.callbacks.append(lambda ph, i: ph == "start" and refs.release())
        gc.set_threshold(1)
        try:
            print(refs.ids)
        except P.InvalidArgument:
            pass
        print("done")
        """
    )


def test_an_out_of_memory_commit_under_a_gc_callback_that_touches_the_region():
    _in_subprocess_with_timeout(
        """
        import gc
        import imp_mem as P
        fake = P.FakeBackend(capacity="64MiB", granularity=4096)
        region = fake.acquire_growable("16MiB", 4096)
        gc.callbacks.append(lambda ph, i: ph == "start" and region.nbytes)
        gc.set_threshold(1)
        fake.fail_commits(5)
        for _ in range(5):
            try:
                region.commit("8MiB")
            except P.OutOfMemory as e:
                assert e.asked >= 0
            except P.ImpMemError:
                pass
        print("done")
        """
    )


CLASS_TEST = """
import gc
import types
import imp_mem as P

fake = P.FakeBackend(capacity="64MiB")
pool = P.BlockPool(fake, 256, 64)
refs = pool.allocate_many(4)
one = pool.allocate()
arena = P.Arena(fake, 1 << 16)
span = arena.take(64)
stack = P.ScratchStack(fake, 1 << 16)
mark = stack.mark()
kv = P.KVCacheManager(64, 4, backend=fake, block_bytes=64)
kv.admit(1, list(range(16)))
region = fake.acquire_growable("1MiB", 4096)
# What main added beside the hardening: a manager with events and a host
# tier, the activation pool, and a memory system (sleep / wake / swap).
tiered = P.KVCacheManager(64, 4, backend=fake, block_bytes=64, kv_events=True, host_blocks=8)
tiered.admit(1, list(range(16)))
tiered.free(1)
tiered.admit(2, list(range(16)))
activations = P.ActivationPool(fake, "1MiB")
shape = P.ModelShape.from_hf_config({
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1000, "max_position_embeddings": 2048,
})
plan = P.plan_memory(P.PlanInput(
    shape, P.Limits(2, 256, kv_policy="fit"), P.Features(), budget="128MiB",
    context=1 << 20, library_reserve=1 << 20,
))
system = P.MemorySystem(P.FakeBackend(capacity="256MiB"), plan)
objects = [pool, refs, one, arena, span, stack, mark, kv, region, fake, tiered, activations, system]
target = [None]

def touch(phase, info):
    # The collection runs inside a method of `target`: read it back through
    # every property and its repr, which take the same locks.
    o = target[0]
    if phase != "start" or o is None:
        return
    repr(o)
    for name in dir(type(o)):
        # pyo3's getters are getset descriptors, not properties.
        if isinstance(getattr(type(o), name, None), (property, types.GetSetDescriptorType)):
            try:
                getattr(o, name)
            except Exception:
                pass
    for name in ("stats", "sequences", "cached_blocks", "host_cached_blocks", "pending_events"):
        try:
            getattr(o, name)()
        except Exception:
            pass

gc.callbacks.append(touch)
ARGS = [(), (1,), (1, 4)]
for o in objects:
    for name in sorted(dir(o)):
        if name.startswith("_") or name in ("release", "reset", "close", "split", "rewind"):
            continue
        for args in ARGS:
            # CPython collects at the first tracked allocation past the
            # threshold: sweeping the threshold and a few fresh objects
            # before the call moves the collection over every allocation
            # inside the method.
            for threshold in range(1, 5):
                for k in range(4):
                    gc.collect()
                    extra = [[] for _ in range(k)]
                    gc.set_threshold(threshold)
                    target[0] = o
                    try:
                        attr = getattr(o, name)
                        if callable(attr):
                            attr(*args)
                    except Exception:
                        pass
                    target[0] = None
                    gc.set_threshold(700)
                    del extra
print("done")
"""


def test_class_every_public_method_under_a_gc_callback_touching_the_same_objects():
    _in_subprocess_with_timeout(CLASS_TEST)


# ------------------------------------------------------ the GIL and the lock


def _saved_manager(tmp_path: pathlib.Path, blocks: int = 1024, block_bytes: int = 64 << 10):
    fake = P.FakeBackend(capacity="1GiB")
    kv = P.KVCacheManager(blocks, 16, backend=fake, block_bytes=block_bytes)
    for s in range(blocks // 8):
        kv.admit(s, list(range(s * 1000, s * 1000 + 16 * 8)))
        kv.free(s)
    return kv


def _worst_gap_while(work, light_calls) -> float:
    stop = threading.Event()
    gaps = []

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    def light():
        while not stop.is_set():
            for call in light_calls:
                try:
                    call()
                except Exception:
                    pass

    threads = [threading.Thread(target=ticker), threading.Thread(target=light)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        work()
    finally:
        stop.set()
        for t in threads:
            t.join()
    return max(gaps)


def test_class_light_methods_during_save_and_load_do_not_stall_the_interpreter(tmp_path):
    kv = _saved_manager(tmp_path)
    path = tmp_path / "cache.bin"
    light = [
        kv.stats,
        lambda: kv.block_table(0),
        lambda: kv.num_tokens(0),
        lambda: kv.can_append(0, 1),
        lambda: kv.evict(0),
        kv.sequences,
        kv.cached_blocks,
        lambda: kv.unpin(7),
        kv.check_invariants,
        lambda: kv.num_blocks,
        lambda: repr(kv),
    ]

    def work():
        for _ in range(3):
            kv.save_prefix_cache(path)

    # The same light load beside GIL-free work of the same shape: the save
    # and the load each run four threads (reads or copies, hashes, checks,
    # writes), so the control hashes on four threads (hashlib releases the
    # GIL): on a loaded host the ticker's gaps come from the CPU, not from
    # us, and the bound allows for them. Before the fix a save froze the
    # ticker for the whole save (~0.7 s). The best of three tries counts: a
    # busy host can stall any one of them.
    blob = b"x" * (8 << 20)

    def control_work():
        hashers = [
            threading.Thread(target=lambda: [hashlib.sha256(blob).digest() for _ in range(3)])
            for _ in range(4)
        ]
        for t in hashers:
            t.start()
        for t in hashers:
            t.join()

    tries = []
    for _ in range(3):
        worst_save = _worst_gap_while(work, light)
        fresh = P.KVCacheManager(
            1024, 16, backend=P.FakeBackend(capacity="1GiB"), block_bytes=64 << 10
        )
        light_fresh = [fresh.stats, fresh.check_invariants, fresh.sequences, fresh.__repr__]
        worst_load = _worst_gap_while(partial(fresh.load_prefix_cache, path), light_fresh)
        assert fresh.stats()["cached"] == 1024
        fresh.check_invariants()
        control = _worst_gap_while(control_work, light)
        bound = max(0.020, 1.5 * control)
        tries.append((worst_save, worst_load, control))
        if worst_save <= bound and worst_load <= bound:
            return
    raise AssertionError(f"worst stalls (save, load, control) in s: {tries}")


# The longest a thread using the manager may wait behind a save or a load:
# a few switch intervals of the interpreter (5 ms each), or on a loaded
# machine twice what the same thread waits with nothing but a sleep beside
# it (the CPU's share, not ours). A lock (the manager's, or the GIL) held
# across the file I/O makes the gap the whole save or load, which the
# second rule catches at any speed where the machine is not loaded: the
# gaps stay a small part of the work.
READER_GAP_BOUND_S = 0.050


def _reader_gaps_while(kv, work) -> tuple[float, float]:
    """(the longest wait between two returns of a thread calling the
    manager's ``stats()`` and now and then ``cached_blocks()``, how long
    ``work`` took) while ``work`` runs."""
    stop, started = threading.Event(), threading.Event()
    gaps = [0.0]

    def reader():
        last = time.perf_counter()
        started.set()
        while not stop.is_set():
            kv.stats()
            if len(gaps) % 64 == 0:
                kv.cached_blocks()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait()
    time.sleep(0.01)
    t0 = time.perf_counter()
    try:
        work()
    finally:
        took = time.perf_counter() - t0
        stop.set()
        thread.join()
    return max(gaps), took


def _reader_gap_verdict(kv, path) -> str | None:
    """20 runs (10 saves and 10 loads of 64 MiB) with a reader beside each,
    and as long a sleep beside it after each: what breaks the rules, or
    None."""
    runs, control = [], []
    for _ in range(10):
        runs.append(("save", *_reader_gaps_while(kv, partial(kv.save_prefix_cache, path))))
        control.append(_reader_gaps_while(kv, partial(time.sleep, runs[-1][2]))[0])
        assert kv.evict(1024) == 1024
        runs.append(("load", *_reader_gaps_while(kv, partial(kv.load_prefix_cache, path))))
        assert kv.stats()["cached"] == 1024
        control.append(_reader_gaps_while(kv, partial(time.sleep, runs[-1][2]))[0])
    kv.check_invariants()
    bound = max(READER_GAP_BOUND_S, 2 * max(control))
    worst = max(runs, key=lambda r: r[1])
    detail = f"runs (op, worst gap s, took s): {runs}; beside a sleep: {control}"
    if worst[1] >= bound:
        return (
            f"a reader waited {worst[1] * 1e3:.1f} ms behind a {worst[0]} of "
            f"{worst[2] * 1e3:.1f} ms (bound {bound * 1e3:.0f} ms); {detail}"
        )
    # Where the machine leaves the reader the CPU (its waits beside a sleep
    # are short against the work), its waits must be too: a lock held
    # across the I/O shows here even when the whole save is under the bound.
    if max(control) < 0.25 * statistics.median(took for _, _, took in runs):
        share = statistics.median(gap / took for _, gap, took in runs)
        if share >= 0.5:
            return f"the reader waited {share:.0%} of a save or load; {detail}"
    return None


def test_a_reader_thread_never_waits_behind_a_save_or_a_load(tmp_path):
    """Issue 30: a thread calling the manager beside 20 saves and loads
    waits under the bound. The best of three tries counts (a busy host can
    preempt the reader past the bound in any one); a lock held across the
    I/O fails all three."""
    kv = _saved_manager(tmp_path)
    path = tmp_path / "cache.bin"
    verdicts = []
    for _ in range(3):
        verdict = _reader_gap_verdict(kv, path)
        if verdict is None:
            return
        verdicts.append(verdict)
    raise AssertionError("\n".join(verdicts))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    kv = P.KVCacheManager(16, 4, backend=P.FakeBackend(), block_bytes=64)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        kv.load_prefix_cache(fifo)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        kv.save_prefix_cache(fifo)
    kv.stats()


# --------------------------------------------------------------- truncation


@pytest.mark.parametrize("n", [16 * 2**32, 2**63, 2**64 - 1, 2**32, 2**32 + 1, 17 * 4])
def test_can_append_never_wraps(n):
    kv = P.KVCacheManager(16, 4)
    kv.admit(1, [1])
    assert kv.can_append(1, n) is False


def test_can_append_property_matches_block_arithmetic():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(
        blocks=st.integers(1, 64),
        bs=st.integers(1, 32),
        have=st.integers(1, 64),
        n=st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1)),
    )
    @hypothesis.settings(max_examples=300, deadline=None)
    def prop(blocks, bs, have, n):
        kv = P.KVCacheManager(blocks, bs)
        have = min(have, blocks * bs)
        kv.admit(1, list(range(have)))
        used = -(-have // bs)
        need = -(-(have + n) // bs) - used
        assert kv.can_append(1, n) == (need <= blocks - used)

    prop()


# ---------------------------------------------------------- one manager


def test_a_second_manager_on_one_pool_is_refused_and_so_is_a_direct_allocate():
    _fb, s = open_system(make_plan())
    kv = s.kv_manager()
    with pytest.raises(InvalidArgument, match="already serves a KV manager"):
        s.kv_manager()
    with pytest.raises(InvalidArgument, match="belongs to a KV manager"):
        s.kv_pool.allocate()
    with pytest.raises(InvalidArgument, match="belongs to a KV manager"):
        s.kv_pool.allocate_many(2)
    kv.admit(1, list(range(64)))
    kv.check_invariants()
    assert kv.stats()["active"] == 4
    kv.free(1)
    del kv
    gc.collect()
    second = s.kv_manager()  # the claim ends with the first manager
    second.check_invariants()


# ------------------------------------------------------------ persistence


def test_stale_temps_of_dead_writers_are_removed_by_the_next_save(tmp_path):
    kv = _saved_manager(tmp_path, blocks=64, block_bytes=64)
    path = tmp_path / "cache.bin"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    stale = [tmp_path / f"cache.bin.tmp-{pid}", tmp_path / f"cache.bin.tmp-{pid}-3"]
    for f in stale:
        f.write_bytes(b"x" * 1000)
    alive = tmp_path / f"cache.bin.tmp-{os.getpid()}-999"
    alive.write_bytes(b"y")
    other = tmp_path / f"other.bin.tmp-{pid}"
    other.write_bytes(b"z")
    kv.save_prefix_cache(path)
    assert not any(f.exists() for f in stale)
    assert alive.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["cache.bin", alive.name, other.name]
    )


def test_paths_may_be_str_bytes_or_pathlike_and_bad_ones_are_typed(tmp_path):
    kv = _saved_manager(tmp_path, blocks=64, block_bytes=64)
    for p in (tmp_path / "a.bin", str(tmp_path / "b.bin"), os.fsencode(tmp_path / "c.bin")):
        assert kv.save_prefix_cache(p) == 64
        fresh = P.KVCacheManager(64, 16, backend=P.FakeBackend(), block_bytes=64)
        assert fresh.load_prefix_cache(p) == 64
    with pytest.raises(TypeError, match="path must be a path"):
        kv.save_prefix_cache(None)
    with pytest.raises(TypeError, match="path must be a path"):
        kv.load_prefix_cache(5)
    with pytest.raises(InvalidArgument, match="NUL"):
        kv.save_prefix_cache("a\0b")
    with pytest.raises(InvalidArgument, match="empty"):
        kv.save_prefix_cache("")


def test_loading_with_prefix_caching_off_is_refused_and_loads_nothing(tmp_path):
    kv = _saved_manager(tmp_path, blocks=64, block_bytes=64)
    path = tmp_path / "cache.bin"
    kv.save_prefix_cache(path)
    off = P.KVCacheManager(
        64, 16, backend=P.FakeBackend(), block_bytes=64, enable_prefix_caching=False
    )
    with pytest.raises(InvalidArgument, match="prefix caching off"):
        off.load_prefix_cache(path)
    assert off.stats()["cached"] == 0 and off.stats()["live"] == 0


# ------------------------------------------------------------ stale spans


def test_a_stale_span_has_no_views_or_subspans(fake):
    arena = P.Arena(fake, 1 << 16)
    span = arena.take(64)
    arena.reset()
    with pytest.raises(StaleSpan):
        span.view("uint8")
    with pytest.raises(StaleSpan):
        span.subspan(0, 8)


def test_reset_with_a_live_export_is_refused_naming_how_many(fake):
    arena = P.Arena(fake, 1 << 16)
    a = np.from_dlpack(arena.take(64))
    b = np.from_dlpack(arena.take(64).view("float32"))
    assert arena.live_exports == 2
    with pytest.raises(InvalidArgument, match="2 export"):
        arena.reset()
    del a
    assert arena.live_exports == 1
    with pytest.raises(InvalidArgument, match="1 export"):
        arena.reset()
    del b
    arena.reset()
    c = np.from_dlpack(arena.take(64))
    arena.reset(unsafe_allow_live_exports=True)
    assert arena.live_exports == 0
    del c
    arena.reset()


# ------------------------------------------------------------ typed errors


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda kv: kv.admit(-1, [1]), "seq_id"),
        (lambda kv: kv.free(2**64), "seq_id"),
        (lambda kv: kv.can_append(1, -1), "n"),
        (lambda kv: kv.evict(-1), "n"),
        (lambda kv: kv.evict(2**32), "n"),
        (lambda kv: kv.block_table(-5), "seq_id"),
        (lambda kv: kv.evict_middle(1, -1, 2), "start"),
        (lambda kv: kv.admit(1, [1], lora_id=-1), "lora_id"),
        (lambda kv: kv.admit(1, [1], cache_salt="\ud800"), "cache_salt"),
        (lambda kv: kv.pin(-1, [1]), "owner"),
        (lambda kv: kv.free(1, -3), "computed_tokens"),
        (lambda kv: P.KVCacheManager(-1, 16), "num_blocks"),
        (lambda kv: P.KVCacheManager(0, 16), "num_blocks"),
        (lambda kv: P.KVCacheManager(4294967295, 16), "num_blocks"),
        (lambda kv: P.KVCacheManager(16, -16), "block_size"),
        (lambda kv: P.KVCacheManager(16, 4, hash_seed=-1), "hash_seed"),
        (lambda kv: P.KVCacheManager(16, 4, pin_budget=2**40), "pin_budget"),
        (lambda kv: P.KVCacheManager(16, 4, block_bytes=-1), "block_bytes"),
        (lambda kv: P.FakeBackend().fail_commits(-1), "n"),
        (lambda kv: P.FakeBackend().fail_decommits(2**40), "n"),
        (lambda kv: P.BlockPool(P.FakeBackend(), 64, 4, min_idle_steps=-1), "min_idle_steps"),
        (lambda kv: P.BlockPool.slots(4).set_decommit_policy(keep_chunks=-1), "keep_chunks"),
    ],
)
def test_bad_values_are_invalid_argument_naming_argument_range_and_value(call, name):
    kv = P.KVCacheManager(16, 4)
    kv.admit(1, [1, 2, 3, 4, 5])
    with pytest.raises(InvalidArgument) as info:
        call(kv)
    text = str(info.value)
    assert name in text, text


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda kv: kv.admit(1, [1], mm=5), "mm"),
        (lambda kv: kv.admit("1", [1]), "seq_id"),
        (lambda kv: kv.free(1.0), "seq_id"),
        (lambda kv: kv.evict(None), "n"),
        (lambda kv: P.KVCacheManager(16, 4, model_fingerprint=3), "model_fingerprint"),
        (lambda kv: P.KVCacheManager(16, 4, enable_prefix_caching=1), "enable_prefix_caching"),
    ],
)
def test_wrong_types_are_type_errors_naming_argument_and_type(call, name):
    kv = P.KVCacheManager(16, 4)
    kv.admit(1, [1, 2, 3, 4, 5])
    with pytest.raises(TypeError) as info:
        call(kv)
    assert name in str(info.value), str(info.value)


def test_acquire_tag_none_is_the_default(fake):
    region = fake.acquire(4096, tag=None)
    assert region.tag == "other"
    region.release()


def test_range_messages_name_the_range_and_the_value():
    kv = P.KVCacheManager(16, 4)
    with pytest.raises(
        InvalidArgument, match=r"seq_id must be an integer from 0 to 18446744073709551615, got -1"
    ):
        kv.free(-1)


def test_system_kv_manager_arguments_are_typed():
    _fb, s = open_system(make_plan())
    with pytest.raises(InvalidArgument, match="block_size"):
        s.kv_manager(block_size=-1)
    with pytest.raises(InvalidArgument, match="pin_budget"):
        s.kv_manager(pin_budget=2**33)
    with pytest.raises(TypeError, match="layout"):
        s.kv_manager(layout=1)
    assert "Ellipsis" not in (type(s).kv_manager.__text_signature__ or "")


def test_device_ordinals_are_typed_before_any_driver_call():
    for cls in (P.CudaBackend, P.VmmBackend):
        with pytest.raises(InvalidArgument, match="device"):
            cls(device=-1)
        with pytest.raises(InvalidArgument, match="device"):
            cls(device=2**40)


def test_class_no_signature_shows_an_ellipsis_default():
    from imp_mem import _core

    shown = []
    for name in dir(_core):
        obj = getattr(_core, name)
        members = [obj]
        if isinstance(obj, type):
            members += [getattr(obj, m) for m in dir(obj) if not m.startswith("_")]
        for member in members:
            signature = getattr(member, "__text_signature__", None) or ""
            if "..." in signature or "Ellipsis" in signature:
                shown.append(f"{name}: {signature}")
    assert shown == []


@pytest.mark.parametrize(
    "call",
    [
        lambda kv, fb: kv.admit(True, [1]),
        lambda kv, fb: kv.admit(seq_id=True, tokens=[1]),
        lambda kv, fb: kv.free(False),
        lambda kv, fb: kv.evict(True),
        lambda kv, fb: fb.acquire(True),
        lambda kv, fb: fb.fail_commits(True),
        lambda kv, fb: P.BlockPool(fb, 4096, True),
        lambda kv, fb: P.KVCacheManager(True, 4),
    ],
)
def test_a_bool_where_an_int_is_expected_is_one_invalid_argument_everywhere(call):
    kv, fb = P.KVCacheManager(16, 4), P.FakeBackend(capacity=1 << 24)
    with pytest.raises(InvalidArgument, match="got a bool"):
        call(kv, fb)


def test_none_is_the_documented_default_of_the_fakes_fault_counts_and_kv_sizes():
    fb = P.FakeBackend(capacity=1 << 24, granularity=4096)
    fb.fail_commits(None)  # the default: the next commit fails
    region = fb.acquire_growable(1 << 20, 0)
    with pytest.raises(P.OutOfMemory):
        region.commit(4096)
    region.commit(4096)
    fb.fail_decommits(None)
    with pytest.raises(P.ImpMemError):
        region.decommit(0)
    region.decommit(0)
    assert "None is the default, 1" in (P.FakeBackend.fail_commits.__doc__ or "")
    kv = P.KVCacheManager(16, 4, block_bytes=None)
    assert kv.stats() == P.KVCacheManager(16, 4, block_bytes=0).stats()
