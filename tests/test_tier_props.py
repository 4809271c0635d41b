"""V3-V6 as hypothesis state machines over the tiers on the fake backend:

* V3 an arena reset frees wholesale; spans of an old generation are refused;
* V4 block pool: free + live == capacity under any allocate/free/share;
* V5 refcounts balance when an exception unwinds a request at any step;
* V6 scratch marks rewind in LIFO order; out of order is a hard error.

A rule acting on "some live handle" draws an index and resolves it against
the live list, so every generated sequence is valid.
"""

from __future__ import annotations

import contextlib
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import imp_mem
from imp_mem import Arena, BlockPool, CapacityError, InvalidArgument, ScratchStack, StaleSpan

# ---------------------------------------------------------------- V3


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fake = imp_mem.FakeBackend(capacity=1 << 20)
        self.arena = Arena(self.fake, 16 << 10)
        self.live_bytes = self.fake.live
        self.spans: list[tuple[imp_mem.StableSpan, int, int]] = []  # span, generation, address
        self.generation = 0

    @rule(nbytes=st.integers(1, 3000), align_log=st.integers(0, 9))
    def take(self, nbytes, align_log):
        used = self.arena.used
        try:
            span = self.arena.take(nbytes, align=1 << align_log)
        except CapacityError:
            assert self.arena.used == used
            return
        assert span.address % (1 << align_log) == 0
        self.spans.append((span, self.generation, span.address))

    @rule()
    def reset(self):
        self.arena.reset()
        self.generation += 1
        assert self.arena.used == 0
        assert self.arena.generation == self.generation

    @precondition(lambda self: self.spans)
    @rule(seed=st.integers(0, 1 << 30))
    def use(self, seed):
        span, generation, address = self.spans[seed % len(self.spans)]
        if generation == self.generation:
            assert span.address == address
        else:
            try:
                _ = span.address
            except StaleSpan:
                pass
            else:
                raise AssertionError("a span of an old generation resolved")

    @invariant()
    def takes_never_reach_the_backend(self):
        assert self.fake.live == self.live_bytes

    @invariant()
    def current_spans_are_disjoint(self):
        ranges = sorted((a, a + s.nbytes) for s, g, a in self.spans if g == self.generation)
        assert all(x[1] <= y[0] for x, y in pairwise(ranges))


TestV3Arena = ArenaMachine.TestCase


# ---------------------------------------------------------------- V4 + V5


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fake = imp_mem.FakeBackend(capacity=16 << 20, granularity=1024)
        self.pool = BlockPool(self.fake, 256, 4, max_blocks=40, grow_blocks=4)
        self.live: list[imp_mem.BlockRef] = []

    @rule()
    def allocate(self):
        with contextlib.suppress(CapacityError, imp_mem.OutOfMemory):
            self.live.append(self.pool.allocate())

    @rule(n=st.integers(0, 12))
    def allocate_many(self, n):
        before = self.pool.stats()
        try:
            refs = self.pool.allocate_many(n)
        except (CapacityError, imp_mem.OutOfMemory):
            after = self.pool.stats()
            assert (after["live"], after["refs"]) == (before["live"], before["refs"])
            return
        assert len(refs) == n
        self.live.extend(refs.split())

    @precondition(lambda self: self.live)
    @rule(seed=st.integers(0, 1 << 30))
    def share(self, seed):
        self.live.append(self.live[seed % len(self.live)].share())

    @precondition(lambda self: self.live)
    @rule(seed=st.integers(0, 1 << 30))
    def free(self, seed):
        ref = self.live.pop(seed % len(self.live))
        ref.release()
        try:
            ref.release()
        except InvalidArgument:
            pass
        else:
            raise AssertionError("a second release went through")

    @rule()
    def fail_next_growth(self):
        self.fake.fail_commits(1)

    @rule(
        steps=st.lists(st.tuples(st.sampled_from("acd"), st.integers(0, 1 << 20)), max_size=12),
        fault_at=st.integers(0, 14),
    )
    def request_unwinds(self, steps, fault_at):
        """V5: a request keeps its blocks in its own table and shares some
        into a longer-lived cache; whatever step an exception interrupts, its
        own refs unwind and only the cache's remain."""
        refs_before = self.pool.stats()["refs"]
        cache: list[imp_mem.BlockRef] = []

        class Injected(Exception):
            pass

        try:
            with contextlib.ExitStack() as table:
                held: list[imp_mem.BlockRef] = []
                for i, (kind, seed) in enumerate(steps):
                    if i == fault_at:
                        raise Injected
                    if kind == "a":
                        refs = self.pool.allocate_many(1 + seed % 4)
                        for r in refs.split():
                            held.append(table.enter_context(r))
                    elif kind == "c" and held:
                        cache.append(held[seed % len(held)].share())
                    elif kind == "d" and cache:
                        cache.pop(seed % len(cache)).release()
        except (Injected, CapacityError, imp_mem.OutOfMemory):
            pass
        assert self.pool.stats()["refs"] == refs_before + len(cache)
        for r in cache:
            r.release()
        assert self.pool.stats()["refs"] == refs_before

    @invariant()
    def free_plus_live_is_capacity(self):
        s = self.pool.stats()
        assert s["free"] + s["live"] == s["capacity"]
        assert s["refs"] == len(self.live)
        assert s["live"] == len({r.id for r in self.live})

    @invariant()
    def refcounts_match_the_refs(self):
        for r in self.live:
            assert r.refcount == sum(1 for o in self.live if o.id == r.id)

    @invariant()
    def core_invariants(self):
        self.pool.check_invariants()


TestV4V5Pool = PoolMachine.TestCase


# ---------------------------------------------------------------- V6


class ScratchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fake = imp_mem.FakeBackend(capacity=1 << 20)
        self.stack = ScratchStack(self.fake, 8 << 10)
        self.marks: list[tuple[imp_mem.Mark, int]] = []  # mark, used when opened
        self.spans: list[tuple[imp_mem.StableSpan, imp_mem.Mark]] = []
        self.broken = False

    @rule()
    def open(self):
        try:
            mark = self.stack.mark()
        except InvalidArgument:
            assert self.broken
            return
        assert not self.broken
        self.marks.append((mark, self.stack.used))

    @precondition(lambda self: self.marks)
    @rule(nbytes=st.integers(1, 700))
    def take(self, nbytes):
        mark, _ = self.marks[-1]
        used = self.stack.used
        try:
            self.spans.append((mark.take(nbytes, align=16), mark))
        except CapacityError:
            assert self.stack.used == used
        except InvalidArgument:
            assert self.broken

    @precondition(lambda self: self.marks)
    @rule(seed=st.integers(0, 1 << 30))
    def close(self, seed):
        i = seed % len(self.marks)
        innermost = i == len(self.marks) - 1
        mark, opened_at = self.marks.pop(i)
        if innermost:
            mark.rewind()
            assert self.stack.used <= opened_at
        else:
            try:
                mark.rewind()
            except InvalidArgument as e:
                assert "LIFO" in str(e)
                self.broken = True
            else:
                raise AssertionError("an out-of-order rewind went through")

    @rule()
    def reset(self):
        self.stack.reset()
        self.marks.clear()
        self.broken = False
        assert self.stack.used == 0

    @invariant()
    def spans_are_valid_exactly_while_their_mark_is_open(self):
        for span, mark in self.spans:
            assert span.valid == mark.open

    @invariant()
    def violations_are_reported(self):
        s = self.stack.stats()
        assert (s["violations"] > 0) == self.broken
        assert s["open_marks"] == len(self.marks)


TestV6Scratch = ScratchMachine.TestCase


@given(st.lists(st.integers(1, 500), min_size=1, max_size=20))
def test_v6_nested_with_blocks_unwind_to_zero(sizes):
    fake = imp_mem.FakeBackend(capacity=1 << 20)
    stack = ScratchStack(fake, 64 << 10)
    with contextlib.ExitStack() as scope:
        for n in sizes:
            mark = scope.enter_context(stack.mark())
            mark.take(n)
    assert stack.used == 0
    assert stack.high_water >= sum(sizes)
