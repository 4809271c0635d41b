"""The paged KV cache without an engine: sequences own their blocks, a
prefix cache owns its own, and admission refuses up front (a typed
`CapacityError` naming what is missing) instead of failing mid-generation.

    python examples/kv_cache.py

Needs only the wheel: no GPU, no torch, no NumPy.
"""

from __future__ import annotations

import imp_mem


def main() -> int:
    kv = imp_mem.KVCacheManager(num_blocks=64, block_size=16)
    system_prompt = list(range(96))  # six full blocks every request shares
    question = [1000, 1001, 1002]

    cached = kv.admit(1, [*system_prompt, *question])
    print(f"seq 1 admitted: {cached} tokens cached, blocks {kv.block_table(1)}")
    for token in range(10):  # decode: one token a step, a block when one fills
        kv.append(1, [2000 + token])
    kv.free(1)  # its full blocks move into the prefix cache

    cached = kv.admit(2, [*system_prompt, 3000, 3001])
    assert cached == 96, cached
    print(f"seq 2 admitted: {cached} tokens were a prefix hit (six shared blocks)")

    # Too long for what is left: refused before any block is taken.
    huge = list(range(64 * 16))
    assert not kv.can_admit(huge)
    try:
        kv.admit(3, huge)
    except imp_mem.CapacityError as err:
        print(f"seq 3 refused up front: {type(err).__name__}: {err}")
    else:
        raise AssertionError("admit() took a sequence that cannot fit")

    # Bad input is a typed error whose message names the argument.
    try:
        kv.admit(4, [1, 2, -3])
    except imp_mem.InvalidArgument as err:
        print(f"bad token refused: {err}")
    kv.free(2)
    print(f"after freeing: {kv.stats()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
