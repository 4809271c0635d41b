"""KV metrics for a router or a dashboard: a ``prometheus_client`` collector.

:class:`KVCacheCollector` reads each registered ``KVCacheManager`` once per
scrape (one ``stats()`` call: one lock, one consistent snapshot) and exposes
vLLM's KV metric meanings under the ``imp_mem_kv_`` prefix:

* ``imp_mem_kv_cache_usage_ratio``: the fraction of the pool's blocks that
  running sequences hold (vLLM's ``kv_cache_usage_perc``, as a fraction:
  cached blocks no sequence uses are reusable, so they do not count);
* ``imp_mem_kv_prefix_cache_queried_tokens_total`` and
  ``imp_mem_kv_prefix_cache_hit_tokens_total``: prompt tokens looked up and
  found cached (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``,
  counted in tokens), so the hit rate is their ``rate()`` ratio;
* the block counts by state, sequences, evictions;
* the host tier: blocks it holds and can hold, blocks and bytes offloaded
  (device to host) and onboarded (host to device); the disk tier: blocks
  and bytes it holds, blocks written and read back. They read 0 for a
  manager without these tiers, so every series exists on every process.

Names follow Prometheus conventions: base units (bytes; blocks and tokens
as counted units), ``_total`` on counters, ``_ratio`` on a fraction. Every
series is labelled ``model``, ``device`` and ``rank``.

``prometheus_client`` is the ``imp-mem[prometheus]`` extra; this module
imports it when a collector is built. Thread safety: a scrape may run on the
HTTP server's thread while the engine runs; it only calls ``stats()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

    from imp_mem._core import KVCacheManager

__all__ = ["KVCacheCollector"]

LABELS = ("model", "device", "rank")

# (name, stats key, help) of each gauge and each counter; the counters'
# names get `_total` from prometheus_client.
_GAUGES = (
    ("imp_mem_kv_capacity_blocks", "max_blocks", "Blocks the KV pool can hold."),
    ("imp_mem_kv_free_blocks", "free", "KV blocks on the free list."),
    ("imp_mem_kv_active_blocks", "active", "KV blocks running sequences hold."),
    ("imp_mem_kv_cached_blocks", "cached", "KV blocks in the device prefix cache."),
    ("imp_mem_kv_evictable_blocks", "evictable", "Cached KV blocks eviction may take."),
    ("imp_mem_kv_pinned_blocks", "pinned", "Cached KV blocks with a pin."),
    ("imp_mem_kv_sequences", "sequences", "Sequences admitted and not freed."),
    ("imp_mem_kv_host_capacity_blocks", "host_capacity", "Blocks the host tier can hold."),
    ("imp_mem_kv_host_cached_blocks", "host_cached", "Prefix blocks held in the host tier."),
    ("imp_mem_kv_disk_cached_blocks", "disk_cached", "Prefix blocks held in the disk tier."),
    ("imp_mem_kv_disk_used_bytes", "disk_bytes", "Bytes of the disk tier's block files."),
)
_COUNTERS = (
    (
        "imp_mem_kv_prefix_cache_queries",
        "prefix_queries",
        "Prefix-cache lookups (one per admission).",
    ),
    (
        "imp_mem_kv_prefix_cache_queried_tokens",
        "prefix_query_tokens",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "imp_mem_kv_prefix_cache_hit_tokens",
        "prefix_hit_tokens",
        "Prompt tokens found in the prefix cache (device or host tier).",
    ),
    ("imp_mem_kv_evicted_blocks", "evictions", "Cached blocks evicted from the device tier."),
    ("imp_mem_kv_offloaded_blocks", "offloads", "Blocks copied device to host."),
    ("imp_mem_kv_offloaded_bytes", "offload_bytes", "Bytes copied device to host."),
    ("imp_mem_kv_onboarded_blocks", "onboards", "Blocks copied host to device."),
    ("imp_mem_kv_onboarded_bytes", "onboard_bytes", "Bytes copied host to device."),
    (
        "imp_mem_kv_host_evicted_blocks",
        "host_evictions",
        "Blocks the host tier dropped (or wrote to disk) for room.",
    ),
    ("imp_mem_kv_disk_spilled_blocks", "disk_spills", "Blocks written to the disk tier."),
    ("imp_mem_kv_disk_loaded_blocks", "disk_loads", "Blocks read back from the disk tier."),
)


def _client() -> Any:
    try:
        from prometheus_client import core
    except ImportError as exc:
        raise ImportError(
            "imp_mem.prometheus needs prometheus_client; install imp-mem[prometheus]"
        ) from exc
    return core


class KVCacheCollector:
    """A ``prometheus_client`` collector of KV managers' metrics.

    ``KVCacheCollector(kv, model="llama-8b", device="cuda:0", rank=0)``
    collects one manager; :meth:`add` registers more (one per rank), each
    with its own labels. Register it once: ``REGISTRY.register(c)``.
    """

    def __init__(
        self,
        kv: KVCacheManager | None = None,
        *,
        model: str = "",
        device: str = "",
        rank: int | str = 0,
    ) -> None:
        self._core = _client()
        self._managers: list[tuple[KVCacheManager, tuple[str, str, str]]] = []
        if kv is not None:
            self.add(kv, model=model, device=device, rank=rank)

    def add(
        self, kv: KVCacheManager, *, model: str = "", device: str = "", rank: int | str = 0
    ) -> None:
        """Collects ``kv`` too, under these labels (which must differ from
        every other manager's)."""
        labels = (str(model), str(device), str(rank))
        if any(existing == labels for _, existing in self._managers):
            raise ValueError(
                f"a manager with labels model={model!r}, device={device!r}, rank={rank!r} "
                "is already collected; give each manager its own device or rank"
            )
        self._managers.append((kv, labels))

    def describe(self) -> Iterator[Any]:
        """The metric families without samples (so registering does not
        scrape)."""
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Any]:
        """One scrape: one ``stats()`` snapshot per manager."""
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Any]:
        core = self._core
        snapshots = [(kv.stats(), labels) for kv, labels in self._managers] if with_samples else []
        usage = core.GaugeMetricFamily(
            "imp_mem_kv_cache_usage_ratio",
            "Fraction of the KV pool's blocks that running sequences hold (0 to 1).",
            labels=LABELS,
        )
        for stats, labels in snapshots:
            total = stats.get("max_blocks", 0)
            usage.add_metric(labels, stats.get("active", 0) / total if total else 0.0)
        yield usage
        for name, key, doc in _GAUGES:
            family = core.GaugeMetricFamily(name, doc, labels=LABELS)
            for stats, labels in snapshots:
                family.add_metric(labels, float(stats.get(key, 0)))
            yield family
        for name, key, doc in _COUNTERS:
            family = core.CounterMetricFamily(name, doc, labels=LABELS)
            for stats, labels in snapshots:
                family.add_metric(labels, float(stats.get(key, 0)))
            yield family
