"""Type stubs for the compiled module ``imp_mem._core``."""

from __future__ import annotations

import enum
import os
from types import TracebackType
from typing import Any, Literal, TypeAlias

__version__: str

ByteCount: TypeAlias = int | str
"""An int, or text such as ``"80GiB"``, ``"80 GB"``, ``"4096"``."""

TagName = Literal[
    "weights",
    "weight_cache",
    "kv_cache",
    "swa_cache",
    "state",
    "workspace",
    "scratch",
    "pinned_host",
    "other",
]

JournalRow = tuple[int, str, str, int, str]
"""``(seq, phase, tag, bytes, op)``; op is acquire, release, commit or decommit."""

def cuda_available() -> bool:
    """True when a CUDA driver and at least one device are present."""

class Phase(enum.Enum):
    """The engine's phase: LOADING -> PLANNING -> SERVING, never back."""

    LOADING = 0
    PLANNING = 1
    SERVING = 2

class Region:
    """Memory acquired from a backend, released exactly once."""

    @property
    def address(self) -> int:
        """Base address; never changes, even across growth."""
    @property
    def nbytes(self) -> int:
        """Bytes committed now (0 once released)."""
    @property
    def reserved(self) -> int:
        """Address space reserved."""
    @property
    def tag(self) -> str: ...
    @property
    def growable(self) -> bool: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None:
        """Release now; a second call raises InvalidArgument."""
    def commit(self, nbytes: ByteCount) -> None:
        """Grow the committed part to at least ``nbytes`` (growable regions)."""
    def decommit(self, nbytes: ByteCount) -> None:
        """Shrink the committed part to ``nbytes`` (growable regions)."""
    def __enter__(self) -> Region: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

class Replanning:
    """Context manager: a bracketed re-entry to PLANNING while serving."""

    def __enter__(self) -> Replanning: ...
    def __exit__(self, *args: Any) -> bool: ...

class Backend:
    """Methods every backend has (FakeBackend, CudaBackend, VmmBackend)."""

    def acquire(
        self, nbytes: ByteCount, *, align: int | None = None, tag: TagName = "other"
    ) -> Region:
        """Acquire ``nbytes`` aligned to ``align`` (default 256) for ``tag``."""
    def acquire_growable(
        self, reserve: ByteCount, initial: ByteCount | None = None, *, tag: TagName = "other"
    ) -> Region:
        """Reserve address space for ``reserve`` bytes and commit ``initial`` of them."""
    def release(self, region: Region) -> None: ...
    def stats(self) -> dict[str, Any]:
        """Totals, ``tags`` (per tag) and ``steady_state_allocations_total``."""
    @property
    def phase(self) -> Phase: ...
    def begin_planning(self) -> None: ...
    def begin_serving(self) -> None: ...
    def advance(self, phase: Phase) -> None: ...
    def replanning(self, reason: str = "model swap") -> Replanning: ...
    @property
    def budget(self) -> int: ...
    def set_budget(self, budget: ByteCount) -> None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def live(self) -> int: ...
    def journal(self) -> list[JournalRow] | None: ...
    def check_invariants(self) -> None: ...

class FakeBackend(Backend):
    """Host-memory backend for tests: journal, poison, fault injection, growth."""

    def __init__(
        self,
        capacity: ByteCount | None = None,
        *,
        budget: ByteCount | None = None,
        granularity: ByteCount | None = None,
        backed: bool = True,
        strict: bool = True,
    ) -> None: ...
    def fail_nth(self, n: int | None) -> None: ...
    def fail_commits(self, n: int = 1) -> None: ...
    def fail_decommits(self, n: int = 1) -> None: ...
    def set_external_usage(self, nbytes: ByteCount) -> None: ...
    def read(self, address: int, nbytes: int) -> bytes: ...
    def write(self, address: int, data: bytes | bytearray | memoryview) -> None: ...
    def is_poisoned(self, address: int, nbytes: int) -> bool: ...
    def quarantine(self) -> list[int]: ...
    @property
    def device_used(self) -> int: ...

TokenIds: TypeAlias = Any
"""Token ids: a list or tuple of ints, or any one-dimensional buffer of
integers (a NumPy integer array, ``array.array``, a ``memoryview``)."""

MmItem = tuple[int, int, int]
"""``(start, end, content_hash)``: a multimodal item's placeholder tokens."""

class KVCacheManager:
    """Paged KV: sequence block tables with holes, a prefix cache that owns
    its blocks, pins as an eviction overlay, an SWA pool, admission control
    and persistence. Thread-safe; heavy calls release the GIL."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        backend: Backend | None = None,
        block_bytes: int = 0,
        swa_blocks: int = 0,
        swa_window: int = 0,
        swa_block_bytes: int = 0,
        enable_prefix_caching: bool = True,
        hash_seed: int | None = None,
        pin_budget: int | None = None,
        model_fingerprint: str = "",
        dtype: str = "",
        layout: str = "",
    ) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    def admit(
        self,
        seq_id: int,
        tokens: TokenIds,
        *,
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
        mm: list[MmItem] | None = None,
    ) -> int:
        """Admits a sequence; returns the cached leading tokens. Raises
        ``CapacityError`` (``needed``, ``free``, ``evictable``, ``pinned``,
        ``pool``) and changes nothing when it does not fit."""
    def can_admit(
        self,
        tokens: TokenIds,
        *,
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
        mm: list[MmItem] | None = None,
    ) -> bool: ...
    def probe(
        self,
        tokens: TokenIds,
        *,
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
        mm: list[MmItem] | None = None,
    ) -> int:
        """Cached leading tokens now; a hint that takes no refs."""
    def append(self, seq_id: int, tokens: TokenIds) -> None: ...
    def can_append(self, seq_id: int, n: int) -> bool: ...
    def free(self, seq_id: int, computed_tokens: int | None = None) -> None: ...
    def abort(self, seq_id: int) -> None: ...
    def evict_middle(self, seq_id: int, start: int, end: int) -> int: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def block_table_bytes(self, seq_id: int) -> bytes: ...
    def swa_table(self, seq_id: int) -> list[int]: ...
    def num_tokens(self, seq_id: int) -> int: ...
    def sequences(self) -> list[int]: ...
    def sequence_hashes(self, seq_id: int) -> list[int]: ...
    def block_span(self, seq_id: int, index: int) -> tuple[int, int] | None: ...
    def cached_blocks(self) -> list[tuple[int, int, int | None]]: ...
    def hash_blocks(
        self,
        tokens: TokenIds,
        *,
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
        mm: list[MmItem] | None = None,
    ) -> list[int]: ...
    def pin(
        self,
        owner: int,
        tokens: TokenIds,
        *,
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
        mm: list[MmItem] | None = None,
    ) -> int: ...
    def unpin(self, owner: int) -> int: ...
    def evict(self, n: int) -> int: ...
    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int: ...
    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...
