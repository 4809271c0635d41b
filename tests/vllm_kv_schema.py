"""vLLM's KV event types as it publishes them (``vllm.distributed.kv_events``):
msgspec structs, ``array_like`` and tagged by class name. A consumer written
from this schema decodes our payloads in ``test_kv_events.py``. Imported only
where msgspec is installed."""

# No `from __future__ import annotations`: msgspec evaluates these at run
# time, and `X | None` needs Python 3.10 (the package supports 3.9).
from typing import Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
