"""A KVCacheManager on a MemorySystem's KV pool (fake backend): the plan's
defaults, admission that counts the room a growable pool can still commit,
blocks inside the system's KV region and attributed by its report, prefix
hits, persistence through the backend, the SWA pool, and `system.step()`
driving the KV pool's hysteretic shrink."""

from __future__ import annotations

import warnings

import pytest
from _helpers import SMALL, make_plan, open_system

from imp_mem import (
    CapacityError,
    ImpMemWarning,
    InvalidArgument,
    KVCacheManager,
)

# Sliding-window layers beside full attention: the plan has an SWA pool.
SLIDING = dict(SMALL, model_type="gemma2", head_dim=64, sliding_window=128)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_the_manager_takes_its_sizes_from_the_plan_and_the_pool(plan):
    _fb, system = open_system(plan)
    with system:
        m = system.kv_manager()
        assert isinstance(m, KVCacheManager)
        assert m.block_size == plan.kv["block_size"]
        assert m.num_blocks == plan.kv_blocks
        s = m.stats()
        assert (s["capacity"], s["max_blocks"], s["free"]) == (8, plan.kv_blocks, 8)
        assert system.kv_pool is system.kv_pool, "one BlockPool object per pool"
        del m


def test_admission_counts_the_room_a_growable_pool_can_still_commit(plan):
    fb, system = open_system(plan)
    with system:
        system.begin_serving()
        m = system.kv_manager()
        bs, pool = m.block_size, system.kv_pool
        seq = plan.kv["blocks_per_sequence"] * bs
        # Four full sequences: 256 blocks, 8 committed. All admitted; the pool
        # grows inside its reservation and nothing is acquired.
        for i in range(4):
            assert m.can_admit(tokens(i << 20, seq))
            m.admit(i, tokens(i << 20, seq))
        assert pool.capacity == pool.stats()["max_blocks"] == plan.kv_blocks
        assert pool.stats()["growths"] > 0
        assert fb.stats()["steady_state_allocations_total"] == {}
        # The pool is at its maximum: one more block is refused, and nothing moves.
        assert not m.can_admit(tokens(99 << 20, 1))
        before = m.stats()
        with pytest.raises(CapacityError) as e:
            m.admit(9, tokens(99 << 20, 1))
        assert (e.value.needed, e.value.free, e.value.growable) == (1, 0, 0)
        assert m.stats() == before
        m.check_invariants()
        system.check()
        for i in range(4):
            m.abort(i)

        s = m.stats()
        assert s["free"] + s["max_blocks"] - s["capacity"] == plan.kv_blocks
        del m, pool


def test_a_refusal_reports_the_room_it_counted(plan):
    _fb, system = open_system(plan)
    with system:
        m = system.kv_manager()
        bs = m.block_size
        m.admit(1, tokens(0, 100 * bs))
        with pytest.raises(CapacityError) as e:
            m.admit(2, tokens(1 << 20, 200 * bs))
        s = m.stats()
        assert e.value.needed == 200
        assert e.value.free == s["free"]
        assert e.value.growable == s["max_blocks"] - s["capacity"]
        assert e.value.free + e.value.growable == plan.kv_blocks - 100
        assert "uncommitted" in str(e.value)
        m.abort(1)
        del m


def test_blocks_live_in_the_systems_kv_region_and_the_report_attributes_them(plan):
    _fb, system = open_system(plan)
    with system:
        m = system.kv_manager()
        bs, stride = m.block_size, plan.kv["block_bytes"]
        shared = tokens(0, 3 * bs)  # a system prompt every request opens with
        for i in range(5):
            m.admit(i, shared + tokens((i + 1) << 20, 20 * bs + 3))
            m.cache_computed(i, 23 * bs)
        address, _ = m.block_span(0, 0)
        base = address - m.block_table(0)[0] * stride
        for i in range(5):
            table = m.block_table(i)
            assert table[:3] == m.block_table(0)[:3], "the shared prompt is shared"
            for j, block in enumerate(table):
                assert m.block_span(i, j) == (base + block * stride, stride)
                assert 0 <= block < plan.kv_blocks
        tier = next(t for t in system.mem_report()["tiers"] if t["key"] == "kv_pool")
        live = m.stats()["live"]
        assert live == 3 + 5 * 21
        assert tier["in_use"] == live * stride
        assert tier["blocks"]["live"] == live
        assert system.kv_pool.live == live
        assert f'imp_mem_pool_live_blocks{{tag="kv_cache"}} {live}' in system.metrics()
        assert m.stats()["prefix_hit_blocks"] == 4 * 3
        for i in range(5):
            m.free(i)
        m.check_invariants()
        system.check()
        del m


def test_persistence_copies_the_bytes_through_the_systems_backend(plan, tmp_path):
    fb, system = open_system(plan)
    with system:
        m = system.kv_manager(model_fingerprint="small")
        bs = m.block_size
        prompt = tokens(0, 4 * bs + 1)
        m.admit(1, prompt)
        for i, h in enumerate(m.sequence_hashes(1)):
            address, nbytes = m.block_span(1, i)
            fb.write(address, h.to_bytes(16, "little") * (nbytes // 16))
        m.free(1)
        path = tmp_path / "prefix.imp"
        assert m.save_prefix_cache(str(path)) == 4
        assert m.evict(100) == 4
        assert m.load_prefix_cache(str(path)) == 4
        for h, _, address in m.cached_blocks():
            assert fb.read(address, 32) == h.to_bytes(16, "little") * 2
        assert m.admit(2, prompt) == 4 * bs
        m.free(2)
        del m


def test_a_sliding_window_plan_gives_the_manager_its_swa_pool():
    p = make_plan(SLIDING)
    assert p.swa is not None
    _fb, system = open_system(p)
    with system:
        m = system.kv_manager()
        s = m.stats()
        assert s["swa_capacity"] == p.swa["blocks"]
        m.admit(1, tokens(0, 1024))
        window = p.swa["window"] // m.block_size
        assert sum(b >= 0 for b in m.swa_table(1)) == window
        assert system.swa_pool.live == window
        m.free(1)
        assert system.swa_pool.live == 0
        with pytest.raises(InvalidArgument, match="swa_window"):
            system.kv_manager(swa_window=0)
        del m


def test_kv_manager_refuses_what_the_plan_does_not_match(plan):
    _fb, system = open_system(plan)
    with pytest.raises(InvalidArgument, match="block_size"):
        system.kv_manager(block_size=plan.kv["block_size"] * 2)
    with pytest.raises(InvalidArgument, match="no SWA pool"):
        system.kv_manager(swa_window=64)
    held = system.kv_pool.allocate()
    with pytest.raises(InvalidArgument, match="live block"):
        system.kv_manager()
    held.release()
    system.close()
    with pytest.raises(InvalidArgument, match="closed"):
        system.kv_manager()
    with pytest.raises(InvalidArgument, match="closed"):
        system.step()


def test_closing_with_a_manager_alive_reports_its_blocks_held(plan):
    fb, system = open_system(plan)
    m = system.kv_manager()
    m.admit(1, tokens(0, 40))
    with pytest.warns(ImpMemWarning, match="still referenced"):
        closed = system.close()
    assert "kv_cache" in closed["still_held"]
    del m
    assert fb.live == 0


class Event:
    """A torch.cuda.Event stand-in: complete once `done` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_step_shrinks_the_kv_pool_behind_its_fence_once_the_blocks_are_free(plan):
    fb, system = open_system(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with system:
            system.begin_serving()
            pool = system.kv_pool
            pool.set_decommit_policy(min_idle_steps=3, keep_chunks=0)
            m = system.kv_manager()
            bs = m.block_size
            m.admit(1, tokens(0, 100 * bs))
            grown = pool.capacity
            assert grown >= 100
            # Freed into the prefix cache the blocks are still live: no shrink.
            m.free(1)
            assert sum(system.step() for _ in range(10)) == 0
            assert pool.stats()["shrinks"] == 0
            # Evicted, they are free; the step withdraws the tail and its
            # decommit waits for the fence.
            m.evict(1000)
            event = Event()
            assert sum(system.step(event) for _ in range(4)) == 0
            assert pool.stats()["pending_blocks"] > 0
            assert pool.capacity == 8
            assert m.stats()["capacity"] == 8
            # Admission still counts the withdrawn blocks as room.
            assert m.can_admit(tokens(5 << 20, 50 * bs))
            event.done = True
            freed = system.step()
            assert freed > 0 and pool.stats()["shrinks"] == 1
            assert freed == (grown - 8) * plan.kv["block_bytes"]
            assert fb.stats()["tags"]["kv_cache"]["committed"] == 8 * plan.kv["block_bytes"]
            # Demand grows it back; criterion 3 still holds.
            m.admit(2, tokens(5 << 20, 50 * bs))
            assert pool.capacity >= 50
            assert fb.stats()["steady_state_allocations_total"] == {}
            m.free(2)
            system.check()
            del m, pool


def test_flush_decommit_waits_for_the_fence_a_step_was_given(plan):
    _fb, system = open_system(plan)
    with system:
        pool = system.kv_pool
        m = system.kv_manager()
        m.admit(1, tokens(0, 100 * m.block_size))
        m.abort(1)
        pool.set_decommit_policy(min_idle_steps=1, keep_chunks=0)
        event = Event()
        for _ in range(3):
            system.step(event)
        assert pool.stats()["pending_blocks"] > 0
        # The system's BlockPool object watches the fence, so either entry
        # point can wait for it.
        assert system.flush_decommit() > 0
        assert event.done and pool.stats()["pending_blocks"] == 0
        assert system.step() == 0
        del m, pool


def test_a_fixed_kv_pool_is_not_stepped(plan):
    _fb, system = open_system(plan, kv_growable=False)
    with system:
        m = system.kv_manager()
        assert m.stats()["capacity"] == m.stats()["max_blocks"] == plan.kv_blocks
        assert system.step() == 0
        del m
