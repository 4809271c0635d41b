"""imp-mem's KV manager beside vLLM's own ``BlockPool``, in one process, on
``bench_kv.py``'s request churn with the prompts held as Python lists (what
a vLLM ``Request`` holds), printed as a ratio.

vLLM is not a dependency. Its block pool is pure Python, so its wheel's
Python files are enough (no torch kernels run); vLLM imports torch, so the
environment needs torch too::

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm
    (cd /tmp/vllm && unzip -q vllm-*.whl 'vllm/*' -x 'vllm/*.so')
    PYTHONPATH=/tmp/vllm:<its pure-Python deps> python benches/bench_kv_vllm.py

(the deps are whatever ``from vllm.v1.core.block_pool import BlockPool``
asks for: psutil, msgspec, pydantic, cachetools, cbor2 and so on).

Each request is what vLLM's scheduler does to a new request's blocks with
prefix caching on: the block hashes (``get_request_block_hasher`` with the
default ``sha256``, and again with ``xxhash``), the longest cached prefix
(``get_cached_block`` block by block, at most ``(num_tokens - 1) // 16``
blocks so one token is left to compute), ``touch`` of the hit, new blocks
for the rest (``get_new_blocks``), ``cache_full_blocks``, then
``free_blocks`` in reverse order as a finished request frees them. The
request object carries only what those calls read, so vLLM pays nothing for
its ``Request`` class. imp-mem does ``admit`` + ``free`` on the same lists.
The builds take turns on slices of fresh prompts (alternating order), so
drift is shared; the fastest slice counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kv

from imp_mem import KVCacheManager

BS = bench_kv.BS
BLOCKS = bench_kv.BLOCKS


def vllm_peer(hash_name: str):
    """A churn step over vLLM's BlockPool: ``step(tokens)`` for one request."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    hash_fn = get_hash_fn_by_name(hash_name)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BS, hash_fn)
    pool = BlockPool(BLOCKS, enable_caching=True, hash_block_size=BS)

    def step(tokens: list[int]) -> int:
        request = SimpleNamespace(
            block_hashes=[],
            num_tokens=len(tokens),
            all_token_ids=tokens,
            mm_features=[],
            lora_request=None,
            cache_salt=None,
            prompt_embeds=None,
        )
        request.block_hashes = hasher(request)
        limit = (len(tokens) - 1) // BS
        hit = []
        for block_hash in request.block_hashes[:limit]:
            cached = pool.get_cached_block(block_hash, [0])
            if cached is None:
                break
            hit.append(cached[0])
        pool.touch(hit)
        need = -(-len(tokens) // BS)
        blocks = hit + pool.get_new_blocks(need - len(hit))
        pool.cache_full_blocks(request, blocks, len(hit), len(tokens) // BS, BS, 0)
        pool.free_blocks(reversed(blocks))
        return len(hit)

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2400, help="requests per side")
    parser.add_argument("--slices", type=int, default=8)
    args = parser.parse_args()
    try:
        peers = {f"vLLM BlockPool ({h})": vllm_peer(h) for h in ("sha256", "xxhash")}
    except ImportError as e:
        print(f"vLLM is not importable here ({e}); see this script's docstring.")
        return 2

    sides = ["imp-mem", *peers]
    base = bench_kv.churn_requests(16 + args.requests * len(sides), 3)
    warm, rest = base[:16], base[16:]
    prompts = {
        s: [t.tolist() for t in rest[k * args.requests : (k + 1) * args.requests]]
        for k, s in enumerate(sides)
    }
    kv = KVCacheManager(BLOCKS, BS)
    counter = iter(range(1 << 62))

    def ours(tokens: list[int]) -> int:
        i = next(counter)
        cached = kv.admit(i, tokens)
        kv.free(i)
        return cached // BS

    steps = {"imp-mem": ours, **peers}
    hits = {s: 0 for s in sides}
    for s in sides:
        for t in warm:
            steps[s](t.tolist())
    size = args.requests // args.slices
    times: dict[str, list[float]] = {s: [] for s in sides}
    for k in range(args.slices):
        for s in sides if k % 2 == 0 else sides[::-1]:
            step, reqs = steps[s], prompts[s][k * size : (k + 1) * size]
            t0 = time.perf_counter()
            for tokens in reqs:
                hits[s] += step(tokens)
            times[s].append((time.perf_counter() - t0) / size)
    for s in sides:
        # Every side must have found the shared half: 31 of 32 blocks a request.
        assert hits[s] >= 31 * size * args.slices, (s, hits[s])

    ours_t = min(times["imp-mem"])
    print(
        f"KV request churn, prompts as Python lists ({args.requests} requests a side, "
        f"64 blocks of {BS}, half shared), Python {sys.version.split()[0]}"
    )
    print(f"{'':34} {'per request':>12} {'requests/s':>11} {'vs imp-mem':>11}")
    for s in sides:
        t = min(times[s])
        print(f"{s:34} {t * 1e6:9.2f} µs {1 / t:11,.0f} {t / ours_t:10.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
