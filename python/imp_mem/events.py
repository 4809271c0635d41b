"""KV events for a KV-aware router, in vLLM's schema and on vLLM's wire.

A ``KVCacheManager`` built with ``kv_events=True`` records, in Rust, what
enters and leaves its prefix cache; the engine takes one batch per step
(:func:`drain`, no Python call per block) and may publish it with
:class:`ZmqEventPublisher`, which speaks vLLM's ZMQ format, so a router that
consumes vLLM's stream consumes ours.

The schema is vLLM's (``vllm.distributed.kv_events``), field for field:
``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium)``, ``BlockRemoved(block_hashes, medium)``,
``AllBlocksCleared()``, carried in ``KVEventBatch(ts, events,
data_parallel_rank)``. On the wire each is a msgpack array: an event is its
type name followed by its fields in that order, a batch ``[ts, events]``
plus ``data_parallel_rank`` when it is set. ``medium`` is ``"GPU"`` for the
device pool, ``"CPU"`` for the host tier, ``"STORAGE"`` for the disk
tier. A block hash, 128 bits here, is sent as 16 big-endian bytes (vLLM
sends its hashes as bytes by default), or, with ``int_hashes=True``, as its
low 64 bits (vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

A ZMQ message is three frames: the topic, the batch's sequence number (8
bytes, big-endian, from 0) and the msgpack payload. With a replay endpoint, a
ROUTER socket answers a request carrying a starting sequence number (8
bytes, big-endian) with every buffered batch from there, then the end
marker ``-1`` and an empty payload; it is served from :meth:`publish` and
:meth:`ZmqEventPublisher.serve_replay` (no thread of its own).

``msgpack`` and ``pyzmq`` are the ``imp-mem[events]`` extra, imported on
first use; the event types and :func:`drain` need neither.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from imp_mem._core import KVCacheManager

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "ZmqEventPublisher",
    "decode_batch",
    "drain",
    "encode_batch",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

_LOW64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockStored:
    """Blocks became cached: a chain whose first block's parent is
    ``parent_block_hash`` (None for a prompt's first block, or unknown)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the cache of ``medium``."""

    block_hashes: list[int]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block left the cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    """The events of one engine step."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _event(raw: tuple) -> KVEvent:
    kind = raw[0]
    if kind == "BlockStored":
        return BlockStored(*raw[1:])
    if kind == "BlockRemoved":
        return BlockRemoved(*raw[1:])
    return AllBlocksCleared()


def drain(kv: KVCacheManager, *, data_parallel_rank: int | None = None) -> KVEventBatch:
    """The events ``kv`` recorded since the last drain, as one batch stamped
    now. Call it once per engine step."""
    return KVEventBatch(
        ts=time.time(),
        events=[_event(e) for e in kv.drain_events()],
        data_parallel_rank=data_parallel_rank,
    )


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError as exc:
        raise ImportError(
            "imp_mem.events needs msgpack to encode events; install imp-mem[events]"
        ) from exc
    return msgpack


def _wire_hash(h: int, int_hashes: bool) -> bytes | int:
    return h & _LOW64 if int_hashes else h.to_bytes(16, "big")


def _wire_event(e: KVEvent, int_hashes: bool) -> list:
    if isinstance(e, BlockStored):
        parent = e.parent_block_hash
        return [
            "BlockStored",
            [_wire_hash(h, int_hashes) for h in e.block_hashes],
            None if parent is None else _wire_hash(parent, int_hashes),
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.medium,
        ]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", [_wire_hash(h, int_hashes) for h in e.block_hashes], e.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: KVEventBatch, *, int_hashes: bool = False) -> bytes:
    """The msgpack payload of ``batch`` in vLLM's array layout."""
    body: list[Any] = [batch.ts, [_wire_event(e, int_hashes) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return _msgpack().packb(body, use_bin_type=True)


def _read_hash(h: bytes | int) -> int:
    return int.from_bytes(h, "big") if isinstance(h, (bytes, bytearray)) else int(h)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Reads a payload of :func:`encode_batch` (or vLLM's) back; hashes come
    back as ints (the low 64 bits only if they were sent as ints)."""
    raw = _msgpack().unpackb(payload, raw=False)
    events: list[KVEvent] = []
    for e in raw[1]:
        kind = e[0]
        if kind == "BlockStored":
            hashes, parent, tokens, block_size, lora_id, medium = e[1:7]
            events.append(
                BlockStored(
                    [_read_hash(h) for h in hashes],
                    None if parent is None else _read_hash(parent),
                    list(tokens),
                    block_size,
                    lora_id,
                    medium,
                )
            )
        elif kind == "BlockRemoved":
            events.append(BlockRemoved([_read_hash(h) for h in e[1]], e[2]))
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
    rank = raw[2] if len(raw) > 2 else None
    return KVEventBatch(ts=raw[0], events=events, data_parallel_rank=rank)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(
            "imp_mem.events.ZmqEventPublisher needs pyzmq; install imp-mem[events]"
        ) from exc
    return zmq


class ZmqEventPublisher:
    """Publishes KV event batches on a ZMQ PUB socket in vLLM's format.

    ``endpoint`` is bound when it has a wildcard or is ``ipc://`` /
    ``inproc://``, connected otherwise (vLLM's rule). ``topic`` is the first
    frame of every message. ``data_parallel_rank`` stamps batches that carry
    none. ``replay_endpoint`` (bound, ROUTER) serves the last
    ``buffer_steps`` batches to a subscriber that missed some.

    Not thread-safe: publish from the engine's loop.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        topic: str = "",
        data_parallel_rank: int | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        int_hashes: bool = False,
    ) -> None:
        zmq = _zmq()
        _msgpack()
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        bind = any(c in endpoint for c in ("*", "::")) or endpoint.startswith(
            ("ipc://", "inproc://")
        )
        if bind:
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._int_hashes = int_hashes
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closed = False

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._seq

    def publish(self, batch: KVEventBatch) -> int:
        """Sends ``batch`` (an empty one too: it tells subscribers the stream
        is alive); returns its sequence number."""
        if self._closed:
            raise RuntimeError("this ZmqEventPublisher is closed")
        if batch.data_parallel_rank is None and self._rank is not None:
            batch.data_parallel_rank = self._rank
        payload = encode_batch(batch, int_hashes=self._int_hashes)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.serve_replay()
        return seq

    def publish_from(self, kv: KVCacheManager) -> int:
        """Drains ``kv`` and publishes the batch: once per engine step."""
        return self.publish(drain(kv))

    def serve_replay(self, timeout_ms: int = 0) -> int:
        """Answers the replay requests waiting (for up to ``timeout_ms`` for
        the first); returns how many were served."""
        if self._replay is None:
            return 0
        served = 0
        while self._replay.poll(timeout_ms if served == 0 else 0):
            frames = self._replay.recv_multipart()
            served += 1
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", self.END_SEQ, b""))
        return served

    def close(self) -> None:
        """Closes the sockets (pending messages are dropped after 100 ms)."""
        if self._closed:
            return
        self._closed = True
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()
