"""Weights from safetensors into T1 (the model-resident arena).

Algorithm. Every file's header is read first (an 8-byte little-endian
length, then that much JSON: per tensor its dtype, shape and byte range
after the header). The tensors are laid out in file order in the arena, each
at a 256-byte aligned offset, and the whole layout is checked against the
plan's weights line (and its vision-tower line: a Gemma-3 checkpoint holds
its tower) before a byte is taken: the first tensor whose end
passes `plan.weights` is refused by name (`WeightsOverflow`), and so is a
header whose sizes do not match its shapes. Then each tensor's bytes are
taken from `system.weights_arena` and the file is streamed through two
staging buffers of pinned host memory (imp-mem's `PinnedBuffer` over the
system's backend: driver-pinned on a GPU, plain host memory on the fake), a
chunk at a time: the file is read into one buffer while the other's copy to
the device runs, and a buffer is reused only after its copy's event
completed. A chunk's reads are positional (``preadv``) and split across a
few threads (`read_threads`): one thread's copy out of the page cache, not
the PCIe link, bounded the load on the H200's host. The returned torch
tensors view the arena in place (DLPack); on the fake backend they are CPU
tensors over the fake's host memory.

Shards. With `shards` (name -> the rows or columns ``[start, stop)`` of one
dimension, a tensor-parallel rank's slice), a tensor is laid out and
checked at its slice's size and only the slice's bytes are read: the
rows of a leading dimension are one contiguous range of the file, any
other dimension one range per index of the dimensions before it, read
in order into consecutive arena bytes (and copied to the device as one
copy per staging buffer). The check against the plan is the same one.

The tensors stay valid while T1 is not reset; each export holds the arena
alive. Not thread-safe: one load at a time per system.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from imp_mem.errors import InvalidArgument, WeightsOverflow

ALIGN = 256
CHUNK_BYTES = 32 << 20
# Loads at least this large show a progress bar (when tqdm is installed).
PROGRESS_BYTES = 256 << 20
# A chunk's reads go to the threads in pieces of at least this much.
READ_PIECE_MIN = 1 << 20

# safetensors dtype -> (torch dtype name, bytes per element)
DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, and where it goes in the arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    # Absolute byte range in the file.
    begin: int
    end: int
    # Offset from the start of this load in the arena.
    offset: int = 0
    # A shard's byte ranges of the file, (start, length), in arena order;
    # empty: the whole [begin, end).
    runs: tuple[tuple[int, int], ...] = ()
    # Placed right after the entry before it, in the same span (a fused
    # group's or a stack's later member; `plan_layout`).
    glued: bool = False

    @property
    def nbytes(self) -> int:
        if self.runs:
            return sum(n for _, n in self.runs)
        return self.end - self.begin

    def file_runs(self) -> tuple[tuple[int, int], ...]:
        """The byte ranges of the file to read, in order."""
        return self.runs or ((self.begin, self.end - self.begin),)


def shard_entry(t: TensorEntry, dim: int, start: int, stop: int) -> TensorEntry:
    """`t` cut to indices ``[start, stop)`` of dimension `dim`: its shape and
    the file ranges that hold the slice (one a row of the dimensions before
    `dim`, merged where they touch)."""
    if not (0 <= dim < len(t.shape) and 0 <= start <= stop <= t.shape[dim]):
        raise InvalidArgument(
            f"tensor {t.name!r} ({list(t.shape)}): shard [{start}, {stop}) of dimension {dim} "
            "is outside it"
        )
    inner = math.prod(t.shape[dim + 1 :]) * DTYPES[t.dtype][1]
    outer = math.prod(t.shape[:dim])
    length = (stop - start) * inner
    runs: list[tuple[int, int]] = []
    if length:
        for o in range(outer):
            at = t.begin + (o * t.shape[dim] + start) * inner
            if runs and runs[-1][0] + runs[-1][1] == at:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((at, length))
    shape = (*t.shape[:dim], stop - start, *t.shape[dim + 1 :])
    # An empty slice keeps one empty run, so nbytes reads 0.
    return replace(t, shape=shape, runs=tuple(runs) or ((t.begin, 0),))


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint's files: `path` itself, or every `*.safetensors` of a
    directory (in name order, which is shard order)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise InvalidArgument(f"{p} holds no *.safetensors file; point path at a checkpoint")
        return files
    if not p.is_file():
        raise InvalidArgument(f"{p} does not exist; pass a .safetensors file or its directory")
    return [p]


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors of one file, in file order, checked against its size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidArgument(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise InvalidArgument(f"{file}: header length {n} does not fit the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"{file}: the header is not JSON ({e})") from None
    start = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(f"{file}: tensor {name!r} has a malformed entry") from None
        if dtype not in DTYPES:
            raise InvalidArgument(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        want = math.prod(shape) * DTYPES[dtype][1]
        if not (0 <= b <= e and start + e <= size) or e - b != want:
            raise InvalidArgument(
                f"{file}: tensor {name!r} ({dtype} {list(shape)}) spans [{b}, {e}), which is not "
                f"its {want} bytes inside the file's {size - start}"
            )
        out.append(TensorEntry(name, dtype, shape, file, start + b, start + e))
    out.sort(key=lambda t: t.begin)
    return out


# Projections a model multiplies by the same input, laid out back to back in
# T1 so that one GEMM reads them as one matrix (the engine's fused decode).
FUSED_ROWS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_groups(names: list[str]) -> list[list[str]]:
    """The `FUSED_ROWS` groups `names` holds whole (every member of a
    module's group), each in its group's order, in the order of their first
    members. The rule the safetensors load and the dummy load share."""
    present = set(names)
    out = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        prefix, _, part = module.rpartition(".")
        for parts in FUSED_ROWS:
            group = [f"{prefix}.{x}.weight" for x in parts]
            if leaf == "weight" and part == parts[0] and all(n in present for n in group):
                out.append(group)
    return out


def fusion_order(
    entries: list[TensorEntry], stacked: dict[str, list[str]] | None = None
) -> tuple[list[TensorEntry], set[str]]:
    """`entries` in placement order: the given order, except that the
    members of a `fused_groups` group (same dtype, 2-D with equal columns)
    follow their group's first member in the group's order. Returns the
    order and the names placed right after their predecessor, unaligned.
    `stacked` (`_complete_groups`: already consecutive in `entries`) are
    left out of the fused groups; a stack's later members are glued too
    where every member but the last fills whole alignment units (no gap),
    with one dtype and no shard runs."""
    stacked = stacked or {}
    by_name = {t.name: t for t in entries}
    groups: dict[str, list[TensorEntry]] = {}
    for names in fused_groups(list(by_name)):
        members = [by_name[n] for n in names]
        first = members[0]
        if all(
            m.name not in stacked
            and m.dtype == first.dtype
            and len(m.shape) == 2
            and m.shape[1] == first.shape[1]
            for m in members
        ):
            for m in members:
                groups[m.name] = members
    order, seen, glued = [], set(), set()
    for t in entries:
        if t.name in seen:
            continue
        for m in groups.get(t.name, [t]):
            order.append(m)
            seen.add(m.name)
        glued.update(m.name for m in groups.get(t.name, [t])[1:])
    for names in {id(g): g for g in stacked.values()}.values():
        members = [by_name[n] for n in names]
        if all(
            m.dtype == members[0].dtype
            and not m.runs
            and (m is members[-1] or m.nbytes % ALIGN == 0)
            for m in members
        ):
            glued.update(names[1:])
    return order, glued


def plan_layout(
    entries: list[TensorEntry], limit: int, *, stacked: dict[str, list[str]] | None = None
) -> tuple[list[TensorEntry], int]:
    """Offsets for `entries` in placement order (`fusion_order`): each
    aligned to `ALIGN`, except a fused group's later members, which follow
    the one before them directly. Refuses the first tensor whose end passes
    `limit`. Returns the placed entries and the end."""
    placed, cursor, names = [], 0, set()
    entries, glued = fusion_order(entries, stacked)
    for t in entries:
        if t.name in names:
            raise InvalidArgument(f"tensor {t.name!r} appears in two files ({t.file})")
        names.add(t.name)
        offset = cursor if t.name in glued else -(-cursor // ALIGN) * ALIGN
        end = offset + t.nbytes
        if end > limit:
            err = WeightsOverflow(
                f"tensor {t.name!r} ({t.dtype} {list(t.shape)}, {t.nbytes} B) would end the "
                f"weights at {end} B; the plan gave weights {limit} B. Plan from this "
                "checkpoint (ModelShape.from_hf_config(directory) reads its real sizes)"
            )
            err.tensor, err.end, err.limit = t.name, end, limit
            raise err
        placed.append(replace(t, offset=offset, glued=t.name in glued))
        cursor = end
    return placed, cursor


def load_safetensors(
    system: Any,
    path: str | os.PathLike[str],
    *,
    device: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool | None = None,
    shards: Mapping[str, Any] | None = None,
    on_layout: Any = None,
    read: bool = True,
    stacks: list[list[str]] | None = None,
) -> dict[str, Any]:
    """Loads a safetensors checkpoint (a file or a directory of shards) into
    `system`'s weights arena and returns `{name: torch.Tensor}` viewing it.

    Every tensor is checked against the plan's weights line first
    (`WeightsOverflow` names the one that does not fit; nothing is taken).
    The bytes travel through pinned host memory in chunks of `chunk_bytes`.
    `device` (default: the backend's device, or the CPU on the fake) must be
    where the arena lives. `progress`: a tqdm bar (None: for loads of 256
    MiB or more, when tqdm is installed). `shards`: name -> an object with
    ``dim``, ``start`` and ``stop`` (`imp_mem.engine.tensor_parallel.Shard`):
    only that slice of the tensor is loaded (module doc); a name the
    checkpoint lacks is refused. `on_layout`: called with the bytes the
    load lays out in T1 once they are known, before any is copied (the
    engine starts pinning the sleep buffer of exactly that size there, so
    the pinning overlaps the copies). `read=False` lays the tensors out and
    leaves their bytes as the arena holds them (a probe of the layout).
    `stacks`: groups of tensor names to lay out end to end in the given
    order, each in one span of the arena where their sizes leave no
    alignment gap (an MoE's experts, which the model then reads as one
    stacked tensor); a group the checkpoint does not hold whole is laid out
    as usual."""
    import torch

    entries = [t for f in safetensors_files(path) for t in read_header(f)]
    groups = _complete_groups(entries, stacks or [])
    if shards:
        missing = sorted(set(shards) - {t.name for t in entries})
        if missing:
            raise InvalidArgument(
                f"shards: {len(missing)} sharded tensors are not in the checkpoint, first "
                f"{missing[0]!r}"
            )
        entries = [
            shard_entry(t, s.dim, s.start, s.stop) if (s := shards.get(t.name)) else t
            for t in entries
        ]
    # Checked before the arena is held here, so a refusal's traceback keeps
    # no tier object alive.
    placed, total = plan_layout(entries, _weights_room(system), stacked=groups)
    if on_layout is not None:
        on_layout(total)
    arena = system.weights_arena

    out: dict[str, Any] = {}
    views = []
    # One arena span a run of tensors placed back to back (a fused group),
    # carved into each member's bytes.
    runs: list[list[TensorEntry]] = []
    for t in placed:
        if runs and t.glued:
            runs[-1].append(t)
        else:
            runs.append([t])
    for run in runs:
        start = run[0].offset
        size = run[-1].offset + run[-1].nbytes - start
        whole = torch.from_dlpack(arena.take(size, ALIGN)) if size else None
        for t in run:
            torch_dtype = getattr(torch, DTYPES[t.dtype][0])
            if t.nbytes == 0:
                out[t.name] = torch.empty(t.shape, dtype=torch_dtype, device=_torch_device(system))
                continue
            raw = whole[t.offset - start : t.offset - start + t.nbytes]
            views.append((t, raw))
            out[t.name] = raw.view(torch_dtype).view(t.shape)
    # Read in file order, whatever the placement.
    views.sort(key=lambda v: (str(v[0].file), v[0].begin))
    target = views[0][1].device if views else _torch_device(system)
    if device is not None and torch.device(device) != target:
        if not (target.type == "cuda" and torch.device(device).type == "cuda"):
            raise InvalidArgument(f"device={device} but the weights arena is on {target}")
    if read:
        _stream(system, views, total, chunk_bytes, progress, target)
    return out


def _complete_groups(entries: list[TensorEntry], stacks: list[list[str]]) -> dict[str, list[str]]:
    """`stacks`' groups the checkpoint holds whole, by member name; the
    entries reordered in place so each such group's members follow one
    another where its first member (in file order) was."""
    index = {t.name: i for i, t in enumerate(entries)}
    key: dict[str, tuple[int, int]] = {}
    out: dict[str, list[str]] = {}
    for group in stacks:
        if not group or any(n not in index or n in out for n in group):
            continue
        first = min(index[n] for n in group)
        for j, n in enumerate(group):
            key[n] = (first, j)
            out[n] = group
    if key:
        entries.sort(key=lambda t: key.get(t.name, (index[t.name], 0)))
    return out


def _weights_room(system: Any) -> int:
    """The bytes a load may take: the plan's weights and vision-tower lines
    (a checkpoint holds both), at most what T1 has left."""
    arena = system.weights_arena
    if arena is None:
        raise InvalidArgument("this MemorySystem has no weights arena (T1); plan weights first")
    plan = system.plan
    vision = int(plan.to_dict().get("vision_tower", 0)) if hasattr(plan, "to_dict") else 0
    return min(int(plan.weights) + vision, arena.capacity - arena.used)


def _torch_device(system: Any) -> Any:
    import torch

    backend = system.backend
    if backend.kind in ("cuda", "vmm"):
        return torch.device("cuda", backend.device)
    return torch.device("cpu")


def _progress(total: int, progress: bool | None) -> Any:
    if progress is False or (progress is None and total < PROGRESS_BYTES):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="weights -> T1")


def read_threads() -> int:
    """The threads a load reads its files with: ``IMP_MEM_LOAD_THREADS``,
    else 8 or the CPUs, whichever is fewer (one thread read 4.4 GB/s from
    the page cache on the H200's host, a quarter of what a PCIe 5 copy
    takes)."""
    env = os.environ.get("IMP_MEM_LOAD_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise InvalidArgument(
                f"IMP_MEM_LOAD_THREADS={env!r}: give a whole number of threads (1 or more)"
            ) from None
        if n < 1:
            raise InvalidArgument(f"IMP_MEM_LOAD_THREADS={n}: give 1 or more threads")
        return n
    return max(1, min(8, os.cpu_count() or 1))


def _read_piece(fd: int, view: memoryview, pos: int, what: str) -> str | None:
    """`view`'s bytes from `fd` at `pos` (positional: the load's threads
    share no file offset); `what` if the file ends first, else None."""
    got, n = 0, len(view)
    while got < n:
        r = os.preadv(fd, [view[got:]], pos + got)
        if not r:
            return what
        got += r
    return None


def _stream(system, views, total, chunk_bytes, progress, device) -> None:
    """Copies every tensor's file bytes into its arena view, through two
    pinned staging buffers. A chunk's reads are split across
    `read_threads()` threads in pieces of a few MiB, all done before its copies
    are queued; the other buffer's copies run meanwhile."""
    import torch

    from imp_mem import PinnedBuffer

    if not views:
        return
    chunk = max(ALIGN, min(chunk_bytes, max(t.nbytes for t, _ in views)))
    cuda = device.type == "cuda"
    threads = read_threads()
    buffers = [PinnedBuffer(chunk, backend=system.backend) for _ in range(2)]
    staging = [torch.from_dlpack(b.span()) for b in buffers]
    hosts = [memoryview(s.numpy()) for s in staging]
    events: list[Any] = [None, None]
    stream = torch.cuda.Stream(device) if cuda else None
    bar = _progress(sum(t.nbytes for t, _ in views), progress)
    pool = None
    if threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads, thread_name_prefix="imp-mem-load")
    piece = max(READ_PIECE_MIN, chunk // threads)
    which, fill = 0, 0
    # [arena view, its first byte, staging offset, bytes]: one copy each.
    pending: list[list[Any]] = []
    # (fd, file offset, staging offset, bytes, what a short read says).
    reads: list[tuple[int, int, int, int, str]] = []

    def read_chunk() -> None:
        host = hosts[which]
        jobs = []
        for fd, pos, at, n, what in reads:
            for k in range(0, n, piece):
                m = min(piece, n - k)
                jobs.append((fd, host[at + k : at + k + m], pos + k, what))
        if pool is None or len(jobs) == 1:
            short = next((m for job in jobs if (m := _read_piece(*job)) is not None), None)
        else:
            # Every piece waited for (a buffer is not reused under a read);
            # a short read comes back as its message, raised here (an error
            # a future held would keep this frame's views alive).
            futures = [pool.submit(_read_piece, *job) for job in jobs]
            short = next((m for m in [f.result() for f in futures] if m is not None), None)
            del futures
        if short is not None:
            raise InvalidArgument(short)
        reads.clear()

    def flush() -> None:
        nonlocal which, fill, pending
        if not pending:
            return
        read_chunk()
        src = staging[which]
        if cuda:
            with torch.cuda.stream(stream):
                for raw, done, at, n in pending:
                    raw[done : done + n].copy_(src[at : at + n], non_blocking=True)
                events[which] = torch.cuda.Event()
                events[which].record(stream)
        else:
            for raw, done, at, n in pending:
                raw[done : done + n].copy_(src[at : at + n])
        if bar is not None:
            bar.update(fill)
        which, fill, pending = 1 - which, 0, []
        if events[which] is not None:
            events[which].synchronize()

    try:
        files: dict[Path, Any] = {}
        for t, raw in views:
            f = files.get(t.file)
            if f is None:
                f = files[t.file] = open(t.file, "rb", buffering=0)
            what = f"{t.file} ended inside tensor {t.name!r}"
            done = 0
            for pos, length in t.file_runs():
                left = length
                while left:
                    if fill == chunk:
                        flush()
                    n = min(left, chunk - fill)
                    reads.append((f.fileno(), pos, fill, n, what))
                    last = pending[-1] if pending else None
                    if last and last[0] is raw and last[1] + last[3] == done:
                        last[3] += n  # a shard's next run, adjacent on both sides
                    else:
                        pending.append([raw, done, fill, n])
                    fill += n
                    done += n
                    pos += n
                    left -= n
        flush()
        if cuda:
            stream.synchronize()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        for f in files.values():
            f.close()
        if bar is not None:
            bar.close()
        for b in buffers:
            b.release()
