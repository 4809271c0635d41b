"""A model of torch's CUDA caching allocator (its native path, one stream,
no expandable segments), replaying an allocation trace to find what torch's
own knobs do to the segments it asks for: the bytes a ``MemPool`` over an
imp-mem tier takes from the tier (issue 28's scope mode).

Replays the trace of ``bench_torch_hf.py --record-trace`` (JSON ``ops`` of
``["a", id, bytes]`` and ``["f", id]``; compiled traces also ``second_ops``)
or the synthetic HF generate() of ``bench_measured_replay.trace``, under
each setting of ``roundup_power2_divisions`` and ``max_split_size_mb``
asked for, and prints the segments' peak (what torch reserves, and the tier
commits under a scope) over the live peak (what torch's
``max_memory_allocated`` reads without rounding past 512 B).

The rules, as read in torch's ``c10/cuda/CUDACachingAllocator.cpp`` and
``CUDAAllocatorConfig``: sizes below 512 B round to 512, others to a 512 B
multiple, or (with power-2 divisions for the size's interval, the
intervals being the powers of two from 1 MiB up) to the next of
``divisions`` equal steps between two powers of two; requests of at most
1 MiB go to the small pool (segments of 2 MiB), others to the large pool
(segments of 20 MiB below 10 MiB, else rounded up to 2 MiB); a request
takes the smallest cached block of at least its size (then the lowest
address), except that with ``max_split_size`` a request below it takes no
block at or above it and a request at or above it no block 20 MiB larger
than itself; a taken block is split when what is left is at least 512 B
(small) or over 1 MiB (large, and the request below ``max_split_size``),
the request getting the front; a free merges with free neighbours of the
same segment. Inside a ``MemPool`` scope nothing cached is released to
retry a failed allocation, so the model never releases: its peak is the
segments' sum at its highest.

``--expandable`` models ``expandable_segments:True`` instead (one segment
a pool, grown at its end by 2 MiB / 20 MiB pages when no cached block
fits), which torch does not offer a pluggable allocator's ``MemPool``
(pytorch#147851): what the scope mode would reach if it did.

Validated against the H200: the compiled trace's torch reserved (1.339 of
its live peak, 2026-12-04) is what the model must give with the defaults.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

MIB = 1 << 20
MIN_BLOCK = 512
SMALL_SIZE = 1 * MIB
SMALL_BUFFER = 2 * MIB
MIN_LARGE_ALLOC = 10 * MIB
LARGE_BUFFER = 20 * MIB
ROUND_LARGE = 2 * MIB
# roundup_power2_divisions has one entry per power-of-two interval from 1 MiB.
INTERVALS = 16
POWER2_START = 1 * MIB


def parse_divisions(text: str) -> list[int]:
    """``"0"`` (off), ``"4"`` (every interval), or torch's list form
    ``"[256:1,512:2,1024:4,>:8]"`` (sizes in MiB; ``>`` the rest)."""
    text = text.strip()
    if not text.startswith("["):
        n = int(text)
        if n < 0 or (n > 1 and n & (n - 1)):
            raise ValueError(f"divisions {text!r}: expected 0, 1 or a power of two")
        return [n] * INTERVALS
    out = [0] * INTERVALS
    last = 0
    for part in filter(None, text.strip("[]").split(",")):
        key, _, value = part.partition(":")
        n = int(value)
        if key.strip() == ">":
            for i in range(last, INTERVALS):
                out[i] = n
            break
        mib = int(key)
        index = max(0, mib.bit_length() - 1)  # log2 of the size in MiB
        for i in range(last, min(index + 1, INTERVALS)):
            out[i] = n
        last = index + 1
    return out


def power2_division_of(size: int, table: list[int]) -> int:
    log_size = size.bit_length() - 1
    start = POWER2_START.bit_length() - 1
    index = log_size - start if log_size > start else 0
    return table[min(index, INTERVALS - 1)]


def round_size(size: int, table: list[int] | None) -> int:
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = power2_division_of(size, table) if table else 0
    if divisions > 1 and size > MIN_BLOCK * divisions:
        return next_division(size, divisions)
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Block:
    __slots__ = ("addr", "free", "next", "prev", "size", "small")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr, self.size, self.small = addr, size, small
        self.free = False
        self.prev: Block | None = None
        self.next: Block | None = None


class CachingModel:
    """One stream's blocks and segments under torch's rules."""

    def __init__(
        self,
        divisions: list[int] | None = None,
        max_split: int | None = None,
        no_split: bool = False,
        expandable: bool = False,
    ) -> None:
        self.table = divisions if divisions and any(d > 1 for d in divisions) else None
        self.max_split = max_split if max_split else None
        # torch.cuda.MemPool(no_split=True): no block of the pool is split.
        self.no_split = no_split
        # expandable_segments:True (which a pluggable allocator's MemPool
        # does not get, pytorch#147851): one segment a pool, grown at its end
        # by pages (2 MiB small, 20 MiB large) when no cached block fits.
        self.expandable = expandable
        self.tail: dict[bool, Block | None] = {True: None, False: None}
        self.end = {True: 0, False: 1 << 50}
        # Each pool: sorted keys (size, addr) of its free blocks, and the blocks.
        self.keys: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.by_key: dict[tuple[int, int], Block] = {}
        self.top = 0  # the next segment's address
        self.reserved = self.reserved_peak = 0
        self.allocated = self.allocated_peak = 0
        self.segments = 0

    def _insert(self, b: Block) -> None:
        b.free = True
        key = (b.size, b.addr)
        bisect.insort(self.keys[b.small], key)
        self.by_key[key] = b

    def _remove(self, b: Block) -> None:
        key = (b.size, b.addr)
        keys = self.keys[b.small]
        del keys[bisect.bisect_left(keys, key)]
        del self.by_key[key]
        b.free = False

    def _find(self, size: int, small: bool) -> Block | None:
        keys = self.keys[small]
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        found = keys[i][0]
        if self.max_split is not None:
            if size < self.max_split and found >= self.max_split:
                return None
            if size >= self.max_split and found >= size + LARGE_BUFFER:
                return None
        return self.by_key[keys[i]]

    def _should_split(self, b: Block, size: int) -> bool:
        if self.no_split:
            return False
        left = b.size - size
        if b.small:
            return left >= MIN_BLOCK
        below = self.max_split is None or size < self.max_split
        return below and left > SMALL_SIZE

    def malloc(self, request: int) -> Block:
        size = round_size(request, self.table)
        small = size <= SMALL_SIZE
        b = self._find(size, small)
        if b is not None:
            self._remove(b)
        elif self.expandable:
            b = self._grow(size, small)
        else:
            seg = segment_size(size)
            b = Block(self.top, seg, small)
            self.top += seg + (1 << 30)  # segments never touch
            self.reserved += seg
            self.segments += 1
            self.reserved_peak = max(self.reserved_peak, self.reserved)
        if self._should_split(b, size):
            rest = Block(b.addr + size, b.size - size, small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
            if self.tail[small] is b:
                self.tail[small] = rest
        self.allocated += b.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return b

    def _grow(self, size: int, small: bool) -> Block:
        """An expandable segment's end grown by whole pages until a block of
        `size` fits there (the free block at the end, if any, grown)."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self.tail[small]
        if tail is not None and tail.free:
            self._remove(tail)
            b, need = tail, size - tail.size
        else:
            b, need = Block(self.end[small], 0, small), size
            b.prev = tail
            if tail is not None:
                tail.next = b
            self.tail[small] = b
        grow = -(-need // page) * page
        b.size += grow
        self.end[small] += grow
        self.reserved += grow
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.segments = int(self.tail[True] is not None) + int(self.tail[False] is not None)
        return b

    def free(self, b: Block) -> None:
        self.allocated -= b.size
        for other in (b.prev, b.next):
            if other is not None and other.free:
                self._remove(other)
                if other is b.prev:
                    other.size += b.size
                    other.next = b.next
                    if b.next is not None:
                        b.next.prev = other
                    b = other
                else:
                    b.size += other.size
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
        if self.expandable and b.next is None:
            self.tail[b.small] = b  # an expandable segment's end
        self._insert(b)


def replay(ops, model: CachingModel, live_from: int = 0) -> dict:
    """Runs `ops`; the live peak counts 512 B rounding only (torch's
    ``max_memory_allocated`` without power-2 divisions), from op
    `live_from` on (a compiled trace's measured pass), with what is live
    then."""
    held: dict = {}
    sizes: dict = {}
    live = live_peak = 0
    reserved_at_mark = None
    for n, op in enumerate(ops):
        if n == live_from:
            live_peak = live
            reserved_at_mark = model.reserved
            model.reserved_peak = model.reserved
        if op[0] == "a":
            held[op[1]] = model.malloc(op[2])
            sizes[op[1]] = r = round_size(op[2], None)
            live += r
            live_peak = max(live_peak, live)
        else:
            b = held.pop(op[1], None)
            if b is not None:
                model.free(b)
                live -= sizes.pop(op[1])
    return {
        "live_peak": live_peak,
        "reserved_peak": model.reserved_peak,
        "reserved_at_mark": reserved_at_mark,
        "segments": model.segments,
        "ratio": model.reserved_peak / live_peak if live_peak else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="a recorded trace (bench_torch_hf.py --record-trace)")
    ap.add_argument(
        "--divisions",
        default="0,2,4,8,16,32",
        help="roundup_power2_divisions settings to try, ';'-separated where a list form "
        "has commas (e.g. '0;4;[256:1,512:2,>:8]'); ',' works for plain numbers",
    )
    ap.add_argument("--max-split-mib", default="0", help="max_split_size_mb settings (0: unset)")
    ap.add_argument(
        "--no-split", action="store_true", help="the pool made with MemPool(no_split=True)"
    )
    ap.add_argument(
        "--expandable",
        action="store_true",
        help="expandable_segments:True (not offered to a pluggable allocator's MemPool)",
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.trace:
        with open(args.trace) as f:
            recorded = json.load(f)
        ops = recorded["ops"]
        mark = recorded.get("second_ops") or 0
        name = f"{args.trace} ({len(ops)} ops, measured from op {mark})"
    else:
        # bench_measured_replay lives in benches/.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
        from bench_measured_replay import trace

        ops, mark = trace(args.batch, args.prompt, args.new), 0
        ops = [("a", 0, 1200 * MIB), *ops]  # the weights
        name = f"synthetic generate() {args.batch} x {args.prompt} + {args.new}"
    sep = ";" if ";" in args.divisions or "[" in args.divisions else ","
    settings = [s for s in args.divisions.split(sep) if s.strip()]
    rows = []
    print(name)
    for split in [int(s) for s in args.max_split_mib.split(",")]:
        for text in settings:
            try:
                table = parse_divisions(text)
            except ValueError as exc:
                ap.error(f"--divisions: {exc}")
            model = CachingModel(
                table, split * MIB if split else None, args.no_split, args.expandable
            )
            got = replay(ops, model, mark)
            got.update(
                divisions=text,
                max_split_mib=split,
                no_split=args.no_split,
                expandable=args.expandable,
            )
            rows.append(got)
            print(
                f"divisions {text:>24}  max_split {split or '-':>5}  reserved peak "
                f"{got['reserved_peak'] / MIB:9.1f} MiB  live peak {got['live_peak'] / MIB:9.1f} "
                f"MiB  ratio {got['ratio']:.3f}  segments {got['segments']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
