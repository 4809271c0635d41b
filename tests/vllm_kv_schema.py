"""vLLM's KV event types as it publishes them (``vllm.distributed.kv_events``):
msgspec structs, ``array_like`` and tagged by class name. A consumer written
from this schema decodes our payloads in ``test_kv_events.py``. Imported only
where msgspec is installed."""

# No `from __future__ import annotations`: msgspec evaluates these at run
# time (`X | None` evaluates there since Python 3.10).
import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
