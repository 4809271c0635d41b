"""KVCacheManager from Python: token buffers of every kind, admission errors
with their arithmetic, holes, SWA, pins, persistence, and a hypothesis state
machine over admit / append / free / abort / evict-middle / pin / unpin /
evict / save / load with V4, V5, sharing only through prefix hits, and the
bytes of every cached block matching its hash."""

from __future__ import annotations

import array
import hashlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import imp_mem
from imp_mem import KVCacheManager

BS = 4


def kv(num_blocks: int = 32, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kw)


@pytest.mark.parametrize(
    "tokens",
    [
        list(range(10)),
        tuple(range(10)),
        np.arange(10, dtype=np.int32),
        np.arange(10, dtype=np.int64),
        np.arange(10, dtype=np.uint16),
        np.arange(10, dtype=">i4"),
        np.arange(20, dtype=np.int64)[::2] // 2,
        array.array("i", range(10)),
        array.array("q", range(10)),
        memoryview(array.array("l", range(10))),
    ],
    ids=lambda t: type(t).__name__ + "/" + str(getattr(t, "dtype", getattr(t, "typecode", ""))),
)
def test_any_buffer_of_integers_hashes_the_same(tokens):
    m = kv()
    assert m.hash_blocks(tokens) == m.hash_blocks(list(range(10)))
    m.admit(1, tokens)
    assert m.num_tokens(1) == 10
    assert len(m.block_table(1)) == 3


@pytest.mark.parametrize(
    "bad",
    [
        "abc",
        b"abc",
        np.arange(4, dtype=np.float32),
        np.zeros((2, 2), np.int32),
        [1, -2],
        [2**40],
        [2**70],
        [1.5],
        np.array([-1], np.int64),
        np.array([2**33], np.uint64),
    ],
    ids=["str", "bytes", "float", "2d", "negative", "huge", "huger", "float-list", "neg64", "u64"],
)
def test_bad_tokens_are_refused_with_a_reason(bad):
    with pytest.raises(imp_mem.InvalidArgument):
        kv().admit(1, bad)


def test_a_freed_prompt_is_a_prefix_hit_and_shares_blocks():
    m = kv()
    assert m.admit(1, list(range(10))) == 0
    first = m.block_table(1)
    m.free(1)
    assert m.stats()["cached"] == 2
    assert m.probe(list(range(12))) == 8
    assert m.admit(2, np.arange(12)) == 8
    assert m.block_table(2)[:2] == first[:2]
    s = m.stats()
    assert (s["active"], s["evictable"], s["prefix_hit_blocks"]) == (3, 0, 2)
    m.check_invariants()


def test_a_running_sequence_shares_its_computed_prefix():
    m = kv()
    m.admit(1, list(range(14)))
    assert m.cache_computed(1, 9) == 2
    assert m.admit(2, list(range(14))) == 8
    assert m.block_table(2)[:2] == m.block_table(1)[:2]
    m.check_invariants()


def test_capacity_error_carries_the_arithmetic_and_changes_nothing():
    m = kv(8, pin_budget=2)
    m.admit(1, list(range(16)))
    m.admit(2, list(range(100, 108)))
    m.free(2)
    m.pin(7, list(range(100, 104)))
    before = m.stats()
    with pytest.raises(imp_mem.CapacityError) as e:
        m.admit(3, list(range(200, 220)))
    assert (e.value.needed, e.value.free, e.value.evictable, e.value.pinned) == (5, 2, 1, 1)
    assert e.value.pool == "kv"
    assert isinstance(e.value, imp_mem.ImpMemError)
    assert m.stats() == before
    assert not m.can_admit(list(range(200, 220)))
    with pytest.raises(imp_mem.CapacityError):
        m.append(1, list(range(40)))
    assert m.num_tokens(1) == 16 and m.stats() == before


def test_holes_keep_the_table_length_and_the_bytes_agree():
    m = kv()
    m.admit(1, list(range(17)))
    assert m.evict_middle(1, 1, 3) == 2
    table = m.block_table(1)
    assert len(table) == 5 and table[1:3] == [-1, -1]
    assert np.frombuffer(m.block_table_bytes(1), dtype=np.int32).tolist() == table
    with pytest.raises(imp_mem.InvalidArgument):
        m.evict_middle(1, 3, 9)
    m.free(1)
    assert m.stats()["cached"] == 2  # blocks 0 and 3; the holes are not cached
    m.check_invariants()


def test_swa_is_its_own_id_space_and_keeps_only_the_window():
    m = kv(32, swa_blocks=4, swa_window=8)
    m.admit(1, list(range(30)))
    swa = m.swa_table(1)
    assert len(swa) == 8 and swa[:5] == [-1] * 5 and min(swa[5:]) >= 0
    assert m.stats()["swa_live"] == 3
    with pytest.raises(imp_mem.CapacityError) as e:
        m.admit(2, list(range(100, 130)))
    assert e.value.pool == "swa"
    m.free(1)
    assert m.stats()["swa_live"] == 0


def test_pins_survive_eviction_until_unpinned():
    m = kv(9, pin_budget=4)
    for i, start in enumerate([0, 10, 20]):
        m.admit(i, list(range(start, start + 9)))
        m.free(i)
    assert m.pin(1, list(range(9))) == 2
    assert m.evict(100) == 4
    assert m.probe(list(range(9))) == 8
    assert m.unpin(1) == 2
    assert m.evict(100) == 2
    assert m.stats()["cached"] == 0


def test_extra_keys_separate_prefixes():
    m = kv()
    toks = list(range(9))
    m.admit(1, toks, cache_salt="tenant-a", lora_id=3)
    m.free(1)
    assert m.probe(toks, cache_salt="tenant-b", lora_id=3) == 0
    assert m.probe(toks, cache_salt=b"tenant-a", lora_id=3) == 8
    assert m.probe(toks, cache_salt="tenant-a") == 0
    img = [(4, 8, 0xABC)]
    with_img, plain = m.hash_blocks(toks, mm=img), m.hash_blocks(toks)
    assert len(plain) == 32  # two full blocks, 16 bytes each
    assert with_img[:16] == plain[:16]  # block 0 is before the image
    assert with_img[16:] != plain[16:]
    seq_hashes = [int.from_bytes(plain[i : i + 16], "little") for i in (0, 16)]
    m.admit(9, toks)
    assert m.sequence_hashes(9) == seq_hashes


def pattern(h: int, n: int) -> bytes:
    return hashlib.blake2b(h.to_bytes(16, "little"), digest_size=32).digest()[:n].ljust(n, b"\0")


@pytest.fixture
def backed():
    fake = imp_mem.FakeBackend(capacity=16 << 20)
    m = KVCacheManager(
        16, BS, backend=fake, block_bytes=32, model_fingerprint="m", dtype="bf16", layout="x"
    )
    return fake, m


def write_blocks(fake, m, seq, start=0):
    for i, h in enumerate(m.sequence_hashes(seq)):
        if i >= start:
            span = m.block_span(seq, i)
            if span is not None:
                fake.write(span[0], pattern(h, span[1]))


def test_save_load_round_trip_through_the_backend(backed, tmp_path):
    fake, m = backed
    m.admit(1, list(range(13)))
    write_blocks(fake, m, 1)
    m.free(1)
    path = tmp_path / "prefix.imp"
    assert m.save_prefix_cache(str(path)) == 3
    assert m.evict(100) == 3
    assert m.load_prefix_cache(path) == 3
    for h, _, addr in m.cached_blocks():
        assert fake.read(addr, 32) == pattern(h, 32)
    other = KVCacheManager(16, BS, backend=fake, block_bytes=32, model_fingerprint="other")
    with pytest.raises(imp_mem.InvalidArgument, match="model_fingerprint"):
        other.load_prefix_cache(path)
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    m.evict(100)
    before = m.stats()
    with pytest.raises(imp_mem.InvalidArgument, match="truncated"):
        m.load_prefix_cache(path)
    assert m.stats() == before


def test_threads_share_one_manager():
    import threading

    m = kv(4096)
    errors = []

    def worker(base: int) -> None:
        try:
            rng = np.random.default_rng(base)
            for i in range(300):
                sid = base * 10_000 + i
                toks = np.concatenate(
                    [np.arange(64, dtype=np.int32), rng.integers(0, 1000, 40, dtype=np.int32)]
                )
                m.admit(sid, toks)
                m.append(sid, [1, 2, 3])
                (m.free if i % 3 else m.abort)(sid)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = m.stats()
    assert s["sequences"] == 0 and s["active"] == 0 and s["prefix_hit_blocks"] > 0
    m.check_invariants()


class KVMachine(RuleBasedStateMachine):
    """The Python twin of the Rust proptest: the "engine" writes a pattern of
    each block's hash into it when it fills; blocks filled after a middle
    eviction get another pattern. A bleed is a byte mismatch."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = imp_mem.FakeBackend(capacity=16 << 20)
        self.m = KVCacheManager(
            20, BS, backend=self.fake, block_bytes=16, pin_budget=5, model_fingerprint="sm"
        )
        self.seqs: dict[int, dict] = {}
        self.next_id = 0
        self.file = None

    def _snapshot(self):
        tables = {s: (self.m.block_table(s), self.m.num_tokens(s)) for s in self.seqs}
        return self.m.stats(), tables, [c[0] for c in self.m.cached_blocks()]

    def _compute(self, sid: int) -> None:
        hashes = self.m.sequence_hashes(sid)
        st_ = self.seqs[sid]
        for i in range(st_["written"], len(hashes)):
            span = self.m.block_span(sid, i)
            if span is not None:
                h = hashes[i] if not st_["holed"] else hashes[i] ^ 1
                self.fake.write(span[0], pattern(h, span[1]))
        st_["written"] = len(hashes)

    def _refused(self, before, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (imp_mem.CapacityError, imp_mem.InvalidArgument):
            assert self._snapshot() == before, "a refused operation changed something (V5)"
            return None

    @rule(fam=st.integers(0, 3), n=st.integers(1, 28), dtype=st.sampled_from(["list", "i4", "i8"]))
    def admit(self, fam, n, dtype):
        toks = [(fam // 2) * 100 + i if i < 8 else fam * 1000 + i for i in range(n)]
        arg = toks if dtype == "list" else np.asarray(toks, dtype=dtype)
        sid = self.next_id
        self.next_id += 1
        fits = self.m.can_admit(arg)
        cached = self._refused(self._snapshot(), self.m.admit, sid, arg)
        assert fits == (cached is not None), "can_admit agrees with admit"
        if cached is not None:
            assert cached % BS == 0 and cached < n
            self.seqs[sid] = {"written": cached // BS, "holed": False}
            self._compute(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        start = self.m.num_tokens(sid)
        ok = self._refused(
            self._snapshot(), self.m.append, sid, array.array("i", range(start, start + n))
        )
        if ok is None and self.m.num_tokens(sid) == start + n:
            self._compute(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), abort=st.booleans())
    def free(self, data, abort):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        (self.m.abort if abort else self.m.free)(sid)
        del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), pct=st.integers(0, 100))
    def cache_computed(self, data, pct):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.cache_computed(sid, self.m.num_tokens(sid) * pct // 100)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), a=st.integers(0, 6), b=st.integers(0, 6))
    def evict_middle(self, data, a, b):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        n = self._refused(self._snapshot(), self.m.evict_middle, sid, a, b)
        if n is not None and b > a:
            self.seqs[sid]["holed"] = True

    @rule(owner=st.integers(0, 2), fam=st.integers(0, 3), n=st.integers(1, 28))
    def pin(self, owner, fam, n):
        toks = [(fam // 2) * 100 + i if i < 8 else fam * 1000 + i for i in range(n)]
        self._refused(self._snapshot(), self.m.pin, owner, toks)

    @rule(owner=st.integers(0, 2))
    def unpin(self, owner):
        self.m.unpin(owner)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        evictable = self.m.stats()["evictable"]
        assert self.m.evict(n) == min(n, evictable)

    @rule()
    def save_and_load(self):
        import os
        import tempfile

        saved = {c[0] for c in self.m.cached_blocks()}
        fd, path = tempfile.mkstemp()
        os.close(fd)
        try:
            self.m.save_prefix_cache(path)
            self.m.evict(1 << 30)
            before = self._snapshot()
            try:
                self.m.load_prefix_cache(path)
                assert saved <= {c[0] for c in self.m.cached_blocks()}
            except imp_mem.CapacityError:
                assert self._snapshot() == before
        finally:
            os.unlink(path)

    @invariant()
    def v4_and_ownership(self):
        s = self.m.stats()
        assert s["free"] + s["live"] == s["capacity"]
        assert s["sequences"] == len(self.seqs)
        self.m.check_invariants()

    @invariant()
    def bytes_match_hashes_and_sharing_is_by_hit(self):
        for h, _, addr in self.m.cached_blocks():
            assert self.fake.read(addr, 16) == pattern(h, 16)
        owner: dict[int, int] = {}
        for sid in self.seqs:
            hashes = self.m.sequence_hashes(sid)
            for i, b in enumerate(self.m.block_table(sid)):
                if b < 0:
                    continue
                h = hashes[i] if i < len(hashes) else None
                if b in owner:
                    assert h is not None and owner[b] == h, "block shared under two hashes"
                owner[b] = h if h is not None else -sid - 1

    def teardown(self):
        for sid in list(self.seqs):
            self.m.free(sid)
        for o in range(3):
            self.m.unpin(o)
        self.m.evict(1 << 30)
        s = self.m.stats()
        assert (s["live"], s["free"]) == (0, s["capacity"])


KVMachine.TestCase.settings = settings(
    max_examples=max(50, settings.default.max_examples // 5),
    stateful_step_count=40,
    deadline=None,
)
test_kv_state_machine = KVMachine.TestCase
