"""The engine's scheduler on the fake backend (no torch): continuous batching
over a MemorySystem's KV manager, with random arrivals, cancellations and
finishes. Capacity never fails a request (a full pool makes it wait, or
preempts and resumes it with the same tokens), prefix hits skip cached
tokens, and after draining no block is held by a sequence (criterion 4)."""

from __future__ import annotations

import pytest
from _helpers import GIB, MIB, TINY
from hypothesis import given, settings
from hypothesis import strategies as st

from imp_mem import (
    FakeBackend,
    Features,
    InvalidArgument,
    Limits,
    MemorySystem,
    ModelShape,
    PlanInput,
    plan_memory,
)
from imp_mem.engine import RequestState, Scheduler

VOCAB = 997

SLIDING = dict(TINY, model_type="gemma2", head_dim=64, sliding_window=32)


def open_system(config=TINY, batch=2, seq=128):
    """A KV pool sized for exactly `batch` x `seq` tokens, so a scheduler
    allowed more sequences than that runs out of blocks."""
    plan = plan_memory(
        PlanInput(
            ModelShape.from_hf_config(config),
            Limits(batch, seq, block_size=16),
            Features(),
            budget=GIB,
            context=8 * MIB,
            library_reserve=4 * MIB,
        )
    )
    return MemorySystem(FakeBackend(capacity="1GiB"), plan, kv_growable=False)


def next_token(tokens):
    """The stand-in model: a function of the whole sequence so far."""
    h = 17
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def expected(prompt, n):
    toks, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(toks))
        toks.append(out[-1])
    return out


def step(sched, kv):
    """One engine step with the stand-in model, checking what the KV
    manager holds at each point against the scheduler's accounting."""
    bs = kv.block_size
    for p in sched.admit_waiting():
        req = p.request
        assert p.start % bs == 0 and p.start < len(p.tokens)
        assert p.tokens == req.tokens
        assert kv.num_tokens(req.seq_id) == len(p.tokens)
        sched.prefilled(p, next_token(p.tokens))
    batch = sched.prepare_decode()
    assert len(batch) <= sched.max_batch
    if batch:
        ids = [r.seq_id for r in batch]
        width = max(len(kv.block_table(i)) for i in ids)
        tables = kv.block_tables(ids)
        assert tables.shape == (len(ids), width)
        for row, req in zip(tables, batch, strict=True):
            n = kv.num_tokens(req.seq_id)
            assert n == req.computed + 1 == len(req.tokens)
            used = -(-n // bs)
            assert (row[:used] >= 0).all() and (row[used:] == -1).all()
        sched.decoded(batch, [next_token(r.tokens) for r in batch])


def drain(sched, kv, limit=10_000):
    for _ in range(limit):
        if not sched.has_work:
            return
        step(sched, kv)
    raise AssertionError("the scheduler did not drain")


def check_baseline(system, kv):
    """No sequence holds a block; what stays live is the prefix cache, and
    evicting it empties the pool."""
    s = kv.stats()
    assert (s["sequences"], s["active"]) == (0, 0)
    assert s["live"] == s["cached"]
    assert s["swa_live"] == 0
    kv.evict(s["capacity"])
    assert kv.stats()["live"] == 0
    assert system.kv_pool.live == 0
    kv.check_invariants()


action = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.integers(0, 3),  # shared prefix
        st.integers(1, 30),  # own tokens
        st.integers(1, 30),  # max_new_tokens
    ),
    st.tuples(st.just("cancel"), st.integers(0, 1000)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=100, deadline=None)
@given(actions=st.lists(action, max_size=40), sliding=st.booleans(), eos=st.booleans())
def test_random_arrivals_cancellations_and_finishes(actions, sliding, eos):
    system = open_system(SLIDING if sliding else TINY)
    kv = system.kv_manager()
    sched = Scheduler(kv, max_batch=6, max_seq_len=128)
    prefixes = [[(7 * k + i) % VOCAB for i in range(16 * (k + 1))] for k in range(4)]
    subs = []
    for kind, *args in actions:
        if kind == "arrive":
            shared, own, new = args
            prompt = prefixes[shared] + [(len(subs) * 13 + i) % VOCAB for i in range(own)]
            subs.append(sched.submit(prompt, new, eos_token_id=3 if eos else None))
        elif kind == "cancel" and subs:
            req = subs[args[0] % len(subs)]
            assert sched.cancel(req.seq_id) == (not req.done) or req.done
        elif kind == "step":
            for _ in range(args[0]):
                step(sched, kv)
    drain(sched, kv)
    for req in subs:
        assert req.done
        if req.state is RequestState.CANCELLED:
            continue
        want = expected(req.prompt, req.max_new_tokens)
        if eos and 3 in want:
            want = want[: want.index(3) + 1]
        assert req.output == want, "capacity never changes or fails a request"
        assert req.finish_reason in ("length", "eos")
    check_baseline(system, kv)
    del kv, sched
    system.close()


def test_a_full_pool_keeps_requests_waiting_and_preempts_then_resumes():
    system = open_system(batch=2, seq=128)
    kv = system.kv_manager(enable_prefix_caching=False)
    sched = Scheduler(kv, max_batch=8, max_seq_len=128)
    reqs = [sched.submit([i + 1] * 60, 60) for i in range(8)]
    step(sched, kv)
    # 16 blocks of 16 tokens: four 60-token prompts fit, the rest wait.
    assert len(sched.running) == 4 and len(sched.waiting) == 4
    assert sched.stats.capacity_waits >= 1
    drain(sched, kv)
    assert sched.stats.preempted > 0, "the decode growth had to preempt"
    for r in reqs:
        assert r.state is RequestState.FINISHED
        assert r.output == expected(r.prompt, 60)
    assert any(r.preemptions for r in reqs)
    check_baseline(system, kv)
    del kv, sched
    system.close()


def test_prefix_hits_skip_the_cached_tokens():
    system = open_system()
    kv = system.kv_manager()
    sched = Scheduler(kv, max_batch=4, max_seq_len=128)
    shared = list(range(100, 148))  # three full blocks
    first = sched.submit([*shared, 1, 2], 4)
    drain(sched, kv)
    second = sched.submit([*shared, 5, 6, 7], 4)
    prefills = sched.admit_waiting()
    assert [p.request for p in prefills] == [second]
    assert prefills[0].start == second.cached_tokens == 48
    assert sched.stats.prefix_hit_tokens == 48
    sched.prefilled(prefills[0], next_token(prefills[0].tokens))
    drain(sched, kv)
    assert first.output == expected(first.prompt, 4)
    assert second.output == expected(second.prompt, 4)
    check_baseline(system, kv)
    del kv, sched
    system.close()


def test_a_running_prompt_is_hit_by_a_later_arrival():
    system = open_system()
    kv = system.kv_manager()
    sched = Scheduler(kv, max_batch=4, max_seq_len=128)
    shared = list(range(200, 232))  # two full blocks
    first = sched.submit([*shared, 1], 20)
    step(sched, kv)
    assert first.state is RequestState.RUNNING
    second = sched.submit([*shared, 2, 3], 5)
    (p,) = sched.admit_waiting()
    assert p.start == second.cached_tokens == 32, "hit while the first still runs"
    sched.prefilled(p, next_token(p.tokens))
    drain(sched, kv)
    assert second.output == expected(second.prompt, 5)
    assert first.output == expected(first.prompt, 20)
    check_baseline(system, kv)
    del kv, sched
    system.close()


def test_cancel_at_every_point_and_bad_requests():
    system = open_system()
    kv = system.kv_manager()
    sched = Scheduler(kv, max_batch=2, max_seq_len=128)
    waiting = [sched.submit([9] * 20, 10) for _ in range(3)]
    step(sched, kv)
    running, queued = waiting[:2], waiting[2]
    assert sched.cancel(queued.seq_id) and queued.state is RequestState.CANCELLED
    assert sched.cancel(running[0].seq_id)
    assert kv.sequences() == [running[1].seq_id]
    assert not sched.cancel(running[0].seq_id), "already ended"
    # Cancelled between admission and prefill: nothing computed, nothing cached.
    late = sched.submit([4] * 40, 5)
    (p,) = sched.admit_waiting()
    assert p.request is late
    sched.cancel(late.seq_id)
    sched.prefilled(p, 1)  # a late result for a cancelled request is ignored
    assert late.output == []
    drain(sched, kv)
    assert sched.reap(running[1].seq_id).state is RequestState.FINISHED
    with pytest.raises(InvalidArgument, match="max_seq_len"):
        sched.submit([1] * 100, 29)
    with pytest.raises(InvalidArgument, match="empty"):
        sched.submit([], 3)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        sched.submit([1], 0)
    with pytest.raises(InvalidArgument, match="already in use"):
        sched.submit([1], 1, seq_id=waiting[0].seq_id)
    with pytest.raises(InvalidArgument, match="no request"):
        sched.cancel(12345)
    check_baseline(system, kv)
    big = Scheduler(kv, max_batch=2, max_seq_len=4096)
    with pytest.raises(InvalidArgument, match="could never be served"):
        big.submit([1] * 4000, 10)
    del kv, big, sched
    system.close()
