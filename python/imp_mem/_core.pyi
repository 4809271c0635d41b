"""Type stubs for the compiled module ``imp_mem._core``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeAlias, final, overload

from typing_extensions import disjoint_base

__version__: str

ByteCount: TypeAlias = int | str
StrOrBytesPath: TypeAlias = str | bytes | os.PathLike[str] | os.PathLike[bytes]
"""An int, or text such as ``"80GiB"``, ``"80 GB"``, ``"4096"``."""

TagName = Literal[
    "weights",
    "weight_cache",
    "kv_cache",
    "swa_cache",
    "state",
    "workspace",
    "scratch",
    "activations",
    "pinned_host",
    "other",
]

KvEventTuple: TypeAlias = (
    tuple[str, list[int], int | None, list[int], int, int | None, str]
    | tuple[str, list[int], str]
    | tuple[str]
)
"""``("BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium)``, ``("BlockRemoved", block_hashes, medium)`` or
``("AllBlocksCleared",)``; hashes are the 128-bit block hashes."""

JournalRow = tuple[int, str, str, int, str]
"""``(seq, phase, tag, bytes, op)``; op is acquire, release, commit or decommit."""

def cuda_available() -> bool:
    """True when a CUDA driver and at least one device are present."""

@final
class Phase:
    """The engine's phase: LOADING -> PLANNING -> SERVING, never back."""

    LOADING: ClassVar[Phase]
    PLANNING: ClassVar[Phase]
    SERVING: ClassVar[Phase]
    def __int__(self) -> int: ...

@final
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

@final
class Replanning:
    """Context manager: a bracketed re-entry to PLANNING while serving."""

    def __enter__(self) -> Replanning: ...
    def __exit__(self, *args: Any) -> bool: ...

@disjoint_base
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
    def attach_ledger(self, tenant: LedgerTenant) -> None:
        """Commits through a device ledger tenant from now on."""
    def headroom(self) -> int:
        """Bytes it could commit now (budget, and the ledger's grant)."""
    def detach_ledger(self) -> None:
        """Stops committing through the ledger (nothing may be committed)."""
    @property
    def capacity(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def growable(self) -> bool: ...
    @property
    def device(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def live(self) -> int: ...
    def enable_journal(self) -> None:
        """Keep the journal from now on (a fake keeps it from the start)."""
    def journal(self) -> list[JournalRow] | None: ...
    def check_invariants(self) -> None: ...

@final
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
    def fail_nth(self, n: int | None) -> None:
        """Make the ``n``-th acquisition from now fail (1 = the next); None clears."""
    def fail_commits(self, n: int | None = 1) -> None:
        """Make the next ``n`` commits fail; 0 clears; None is the default, 1."""
    def fail_decommits(self, n: int | None = 1) -> None:
        """Make the next ``n`` decommits fail; 0 clears; None is the default, 1."""
    def set_external_usage(self, nbytes: ByteCount) -> None: ...
    def read(self, address: int, nbytes: int) -> bytes: ...
    def write(self, address: int, data: bytes | bytearray | memoryview) -> None: ...
    def is_poisoned(self, address: int, nbytes: int) -> bool: ...
    def quarantine(self) -> list[int]: ...
    @property
    def device_used(self) -> int: ...

TokenIds: TypeAlias = Any
"""Token ids in ``0..=4294967295``: a list or tuple of ints (``int``
subclasses and objects with ``__index__``, such as NumPy integer scalars,
count as ints; ``bool`` and ``float`` are refused), or any one-dimensional
buffer of integers (a NumPy integer array, ``array.array``, a
``memoryview``)."""

MmItem = tuple[int, int, int]
"""``(start, end, content_hash)``: a multimodal item's placeholder tokens."""

def _set_numpy_direct(enabled: bool) -> bool:
    """Test hook: read int32/uint32 NumPy arrays straight from the array
    (the default) or through the buffer protocol like any other buffer;
    returns the previous setting."""

def _numpy_direct_active() -> bool:
    """Test hook: whether int32/uint32 NumPy arrays are read straight from
    the array now (the hook on, NumPy imported and its layout self-checked)."""

def _set_buffer_protocol(enabled: bool) -> bool:
    """Test hook: read token buffers in place through the buffer protocol
    (the default) or copy them, as a strided view is; returns the previous
    setting."""

def _set_list_direct(enabled: bool) -> bool:
    """Test hook: read lists and tuples of ints straight from the objects'
    C structs (the default, on CPython 3.9-3.14 once self-checked) or
    through the limited API's item and int calls; returns the previous
    setting."""

def _list_direct_active() -> bool:
    """Test hook: whether lists and tuples of ints are read straight from
    the objects now (the hook on, the interpreter's layout self-checked)."""

@final
class KVCacheManager:
    """Paged KV: sequence block tables with holes, a prefix cache that owns
    its blocks, pins as an eviction overlay, an SWA pool, admission control
    and persistence. Thread-safe; heavy calls release the GIL.

    A keyword argument given as None takes its default, as everywhere in
    this API: ``block_bytes=None`` is ``block_bytes=0`` (the manager keeps
    ids only, with no backing pool)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        backend: Backend | None = None,
        block_bytes: int | None = 0,
        swa_blocks: int | None = 0,
        swa_window: int | None = 0,
        swa_block_bytes: int | None = 0,
        enable_prefix_caching: bool | None = True,
        hash_seed: int | None = None,
        pin_budget: int | None = None,
        model_fingerprint: str = "",
        dtype: str = "",
        layout: str = "",
        kv_events: bool = False,
        host_blocks: int = 0,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
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
        """Admits a sequence; returns the cached leading tokens (host-tier
        hits included: call ``wait_onboarding(seq_id)`` before its first
        step). Raises ``CapacityError`` (``needed``, ``free``, ``evictable``,
        ``pinned``, ``pool``) and changes nothing when it does not fit."""
    def try_admit(
        self,
        seq_id: int,
        tokens: TokenIds,
        *,
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
        mm: list[MmItem] | None = None,
    ) -> int | None:
        """``admit``, or ``None`` (and nothing changed) when it does not fit:
        one call where ``can_admit`` then ``admit`` would hash the prompt
        twice. Other errors still raise."""
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
    def append_each(self, seq_ids: Sequence[int] | Any, tokens: TokenIds) -> int:
        """Appends ``tokens[i]`` to ``seq_ids[i]`` in order; stops at the first
        sequence the pools cannot take and returns how many were appended."""
    def can_append(self, seq_id: int, n: int) -> bool: ...
    def free(self, seq_id: int, computed_tokens: int | None = None) -> None: ...
    def cache_computed(self, seq_id: int, computed_tokens: int) -> int:
        """Caches the full computed blocks of a running sequence now."""
    def abort(self, seq_id: int) -> None: ...
    def evict_middle(self, seq_id: int, start: int, end: int) -> int: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def block_table_bytes(self, seq_id: int) -> bytes: ...
    def swa_table(self, seq_id: int) -> list[int]: ...
    @overload
    def block_tables(
        self,
        seq_ids: Sequence[int] | Any,
        out: None = None,
        *,
        pool: Literal["full", "swa"] = "full",
    ) -> Any:
        """A new NumPy int32 array ``[len(seq_ids), longest row]``, padded with -1."""
    @overload
    def block_tables(
        self, seq_ids: Sequence[int] | Any, out: Any, *, pool: Literal["full", "swa"] = "full"
    ) -> int:
        """Writes the batch's block tables (or SWA tables) into ``out``, a
        writable C-contiguous int32 buffer ``[len(seq_ids), width]``, padded
        with -1; returns the columns used. An unknown id or a too-narrow
        ``out`` raises ``InvalidArgument``, a non-int32 ``out`` ``TypeError``;
        a refused call writes nothing."""
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
    ) -> bytes:
        """The chained hashes of the full blocks, 16 little-endian bytes each."""
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
    def evict(self, n: int) -> int:
        """Evicts up to ``n`` LRU cached blocks; with a host tier they are
        copied there (device blocks free after a later ``poll_copies()``)."""
    def give_back(
        self, nbytes: ByteCount, keep_blocks: int | None = None, fence: Fence | None = None
    ) -> int:
        """Decommits about ``nbytes``: the free tail, then prefix-cache chunks."""
    def reserve_free(self, blocks: int) -> bool:
        """Makes ``blocks`` free now (growing); False, nothing changed, if not."""
    def ledger_tick(self, keep_blocks: int | None = None, fence: Fence | None = None) -> int:
        """Records KV live bytes and answers the ledger's pressure."""
    def save_prefix_cache(self, path: StrOrBytesPath) -> int: ...
    def load_prefix_cache(self, path: StrOrBytesPath) -> int: ...
    def drain_events(self) -> list[KvEventTuple]:
        """The KV events since the last call, oldest first, each a tuple in
        the field order of vLLM's event (``imp_mem.events`` wraps them).
        Empty unless built with ``kv_events=True``."""
    def pending_events(self) -> int: ...
    def poll_copies(self, wait: bool = False) -> int:
        """Finishes the host tier's completed copies (all, waiting, with
        ``wait=True``): offloaded blocks' device blocks are free again, their
        hashes host hits. Once per engine step; returns device blocks freed."""
    def onboarding(self, seq_id: int) -> list[int]:
        """The host-to-device copies ``seq_id``'s blocks still wait for."""
    def wait_onboarding(self, seq_id: int, stream: int | None = None) -> int:
        """Waits for ``seq_id``'s onboarding on the host, or makes CUDA
        stream ``stream`` wait for it; returns the copies waited on."""
    def host_cached_blocks(self) -> list[int]:
        """Hashes resident in the host tier, least recently used first."""
    def disk_cached_blocks(self) -> list[int]:
        """Hashes in the disk tier (one prefix-cache file each under
        ``disk_dir``), least recently written first."""
    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache when no cached block is in use or
        pinned; False (nothing changed) otherwise."""
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...

# ---------------------------------------------------------------- tiers (L2/L3)

DTypeLike: TypeAlias = Any
"""A dtype name (``"float16"``), a NumPy dtype or scalar type, or a torch dtype."""

@final
class Tier:
    """The lifetime tiers (T1 weights, T2 engine buffers, T3 pools, T4 scratch,
    T4a activations, T5b pinned host)."""

    MODEL_RESIDENT: ClassVar[Tier]
    ENGINE_PERSISTENT: ClassVar[Tier]
    POOLED: ClassVar[Tier]
    SCRATCH: ClassVar[Tier]
    ACTIVATIONS: ClassVar[Tier]
    PINNED_HOST: ClassVar[Tier]
    def __int__(self) -> int: ...
    @property
    def label(self) -> str:
        """``T1``, ``T2``, ``T3``, ``T4``, ``T4a`` or ``T5b``."""

@final
class StableSpan:
    """Memory whose address a tier allocator promises is stable while the span
    is valid. Minted only by the tiers; no public constructor. Used after its
    arena was reset, its mark closed or its block ref released, it raises
    StaleSpan."""

    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def address(self) -> int:
        """The first address; raises StaleSpan when no longer valid."""
    @property
    def valid(self) -> bool: ...
    @property
    def device(self) -> tuple[int, int]:
        """``(device_type, device_id)``: kDLCPU=1, kDLCUDA=2, kDLCUDAHost=3."""
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the bytes (uint8, 1-D); it keeps the memory alive."""
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3, for device memory only (AttributeError otherwise)."""
    def view(self, dtype: DTypeLike, shape: int | tuple[int, ...] | None = None) -> TensorView:
        """A typed view for export; the shape defaults to as many elements as fit."""
    def subspan(self, offset: int, nbytes: int | None = None) -> StableSpan: ...
    def as_device(self) -> DeviceSpan:
        """Widen to a DeviceSpan; there is no conversion back."""

@final
class DeviceSpan:
    """Memory with no stability promise: what a StableSpan widens to."""

    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def valid(self) -> bool: ...
    @property
    def device(self) -> tuple[int, int]: ...
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def view(self, dtype: DTypeLike, shape: int | tuple[int, ...] | None = None) -> TensorView: ...
    def subspan(self, offset: int, nbytes: int | None = None) -> DeviceSpan: ...

@final
class TensorView:
    """A typed, shaped view of a span, exported through DLPack / CAI."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

@final
class Arena:
    """A bump arena for T1 (model-resident) or T2 (engine-persistent): takes
    are O(1), ``reset()`` frees everything at once and makes older spans stale."""

    def __init__(
        self,
        backend: Backend,
        nbytes: ByteCount,
        *,
        tier: Tier = Tier.MODEL_RESIDENT,
        tag: TagName | None = None,
    ) -> None: ...
    def take(self, nbytes: ByteCount, align: int | None = None) -> StableSpan:
        """``nbytes`` aligned to ``align`` (default 256); CapacityError when full."""
    def reset(self, *, unsafe_allow_live_exports: bool = False) -> None:
        """Frees everything; refused (``InvalidArgument``) while DLPack
        exports of the arena are alive, unless ``unsafe_allow_live_exports``
        (unsafe: those views then read what the arena hands out next)."""
    @property
    def live_exports(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def used(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def high_water(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def tier(self) -> Tier: ...
    @property
    def tag(self) -> str: ...

@final
class BlockRef:
    """One reference to a live block. ``share()`` is the only alias; a second
    ``release()`` raises InvalidArgument."""

    @property
    def id(self) -> int: ...
    @property
    def refcount(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def share(self) -> BlockRef: ...
    def release(self) -> None: ...
    def span(self) -> StableSpan:
        """The block's bytes, valid while this ref is held (not in slots mode)."""
    def __enter__(self) -> BlockRef: ...
    def __exit__(self, *args: Any) -> bool: ...

@final
class BlockRefs:
    """A batch of refs from ``allocate_many``, released together."""

    @property
    def ids(self) -> list[int]: ...
    def __len__(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def share(self) -> BlockRefs: ...
    def release(self) -> None: ...
    def split(self) -> list[BlockRef]:
        """One BlockRef per block; the batch is released (no count changes)."""
    def span(self, i: int) -> StableSpan: ...
    def __enter__(self) -> BlockRefs: ...
    def __exit__(self, *args: Any) -> bool: ...

@final
class BlockPool:
    """A refcounted pool of fixed-size blocks (T3), O(1) allocate and release."""

    def __init__(
        self,
        backend: Backend,
        block_bytes: ByteCount,
        blocks: int,
        *,
        max_blocks: int | None = None,
        grow_blocks: int | None = None,
        tag: TagName | None = None,
        min_idle_steps: int | None = None,
        keep_chunks: int | None = None,
    ) -> None:
        """``min_idle_steps`` (default 256) and ``keep_chunks`` (default 1)
        set the shrink policy of a growable pool (see ``step``)."""
    @staticmethod
    def slots(blocks: int) -> BlockPool:
        """An id space only: free list and refcounts, no memory."""
    def span(self) -> StableSpan:
        """The whole reservation (``max_blocks * block_bytes`` from the base,
        which never moves); only committed blocks, whose ids you hold, may be
        touched."""
    def view(self, dtype: DTypeLike, block_shape: int | Sequence[int]) -> TensorView:
        """A typed view ``[max_blocks, *block_shape]`` of the whole pool, for
        DLPack / ``__cuda_array_interface__``; ``block_shape`` must fill exactly
        ``block_bytes``. Valid across growth; touch only committed blocks."""
    def step(self, fence: Fence | Any | None = None) -> int:
        """One engine step of the shrink policy; call it once per step with a
        fence recorded after the step's work was enqueued: an ``imp_mem.Fence``,
        an event with ``query()`` / ``synchronize()`` (``torch.cuda.Event``),
        or None (nothing in flight). After ``min_idle_steps`` steps with more than ``keep_chunks``
        spare chunks above the highest live block, the free tail is
        withdrawn and decommitted once its fence completes. Returns the bytes
        decommitted during this call."""
    def shrink(self, fence: Fence | Any | None = None) -> int:
        """Shrink to the highest live block now (never below the initial
        blocks), bypassing the hysteresis; the decommit still waits for
        ``fence``. Returns the bytes decommitted during this call."""
    def flush_decommit(self) -> int:
        """Wait for a pending decommit's fence and decommit; bytes returned."""
    def limit_blocks(self, max_blocks: int) -> None:
        """Lowers the most blocks the pool may grow to, at least the blocks
        committed now (the reservation and every address stay)."""
    def set_decommit_policy(
        self, min_idle_steps: int | None = None, keep_chunks: int | None = None
    ) -> None: ...
    @property
    def decommit_policy(self) -> dict[str, int]: ...
    def allocate(self) -> BlockRef: ...
    def allocate_many(self, n: int) -> BlockRefs:
        """All or nothing: CapacityError leaves the pool unchanged."""
    def release(self, block: BlockRef | BlockRefs) -> None: ...
    def refcount(self, id: int) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def check_invariants(self) -> None: ...
    @property
    def free(self) -> int: ...
    @property
    def live(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...

@final
class Mark:
    """An open scratch mark; rewinds on ``rewind()`` or leaving ``with``."""

    def take(self, nbytes: ByteCount, align: int | None = None) -> StableSpan: ...
    def rewind(self) -> None:
        """Out of LIFO order this raises InvalidArgument and stops the stack
        until ``reset()`` (V6)."""
    @property
    def open(self) -> bool: ...
    def __enter__(self) -> Mark: ...
    def __exit__(self, *args: Any) -> bool: ...

@final
class ScratchStack:
    """A LIFO scratch stack (T4); its high-water mark sizes the plan."""

    def __init__(
        self, backend: Backend, nbytes: ByteCount, *, tag: TagName | None = None
    ) -> None: ...
    def mark(self) -> Mark: ...
    def reset(self) -> None: ...
    def reset_high_water(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def used(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def high_water(self) -> int: ...

@final
class ActivationPool:
    """A general-purpose, stream-ordered sub-allocator (TLSF, 512-B granule by
    default) over one region of tag ``activations`` (T4a): what torch's and
    CuPy's own allocations go through, via the C hooks once ``install()``-ed.
    ``strict=None`` follows the backend's phase mode: strict refuses on
    exhaustion (``OutOfMemory``; the hooks return null), production falls back
    to a backend acquisition (counted while SERVING).

    A *measured* pool (``measure_chunk=``, a growable backend): ``capacity``
    is reserved as address space and committed in chunks of
    ``measure_chunk`` bytes as blocks reach past the committed end
    (addresses never move); ``freeze(margin)`` fixes it at its
    ``high_water`` plus ``margin``, rounded up to a chunk, and decommits the
    rest. Route a torch ``MemPool`` into one with ``imp_mem.torch.region``
    (``measure_chunk=``) or ``imp_mem.torch.serve``."""

    def __init__(
        self,
        backend: Backend,
        capacity: ByteCount,
        *,
        strict: bool | None = None,
        align: int | None = None,
        growable: bool | None = None,
        measure_chunk: ByteCount | None = None,
    ) -> None: ...
    @property
    def measuring(self) -> bool:
        """A measured pool not frozen yet: it commits chunks as it grows."""
    @property
    def high_water(self) -> int:
        """The highest end offset any block has reached (bytes)."""
    def reset_high_water(self) -> None:
        """Starts ``high_water`` again from the blocks live now (after a
        compile or a first warm-up whose temporaries are gone); the freeze
        then decommits the chunks only that needed. A no-op unless measuring."""
    @property
    def committed(self) -> int:
        """Bytes committed now."""
    @property
    def frozen(self) -> dict[str, int] | None:
        """What ``freeze`` fixed (``high_water``, ``margin``, ``size``,
        ``committed_before``, ``decommitted``), or None before it."""
    def freeze(self, margin: ByteCount = 0) -> dict[str, int]:
        """Fixes a measured pool at ``high_water + margin`` rounded up to a
        chunk: exactly that is committed, the rest decommitted, nothing live
        moves, nothing is committed after. InvalidArgument on a pool that does
        not measure, was frozen, or sleeps."""
    def record_pass(self) -> None:
        """Starts recording a pass of repeated work: every allocation and
        free until ``plan_pass()``. Installed hints are dropped."""
    @property
    def recording(self) -> bool:
        """Whether a pass is being recorded."""
    def plan_pass(self) -> dict[str, int | bool]:
        """Ends the recording and lays the pass out offline, every lifetime
        known; installs the layout as placement hints when it needs less
        than the recorded high-water (measuring: the high-water becomes the
        layout's top, so a freeze fixes the pool there) or fits the capacity
        (fixed). Keys: ``allocations``, ``hinted``, ``ops``, ``live_peak``,
        ``top``, ``recorded_high_water`` (bytes), ``installed``.
        InvalidArgument when no pass is being recorded."""
    @property
    def pass_hints(self) -> dict[str, int] | None:
        """The installed hints' counters (``hints``, ``hits``, ``misses``,
        ``refused``), or None."""
    def drop_pass_plan(self) -> None:
        """Drops the hints and any recording: the ordinary search again."""
    def allocate(self, nbytes: ByteCount, stream: int | None = None) -> int:
        """An address of at least ``nbytes`` for work on ``stream`` (a raw
        ``cudaStream_t``; 0 is the legacy default stream)."""
    def free(self, ptr: int, stream: int | None = None) -> None:
        """Frees an address ``allocate`` returned; anything else raises
        InvalidArgument and changes nothing."""
    def size_of(self, ptr: int) -> int | None:
        """The requested size of the live allocation at ``ptr``, or None."""
    def stats(self) -> dict[str, int]: ...
    def memory_stats(self) -> dict[str, int]:
        """The counters under ``torch.cuda.memory_stats`` key names."""
    def reset_peak(self) -> None: ...
    def check_invariants(self) -> None: ...
    def install(self, device: int | None = None, weights_arena: Arena | None = None) -> None:
        """Routes the C hooks to this pool for ``device`` (replacing any)."""
    def pause(self, cpu_backup: bool = True) -> int:
        """Give the region's physical memory back, its addresses kept; with
        ``cpu_backup`` the live blocks' bytes are copied to pinned host memory
        first and ``resume()`` restores them. Allocations raise ``Asleep``
        (the hooks return null) until ``resume()``. Synchronise first. Needs
        ``growable=True`` on a VMM backend. Returns the bytes copied."""
    def resume(self) -> None:
        """Recommit at the same addresses (and restore the bytes after a
        ``cpu_backup`` pause); on failure it stays paused and can retry."""
    @property
    def asleep(self) -> int | None: ...
    @property
    def host_bytes(self) -> int: ...
    def release_host_copy(self) -> int:
        """Free the pinned buffer kept after a resume; the bytes freed."""
    def pin_host_copy(self, nbytes: ByteCount | None = None) -> int:
        """Pin the buffer the next ``pause(cpu_backup=True)`` copies into, ahead
        of it (default: the live blocks' bytes now); the size kept, 0 while
        paused. Releases the GIL while pinning."""
    def host_copy_address(self, ptr: int, nbytes: int) -> int | None:
        """The host address of the copy of ``nbytes`` device bytes at ``ptr``
        (inside one live block): while paused with a CPU backup, or after the
        resume while the buffer is kept; None otherwise."""
    @property
    def id(self) -> int: ...
    @property
    def installed(self) -> bool: ...
    @property
    def capacity(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def strict(self) -> bool: ...
    @property
    def align(self) -> int: ...
    @property
    def tag(self) -> str: ...

TORCH_MALLOC_SYMBOL: str
"""``imp_mem_torch_malloc``: ``void* (ssize_t size, int device, cudaStream_t stream)``."""
TORCH_FREE_SYMBOL: str
"""``imp_mem_torch_free``: ``void (void* ptr, ssize_t size, int device, cudaStream_t stream)``."""
CUPY_MALLOC_SYMBOL: str
"""``imp_mem_cupy_malloc``: ``void* (void* param, size_t size, int device)``; param: the stream."""
CUPY_FREE_SYMBOL: str
"""``imp_mem_cupy_free``: ``void (void* param, void* ptr, int device)``; param: the stream."""
CUPY_REGION_MALLOC_SYMBOL: str
"""``imp_mem_cupy_region_malloc``: ``void* (void* param, size_t size, int device)``; param:
the id of a pool added as a hook region (``add_hook_region``), which serves the block
whatever is installed."""
CUPY_REGION_FREE_SYMBOL: str
"""``imp_mem_cupy_region_free``: ``void (void* param, void* ptr, int device)``; the free of
``imp_mem_cupy_region_malloc``'s blocks (param: the pool id, as CuPy passes the same param
to both; the legacy default stream, as at the malloc)."""
FREE_OWNED_SYMBOL: str
"""``imp_mem_hooks_free_owned``: ``int (void* ptr, cudaStream_t stream)``; the free of the
LD_PRELOAD interposer (``imp_mem._preload``): 1 if the hooks handed ``ptr`` out (freed at
home, from any thread, at its own device), 0 if not (nothing counted: the interposer gives
it to the real ``cudaFree``), -1 if a panic was caught."""

def hook_stats() -> dict[str, Any]:
    """The C hooks' counters, plus ``installed`` and ``route`` (the calling thread's). Calls:
    ``mallocs``, ``malloc_ok``, ``frees``, ``free_ok``. Refused, by kind:
    ``not_installed`` / ``free_not_installed`` (no pool), ``zero_size`` (torch
    asks for 0 bytes for an empty tensor; null is returned), ``negative_size``,
    ``absurd_size`` (above the device's capacity), ``wrong_device``, ``ooms``
    (the pool, or its fallback, refused), ``malloc_errors`` (any other core
    error), ``null_frees``, ``foreign_frees`` (never handed out by the
    installed pool), ``double_frees`` (inside the pool but not a live block's
    start: a second free, or a pointer into a block), ``bad_stream_frees``
    (the reserved stream value). Accepted but odd: ``size_mismatches`` (a
    free whose size disagrees; freed by the real size). Weights route:
    ``weights_takes`` / ``weights_bytes``, ``weights_refused``,
    ``stranded_frees`` / ``stranded_bytes`` (freed T1 takes, not reusable).
    ``panics``: caught panics (always a bug). ``retired_frees``: frees that
    reached a pool which had left the hooks with live blocks;
    ``retired_pools``: how many such pools are still kept (for their live
    blocks, or while another thread's copy of the hooks still holds one);
    ``retired_arenas``:
    T1 arenas kept past their uninstall for live weights-route takes."""

def reset_hook_stats() -> None: ...
def uninstall_hooks() -> bool:
    """Removes the installed pool (every thread's next hook call returns null);
    True if one was. The pool is released once no thread holds it: this
    thread's copy goes now, another thread's at its next hook call. A pool
    with live blocks is retired instead (``hook_stats()["retired_pools"]``):
    frees of its blocks still reach it, and it goes with the last."""

def set_hook_route(route: Literal["activations", "weights"]) -> None:
    """Where the calling thread's hook mallocs go: the installed pool, or
    (while loading) the installed T1 arena, whose frees are counted as
    stranded. Per thread, as torch's MemPool scopes are: another thread's
    forward during a load stays in the activations."""

def hook_route() -> str:
    """The calling thread's route (``set_hook_route``)."""

def add_hook_region(pool: ActivationPool, device: int | None = None) -> None:
    """Add ``pool`` as a region of the hooks: mallocs of a thread that selects
    it (``set_hook_region``) go to it, frees of its addresses come back to it
    from any thread (``imp_mem.torch.region``)."""

def remove_hook_region(pool: ActivationPool) -> bool:
    """Remove ``pool``'s region; True if it was one. With blocks of it live
    it is retired: their frees still reach it until the last."""

def set_hook_region(pool: ActivationPool | None) -> None:
    """Route this thread's mallocs to ``pool``'s region (None: the installed
    pool)."""

def hook_library_path() -> str:
    """The shared library exporting the hooks (this module's file)."""

def hook_addresses() -> dict[str, int]:
    """Each hook's address in this process, by symbol name."""

@final
class PinnedBuffer:
    """Pinned host memory (T5b), freed exactly once; ``or_empty=True`` gives an
    empty buffer instead of raising so a caller can fall back. With a CUDA
    backend the driver pins it (``cuMemHostAlloc``; exported as kDLCPU like torch's own
    pinned tensors, or as kDLCUDAHost when a consumer asks with ``dl_device=(3, 0)``);
    with ``backend=None`` or a fake it is ordinary host memory (kDLCPU)."""

    def __init__(
        self, nbytes: ByteCount, *, backend: Backend | None = None, or_empty: bool = False
    ) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def empty(self) -> bool: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def span(self) -> StableSpan: ...
    def __enter__(self) -> PinnedBuffer: ...
    def __exit__(self, *args: Any) -> bool: ...

def pinned_stats() -> dict[str, int]:
    """Live bytes, buffers and failures of the pinned allocators (the fake's
    and every device's, sleep host buffers included); ``peak_bytes`` sums
    each one's peak."""

@disjoint_base
class DeviceBackend(Backend):
    """What CudaBackend and VmmBackend add to Backend; not constructed itself."""

    @property
    def device_name(self) -> str: ...
    def mem_get_info(self) -> tuple[int, int]:
        """Device ``(free, total)`` bytes now."""
    def read(self, region: Region, offset: int = 0, nbytes: int | None = None) -> bytes:
        """Copy bytes of a live region of this backend to the host."""
    def write(self, region: Region, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        """Copy host bytes into a live region of this backend."""

@final
class CudaBackend(DeviceBackend):
    """Device memory through ``cuMemAlloc``. Raises ``BackendUnavailable`` where
    there is no CUDA driver or device."""

    def __init__(
        self, device: int = 0, budget: ByteCount | None = None, strict: bool = False
    ) -> None: ...

@final
class VmmBackend(DeviceBackend):
    """Growable device regions over the CUDA VMM API: address space reserved for
    the maximum, physical memory committed in chunks, the base never moves."""

    def __init__(
        self,
        device: int = 0,
        budget: ByteCount | None = None,
        strict: bool = False,
        chunk_bytes: ByteCount | None = None,
        cache_chunks: int | None = None,
    ) -> None: ...
    @property
    def chunk_bytes(self) -> int:
        """Bytes per physical handle; growable regions commit in these."""
    @property
    def device_granularity(self) -> int: ...
    @property
    def cache_chunks(self) -> int: ...
    @property
    def cached_bytes(self) -> int:
        """Physical bytes kept in the handle cache (held by no region)."""
    @property
    def mapped_bytes(self) -> int: ...
    def trim_cache(self) -> None:
        """Release every cached handle to the device now."""
    def counters(self) -> dict[str, int]: ...
    def record_fence(self, stream: int = 0) -> Fence:
        """Record a fence on a raw ``CUstream`` (0: the legacy default stream)."""

@final
class Fence:
    """A CUDA event recorded on a stream; decommit only after it completed."""

    def __init__(self, device: int = 0, stream: int = 0) -> None: ...
    def is_complete(self) -> bool: ...
    def wait(self) -> None: ...
    @property
    def device(self) -> int: ...

def cuda_driver_version() -> int: ...
def cuda_device_count() -> int: ...
def cuda_mem_get_info(device: int = 0) -> tuple[int, int]: ...

# ---- planner ------------------------------------------------------------

H200_CONTEXT_BYTES: int
"""The CUDA context measured on an H200 (527 MiB): the default ``context``."""
H200_LIBRARY_RESERVE_BYTES: int
"""cuBLAS's reserve measured on an H200 (66 MiB): the default ``library_reserve``."""

def parse_size(text: str, field: str = "size") -> int:
    """``"80GiB"`` / ``"80 GB"`` / ``"81920MiB"`` / ``"4096B"`` -> bytes (units binary:
    G = GB = GiB); a string without a unit, a negative size or one over 256 PiB
    raises InvalidArgument naming ``field``."""

@final
class ModelShape:
    """What a model costs: layers by kind, attention geometry, state, experts, weights.

    ``ModelShape(**config_json_fields)`` reads the same fields as
    :meth:`from_hf_config`; a field the planner does not read is refused
    with the nearest one it does ("did you mean").
    """

    def __init__(self, **fields: Any) -> None: ...
    @staticmethod
    def from_preset(name: str) -> ModelShape:
        """A shipped preset's shape, by its name or Hugging Face id
        (``imp_mem.presets()``); InvalidArgument with the nearest names if
        unknown."""
    @staticmethod
    def from_hf_config(
        path_or_dict: str | os.PathLike[str] | dict[str, Any],
        *,
        weights_bytes: ByteCount | None = None,
    ) -> ModelShape:
        """Read a Hugging Face ``config.json`` (path, checkpoint directory or dict).

        Safetensors beside a path give the real weight bytes.
        """
    def with_weights_bytes(self, nbytes: ByteCount) -> ModelShape: ...
    def rank_weights_line(self, tp: int) -> int:
        """The planner's weights line for one of `tp` ranks: ``ceil(weights /
        tp)`` rounded up to a MiB."""
    def for_rank_layout(self, tp: int, largest_rank: ByteCount) -> ModelShape:
        """The shape `tp` ranks plan with when the largest rank's load lays
        out `largest_rank` bytes (raised to ``tp * largest_rank`` when the
        per-rank line is short)."""
    def check_tp(self, tp: int) -> None:
        """Raise InvalidArgument when the heads do not split over `tp` ranks."""
    def kv_bytes_per_token(
        self, kv_dtype: str | None = None, tp: int | None = None
    ) -> dict[str, int]:
        """``{"full", "sliding", "total"}`` KV bytes per token on one of ``tp`` ranks."""
    @property
    def name(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def attention_kind(self) -> Literal["gqa", "mla"]: ...
    @property
    def attention(self) -> dict[str, Any]: ...
    @property
    def full_attention_layers(self) -> int: ...
    @property
    def sliding_layers(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def state_layers(self) -> int: ...
    @property
    def state_bytes_per_layer(self) -> int: ...
    @property
    def moe(self) -> dict[str, int] | None: ...
    @property
    def dtype(self) -> Literal["f32", "f16", "bf16", "fp8"]: ...
    @property
    def params(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def weight_formats(self) -> dict[str, str]: ...
    @property
    def max_position_embeddings(self) -> int | None: ...
    def to_json(self) -> str: ...

@final
class Limits:
    """The concurrency a plan must serve. ``kv_policy``: ``"full"`` (the KV
    pool holds ``max_batch`` sequences of ``max_seq_len`` tokens, or the plan
    fails with its report), ``"fit"`` (where they do not fit, the pool shrinks
    to what the budget leaves, failing only below one full sequence; it never
    grows past the full target) or ``"none"`` (no KV pool: the caller keeps
    its KV itself, e.g. a Hugging Face model's in torch tensors)."""

    def __init__(
        self,
        max_batch: int,
        max_seq_len: int,
        *,
        kv_dtype: str | None = None,
        block_size: int | None = None,
        max_batch_tokens: int | None = None,
        kv_policy: Literal["full", "fit", "none"] = "full",
    ) -> None: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def kv_dtype(self) -> Literal["f32", "f16", "bf16", "fp8"] | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_batch_tokens(self) -> int | None: ...
    @property
    def kv_policy(self) -> Literal["full", "fit", "none"]: ...

@final
class Features:
    """Features that cost memory beyond the model and its KV."""

    def __init__(
        self,
        *,
        spec_depth: int | None = None,
        draft_weights_bytes: ByteCount | None = None,
        vision_tower_bytes: ByteCount | None = None,
        lora_slots: int | None = None,
        lora_rank: int | None = None,
        scratch_bytes: ByteCount | None = None,
        engine_persistent_bytes: ByteCount | None = None,
        kv_host_bytes: ByteCount | None = None,
        activation_bytes: ByteCount | None = None,
        engine_kv_blocks: int | None = None,
        engine_swa_blocks: int | None = None,
        warmup_bytes: ByteCount | None = None,
    ) -> None: ...
    @property
    def spec_depth(self) -> int: ...
    @property
    def draft_weights_bytes(self) -> int: ...
    @property
    def vision_tower_bytes(self) -> int: ...
    @property
    def lora_slots(self) -> int: ...
    @property
    def lora_rank(self) -> int: ...
    @property
    def kv_host_bytes(self) -> int:
        """Pinned host bytes for the KV host tier (T5b; not device memory)."""
    @property
    def scratch_bytes(self) -> int | None: ...
    @property
    def engine_persistent_bytes(self) -> int | None: ...
    @property
    def activation_bytes(self) -> int | None: ...
    @property
    def engine_kv_blocks(self) -> int:
        """KV blocks the engine holds for itself beyond `max_batch` sequences."""
    @property
    def engine_swa_blocks(self) -> int:
        """The same for the sliding-window pool."""
    @property
    def warmup_bytes(self) -> int:
        """What a warm-up leaves outside the tiers, measured (the `warmup` line)."""

@final
class PlanInput:
    """Everything ``plan_memory`` reads, validated at construction."""

    def __init__(
        self,
        model: ModelShape,
        limits: Limits,
        features: Features | None = None,
        *,
        budget: ByteCount,
        tp: int | None = None,
        context: ByteCount | None = None,
        library_reserve: ByteCount | None = None,
    ) -> None: ...
    @property
    def model(self) -> ModelShape: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def features(self) -> Features: ...
    @property
    def budget(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def library_reserve(self) -> int: ...
    def to_json(self) -> str: ...

@final
class MemoryPlan:
    """Every tier's size on one rank, within the budget."""

    def total(self) -> int: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...
    @staticmethod
    def from_json(text: str) -> MemoryPlan: ...
    @staticmethod
    def activations_only(budget: int, context: int, activations: int) -> MemoryPlan:
        """A plan of the activations tier alone (whole MiB) and the CUDA
        context, within the budget; no model, no KV pool, no scratch. A tier
        that does not fit raises `PlanFailure`, an empty one `InvalidArgument`."""
    @staticmethod
    def activations_room(budget: int, context: int) -> int:
        """The largest activations tier (whole MiB) that fits in the budget
        beside the context; 0 when none does."""
    def table(self) -> str: ...
    @property
    def budget(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def model_resident(self) -> int: ...
    @property
    def weights(self) -> int: ...
    @property
    def sleep_host(self) -> int:
        """T5b, host side: pinned host bytes a level-1 sleep holds (T1's copy)."""
    @property
    def engine_persistent(self) -> int: ...
    @property
    def scratch(self) -> int: ...
    @property
    def activations(self) -> int: ...
    @property
    def kv(self) -> dict[str, Any]: ...
    @property
    def swa(self) -> dict[str, Any] | None: ...
    @property
    def kv_host(self) -> dict[str, Any] | None:
        """The KV host tier (``blocks``, ``block_bytes``, ``bytes``): pinned
        host memory within ``Features.kv_host_bytes``, outside ``total``."""
    @property
    def pools(self) -> list[dict[str, Any]]: ...
    @property
    def kv_blocks(self) -> int: ...
    @property
    def kv_bytes(self) -> int: ...
    @property
    def library_reserve(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def warmup(self) -> int:
        """The measured warm-up line (`Features.warmup_bytes`); 0 without one."""
    @property
    def headroom(self) -> int: ...
    @property
    def charges(self) -> list[dict[str, Any]]: ...

def transformers_defaults(model_type: str) -> dict[str, int | float | bool | str]:
    """transformers' defaults of ``model_type`` (the fields a config.json
    may leave out), as the planner reads them; empty for a type not covered."""

def plan_memory(plan_input: PlanInput) -> MemoryPlan:
    """Plan, or raise PlanFailure (report as message; arithmetic as attributes)."""

@final
class MemorySystem:
    """The tiers of one MemoryPlan opened on one backend, in the seed's order
    (T2, T1, fixed T3 pools, T4, the KV pool last), with the phases, the memory
    report and Prometheus metrics. A failed open raises the failing step's
    exception (with ``step`` and ``step_name``) and leaves nothing acquired."""

    def __init__(
        self,
        backend: Backend,
        plan: MemoryPlan,
        *,
        context: ByteCount | None = None,
        library_reserve: ByteCount | None = None,
        kv_growable: bool | None = None,
        kv_initial_blocks: int | None = None,
        kv_grow_blocks: int | None = None,
        apply_budget: bool = True,
        activation_strict: bool | None = None,
        sleepable: bool | None = None,
        activation_measure: ByteCount | None = None,
        activation_margin: ByteCount | None = None,
    ) -> None:
        """``activation_measure=CHUNK`` opens the activation tier as a measured
        one: the plan's activation line is reserved, committed in chunks as the
        warm-up asks, and ``begin_serving()`` fixes it at its high-water plus
        ``activation_margin`` (see ``measured()``)."""
    @property
    def backend(self) -> Backend: ...
    @property
    def plan(self) -> MemoryPlan: ...
    def measured(self) -> list[dict[str, Any]]:
        """The measured tiers: ``tier``, ``state`` (``measuring`` /
        ``frozen``), ``high_water``, ``margin``, ``size``, ``committed``,
        ``decommitted`` (bytes)."""
    @property
    def phase(self) -> Phase: ...
    @property
    def closed(self) -> bool: ...
    @property
    def weights_arena(self) -> Arena | None: ...
    @property
    def engine_arena(self) -> Arena | None: ...
    @property
    def kv_pool(self) -> BlockPool | None: ...
    @property
    def swa_pool(self) -> BlockPool | None: ...
    @property
    def state_pools(self) -> list[BlockPool]: ...
    @property
    def scratch(self) -> ScratchStack | None: ...
    @property
    def activations(self) -> ActivationPool | None: ...
    @property
    def tiers(self) -> list[str]: ...
    def swap_model(self, plan: MemoryPlan) -> dict[str, Any]:
        """Swap the model in place: T2 kept, idle tiers re-laid, T1 reset and
        resized at the same base on a VMM backend. Returns ``kept``,
        ``relaid``, ``opened``, ``released``, ``t1_in_place``, ``t1_base``
        and ``prefix_cache_dropped``. A failure's exception carries
        ``old_model_kept`` and ``missing``."""
    def sleep(self, level: int = 1, tiers: str | Iterable[str] | None = None) -> dict[str, Any]:
        """Give the tiers' memory back (VMM backend): level 1 keeps T1 in pinned
        host memory, level 2 drops it; the KV pool is dropped at both. Every
        address is the same after ``wake()``. Returns ``level``, ``released``,
        ``host_bytes`` and ``tiers``."""
    def check_sleep(self, level: int = 1, tiers: str | Iterable[str] | None = None) -> None:
        """Check what ``sleep(level, tiers)`` checks before any tier sleeps
        (the level, the backend, the names, a tier already asleep), sleeping
        nothing: raises as ``sleep`` would."""
    def sleep_groups(self) -> dict[str, list[str]]:
        """The groups an engine sleeps and wakes by name, ``{group: [tier
        key, ...]}``: ``weights`` (T1), ``kv_cache`` (the KV pool and the
        sliding-window pool), ``activations`` (T4a), those this system has."""
    def adopt_replan(self, plan: MemoryPlan) -> int:
        """Adopt this system's plan made again with a measured warm-up line:
        the KV pool capped at its blocks, the backend's budget lowered to what
        it gives the tiers (as an open on it sets it). Returns its KV blocks;
        InvalidArgument, changing nothing, when its KV pool does not fit the
        open one."""
    def wake(self, tiers: str | Iterable[str] | None = None) -> list[str]:
        """Recommit sleeping tiers at their addresses and restore T1's bytes
        after a level-1 sleep; returns the keys woken. ``tiers`` names keys
        or tags as ``sleep`` takes them (default: every sleeping tier), so a
        wake can be staged (``"weights"``, the update, then ``"kv_cache"``);
        an awake tier is skipped, a name that is no tier (or T2, scratch)
        raises InvalidArgument. When the device has no room it raises
        OutOfMemory with ``needed``, ``device_free``, ``budget_free``,
        ``woken`` and ``still_asleep``; those tiers still sleep and a later
        ``wake()`` retries them."""
    def wake_needs(self, tiers: str | Iterable[str] | None = None) -> int:
        """Device bytes ``wake(tiers)`` would commit now (the named tiers that
        sleep; default: every sleeping tier), to make room before waking."""
    def pin_sleep_host(self, nbytes: ByteCount | None = None) -> int:
        """Pin T1's level-1 host buffer now (T5b), so the first sleep copies at
        the line rate instead of pinning. ``nbytes`` defaults to the plan's
        T1 weights bytes (``plan.sleep_host``, or what T1 holds if more);
        exactly that is held. Releases the GIL and holds no lock while
        pinning: run it on a background thread during the weight load.
        Returns the bytes held; ``release_sleep_host()`` frees them."""
    def release_sleep_host(self) -> int:
        """Free the pinned buffer kept for the next level-1 sleep (pinned by
        ``pin_sleep_host`` or kept after ``wake()``); returns the bytes
        freed."""
    @property
    def asleep(self) -> dict[str, int]:
        """The tiers asleep now, ``{key: level}``."""
    def begin_planning(self) -> None: ...
    def begin_serving(self) -> None: ...
    def set_charge(self, key: str, nbytes: ByteCount, label: str | None = None) -> None: ...
    def mem_report(
        self,
        device: tuple[int, int] | bool | None = None,
        other_processes: ByteCount | None = None,
    ) -> dict[str, Any]: ...
    def mem_report_text(
        self,
        device: tuple[int, int] | bool | None = None,
        other_processes: ByteCount | None = None,
    ) -> str: ...
    def metrics(
        self,
        device: tuple[int, int] | bool | None = None,
        other_processes: ByteCount | None = None,
    ) -> str: ...
    def kv_manager(
        self,
        block_size: int | None = None,
        *,
        swa_window: int | None = None,
        enable_prefix_caching: bool = True,
        hash_seed: int | None = None,
        pin_budget: int | None = None,
        model_fingerprint: str = "",
        dtype: str | None = None,
        layout: str = "",
        kv_events: bool = False,
        host_blocks: int | None = None,
    ) -> KVCacheManager:
        """A KVCacheManager over this system's KV (and SWA) pool: its blocks are
        the ones the report attributes to ``kv_cache``. Defaults come from the
        plan; admission counts the blocks a growable pool can still commit.
        Drop it before ``close()``."""
    def step(self, fence: Fence | Any | None = None) -> int:
        """One engine step for every growable pool (the KV pool's hysteretic,
        fenced shrink); returns the bytes decommitted."""
    def flush_decommit(self) -> int:
        """Waits for every growable pool's pending decommit; the bytes returned."""
    def check(self) -> None: ...
    def close(self) -> dict[str, Any]: ...
    def __enter__(self) -> MemorySystem: ...
    def __exit__(self, *args: object) -> bool: ...

@final
class DeviceLedger:
    """One device's table of imp-mem tenants, shared across processes."""

    def __init__(
        self, key: str, budget: ByteCount | None = None, dir: StrOrBytesPath | None = None
    ) -> None: ...
    @property
    def key(self) -> str: ...
    @property
    def budget(self) -> int: ...
    def join(
        self, name: str, floor: ByteCount, cap: ByteCount, wait_s: float = 5.0
    ) -> LedgerTenant: ...
    def tenants(self) -> list[dict[str, Any]]: ...

@final
class LedgerTenant:
    """An admitted tenant; attach it to a backend with ``attach_ledger``."""

    @property
    def slot(self) -> int: ...
    def record(self) -> dict[str, Any]: ...
    def headroom(self) -> int: ...
    def pressure(self) -> int: ...
    def want(self, nbytes: ByteCount) -> None: ...
    def grow(self, nbytes: ByteCount) -> None: ...
    def raise_floor(self, nbytes: ByteCount) -> None:
        """Raises its floor (and cap) by `nbytes`; `OutOfMemory` when the
        others' reservations leave no room (nothing changed)."""
    def lower_floor(self, nbytes: ByteCount) -> None:
        """Lowers its floor by `nbytes` (to zero at most); always granted,
        its cap unchanged."""
    def shrink(self, nbytes: ByteCount) -> None: ...
    def set_asleep(self, level: int) -> None: ...
    def set_kv_live(self, nbytes: ByteCount) -> None: ...

def ledger_devices(dir: StrOrBytesPath | None = None) -> list[str]: ...
def ledger_dir() -> str: ...
