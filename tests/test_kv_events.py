"""KV events from Python: one batch per step, vLLM's schema and wire format.

A router-side index that replays the drained events must hold exactly the
manager's cached set after random admit / append / free / abort / commit /
evict / pin / reset sequences; every published payload must decode with a
consumer written from vLLM's published schema (msgpack arrays, the type
name first; msgspec's ``array_like`` structs where msgspec is installed);
and the ZMQ stream must carry topic, sequence number and payload, with
replay of missed batches."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import events as ev

BS = 4


def tokens(fam: int, n: int) -> list[int]:
    return [(fam // 2) * 100 + i if i < 8 else fam * 1000 + i for i in range(n)]


def cached_set(kv) -> set[tuple[int, str]]:
    return {(h, ev.MEDIUM_GPU) for h, _, _ in kv.cached_blocks()}


class Router:
    """What a KV-aware router keeps: (hash, medium) of every cached block."""

    def __init__(self) -> None:
        self.index: set[tuple[int, str]] = set()

    def apply(self, batch: ev.KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, ev.BlockStored):
                for h in e.block_hashes:
                    assert (h, e.medium) not in self.index, "stored twice"
                    self.index.add((h, e.medium))
            elif isinstance(e, ev.BlockRemoved):
                for h in e.block_hashes:
                    self.index.remove((h, e.medium))
            else:
                assert isinstance(e, ev.AllBlocksCleared)
                self.index.clear()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 3), st.integers(1, 30)),
        st.tuples(st.just("append"), st.integers(0, 99), st.integers(1, 9)),
        st.tuples(st.just("free"), st.integers(0, 99), st.integers(0, 100)),
        st.tuples(st.just("abort"), st.integers(0, 99), st.just(0)),
        st.tuples(st.just("commit"), st.integers(0, 99), st.integers(0, 100)),
        st.tuples(st.just("evict"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("pin"), st.integers(0, 3), st.integers(1, 30)),
        st.tuples(st.just("unpin"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("reset"), st.just(0), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


def run_ops(kv, script, on_batch) -> None:
    seqs: list[int] = []
    next_id = 0
    for op, a, b in script:
        try:
            if op == "admit":
                kv.admit(next_id, tokens(a, b))
                seqs.append(next_id)
                next_id += 1
            elif op == "append" and seqs:
                sid = seqs[a % len(seqs)]
                n = kv.num_tokens(sid)
                kv.append(sid, [7 * t + 3 for t in range(n, n + b)])
            elif op == "free" and seqs:
                sid = seqs.pop(a % len(seqs))
                kv.free(sid, kv.num_tokens(sid) * b // 100)
            elif op == "abort" and seqs:
                kv.abort(seqs.pop(a % len(seqs)))
            elif op == "commit" and seqs:
                sid = seqs[a % len(seqs)]
                kv.cache_computed(sid, kv.num_tokens(sid) * b // 100)
            elif op == "evict":
                kv.evict(a)
            elif op == "pin":
                kv.pin(a % 2, tokens(a, b))
            elif op == "unpin":
                kv.unpin(a % 2)
            elif op == "reset":
                kv.reset_prefix_cache()
            elif op == "step":
                on_batch(ev.drain(kv))
        except imp_mem.CapacityError:
            pass
    on_batch(ev.drain(kv))


@settings(max_examples=150, deadline=None)
@given(script=ops)
def test_a_router_replaying_the_events_holds_exactly_the_cached_set(script):
    kv = imp_mem.KVCacheManager(16, BS, kv_events=True, pin_budget=4)
    router = Router()

    def step(batch):
        router.apply(batch)
        assert router.index == cached_set(kv)
        for e in batch.events:
            if isinstance(e, ev.BlockStored):
                assert e.block_size == BS and e.medium == ev.MEDIUM_GPU
                assert len(e.token_ids) == BS * len(e.block_hashes)
                if e.parent_block_hash is None:
                    raw = kv.hash_blocks(e.token_ids)
                    assert [
                        int.from_bytes(raw[16 * i : 16 * i + 16], "little")
                        for i in range(len(raw) // 16)
                    ] == e.block_hashes

    run_ops(kv, script, step)
    kv.check_invariants()


def test_a_batch_names_the_stored_chain_and_the_stats_count_tokens():
    kv = imp_mem.KVCacheManager(8, BS, kv_events=True)
    kv.admit(1, tokens(0, 9), lora_id=3)
    assert kv.pending_events() == 0
    kv.free(1)
    batch = ev.drain(kv, data_parallel_rank=2)
    assert batch.data_parallel_rank == 2 and abs(batch.ts - time.time()) < 60
    (stored,) = batch.events
    raw = kv.hash_blocks(tokens(0, 9), lora_id=3)
    assert stored == ev.BlockStored(
        block_hashes=[int.from_bytes(raw[i : i + 16], "little") for i in (0, 16)],
        parent_block_hash=None,
        token_ids=tokens(0, 8),
        block_size=BS,
        lora_id=3,
        medium="GPU",
    )
    assert set(stored.block_hashes) == {h for h, _, _ in kv.cached_blocks()}
    assert kv.admit(2, tokens(0, 9), lora_id=3) == 8
    s = kv.stats()
    assert (s["prefix_query_tokens"], s["prefix_hit_tokens"]) == (18, 8)
    kv.abort(2)
    assert kv.reset_prefix_cache()
    assert ev.drain(kv).events == [ev.AllBlocksCleared()]


def test_reset_is_refused_while_a_cached_block_is_in_use():
    kv = imp_mem.KVCacheManager(8, BS, kv_events=True)
    kv.admit(1, tokens(0, 9))
    kv.free(1)
    kv.admit(2, tokens(0, 9))
    ev.drain(kv)
    assert not kv.reset_prefix_cache()
    assert kv.stats()["cached"] == 2 and ev.drain(kv).events == []


# ---------------------------------------------------------------- the wire


def vllm_consumer(payload: bytes) -> list[tuple]:
    """A consumer written from vLLM's schema alone: a batch is
    ``[ts, events(, data_parallel_rank)]``, an event a type-tagged array in
    field order; hashes are bytes (or ints)."""
    msgpack = pytest.importorskip("msgpack")
    raw = msgpack.unpackb(payload, raw=False)
    assert isinstance(raw, list) and len(raw) in (2, 3)
    assert isinstance(raw[0], float)
    out = []
    for e in raw[1]:
        tag = e[0]
        if tag == "BlockStored":
            assert len(e) == 7
            hashes, parent, token_ids, block_size, lora_id, medium = e[1:]
            assert all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
            assert parent is None or (isinstance(parent, bytes) and len(parent) == 16)
            assert len(token_ids) in (0, block_size * len(hashes))
            assert lora_id is None or isinstance(lora_id, int)
            out += [("stored", h, medium) for h in hashes]
        elif tag == "BlockRemoved":
            assert len(e) == 3
            out += [("removed", h, e[2]) for h in e[1]]
        else:
            assert tag == "AllBlocksCleared" and len(e) == 1
            out.append(("cleared", None, None))
    return out


@settings(max_examples=60, deadline=None)
@given(script=ops)
def test_every_payload_decodes_with_a_consumer_written_from_the_schema(script):
    pytest.importorskip("msgpack")
    kv = imp_mem.KVCacheManager(16, BS, kv_events=True, pin_budget=4)
    index: set[tuple[bytes, str]] = set()

    def step(batch):
        payload = ev.encode_batch(batch)
        assert ev.decode_batch(payload).events == batch.events
        for kind, h, medium in vllm_consumer(payload):
            if kind == "stored":
                index.add((h, medium))
            elif kind == "removed":
                index.remove((h, medium))
            else:
                index.clear()
        want = {(h.to_bytes(16, "big"), m) for h, m in cached_set(kv)}
        assert index == want

    run_ops(kv, script, step)


def test_int_hashes_are_the_low_64_bits():
    msgpack = pytest.importorskip("msgpack")
    kv = imp_mem.KVCacheManager(8, BS, kv_events=True)
    kv.admit(1, tokens(0, 5))
    kv.free(1)
    batch = ev.drain(kv)
    (h,) = batch.events[0].block_hashes
    raw = msgpack.unpackb(ev.encode_batch(batch, int_hashes=True))
    assert raw[1][0][1] == [h & (2**64 - 1)]
    assert len(raw) == 2, "no data_parallel_rank: omitted, as msgspec omits a default"


def test_payloads_decode_as_vllm_msgspec_structs():
    msgspec = pytest.importorskip("msgspec")
    from vllm_kv_schema import BlockRemoved, BlockStored, KVEventBatch

    kv = imp_mem.KVCacheManager(8, BS, kv_events=True)
    kv.admit(1, tokens(0, 13), lora_id=5)
    kv.free(1)
    kv.evict(1)
    kv.admit(2, tokens(2, 6))
    kv.abort(2)
    assert kv.reset_prefix_cache()
    batch = ev.drain(kv, data_parallel_rank=1)
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(ev.encode_batch(batch))
    assert decoded.data_parallel_rank == 1
    assert [type(e).__name__ for e in decoded.events] == ["AllBlocksCleared"]
    kv.admit(3, tokens(1, 9))
    kv.free(3)
    kv.evict(2)
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(ev.encode_batch(ev.drain(kv)))
    stored, removed = decoded.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.token_ids == tokens(1, 8) and stored.medium == "GPU"
    assert sorted(removed.block_hashes) == sorted(stored.block_hashes)


def test_zmq_carries_topic_sequence_and_payload_and_replays_missed_batches():
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    with tempfile.TemporaryDirectory() as d:
        endpoint = f"ipc://{os.path.join(d, 'kv')}"
        replay = f"ipc://{os.path.join(d, 'replay')}"
        kv = imp_mem.KVCacheManager(8, BS, kv_events=True)
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        with ev.ZmqEventPublisher(
            endpoint, topic="kv@rank0", data_parallel_rank=0, replay_endpoint=replay
        ) as pub:
            sub.connect(endpoint)
            # A SUB socket joins late: publish empty batches until one lands.
            deadline = time.time() + 10
            while not sub.poll(50):
                assert time.time() < deadline, "the subscriber never joined"
                pub.publish(ev.KVEventBatch(ts=time.time()))
            while sub.poll(200):
                sub.recv_multipart()
            first = pub.next_seq
            seen = []
            for i in range(3):
                kv.admit(i, tokens(i, 9))
                kv.free(i)
                assert pub.publish_from(kv) == first + i
            for i in range(3):
                assert sub.poll(5000)
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv@rank0"
                assert int.from_bytes(seq, "big") == first + i
                batch = ev.decode_batch(payload)
                assert batch.data_parallel_rank == 0
                seen += vllm_consumer(payload)
            assert {h for _, h, _ in seen} == {
                h.to_bytes(16, "big") for h, _, _ in kv.cached_blocks()
            }

            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay)
            dealer.send_multipart([b"", (first + 1).to_bytes(8, "big")])
            got = []
            deadline = time.time() + 10
            while True:
                pub.serve_replay(timeout_ms=50)
                if dealer.poll(50):
                    _, seq, payload = dealer.recv_multipart()
                    if seq == ev.ZmqEventPublisher.END_SEQ:
                        assert payload == b""
                        break
                    got.append(int.from_bytes(seq, "big"))
                assert time.time() < deadline, "no replay"
            assert got == [first + 1, first + 2]
            dealer.close(linger=0)
        sub.close(linger=0)
        with pytest.raises(RuntimeError, match="closed"):
            pub.publish(ev.KVEventBatch(ts=0.0))


def test_without_the_extra_the_events_say_what_to_install():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        sys.modules["msgpack"] = None
        sys.modules["zmq"] = None
        sys.modules["prometheus_client"] = None
        import imp_mem
        from imp_mem import events, prometheus
        kv = imp_mem.KVCacheManager(8, 4, kv_events=True)
        kv.admit(1, list(range(9)))
        kv.free(1)
        batch = events.drain(kv)
        assert len(batch.events) == 1
        for call in (
            lambda: events.encode_batch(batch),
            lambda: events.ZmqEventPublisher("ipc:///nonexistent/x"),
            lambda: prometheus.KVCacheCollector(kv),
        ):
            try:
                call()
            except ImportError as exc:
                print("HINT", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    hints = [line for line in proc.stdout.splitlines() if line.startswith("HINT")]
    assert len(hints) == 3, proc.stdout
    assert all("imp-mem[events]" in h for h in hints[:2]) and "imp-mem[prometheus]" in hints[2]
