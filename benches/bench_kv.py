"""KVCacheManager against a plain-Python implementation of the same
semantics, in one run, printed as ratios.

The reference (``RefKV``) is what a careful Python engine would write:
refcounted block ids on a free list, a dict prefix cache whose entries own a
ref, an ``OrderedDict`` LRU of the evictable entries (O(1)), chained hashes
with ``hashlib.blake2b`` (128-bit, the stdlib's fastest collision-resistant
hash; vLLM's default SHA-256 over pickle is slower), tokens sliced from one
``tobytes()`` per request. It implements admission with the same capacity
rule, prefix hits that leave one token to compute, and freeing that moves
full blocks into the cache, last block first — not pins, holes or SWA,
which the workloads do not exercise.

Workloads (vLLM's BlockPool peer figures were measured when the project was
specified; that note is not part of this repository):

* request churn: hash + lookup + allocate + cache + free; 64 blocks of 16
  tokens a request, the first 32 from one of 8 shared system prompts. The
  4000 prompts (16 MB) are built before the timing, so both sides read each
  from memory at its first touch, as an engine reads a request tokenized
  before its turn;
* batched allocate + free of 16 blocks (prefix caching off: a 256-token
  request admitted and aborted);
* chained hashing, per block (one 64-block prompt, hashed over and over:
  warm in the CPU caches);
* the churn again with the prompts held as Python lists of ints (what
  vLLM's and SGLang's requests hold), int32 and int64 NumPy arrays and
  ``array('i')``, the formats taking turns on slices of the same prompts,
  each against the reference given the same objects; and ``append`` of one
  token and of an 8-token list, from a list and from an int32 array (a
  decode step), printed as list / NumPy ratios.

Run with a release build of the wheel: ``python benches/bench_kv.py``.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import time
from array import array
from collections import OrderedDict

import numpy as np

from imp_mem import KVCacheManager

BS = 16
BLOCKS = 10_000
ROOT = b"\0" * 16


class RefCapacityError(Exception):
    pass


class RefKV:
    """The same semantics in plain Python (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.bs = block_size
        self.caching = caching
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.cache: dict[bytes, list[int]] = {}  # hash -> [block, users]
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # evictable entries
        self.seqs: dict[int, tuple] = {}

    def hash_blocks(self, tokens, parent: bytes = ROOT) -> list[bytes]:
        # One bytes object per request, in whatever width the ids come in
        # (a list is packed by `array`, the fastest way in plain Python).
        if isinstance(tokens, (list, tuple)):
            tokens = array("I", tokens)
        raw = tokens.tobytes()
        step = tokens.itemsize * self.bs
        out = []
        blake = hashlib.blake2b
        for off in range(0, len(raw) - step + 1, step):
            parent = blake(parent + raw[off : off + step], digest_size=16).digest()
            out.append(parent)
        return out

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_ids.append(b)

    def admit(self, sid: int, tokens: np.ndarray) -> int:
        n = len(tokens)
        bs = self.bs
        hashes = self.hash_blocks(tokens) if self.caching else []
        total = -(-n // bs)
        max_hit = len(hashes) - 1 if n and n % bs == 0 else len(hashes)
        hits = []
        cache = self.cache
        for h in hashes[:max_hit]:
            if h not in cache:
                break
            hits.append(h)
        need = total - len(hits)
        lru = self.lru
        taken = sum(1 for h in hits if h in lru)
        if need > len(self.free_ids) + len(lru) - taken:
            raise RefCapacityError(need)
        blocks = []
        for h in hits:
            e = cache[h]
            e[1] += 1
            lru.pop(h, None)
            self.refs[e[0]] += 1
            blocks.append(e[0])
        while len(self.free_ids) < need:
            h, b = lru.popitem(last=False)
            del cache[h]
            self._release(b)
        for _ in range(need):
            b = self.free_ids.pop()
            self.refs[b] = 1
            blocks.append(b)
        self.seqs[sid] = (n, hashes, blocks, len(hits))
        return len(hits) * bs

    def free(self, sid: int, cache_blocks: bool = True) -> None:
        _n, hashes, blocks, nhits = self.seqs.pop(sid)
        cache, lru = self.cache, self.lru
        # Last block first, as the manager does: the prefix's head is the
        # most recently used, so eviction shortens it from the end.
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            if i < nhits:
                h = hashes[i]
                e = cache[h]
                e[1] -= 1
                self.refs[b] -= 1
                if e[1] == 0:
                    lru[h] = b
            elif cache_blocks and i < len(hashes) and hashes[i] not in cache:
                cache[hashes[i]] = [b, 0]
                lru[hashes[i]] = b
            else:
                self._release(b)

    def abort(self, sid: int) -> None:
        self.free(sid, cache_blocks=False)


def best(fn, repeat: int = 3) -> float:
    """The fastest of `repeat` runs of fn(), in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def churn_requests(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50_000, 32 * BS, dtype=np.int32) for _ in range(8)]
    out = []
    for i in range(n):
        unique = rng.integers(0, 50_000, 32 * BS, dtype=np.int32)
        unique[0] = 60_000 + (i % 1000)  # no accidental suffix hits
        out.append(np.concatenate([systems[i % 8], unique]))
    return out


def bench_churn(n_ours: int, n_ref: int, chunks: int = 3) -> tuple[float, float]:
    def run(kv, reqs, first):
        def go():
            for i, toks in enumerate(reqs, first):
                kv.admit(i, toks)
                kv.free(i)

        return go

    def per_request(kv, reqs) -> float:
        """The fastest of `chunks` consecutive slices, per request: the
        same steady state each time (the unique suffixes never repeat), so
        the minimum drops only what the machine added."""
        run(kv, reqs[:16], 0)()
        size = (len(reqs) - 16) // chunks
        times = []
        for c in range(chunks):
            start = 16 + c * size
            times.append(best(run(kv, reqs[start : start + size], start), repeat=1) / size)
        return min(times)

    reqs = churn_requests(n_ours, 1)
    # Fresh managers per repeat would re-warm the cache; the first requests
    # warm the system prompts, then each slice runs on the same manager.
    ours = KVCacheManager(BLOCKS, BS)
    t_ours = per_request(ours, reqs)
    s = ours.stats()
    assert s["prefix_hit_blocks"] >= 31 * (s["prefix_queries"] - 16), s
    ref = RefKV(BLOCKS, BS)
    t_ref = per_request(ref, reqs[:n_ref])
    return t_ours, t_ref


# The token formats of the format churn, each made from an int32 prompt.
FORMATS = {
    "list": lambda t: t.tolist(),
    "int32": lambda t: t,
    "int64": lambda t: t.astype(np.int64),
    "array('i')": lambda t: array("i", t.tobytes()),
}


def bench_churn_formats(n: int, n_ref: int, slices: int = 16) -> dict[str, tuple[float, float]]:
    """Per-request churn time of each of `FORMATS`, ours and the
    reference's: the formats take turns (in alternating order) on slices of
    fresh prompts, each on its own manager, so drift is shared; the fastest
    slice counts. The reference runs `n_ref` requests a format, after."""
    base = churn_requests(16 + n * len(FORMATS), 2)
    warm, rest = base[:16], base[16:]
    size = n // slices
    ours: dict[str, list[float]] = {f: [] for f in FORMATS}
    managers = {f: KVCacheManager(BLOCKS, BS) for f in FORMATS}
    prompts = {}
    for k, (name, make) in enumerate(FORMATS.items()):
        for i, toks in enumerate(warm):
            managers[name].admit(i, make(toks))
            managers[name].free(i)
        prompts[name] = [make(t) for t in rest[k * n : (k + 1) * n]]
    order = list(FORMATS)
    for s in range(slices):
        for name in order if s % 2 == 0 else order[::-1]:
            kv, reqs = managers[name], prompts[name][s * size : (s + 1) * size]
            first = 16 + s * size
            t0 = time.perf_counter()
            for i, toks in enumerate(reqs, first):
                kv.admit(i, toks)
                kv.free(i)
            ours[name].append((time.perf_counter() - t0) / size)
    out = {}
    for name, make in FORMATS.items():
        ref = RefKV(BLOCKS, BS)
        for i, toks in enumerate(warm):
            ref.admit(i, make(toks))
            ref.free(i)
        t0 = time.perf_counter()
        for i, toks in enumerate(prompts[name][:n_ref], 16):
            ref.admit(i, toks)
            ref.free(i)
        out[name] = (min(ours[name]), (time.perf_counter() - t0) / n_ref)
    return out


def bench_append(n: int, rounds: int = 15) -> dict[str, float]:
    """Per-call time of `append` of one token and of 8, from fresh lists
    and fresh int32 arrays (a decode step's output, as an engine holds it),
    each shape in turn on its own sequence; the fastest round counts."""
    rng = np.random.default_rng(4)
    shapes = {}
    for width in (1, 8):
        ids = rng.integers(0, 50_000, (n, width), dtype=np.int32)
        shapes[f"list/{width}"] = [row.tolist() for row in ids]
        shapes[f"int32/{width}"] = list(ids)
    kv = KVCacheManager(BLOCKS * 4, BS, enable_prefix_caching=False)
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for r in range(rounds):
        for k, (name, calls) in enumerate(shapes.items()):
            sid = r * len(shapes) + k
            kv.admit(sid, [1] * BS)
            append = kv.append
            t0 = time.perf_counter()
            for toks in calls:
                append(sid, toks)
            times[name].append((time.perf_counter() - t0) / n)
            kv.abort(sid)
    return {name: min(t) for name, t in times.items()}


def bench_alloc16(n: int) -> tuple[float, float]:
    toks = np.arange(16 * BS, dtype=np.int32)

    def run(kv, count):
        def go():
            for i in range(count):
                kv.admit(i, toks)
                kv.abort(i)

        return go

    ours = KVCacheManager(BLOCKS, BS, enable_prefix_caching=False)
    ref = RefKV(BLOCKS, BS, caching=False)
    t_ours = best(run(ours, n)) / n / 16
    t_ref = best(run(ref, n // 4)) / (n // 4) / 16
    return t_ours, t_ref


def bench_hash(n: int) -> tuple[float, float]:
    toks = np.random.default_rng(3).integers(0, 50_000, 64 * BS, dtype=np.int32)
    ours = KVCacheManager(BLOCKS, BS)
    ref = RefKV(BLOCKS, BS)

    def run(fn, count):
        def go():
            for _ in range(count):
                fn(toks)

        return go

    t_ours = best(run(ours.hash_blocks, n)) / n / 64
    t_ref = best(run(ref.hash_blocks, n // 10)) / (n // 10) / 64
    return t_ours, t_ref


def fmt(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:8.1f} ns"
    return f"{seconds * 1e6:8.2f} µs"


def main() -> int:
    quick = "--quick" in sys.argv
    k = 10 if quick else 1
    print(f"imp-mem KV manager vs plain Python, {platform.python_version()}, {platform.machine()}")
    print(
        f"{'workload':<44} {'imp-mem':>11} {'Python':>11} {'ratio':>8} {'goal':>6}"
        f" {'vLLM*':>11} {'ratio*':>8}"
    )
    rows = []
    t_ours, t_ref = bench_churn(4000 // k, 400 // k)
    rows.append(("request churn, per request (64 blocks, half hit)", t_ours, t_ref, 30, 1 / 6.7e3))
    t_ours, t_ref = bench_alloc16(40_000 // k)
    rows.append(("allocate 16 + free 16, per block", t_ours, t_ref, 10, 143e-9))
    t_ours, t_ref = bench_hash(20_000 // k)
    rows.append(("chained block hash, per 16-token block", t_ours, t_ref, 30, 1.39e-6))
    for name, a, b, goal, vllm in rows:
        print(f"{name:<44} {fmt(a)} {fmt(b)} {b / a:7.1f}x {goal:5d}x {fmt(vllm)} {vllm / a:7.1f}x")
    churn = rows[0]
    print(
        f"\nrequest churn: {1 / churn[1]:,.0f} requests/s (imp-mem) vs "
        f"{1 / churn[2]:,.0f} (plain Python, this run)"
    )
    print(
        "* vLLM 0.33.0's own BlockPool on this class of machine, measured when the project was "
        "specified (not this run);\n  SGLang's radix tree (Rust core) did about 23 k "
        "requests/s on the same churn."
    )
    print(f"\n{'request churn by token format':<44} {'imp-mem':>11} {'Python':>11} {'ratio':>8}")
    formats = bench_churn_formats(4000 // k, 200 // k, slices=16 if k == 1 else 4)
    for name, (a, b) in formats.items():
        print(f"{'  ' + name:<44} {fmt(a)} {fmt(b)} {b / a:7.1f}x")
    appends = bench_append(20_000 // k)
    print(f"{'append to a sequence, per call':<44} {'list':>11} {'int32':>11} {'ratio':>8}")
    for width in (1, 8):
        lst, arr = appends[f"list/{width}"], appends[f"int32/{width}"]
        print(f"{f'  {width} token(s)':<44} {fmt(lst)} {fmt(arr)} {lst / arr:7.2f}x")
    t_np, t_arr = formats["int32"][0], formats["array('i')"][0]
    print(
        f"list / int32 NumPy: churn {formats['list'][0] / t_np:.2f}x (goal <= 2), "
        f"append of 1 {appends['list/1'] / appends['int32/1']:.2f}x (goal <= 1.5), "
        f"of 8 {appends['list/8'] / appends['int32/8']:.2f}x; "
        f"int64 / int32 {formats['int64'][0] / t_np:.2f}x, "
        f"array('i') / int32 {t_arr / t_np:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
