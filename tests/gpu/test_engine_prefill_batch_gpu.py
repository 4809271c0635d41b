"""The batched (varlen) prefill on the GPU (issues 25 and 27).

Kernel: the Triton varlen prefill kernel at Qwen3-0.6B's attention shapes
(16 query / 8 KV heads, head_dim 128, bf16 pages of 16 tokens) against the
torch reference (`prefill_attention` chunk by chunk, in float32 over the
same pages): 16 chunks of 512 from position 0, mixed lengths after
prefixes already in the pages (a prefix hit: up to 1 500 tokens before
the chunk), a 256-token window, GQA 2 and 4, holes below the chunks, NaN
in every slot no context covers.

Engine: Qwen3-0.6B's shapes with random weights (dummy load), bf16, one
step prefilling 8 prompts of mixed lengths with batching on and off: the
first greedy tokens agree where the unbatched logits' top-2 margin is
decisive (the two paths differ in attention's kernel and the GEMMs' row
blocking, bf16 rounding), and the batched engine serves with no imp-mem
acquisition.

Tolerance as ``test_engine_attention_gpu``: the kernel rounds P to bf16
before P @ V and its output to bf16; |Δ| ≤ 1e-2 + 2e-2·|ref|.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from imp_mem.engine.model.attention import varlen_prefill_attention  # noqa: E402

HEAD_DIM, BLOCK = 128, 16
ATOL, RTOL = 1e-2, 2e-2


def make_case(spans, *, heads, kv_heads, holes, seed=0, layers=2, head_dim=HEAD_DIM):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = max(-(-(s + n) // BLOCK) for s, n in spans)
    blocks = 1 + sum(-(-(s + n) // BLOCK) for s, n in spans)
    kv = torch.full(
        (blocks, layers, 2, BLOCK, kv_heads, head_dim),
        float("nan"),
        dtype=torch.bfloat16,
        device="cuda",
    )
    perm = (torch.randperm(blocks - 1, generator=gen, device="cuda") + 1).int()
    tables = torch.full((len(spans), width), -1, dtype=torch.int32, device="cuda")
    used = 0
    for r, (s, n) in enumerate(spans):
        k = -(-(s + n) // BLOCK)
        row = perm[used : used + k]
        used += k
        tables[r, :k] = row
        # Every slot of the sequence's blocks up to its end; the last
        # block's tail stays NaN.
        vals = torch.randn(k * BLOCK, layers, 2, kv_heads, head_dim, generator=gen, device="cuda")
        vals[s + n :] = float("nan")
        kv[row.long()] = (
            vals.view(k, BLOCK, layers, 2, kv_heads, head_dim)
            .permute(0, 2, 3, 1, 4, 5)
            .to(torch.bfloat16)
        )
        below = s // BLOCK
        if holes and below > 2:
            hole = torch.randint(0, below - 1, (below // 3,), generator=gen, device="cuda")
            tables[r, hole] = -1
    total = sum(n for _, n in spans)
    q = torch.randn(total, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    lens = [n for _, n in spans]
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], device="cuda")
    starts = torch.tensor([s for s, _ in spans], device="cuda")
    return q, kv, tables, cu.to(torch.int32), starts


CASES = {
    "16x512_from_0": [(0, 512)] * 16,
    "mixed_after_prefixes": [(0, 700), (1500, 300), (37, 1), (256, 129), (999, 64), (16, 512)],
    "one_token_chunks": [(s, 1) for s in (0, 5, 511, 1023)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("kv_heads", [8, 4])
def test_kernel_matches_reference(case, window, kv_heads):
    spans = CASES[case]
    q, kv, tables, cu, starts = make_case(spans, heads=16, kv_heads=kv_heads, holes=window is None)
    args = (kv, 1, tables, cu, starts, spans)
    out = varlen_prefill_attention(q, *args, window=window, backend="triton")
    ref = varlen_prefill_attention(q.float(), kv.float(), *args[1:], window=window, backend="torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [None, 512])
def test_kernel_wide_heads(window):
    """Gemma-3's head_dim 256 (the kernel's half tiles), 8 query / 4 KV heads."""
    spans = CASES["mixed_after_prefixes"]
    q, kv, tables, cu, starts = make_case(spans, heads=8, kv_heads=4, holes=False, head_dim=256)
    args = (kv, 0, tables, cu, starts, spans)
    out = varlen_prefill_attention(q, *args, window=window, scale=0.0625, backend="triton")
    ref = varlen_prefill_attention(
        q.float(), kv.float(), *args[1:], window=window, scale=0.0625, backend="torch"
    )
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


def test_engine_batched_first_tokens_match_unbatched():
    import imp_mem
    from imp_mem.engine.config import qwen3_0_6b_config
    from imp_mem.engine.llm_engine import Engine

    config = {**qwen3_0_6b_config(), "num_hidden_layers": 4}
    rng = random.Random(0)
    lens = [1, 17, 200, 512, 700, 1024, 33, 511]
    prompts = [[rng.randrange(1000, 100000) for _ in range(n)] for n in lens]
    first, logits = {}, {}
    for budget in (0, 2048):
        with Engine(
            config,
            load_format="dummy",
            backend=imp_mem.VmmBackend(device=0),
            max_batch=8,
            max_seq_len=1100,
            keep_logits=False,
            enable_prefix_caching=False,
            prefill_batch_tokens=budget,
            warmup_probe=False,
        ) as e:
            assert e.runner.batching == bool(budget)
            model = e.runner.model
            seen = []
            name = "prefill_batch" if budget else "prefill"
            inner = getattr(model, name)

            def kept(*a, _inner=inner, _seen=seen, **kw):
                out = _inner(*a, **kw)
                _seen.append(out.float().clone())
                return out

            setattr(model, name, kept)
            reqs = [e.submit(p, 1) for p in prompts]
            e.step()
            first[budget] = [r.output[0] for r in reqs]
            steady = sum(e.backend.stats()["steady_state_allocations_total"].values())
            assert steady == 0, f"imp-mem acquisitions while serving: {steady}"
            logits[budget] = seen
            delattr(model, name)
    # The unbatched path's last logits of each request (its last chunk).
    per_req = [rows[-1] for rows in _per_request(logits[0], lens)]
    # 10 chunks one a forward unbatched; at most 4 forwards of 2 048 tokens batched.
    assert len(logits[0]) == sum(-(-n // 512) for n in lens) == 10
    assert len(logits[2048]) <= 4
    for i, ref in enumerate(per_req):
        top2 = ref.topk(2).values
        if (top2[0] - top2[1]).item() > 0.5:
            assert first[2048][i] == first[0][i], f"request {i} ({lens[i]} tokens)"


def _per_request(calls, lens, chunk=512):
    """The unbatched calls' logits grouped by request (its chunks in order)."""
    out, at = [], 0
    for n in lens:
        k = -(-n // chunk)
        out.append([c[0] for c in calls[at : at + k]])
        at += k
    return out
