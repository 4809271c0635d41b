"""V1 (conservation), V2 (no acquisition while serving) and V9 (a growable
region's base never moves) as a hypothesis state machine over the fake."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import imp_mem

TAGS = ["weights", "weight_cache", "kv_cache", "workspace", "scratch", "other"]
GRANULE = 4096
CAPACITY = 4 << 20


class BackendMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.strict = True
        self.backend = imp_mem.FakeBackend(capacity=CAPACITY, granularity=GRANULE)
        self.regions: list[imp_mem.Region] = []
        self.bases: dict[int, int] = {}  # id(region) -> base at acquisition
        self.model_live = 0
        self.serving = False

    @rule(nbytes=st.integers(1, 1 << 20), tag=st.sampled_from(TAGS), align_log=st.integers(0, 12))
    def acquire(self, nbytes, tag, align_log):
        live_before = self.backend.live
        try:
            region = self.backend.acquire(nbytes, align=1 << align_log, tag=tag)
        except imp_mem.PhaseViolation:
            assert self.serving  # V2: refused exactly while serving
            assert self.backend.live == live_before
            return
        except imp_mem.OutOfMemory as e:
            assert e.live + e.asked > e.budget
            assert self.backend.live == live_before
            return
        assert not self.serving, "V2: an acquisition succeeded while SERVING"
        assert region.address % (1 << align_log) == 0
        self.regions.append(region)
        self.model_live += nbytes

    @rule(reserve=st.integers(1, 2 << 20), initial=st.integers(0, 1 << 20))
    def acquire_growable(self, reserve, initial):
        initial = min(initial, reserve)
        try:
            region = self.backend.acquire_growable(reserve, initial, tag="kv_cache")
        except (imp_mem.PhaseViolation, imp_mem.OutOfMemory):
            return
        assert not self.serving
        self.regions.append(region)
        self.bases[id(region)] = region.address
        self.model_live += region.nbytes

    @precondition(lambda self: self.regions)
    @rule(seed=st.integers(0, 10**6))
    def release(self, seed):
        region = self.regions.pop(seed % len(self.regions))
        self.bases.pop(id(region), None)
        self.model_live -= region.nbytes
        region.release()

    @precondition(lambda self: self.bases)
    @rule(seed=st.integers(0, 10**6), size=st.integers(0, 2 << 20), fail=st.booleans())
    def resize(self, seed, size, fail):
        growable = [r for r in self.regions if id(r) in self.bases]
        region = growable[seed % len(growable)]
        before = region.nbytes
        grow = size > before
        if fail:
            if grow:
                self.backend.fail_commits(1)
            else:
                self.backend.fail_decommits(1)
        try:
            if grow:
                region.commit(min(size, region.reserved))
            else:
                region.decommit(size)
        except (imp_mem.OutOfMemory, imp_mem.DriverError):
            assert region.nbytes == before
        finally:
            self.backend.fail_commits(0)
            self.backend.fail_decommits(0)
        self.model_live += region.nbytes - before
        assert region.nbytes % GRANULE == 0
        assert region.address == self.bases[id(region)], "V9: the base moved"

    @precondition(lambda self: not self.serving)
    @rule()
    def advance(self):
        if self.backend.phase == imp_mem.Phase.LOADING:
            self.backend.begin_planning()
        else:
            self.backend.begin_serving()
            self.serving = True

    @invariant()
    def conservation(self):
        s = self.backend.stats()
        assert s["live"] == self.model_live
        assert s["acquired_bytes_total"] - s["released_bytes_total"] == s["live"]
        journal = self.backend.journal()
        signed = {"acquire": 1, "commit": 1, "release": -1, "decommit": -1}
        assert sum(signed[op] * n for _, _, _, n, op in journal) == s["live"]  # V1
        assert not any(ph == "SERVING" and op == "acquire" for _, ph, _, _, op in journal)  # V2
        assert sum(t["live"] for t in s["tags"].values()) == s["live"]
        assert s["live"] <= s["budget"]

    def teardown(self):
        for region in self.regions:
            region.release()
        assert self.backend.live == 0


TestBackendMachine = BackendMachine.TestCase
