"""The runner's steps: a step's prefills and a decode, over T2.

Prefill pipelining. A step's prefills run back to back without the host
waiting for the device: a chunk's inputs are staged in one of the host
slots in turn and copied non-blocking (`runner.buffers._Slots`; the single
T2 region is safe, as the stream orders each copy after the previous
chunk's kernels), and each prefill's greedy token goes to its own row of
T2's ``next``, read back in one copy after the step's last prefill
(`prefill_tokens`). The host launches the next request's kernels while the
device still runs the previous one's.

Batched prefill (`prefill_step`, `prefill_batch_tokens` > 0 and a model
with ``prefill_batch_ok``). One forward runs a chunk of each of several
requests (`model.prefill_batch`): the step's prefills are packed greedily,
in admission order, into batches of at most `prefill_batch_tokens` tokens
and at most one chunk of a request (its next chunk reads this one's K/V,
so it goes in a later batch); chunk boundaries are the unbatched path's.
The requests' block tables are read from the manager once a step; a
batch's ids, tables, ``cu_seqlens``, starts, and which chunks end their
prompt (``prefill_pick``) and their rows of ``next`` (``prefill_rows``)
are staged in one slot and copied once; T2's ``prefill_in`` is sized for
the largest batch (`batch_rows` chunks, the budget's tokens) and the
warm-up runs that batch, so serving allocates nothing new. A request
whose image is still to encode is prefilled alone (`prefill`). With
sliding layers, one request at a time holds the SWA ring
(`runner.kv`): it is put first in every batch until its chunks read only
blocks the manager gave, and no other request's chunk that needs the ring
joins meanwhile.

Decode. A step's rows are staged with the padding rows of its bucket
(position 0 on the runner's padding block), copied into T2 in one copy,
and the bucket's graph replayed (`runner.graphs`), or its body run eagerly
without graphs.

Images (a model with a vision tower, Gemma-3). A request's image is
encoded once at its prefill, when its image tokens are not all in the
prefix cache; the image's tokens attend to each other both ways, so a
chunk ends before them rather than inside them and they are prefilled in
one call (`prefill_chunk` >= ``mm_tokens_per_image``, checked by the
engine).

`Steps` is the part of `ModelRunner` that does this.

Thread safety: none; one thread drives the runner.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from imp_mem.engine.scheduler import Prefill, Request
from imp_mem.errors import InvalidArgument

# The default batched prefill budget, in chunks (`Engine(prefill_batch_tokens=)`):
# 4 x 512 tokens of Qwen3-0.6B's activations are ~0.1 GiB (hidden, q/k/v,
# the MLP's 3 x 3072 columns, in bf16), small beside the KV pool, and 4
# chunks a forward cut a step's launches about fourfold. On a device of at
# least `LARGE_DEVICE_BYTES` (vLLM draws the same line at 70 GiB for its
# max_num_batched_tokens) a forward holds 16 chunks, 8 192 tokens at the
# default chunk: a burst's prefill is the queue its time to first token
# waits in, and the 0.6B prefills 171 k tokens/s at 8 192 a forward
# against 97 k at 2 048 (the H200; `bench_shared_gpu`'s burst TTFT p99,
# docs/perf/history.md, 2026-12-03, the burst's prefill queue). The 8B's
# warm-up line grows 854 -> 2 010 MiB with it, which a 70 GiB device can spare.
PREFILL_BATCH_CHUNKS = 4
PREFILL_BATCH_CHUNKS_LARGE = 16
LARGE_DEVICE_BYTES = 70 << 30


def default_prefill_batch_tokens(prefill_chunk: int, device_bytes: int) -> int:
    """`Engine(prefill_batch_tokens=None)`: `PREFILL_BATCH_CHUNKS` chunks a
    forward, `PREFILL_BATCH_CHUNKS_LARGE` on a device of at least
    `LARGE_DEVICE_BYTES` (`device_bytes`: the backend's capacity)."""
    large = device_bytes >= LARGE_DEVICE_BYTES
    return (PREFILL_BATCH_CHUNKS_LARGE if large else PREFILL_BATCH_CHUNKS) * prefill_chunk


class Steps:
    """The prefills and the decode, as a part of `ModelRunner`."""

    def decode_body(self, b: int) -> None:
        """The decode of bucket `b` over the T2 buffers (what a graph holds)."""
        t2 = self.t2
        logits = self.model.decode(
            t2["ids"][:b],
            t2["pos"][:b],
            t2["tables"][:b],
            t2["swa_tables"][:b] if self.sliding else None,
            self.kv_views,
        )
        t2["next"][:b].copy_(logits.argmax(-1))
        if self.keep_logits:
            t2["logits"][:b].copy_(logits)

    def prefill(self, p: Prefill, row: int = 0) -> int:
        """Prefills a request from its first uncached token, in chunks,
        without waiting for the device; its greedy token goes to row `row`
        of T2's ``next`` (read by `prefill_tokens`, one row per prefill of
        the step). Returns the tokens prefilled. A request with an image
        runs the vision tower once (when its image tokens are not all
        cached) and ends a chunk before the image's tokens rather than
        inside them, so the image is prefilled in one call (its tokens
        attend to each other both ways)."""
        if not 0 <= row < self.max_batch:
            raise InvalidArgument(f"row={row}: a prefill's row is in [0, {self.max_batch})")
        tokens, n = p.tokens, len(p.tokens)
        sid = p.request.seq_id
        start = p.start
        mm = self._image_embeddings(p.request, start)
        logits = None
        while start < n:
            end = min(n, start + self.prefill_chunk)
            if mm is not None and start < mm[0] < end < mm[1]:
                end = mm[0]
            touches = mm is not None and start < mm[1] and mm[0] < end
            logits = self.prefill_chunk_logits(sid, tokens, start, end, mm if touches else None)
            start = end
        self.t2["next"][row : row + 1].copy_(logits[0].argmax(-1, keepdim=True))
        return n - p.start

    @property
    def batching(self) -> bool:
        """Whether this model's prefills are batched (a budget is set and
        the model serves `prefill_batch`)."""
        return bool(self.prefill_batch_tokens) and getattr(self.model, "prefill_batch_ok", False)

    def prefill_step(self, prefills: Sequence[Prefill]) -> int:
        """Prefills a step's admissions, prefill ``k`` into row ``k`` of T2's
        ``next`` (read by `prefill_tokens`), without waiting for the device;
        returns the tokens prefilled. With batching (module doc) the
        requests' chunks go in batches of at most `prefill_batch_tokens`
        tokens, one chunk of each request a batch; a request whose image
        is still to encode, or a model without `prefill_batch`, runs
        `prefill` alone."""
        if len(prefills) > self.max_batch:
            raise InvalidArgument(
                f"{len(prefills)} prefills in one step: at most max_batch={self.max_batch}"
            )
        if not self.batching:
            return sum(self.prefill(p, row) for row, p in enumerate(prefills))
        done, todo = 0, []
        for row, p in enumerate(prefills):
            req = p.request
            if req.image is not None and req.mm and req.mm[0][1] > p.start:
                done += self.prefill(p, row)
            else:
                todo.append((row, p))
        if not todo:
            return done
        n = len(todo)
        seqs = [p.request.seq_id for _, p in todo]
        tables, swa = self._step_tables[:n], self._step_swa[:n]
        t0 = time.perf_counter()
        self.kv.block_tables(seqs, tables)
        if self.sliding:
            self.kv.block_tables(seqs, swa, pool="swa")
        self.imp_mem_seconds += time.perf_counter() - t0
        at = [p.start for _, p in todo]
        left = [i for i in range(n) if at[i] < len(todo[i][1].tokens)]
        budget, chunk = self.prefill_batch_tokens, self.prefill_chunk
        # The request whose chunks map onto the SWA ring (at most one at a
        # time: the ring holds one sequence's early window).
        owner = None
        while left:
            batch, used = [], 0
            for i in sorted(left, key=lambda i: i != owner):
                row, p = todo[i]
                s, e = at[i], min(len(p.tokens), at[i] + chunk)
                if used + e - s > budget:
                    continue
                if self.sliding and self._needs_ring(swa[i], s, e):
                    if owner is None:
                        owner = i
                    elif owner != i:
                        continue
                elif owner == i:
                    owner = None
                last = row if e == len(p.tokens) else None
                batch.append((p.tokens, s, e, tables[i], swa[i] if self.sliding else None, last))
                used += e - s
                at[i] = e
            self._prefill_batch(batch)
            done += used
            left = [i for i in left if at[i] < len(todo[i][1].tokens)]
            if owner not in left:
                owner = None
        return done

    def _prefill_batch(self, chunks: list[tuple]) -> torch.Tensor:
        """One forward over `chunks`, each ``(tokens, start, end, table,
        swa_table, row)``: positions ``[start, end)`` of a sequence whose
        block tables are given (host rows; the SWA row mapped onto the ring
        here where the manager gave no block); a chunk with a `row` ends its
        prompt, and its greedy token goes to that row of T2's ``next``.
        Returns the logits ``[R, vocab]``."""
        slots, t2 = self.prefill_slots, self.t2
        host = slots.take().np
        r = len(chunks)
        cu, at, pick, spans = host["prefill_cu"], 0, [], []
        cu[0] = 0
        for k, (tokens, start, end, table, swa, row) in enumerate(chunks):
            host["prefill_ids"][at : at + end - start] = tokens[start:end]
            at += end - start
            cu[k + 1] = at
            host["prefill_starts"][k] = start
            host["prefill_table"][k] = table
            if self.sliding:
                host["prefill_swa"][k] = swa
                self._fill_ring(host["prefill_swa"][k], start, end)
            spans.append((start, end - start))
            if row is not None:
                pick.append((k, row))
        f = len(pick)
        host["prefill_pick"][:f] = [k for k, _ in pick]
        host["prefill_rows"][:f] = [row for _, row in pick]
        # Non-blocking: the slot is rewritten only after this copy's event.
        slots.copy_to(self.t2_raw["prefill_in"])
        logits = self.model.prefill_batch(
            t2["prefill_ids"][:at],
            t2["prefill_cu"][: r + 1],
            t2["prefill_starts"][:r],
            t2["prefill_table"][:r],
            t2["prefill_swa"][:r] if self.sliding else None,
            self.kv_views,
            spans=spans,
        )
        if f:
            tokens = logits.argmax(-1).index_select(0, t2["prefill_pick"][:f])
            t2["next"].index_copy_(0, t2["prefill_rows"][:f], tokens)
        return logits

    def prefill_tokens(self, k: int) -> list[int]:
        """The greedy tokens of the step's `k` prefills (rows ``[0, k)`` of
        T2's ``next``), in one copy that waits for them."""
        nxt = self.staging["next"]
        nxt.t["next"][:k].copy_(self.t2["next"][:k])  # blocking: waits for the prefills
        return nxt.np["next"][:k].tolist()

    def _stage_decode(self, b: int, *, blocking: bool) -> None:
        """Plans FlashInfer's step for bucket `b` over the staged rows (when
        it serves the decode), then copies the step's inputs into T2."""
        staged = self.staging["decode_in"]
        if self.flashinfer is not None:
            self.flashinfer.plan(b, staged.np["pos"], staged.np["tables"])
        self.t2_raw["decode_in"].copy_(staged.raw, non_blocking=not blocking)

    def decode(self, batch: list[Request]) -> tuple[list[int], int]:
        """One decode of every sequence of `batch`; returns the greedy
        tokens and the bucket replayed."""
        n = len(batch)
        b = next(x for x in self.buckets if x >= n)
        staged = self.staging["decode_in"]
        host = staged.np
        host["ids"][:n] = [r.output[-1] for r in batch]
        host["pos"][:n] = [r.computed for r in batch]
        host["ids"][n:b] = 0
        host["pos"][n:b] = 0
        seqs = [r.seq_id for r in batch]
        t0 = time.perf_counter()
        self.kv.block_tables(seqs, host["tables"][:n])
        if self.sliding:
            self.kv.block_tables(seqs, host["swa_tables"][:n], pool="swa")
        self.imp_mem_seconds += time.perf_counter() - t0
        host["tables"][n:b] = self._pad_row
        if self.sliding:
            host["swa_tables"][n:b] = self._pad_swa_row
        # One copy of the whole input region (tens of KiB; FlashInfer's page
        # table planned first, when it serves); it is complete before the
        # next step rewrites the staging, which the blocking read of the
        # tokens below guarantees.
        self._stage_decode(b, blocking=False)
        if self.use_graphs:
            if self.replay_events is None:
                self.graphs[b].replay()
            else:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                self.graphs[b].replay()
                end.record()
                self.replay_events.append((start, end))
        else:
            self.decode_body(b)
        nxt = self.staging["next"]
        nxt.t["next"][:b].copy_(self.t2["next"][:b])  # blocking: waits for the step
        return nxt.np["next"][:n].tolist(), b

    def _image_embeddings(self, req: Request, start: int) -> Any:
        """``(s, e, embeddings)`` of a request's image when a prefill from
        `start` reaches its tokens ``[s, e)``; None otherwise."""
        if req.image is None or not req.mm:
            return None
        lo, hi, _ = req.mm[0]
        if hi <= start:
            return None
        pixels = req.image.to(self.device, non_blocking=True)
        return lo, hi, self.model.encode_images(pixels)[0]

    def prefill_chunk_logits(
        self, sid: int, tokens, start: int, end: int, mm: Any = None
    ) -> torch.Tensor:
        """Prefills positions [start, end) of sequence `sid`; the last
        token's logits. `mm`: the image's ``(s, e, embeddings)`` when the
        chunk holds its tokens."""
        slots, t2 = self.prefill_slots, self.t2
        host = slots.take().np
        n = end - start
        host["prefill_ids"][:n] = tokens[start:end]
        t0 = time.perf_counter()
        self.kv.block_tables([sid], host["prefill_table"][:1])
        if self.sliding:
            swa = host["prefill_swa"][0]
            self.kv.block_tables([sid], host["prefill_swa"][:1], pool="swa")
        self.imp_mem_seconds += time.perf_counter() - t0
        if self.sliding:
            self._fill_ring(swa, start, end)
        # Non-blocking: the slot is rewritten only after this copy's event.
        slots.copy_to(self.t2_raw["prefill_in"])
        return self.model.prefill(
            t2["prefill_ids"][:n],
            start,
            t2["prefill_table"][0],
            t2["prefill_swa"][0] if self.sliding else None,
            self.kv_views,
            last_only=True,
            **({"mm": mm} if mm is not None else {}),
        )
