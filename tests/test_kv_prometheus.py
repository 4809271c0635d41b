"""``imp_mem.prometheus``: every scrape parses with prometheus_client's own
parser, names follow Prometheus conventions, and the values are one
snapshot of the manager's counters under vLLM's meanings."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import imp_mem

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from imp_mem.prometheus import KVCacheCollector  # noqa: E402

BS = 4


def scrape(collector) -> dict[str, dict[tuple, float]]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    text = prometheus_client.generate_latest(registry).decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("imp_mem_kv_")
        assert re.fullmatch(r"[a-z_]+", family.name)
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples)
        for s in family.samples:
            key = (s.labels["model"], s.labels["device"], s.labels["rank"])
            out.setdefault(s.name, {})[key] = s.value
    return out


def test_names_are_conventional_and_the_values_are_the_snapshot():
    kv = imp_mem.KVCacheManager(10, BS)
    kv.admit(1, list(range(9)))
    kv.free(1)
    kv.admit(2, list(range(9)))
    kv.admit(3, list(range(100, 105)))
    m = scrape(KVCacheCollector(kv, model="tiny", device="cpu", rank=0))
    key = ("tiny", "cpu", "0")
    s = kv.stats()
    assert m["imp_mem_kv_cache_usage_ratio"][key] == pytest.approx(s["active"] / 10)
    assert 0 < m["imp_mem_kv_cache_usage_ratio"][key] <= 1
    assert m["imp_mem_kv_prefix_cache_queried_tokens_total"][key] == 9 + 9 + 5
    assert m["imp_mem_kv_prefix_cache_hit_tokens_total"][key] == 8
    assert m["imp_mem_kv_prefix_cache_queries_total"][key] == 3
    assert m["imp_mem_kv_active_blocks"][key] == s["active"]
    assert m["imp_mem_kv_free_blocks"][key] == s["free"]
    assert m["imp_mem_kv_capacity_blocks"][key] == 10
    assert m["imp_mem_kv_sequences"][key] == 2
    for name in (
        "imp_mem_kv_offloaded_bytes_total",
        "imp_mem_kv_onboarded_bytes_total",
        "imp_mem_kv_offloaded_blocks_total",
        "imp_mem_kv_onboarded_blocks_total",
        "imp_mem_kv_host_cached_blocks",
        "imp_mem_kv_host_capacity_blocks",
    ):
        assert m[name][key] == 0, name
    for name in m:
        assert name.endswith(("_total", "_blocks", "_bytes", "_ratio", "_sequences")), name


def test_two_ranks_are_two_label_sets_and_a_duplicate_is_refused():
    a = imp_mem.KVCacheManager(8, BS)
    b = imp_mem.KVCacheManager(16, BS)
    c = KVCacheCollector(a, model="m", device="cuda:0", rank=0)
    c.add(b, model="m", device="cuda:1", rank=1)
    with pytest.raises(ValueError, match="already collected"):
        c.add(b, model="m", device="cuda:1", rank=1)
    m = scrape(c)
    assert m["imp_mem_kv_capacity_blocks"] == {("m", "cuda:0", "0"): 8, ("m", "cuda:1", "1"): 16}


def test_registering_does_not_scrape():
    calls = []

    class Counting:
        def __init__(self, kv):
            self.kv = kv

        def stats(self):
            calls.append(1)
            return self.kv.stats()

    c = KVCacheCollector(Counting(imp_mem.KVCacheManager(8, BS)))
    registry = prometheus_client.CollectorRegistry()
    registry.register(c)
    assert calls == []
    prometheus_client.generate_latest(registry)
    assert calls == [1], "one stats() snapshot per scrape"


@settings(max_examples=40, deadline=None)
@given(
    script=st.lists(
        st.tuples(st.sampled_from(["admit", "free", "evict"]), st.integers(0, 40)), max_size=30
    )
)
def test_every_scrape_parses_and_counters_never_go_down(script):
    kv = imp_mem.KVCacheManager(12, BS)
    c = KVCacheCollector(kv, model='quote"and\\slash', device="cpu", rank="r0")
    last: dict[str, float] = {}
    live: list[int] = []
    for i, (op, n) in enumerate(script):
        try:
            if op == "admit":
                kv.admit(i, list(range(n % 5, n % 5 + n + 1)))
                live.append(i)
            elif op == "free" and live:
                kv.free(live.pop(n % len(live)))
            elif op == "evict":
                kv.evict(n % 4)
        except imp_mem.CapacityError:
            pass
        m = scrape(c)
        for name, series in m.items():
            (value,) = series.values()
            if name.endswith("_total"):
                assert value >= last.get(name, 0), name
            last[name] = value
        ratio = m["imp_mem_kv_cache_usage_ratio"]
        assert all(0 <= v <= 1 for v in ratio.values())
