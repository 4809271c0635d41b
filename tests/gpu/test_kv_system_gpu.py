"""A KVCacheManager on a MemorySystem's KV pool over the CUDA VMM backend:
the manager's blocks are device memory inside the KV pool's reservation,
the memory report attributes them to the KV tier, the pool grows while
serving without an acquisition, `system.step()` with a recorded fence
gives the grown tail back once the blocks are free, and the prefix cache
persists through the pool's block copies (device -> host -> file). Skipped
where no CUDA device exists."""

from __future__ import annotations

import gc

import pytest
from test_system import SMALL  # the small llama shape the system tests share

import imp_mem
from imp_mem import Features, KVCacheManager, Limits, MemorySystem, ModelShape, PlanInput

pytestmark = pytest.mark.gpu

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 2 << 20  # VMM handle size and the region's granularity


def small_plan():
    """4 x 1024 tokens: 256 KV blocks of 16 tokens, 32 KiB each (8 MiB)."""
    return imp_mem.plan_memory(
        PlanInput(
            ModelShape.from_hf_config(SMALL),
            Limits(4, 1024, kv_policy="fit"),
            Features(),
            budget=GIB,
            context=8 * MIB,
            library_reserve=4 * MIB,
        )
    )


def kv_tier(system) -> dict:
    report = system.mem_report(device=False)
    return next(t for t in report["tiers"] if t["key"] == "kv_pool")


def test_a_kv_manager_serves_device_blocks_from_the_systems_kv_pool(tmp_path):
    vmm = imp_mem.VmmBackend(device=0, chunk_bytes=CHUNK)
    plan = small_plan()
    stride = plan.kv["block_bytes"]
    per_chunk = CHUNK // stride  # 64 blocks a granule
    assert plan.kv_blocks == 256 and stride == 32 << 10
    system = MemorySystem(vmm, plan, kv_initial_blocks=per_chunk, kv_grow_blocks=per_chunk)
    try:
        pool = system.kv_pool
        s = pool.stats()
        assert (s["capacity"], s["max_blocks"]) == (per_chunk, plan.kv_blocks)
        assert s["committed_bytes"] == CHUNK

        # The KV pool's reservation: base + id * stride for every block id.
        probe = pool.allocate()
        base = probe.span().address - probe.id * stride
        probe.release()
        end = base + plan.kv_blocks * stride
        assert vmm.stats()["tags"]["kv_cache"]["reserved"] >= plan.kv_blocks * stride

        system.begin_serving()
        acquisitions = vmm.stats()["tags"]["kv_cache"]["acquisitions"]
        m = system.kv_manager(model_fingerprint="small-gpu")
        assert isinstance(m, KVCacheManager)
        bs = m.block_size
        assert bs == plan.kv["block_size"]

        # Three requests sharing a system prompt: more than the first granule.
        shared = list(range(4 * bs))
        prompts = [shared + list(range((i + 1) << 20, ((i + 1) << 20) + 60 * bs)) for i in range(3)]
        hits = []
        for i, prompt in enumerate(prompts):
            assert m.can_admit(prompt)
            hits.append(m.admit(i, prompt))
            m.cache_computed(i, len(prompt))
        assert hits == [0, 4 * bs, 4 * bs], "the shared prompt is served from the cache"
        assert pool.capacity > per_chunk, "the pool grew while serving"
        assert vmm.stats()["tags"]["kv_cache"]["acquisitions"] == acquisitions, (
            "growth is a commit inside the reservation, not an acquisition"
        )
        live = m.stats()["live"]
        assert live == 4 + 3 * 60
        for i in range(3):
            table = m.block_table(i)
            assert table[:4] == m.block_table(0)[:4]
            for j, block in enumerate(table):
                address, nbytes = m.block_span(i, j)
                assert nbytes == stride
                assert address == base + block * stride
                assert base <= address and address + nbytes <= end

        # The report attributes the manager's blocks to the KV tier.
        tier = kv_tier(system)
        assert tier["tag"] == "kv_cache"
        assert tier["in_use"] == live * stride
        assert tier["blocks"]["live"] == live
        assert tier["in_use"] <= tier["committed"] <= tier["reserved"]
        kv_tag = next(t for t in system.mem_report(device=False)["tags"] if t["tag"] == "kv_cache")
        assert kv_tag["committed"] == tier["committed"] == pool.stats()["committed_bytes"]
        assert f'imp_mem_pool_live_blocks{{tag="kv_cache"}} {live}' in system.metrics()
        m.check_invariants()
        system.check()

        # Persistence through the pool's block copies: save, evict, load, hit.
        for i in range(3):
            m.free(i)
        path = tmp_path / "prefix.imp"
        cached = m.stats()["cached"]
        assert m.save_prefix_cache(str(path)) == cached
        assert m.evict(10_000) == cached
        assert m.load_prefix_cache(str(path)) == cached
        assert m.admit(7, prompts[1]) == 64 * bs - bs, "all but the last block are hits"
        m.free(7)

        # Evicted, the blocks are free: system.step() with a recorded fence
        # gives the grown tail back, and the base does not move.
        pool.set_decommit_policy(min_idle_steps=2, keep_chunks=0)
        m.evict(10_000)
        assert pool.live == 0
        returned = 0
        for _ in range(4):
            returned += system.step(vmm.record_fence(0))
        returned += system.flush_decommit()
        s = pool.stats()
        assert s["shrinks"] == 1 and s["pending_blocks"] == 0, s
        assert s["capacity"] == per_chunk
        assert returned == s["decommitted_bytes"] > 0
        assert s["committed_bytes"] == CHUNK
        assert kv_tier(system)["committed"] == CHUNK

        # Admission counts the room again; the pool grows back in place.
        m.admit(8, prompts[2])
        assert m.block_span(8, 0)[0] >= base
        for j, block in enumerate(m.block_table(8)):
            assert m.block_span(8, j)[0] == base + block * stride
        m.abort(8)
        m.check_invariants()
        system.check()
        del m, pool
    finally:
        gc.collect()
        closed = system.close()
    assert closed["still_held"] == {}
    assert vmm.live == 0
