"""The KV host tier from Python, on the fake backend: what the binding adds
(arguments, stats, the copies to wait on, events and metrics of the host
tier). The tier's rules are proven by the Rust state machine
(`kv_host_props.rs`)."""

from __future__ import annotations

import pytest
from _helpers import make_plan

import imp_mem
from imp_mem import events as ev

BS = 4
BLOCK = 64


def manager(blocks=8, host=16, **kw):
    fake = imp_mem.FakeBackend(capacity="4MiB")
    kv = imp_mem.KVCacheManager(blocks, BS, backend=fake, block_bytes=BLOCK, host_blocks=host, **kw)
    return kv, fake


def fill(kv, fake, seq_id):
    """The engine computes a sequence: a pattern per block, from its hash."""
    for i, h in enumerate(kv.sequence_hashes(seq_id)):
        span = kv.block_span(seq_id, i)
        fake.write(span[0], (h % 251).to_bytes(1, "little") * BLOCK)


def test_an_evicted_prefix_is_onboarded_with_its_bytes():
    kv, fake = manager()
    prompt = list(range(13))
    kv.admit(1, prompt)
    fill(kv, fake, 1)
    kv.free(1)
    assert kv.evict(3) == 3
    assert kv.stats()["host_offloading"] == 3
    assert kv.poll_copies() == 3
    s = kv.stats()
    assert (s["cached"], s["host_cached"], s["offloads"], s["offload_bytes"]) == (
        0,
        3,
        3,
        3 * BLOCK,
    )
    # Someone else scribbles over every device block.
    kv.admit(2, list(range(1000, 1031)))
    for i in range(8):
        fake.write(kv.block_span(2, i)[0], b"\xee" * BLOCK)
    kv.abort(2)
    assert kv.probe(prompt) == 12
    assert kv.admit(3, prompt) == 12
    assert kv.wait_onboarding(3) in (0, 3)
    for i, h in enumerate(kv.sequence_hashes(3)):
        assert fake.read(kv.block_span(3, i)[0], BLOCK) == (h % 251).to_bytes(1, "little") * BLOCK
    s = kv.stats()
    assert (s["host_hit_blocks"], s["onboards"], s["onboard_bytes"]) == (3, 3, 3 * BLOCK)
    assert s["prefix_hit_tokens"] == 12
    kv.poll_copies(wait=True)
    assert kv.onboarding(3) == []
    kv.check_invariants()


def test_host_blocks_need_a_backend_with_block_bytes():
    with pytest.raises(imp_mem.InvalidArgument, match="host_blocks"):
        imp_mem.KVCacheManager(8, BS, host_blocks=4)
    fake = imp_mem.FakeBackend(capacity="1MiB")
    with pytest.raises(imp_mem.InvalidArgument, match="host_blocks"):
        imp_mem.KVCacheManager(8, BS, backend=fake, host_blocks=4)
    with pytest.raises(imp_mem.InvalidArgument, match="prefix caching"):
        imp_mem.KVCacheManager(
            8, BS, backend=fake, block_bytes=BLOCK, host_blocks=4, enable_prefix_caching=False
        )
    kv = imp_mem.KVCacheManager(8, BS)
    assert kv.stats()["host_capacity"] == 0 and kv.poll_copies() == 0
    kv.admit(1, [1, 2, 3])
    assert kv.onboarding(1) == [] and kv.wait_onboarding(1) == 0
    with pytest.raises(imp_mem.InvalidArgument, match="no sequence 9"):
        kv.onboarding(9)


def test_host_tier_events_and_metrics():
    kv, _ = manager(kv_events=True)
    kv.admit(1, list(range(9)))
    kv.free(1)
    ev.drain(kv)
    kv.evict(2)
    kv.poll_copies()
    batch = ev.drain(kv)
    removed = [e for e in batch.events if isinstance(e, ev.BlockRemoved)]
    stored = [e for e in batch.events if isinstance(e, ev.BlockStored)]
    assert [e.medium for e in removed] == ["GPU"]
    assert {e.medium for e in stored} == {"CPU"}
    assert {h for e in stored for h in e.block_hashes} == set(kv.host_cached_blocks())
    kv.admit(2, list(range(9)))
    batch = ev.drain(kv)
    media = [(type(e).__name__, e.medium) for e in batch.events]
    assert ("BlockRemoved", "CPU") in media and ("BlockStored", "GPU") in media

    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from imp_mem.prometheus import KVCacheCollector

    registry = prometheus_client.CollectorRegistry()
    registry.register(KVCacheCollector(kv, model="m", device="cpu"))
    text = prometheus_client.generate_latest(registry).decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["imp_mem_kv_host_capacity_blocks"] == 16
    assert values["imp_mem_kv_offloaded_blocks_total"] == 2
    assert values["imp_mem_kv_offloaded_bytes_total"] == 2 * BLOCK
    assert values["imp_mem_kv_onboarded_bytes_total"] == 2 * BLOCK


def test_the_plan_sizes_the_host_tier_of_a_systems_manager():
    def plan(**features):
        return make_plan(features=imp_mem.Features(**features))

    device_only = plan()
    with_host = plan(kv_host_bytes="8MiB")
    assert device_only.kv_host is None
    host = with_host.kv_host
    assert host["block_bytes"] == with_host.kv["block_bytes"]
    assert host["blocks"] == (8 << 20) // host["block_bytes"] and host["blocks"] > 0
    assert with_host.total() == device_only.total(), "host memory is not device memory"
    assert imp_mem.MemoryPlan.from_json(with_host.to_json()).kv_host == host
    with pytest.raises(imp_mem.InvalidArgument, match="kv_host_bytes"):
        imp_mem.Features(kv_host_bytes=-1)

    fake = imp_mem.FakeBackend(capacity=1 << 30)
    with imp_mem.MemorySystem(fake, with_host) as system:
        kv = system.kv_manager()
        assert kv.stats()["host_capacity"] == host["blocks"]
        del kv
        kv = system.kv_manager(host_blocks=0)
        assert kv.stats()["host_capacity"] == 0
        del kv


def test_a_disk_tier_behind_the_host_tier(tmp_path):
    fake = imp_mem.FakeBackend(capacity="4MiB")
    kv = imp_mem.KVCacheManager(
        8,
        BS,
        backend=fake,
        block_bytes=BLOCK,
        host_blocks=2,
        disk_dir=tmp_path / "kv",
        disk_bytes=1 << 20,
    )
    prompt = list(range(13))
    kv.admit(1, prompt)
    fill(kv, fake, 1)
    hashes = kv.sequence_hashes(1)
    kv.free(1)
    kv.evict(2)
    kv.poll_copies(wait=True)
    kv.evict(1)  # the host tier's oldest block goes to disk
    kv.poll_copies(wait=True)
    s = kv.stats()
    assert (s["host_cached"], s["disk_cached"], s["disk_spills"]) == (2, 1, 1)
    (on_disk,) = kv.disk_cached_blocks()
    files = list((tmp_path / "kv").iterdir())
    assert [f.name for f in files] == [f"{on_disk:032x}.impkv"]
    assert s["disk_bytes"] == files[0].stat().st_size
    # A spilled block is a prefix-cache file of one entry.
    other = imp_mem.KVCacheManager(8, BS, backend=fake, block_bytes=BLOCK)
    assert other.load_prefix_cache(files[0]) == 1
    assert [h for h, _, _ in other.cached_blocks()] == [on_disk]
    del other
    # The host tier holds two slots: two host hits and no room to stage the
    # disk block, so the third block is recomputed.
    assert kv.admit(2, prompt) == 8
    kv.wait_onboarding(2)
    for i in range(2):
        want = (hashes[i] % 251).to_bytes(1, "little") * BLOCK
        assert fake.read(kv.block_span(2, i)[0], BLOCK) == want
    kv.check_invariants()
    with pytest.raises(imp_mem.InvalidArgument, match="disk_dir and disk_bytes"):
        imp_mem.KVCacheManager(8, BS, backend=fake, block_bytes=BLOCK, disk_bytes=1 << 20)
