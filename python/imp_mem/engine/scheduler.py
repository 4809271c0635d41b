"""Continuous batching over a `KVCacheManager` (no torch).

Algorithm. Requests wait in a FIFO queue. Each step the scheduler admits
from the head while a sequence slot is free and the head fits the KV pool
(`try_admit`: one call); a refusal (`None`, nothing changed) leaves the
head waiting and ends admission for the step, so
arrival order is kept and nothing is failed for lack of memory. An
admission reports the prompt's cached leading tokens (prefix hits): the
prefill computes only the tokens after them, and once it has, the prompt's
full blocks are shared with the cache (`cache_computed`) so that requests
arriving while it runs hit them too. Every running sequence
decodes one token per step. Before a decode, the token the previous step
produced is appended to the sequence (`append_each`: the whole batch in one
call, each sequence all or nothing); when the pool cannot take one, the
newest running sequence is preempted — freed with
its computed tokens, so its full blocks go to the prefix cache — and put
back at the head of the queue with its prompt and the tokens generated so
far, to be prefilled again (mostly from the cache) when room returns. A
request is therefore never failed by capacity: the worst it sees is a
wait. A request that could never fit an empty pool, or is longer than the
engine's `max_seq_len`, is refused at `submit` with `InvalidArgument`.

Cancellation works at any point: a waiting request leaves the queue, a
running one is freed (its computed full blocks cached) at once. A finished
request (its token budget spent, or an end-of-sequence token) is freed the
same way.

Token accounting. `Request.computed` counts the tokens whose KV is in the
pages; the manager holds `computed` tokens after a decode and `computed +
1` once the pending token is appended, which is what the block tables the
engine reads cover. The time spent in imp-mem calls (admission, appends,
frees) is summed in `Scheduler.kv_seconds`, so an engine can report it as a
share of its step.

Thread safety: none. One engine loop owns a scheduler; the manager beneath
it is thread-safe on its own.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from time import perf_counter
from typing import Any

from imp_mem.errors import InvalidArgument


class RequestState(Enum):
    """Where a request is."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Request:
    """One generation request and what it produced so far."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    # Tokens whose KV is written (prompt and generated); 0 while waiting.
    computed: int = 0
    # Leading tokens of the last admission found in the prefix cache.
    cached_tokens: int = 0
    # How often it was preempted (freed for room and queued again).
    preemptions: int = 0
    finish_reason: str | None = None
    # An image the prompt's image tokens stand for (pixel values, checked by
    # the engine), and the KV manager's multimodal keys for it:
    # ``[(start, end, content_hash)]``, so a prefix hit never shares blocks
    # computed with another image behind the same token ids.
    image: Any = None
    mm: list[tuple[int, int, int]] | None = None

    @property
    def tokens(self) -> list[int]:
        """The prompt followed by the generated tokens."""
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.CANCELLED)


@dataclass
class Prefill:
    """A sequence to prefill: `tokens[start:]` are new, `tokens[:start]`
    are already in the pages (a prefix hit)."""

    request: Request
    tokens: list[int]
    start: int


@dataclass
class SchedulerStats:
    """Counters since the scheduler was made."""

    submitted: int = 0
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    preempted: int = 0
    capacity_waits: int = 0
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    """Continuous batching over `kv` for at most `max_batch` running
    sequences of at most `max_seq_len` tokens (prompt plus output)."""

    def __init__(self, kv: Any, *, max_batch: int, max_seq_len: int) -> None:
        if max_batch < 1:
            raise InvalidArgument(f"max_batch must be at least 1, got {max_batch}")
        if max_seq_len < 2:
            raise InvalidArgument(f"max_seq_len must be at least 2, got {max_seq_len}")
        self.kv = kv
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        stats = kv.stats()
        self._block_size = kv.block_size
        self._max_blocks = int(stats["max_blocks"])
        self.waiting: deque[Request] = deque()
        # Admission order: the newest is preempted first.
        self.running: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}
        self.stats = SchedulerStats()
        self.kv_seconds = 0.0
        self._ids = itertools.count()
        # Called with the head of the queue before its admission: False
        # keeps it waiting (the shared-GPU engine's promise of room).
        self.gate: Any = None

    # ------------------------------------------------------------ requests

    def submit(
        self,
        prompt: Sequence[int] | Iterable[int],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        seq_id: int | None = None,
        image: Any = None,
        mm: list[tuple[int, int, int]] | None = None,
    ) -> Request:
        """Queues a request; returns it (its `seq_id` names it from now).
        `image` and `mm`: an image and its multimodal keys (`Request`)."""
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise InvalidArgument("prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        total = len(tokens) + max_new_tokens
        if total > self.max_seq_len:
            raise InvalidArgument(
                f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) = {total} tokens is "
                f"above max_seq_len={self.max_seq_len}; shorten one"
            )
        # The manager holds at most total - 1 tokens (the last is never fed).
        need = math.ceil((total - 1) / self._block_size)
        if need > self._max_blocks:
            raise InvalidArgument(
                f"the request needs {need} KV blocks and the pool has {self._max_blocks}: it "
                "could never be served; shorten it or plan a larger pool"
            )
        if seq_id is None:
            seq_id = next(self._ids)
            while seq_id in self.requests:
                seq_id = next(self._ids)
        elif seq_id in self.requests:
            raise InvalidArgument(f"seq_id {seq_id} is already in use; pick another")
        req = Request(seq_id, tokens, max_new_tokens, eos_token_id, image=image, mm=mm)
        self.requests[seq_id] = req
        self.waiting.append(req)
        self.stats.submitted += 1
        return req

    def cancel(self, seq_id: int) -> bool:
        """Cancels a waiting or running request; False if it already ended."""
        req = self.requests.get(seq_id)
        if req is None:
            raise InvalidArgument(f"no request {seq_id}; it was never submitted or was reaped")
        if req.done:
            return False
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
        else:
            self._release(req)
        req.state = RequestState.CANCELLED
        req.finish_reason = "cancelled"
        self.stats.cancelled += 1
        return True

    def reap(self, seq_id: int) -> Request:
        """Forgets an ended request (keeps `requests` from growing)."""
        req = self.requests[seq_id]
        if not req.done:
            raise InvalidArgument(f"request {seq_id} is still {req.state.value}; cancel it first")
        return self.requests.pop(seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------- scheduling

    def admit_waiting(self) -> list[Prefill]:
        """Admits from the head of the queue while it fits; the prefills."""
        out: list[Prefill] = []
        kv = self.kv
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            tokens = req.tokens
            t0 = perf_counter()
            if self.gate is not None and not self.gate(req):
                self.kv_seconds += perf_counter() - t0
                self.stats.capacity_waits += 1
                break
            try:
                cached = kv.try_admit(req.seq_id, tokens, mm=req.mm)
            finally:
                self.kv_seconds += perf_counter() - t0
            if cached is None:
                self.stats.capacity_waits += 1
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            req.cached_tokens = cached
            req.computed = cached
            self.running[req.seq_id] = req
            self.stats.admitted += 1
            self.stats.prefix_hit_tokens += cached
            self.stats.prefill_tokens += len(tokens) - cached
            out.append(Prefill(req, tokens, cached))
        return out

    def prefilled(self, prefill: Prefill, next_token: int) -> None:
        """Records a prefill's result: its KV is written, `next_token` is
        the first new token (finishing the request if it ends it)."""
        req = prefill.request
        if req.state is not RequestState.RUNNING:
            return
        req.computed = len(prefill.tokens)
        # Share the prompt's full blocks now, so requests admitted while this
        # one runs hit them (a no-op with prefix caching off).
        t0 = perf_counter()
        try:
            self.kv.cache_computed(req.seq_id, req.computed)
        finally:
            self.kv_seconds += perf_counter() - t0
        self._emit(req, int(next_token))

    def prepare_decode(self) -> list[Request]:
        """Appends each running sequence's pending token to the manager
        (preempting the newest sequences when the pool is full) and returns
        the batch to decode, in admission order: row `i` feeds
        `batch[i].output[-1]` at position `batch[i].computed`."""
        kv = self.kv
        rows = list(self.running.values())
        while rows:
            # One call appends the whole batch, up to the first sequence the
            # pools cannot take. (Only the call is timed as imp-mem's.)
            ids = [r.seq_id for r in rows]
            tokens = [r.output[-1] for r in rows]
            t0 = perf_counter()
            try:
                done = kv.append_each(ids, tokens)
            finally:
                self.kv_seconds += perf_counter() - t0
            if done == len(rows):
                break
            # Make room: the newest running sequence goes back to the queue
            # (the one that did not fit, if it is the newest).
            victim = next(reversed(self.running.values()))
            self._preempt(victim)
            rows = [r for r in rows[done:] if r.state is RequestState.RUNNING]
        return list(self.running.values())

    def decoded(self, batch: Sequence[Request], tokens: Sequence[int]) -> None:
        """Records one decode step: row `i`'s KV is written and `tokens[i]`
        is its next token."""
        if len(batch) != len(tokens):
            raise InvalidArgument(f"{len(batch)} requests but {len(tokens)} tokens")
        for req, tok in zip(batch, tokens, strict=True):
            if req.state is not RequestState.RUNNING:
                continue
            req.computed += 1
            self.stats.decode_tokens += 1
            self._emit(req, int(tok))

    # ------------------------------------------------------------ internals

    def _emit(self, req: Request, token: int) -> None:
        req.output.append(token)
        if len(req.output) >= req.max_new_tokens:
            self._finish(req, "length")
        elif req.eos_token_id is not None and token == req.eos_token_id:
            self._finish(req, "eos")

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        self.stats.finished += 1

    def _release(self, req: Request) -> None:
        """Frees a running sequence; its computed full blocks are cached."""
        del self.running[req.seq_id]
        t0 = perf_counter()
        try:
            if req.computed:
                self.kv.free(req.seq_id, req.computed)
            else:
                self.kv.abort(req.seq_id)
        finally:
            self.kv_seconds += perf_counter() - t0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.state = RequestState.WAITING
        req.computed = 0
        req.preemptions += 1
        self.stats.preempted += 1
        self.waiting.appendleft(req)
