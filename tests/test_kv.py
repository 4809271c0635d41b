"""KVCacheManager from Python: a prefix hit end to end, admission errors
with their arithmetic as exception attributes, holes and the block table's
bytes, SWA's own pool named in its error, cache salts as str or bytes, and
persistence through the backend. Token readers are in test_kv_tokens.py; the
rules (V4, V5, sharing only through prefix hits, bytes matching hashes) are
proved in Rust (``crates/imp-mem-core/tests/kv_props.rs``,
``src/kv/tests.rs``)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import imp_mem
from imp_mem import KVCacheManager

BS = 4


def kv(num_blocks: int = 32, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kw)


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


def test_try_admit_is_admit_that_answers_none_when_it_does_not_fit():
    m = kv(8)
    assert m.try_admit(1, list(range(16))) == 0
    m.free(1)
    assert m.try_admit(2, np.arange(17, dtype=np.int32)) == 16
    before = m.stats()
    for toks in (list(range(200, 220)), np.arange(200, 220, dtype=np.int32)):
        assert m.try_admit(3, toks) is None
        assert m.stats() == before and 3 not in m.sequences()
    m.free(2)
    assert m.try_admit(3, list(range(200, 220))) == 0  # room again
    with pytest.raises(imp_mem.InvalidArgument):
        m.try_admit(3, [1])  # already admitted: an error, not a refusal
    with pytest.raises(imp_mem.InvalidArgument):
        m.try_admit(4, np.array([1, -7], dtype=np.int32))
    with pytest.raises(imp_mem.InvalidArgument):
        m.try_admit(4, [1], mm=[(2, 2, 9)])
    s = kv(32, swa_blocks=2, swa_window=8)
    assert s.try_admit(1, list(range(30))) is None  # the SWA pool's refusal
    m.check_invariants()


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
