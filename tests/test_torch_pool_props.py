"""``imp_mem.torch.Pool``'s routing as a property: random lifetimes of Pools
over three tiers (made directly or through ``pool()``, closed in any
order), scopes and routes nested in any order, torch's mallocs inside them
and frees anywhere, through the real hooks on the fake backend (torch's
CUDA side stood in for, ``_torch_standins``).

* A malloc inside an open Pool's scope (or route) lands in that Pool's
  tier, whichever Pools are open and whichever tier holds the hooks'
  installed slot; the innermost scope wins.
* Every free goes home: no free is ever taken for a foreign or a double one.
* The installed slot is the tier of an open Pool, or empty.
* Once every Pool is closed and every block freed, each system closes
  holding nothing, and no pool stays retired."""

from __future__ import annotations

import pytest
from _torch_standins import MIB, closes_clean, small_system, stand_in, tear_down, torch_hooks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imp_mem import _core

torch = pytest.importorskip("torch")
imt = pytest.importorskip("imp_mem.torch")

TIERS = 3

_op = st.one_of(
    st.tuples(st.just("open"), st.integers(0, TIERS - 1)),
    st.tuples(st.just("pool"), st.integers(0, TIERS - 1)),
    st.tuples(st.just("close"), st.integers(0, 15)),
    st.tuples(st.just("scope"), st.integers(0, 15), st.integers(0, 15), st.integers(1, 3)),
    st.tuples(st.just("routed"), st.integers(0, 15), st.integers(1, 3)),
    st.tuples(st.just("free"), st.integers(0, 63)),
)


def _counters() -> tuple[int, int]:
    stats = _core.hook_stats()
    return stats["foreign_frees"], stats["double_frees"]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(_op, max_size=40))
def test_pools_route_every_block_to_their_tier_and_home(ops, monkeypatch):
    stand_in(monkeypatch)
    malloc, free = torch_hooks()
    systems = [small_system() for _ in range(TIERS)]
    tier_ids = [s.activations.id for s in systems]
    retired = _core.hook_stats()["retired_pools"]
    before = _counters()
    pools: list[tuple[imt.Pool, int]] = []  # every Pool made, with its tier
    live: list[tuple[int, int, int]] = []  # (address, bytes, tier)

    def owner(ptr: int) -> int | None:
        found = [i for i, s in enumerate(systems) if s.activations.size_of(ptr) is not None]
        assert len(found) <= 1
        return found[0] if found else None

    def open_pools() -> list[tuple[imt.Pool, int]]:
        return [(p, t) for p, t in pools if not p.closed]

    def take(tier: int, mib: int) -> None:
        ooms = _core.hook_stats()["ooms"]
        ptr = malloc(mib * MIB, 0, None)
        if not ptr:
            assert _core.hook_stats()["ooms"] == ooms + 1, "refused without an OOM"
            return
        assert owner(ptr) == tier, f"a block of tier {tier}'s scope landed in {owner(ptr)}"
        live.append((ptr, mib * MIB, tier))

    try:
        for op in ops:
            kind = op[0]
            if kind == "open":
                pools.append((imt.Pool(systems[op[1]], device=0), op[1]))
            elif kind == "pool":
                p = imt.pool(systems[op[1]], device=0)
                assert not p.closed
                if all(p is not q for q, _ in pools):
                    pools.append((p, op[1]))
            elif kind == "close" and pools:
                pools[op[1] % len(pools)][0].close()
            elif kind in ("scope", "routed") and open_pools():
                opened = open_pools()
                outer, outer_tier = opened[op[1] % len(opened)]
                enter = (lambda p: p.scope()) if kind == "scope" else (lambda p: p.routed())
                with enter(outer):
                    take(outer_tier, op[-1])
                    if kind == "scope":
                        inner, inner_tier = opened[op[2] % len(opened)]
                        with inner.scope():
                            take(inner_tier, op[-1])
                        take(outer_tier, 1)  # the outer scope's again
            elif kind == "free" and live:
                ptr, n, tier = live.pop(op[1] % len(live))
                in_use = systems[tier].activations.stats()["in_use"]
                free(ptr, n, 0, None)
                assert systems[tier].activations.stats()["in_use"] < in_use, "a free missed home"
            assert _counters() == before, f"a free was refused after {op}"
            # (An id, not the handle: a handle left here would hold the tier.)
            installed = getattr(imt.installed(), "id", None)
            if installed is not None:
                assert any(t == tier_ids.index(installed) for _, t in open_pools()), (
                    "the installed slot holds a tier no open Pool has"
                )
    finally:
        for ptr, n, _ in live:
            free(ptr, n, 0, None)
        for p, _ in pools:
            p.close()
        tear_down()
    assert _counters() == before
    assert not any(_core.remove_hook_region(s.activations) for s in systems), "a region left"
    assert _core.hook_stats()["retired_pools"] == retired
    assert all(closes_clean(s) for s in systems), "a tier held after everything let go"
