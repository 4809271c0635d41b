"""KVCacheManager from several Python threads: small calls keep the GIL
only when the manager's lock is free, large ones (and contended ones)
release it, so mixing them neither deadlocks nor breaks an invariant."""

from __future__ import annotations

import threading

import numpy as np

from imp_mem import CapacityError, KVCacheManager


def test_small_and_large_calls_from_threads_keep_the_invariants():
    m = KVCacheManager(4096, 16)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            rng = np.random.default_rng(k)
            for i in range(150):
                sid = k * 1_000_000 + i
                # Alternate small calls (GIL kept) with large ones (released).
                n = 64 if i % 3 else 8192
                tokens = rng.integers(0, 1000, n, dtype=np.int32)
                try:
                    m.admit(sid, tokens)
                except CapacityError:
                    continue
                m.append(sid, np.arange(5, dtype=np.int64))
                (m.free if i % 2 else m.abort)(sid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert errors == []
    m.check_invariants()
    s = m.stats()
    assert s["sequences"] == 0
    assert s["live"] == s["cached"]
    assert s["prefix_queries"] > 400, "most admissions went through"
