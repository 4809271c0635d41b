"""The Triton paged decode kernel on the GPU, at the engine's shapes
(issue 13): Qwen3-0.6B's 16 query / 8 KV heads, head_dim 128, bf16 pages of
16 tokens, against the float32 torch reference over the same pages.

Cases: batch 1, 32 and 128; contexts from 1 token to 2 048; full attention
and a 256-token window; holes in the tables; padding rows on a scratch
block; NaN in every slot outside a context; a pool larger than 2^31
elements (int64 offsets); and the kernel captured in a CUDA graph, replayed
after the positions and tables change in place.

Tolerance: the kernel rounds P to bf16 before P @ V and its output to
bf16; the reference is float32 throughout. |Δ| ≤ 1e-2 + 2e-2·|ref| holds
with a wide margin (the bf16 output alone rounds by 2^-9 relative).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from imp_mem.engine.model.attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
    slots,
    store_kv,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
ATOL, RTOL = 1e-2, 2e-2


def make_case(batch, max_ctx, *, holes, layers=2, spare_blocks=8, seed=0, min_ctx=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-max_ctx // BLOCK)
    blocks = batch * width + spare_blocks
    kv = torch.full(
        (blocks, layers, 2, BLOCK, KV_HEADS, HEAD_DIM),
        float("nan"),
        dtype=torch.bfloat16,
        device="cuda",
    )
    positions = torch.randint(min_ctx - 1, max_ctx, (batch,), generator=gen, device="cuda")
    positions[0] = max_ctx - 1
    if batch > 1:
        positions[-1] = 0  # padding row
    perm = torch.randperm(blocks - 1, generator=gen, device="cuda").int() + 1
    tables = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
    pos = positions.tolist()
    used = 0
    for b in range(batch):
        if batch > 1 and b == batch - 1:
            tables[b, 0] = 0
            continue
        n = pos[b] // BLOCK + 1
        tables[b, :n] = perm[used : used + n]
        used += n
    if holes:
        # About a quarter of the blocks, never the current token's.
        logical = torch.arange(width, device="cuda").unsqueeze(0)
        current = (positions // BLOCK).unsqueeze(1)
        punch = (torch.rand(batch, width, generator=gen, device="cuda") < 0.25) & (
            logical != current
        )
        tables = torch.where(punch, torch.full_like(tables, -1), tables)
    # Fill every slot inside a context with data; the rest stays NaN.
    for layer in range(layers):
        for b in range(batch):
            p = pos[b] + 1
            key_pos = torch.arange(p, device="cuda")
            blk, off = slots(tables[b], key_pos, BLOCK)
            keep = blk >= 0
            k = torch.randn(p, KV_HEADS, HEAD_DIM, generator=gen, device="cuda")
            v = torch.randn(p, KV_HEADS, HEAD_DIM, generator=gen, device="cuda")
            store_kv(kv, layer, k[keep], v[keep], blk[keep], off[keep])
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    return q, kv, tables, positions


def check(out, ref):
    assert torch.isfinite(out).all(), "non-finite output: a slot outside the context was read"
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch,max_ctx", [(1, 1), (1, 2048), (32, 1024), (128, 600)])
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("holes", [False, True])
def test_kernel_matches_reference(batch, max_ctx, window, holes):
    q, kv, tables, positions = make_case(batch, max_ctx, holes=holes, seed=batch + max_ctx)
    for layer in (0, 1):
        ref = paged_decode_attention_reference(q, kv, layer, tables, positions, window=window)
        out = paged_decode_attention(q, kv, layer, tables, positions, window=window)
        check(out, ref)


@pytest.mark.parametrize("splits", [1, 2, 3, 8, 32])
@pytest.mark.parametrize("window", [None, 256])
def test_split_counts(splits, window):
    q, kv, tables, positions = make_case(32, 1024, holes=True, seed=splits)
    ref = paged_decode_attention_reference(q, kv, 1, tables, positions, window=window)
    out = paged_decode_attention(q, kv, 1, tables, positions, window=window, splits=splits)
    check(out, ref)


def test_wide_table_with_short_contexts():
    """A table sized for 40 960 tokens (Qwen3's max) with contexts of a few
    hundred: most splits are empty and must be skipped, not merged."""
    q, kv, tables, positions = make_case(8, 400, holes=False, seed=5)
    wide = torch.full((8, 40960 // BLOCK), -1, dtype=torch.int32, device="cuda")
    wide[:, : tables.shape[1]] = tables
    ref = paged_decode_attention_reference(q, kv, 0, tables, positions)
    check(paged_decode_attention(q, kv, 0, wide, positions), ref)


def test_pool_beyond_int32_elements():
    """Block ids whose element offset exceeds 2^31 (a 4.6 GB one-layer pool)."""
    per_block = 2 * BLOCK * KV_HEADS * HEAD_DIM
    blocks = (1 << 31) // per_block + 4096
    kv = torch.zeros((blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, ctx = 4, 100
    width = -(-ctx // BLOCK)
    tables = (blocks - 1 - torch.arange(batch * width, device="cuda")).int().view(batch, width)
    positions = torch.full((batch,), ctx - 1, device="cuda")
    key_pos = torch.arange(ctx, device="cuda")
    for b in range(batch):
        blk, off = slots(tables[b], key_pos, BLOCK)
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen, device="cuda")
        store_kv(kv, 0, k, -k, blk, off)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    check(
        paged_decode_attention(q, kv, 0, tables, positions),
        paged_decode_attention_reference(q, kv, 0, tables, positions),
    )
    del kv
    torch.cuda.empty_cache()


def replay_over_new_cases(graph, out, kv, static_q, static_t, static_p, seeds):
    """Writes each seed's case into the captured call's inputs in place
    (pages, queries, tables, positions; 32 sequences of up to 512 tokens,
    holes, layer 1, a 256-token window), replays, and checks the output."""
    for seed in seeds:
        q2, kv2, tables2, positions2 = make_case(32, 512, holes=True, seed=seed)
        kv.copy_(kv2)
        static_q.copy_(q2)
        static_t.copy_(tables2)
        static_p.copy_(positions2)
        graph.replay()
        torch.cuda.synchronize()
        check(out, paged_decode_attention_reference(q2, kv, 1, tables2, positions2, window=256))


def test_captured_in_a_cuda_graph():
    q, kv, tables, positions = make_case(32, 512, holes=True, seed=9)
    static_q, static_t, static_p = q.clone(), tables.clone(), positions.clone()
    paged_decode_attention(static_q, kv, 1, static_t, static_p, window=256)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(static_q, kv, 1, static_t, static_p, window=256)
    replay_over_new_cases(graph, out, kv, static_q, static_t, static_p, (10, 11))


@pytest.mark.parametrize("batch,max_ctx", [(1, 2048), (32, 1024), (128, 600)])
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("splits,tile", [(1, 16), (1, 32), (2, 32), (3, 64)])
def test_tma_loads_match_the_reference(batch, max_ctx, window, splits, tile):
    """``loads="tma"`` (issue 25's probe: each page of a KV head one
    descriptor box, one to four pages an iteration) on the H200's tensor
    memory accelerator: holes, padding rows, a window, NaN outside every
    context (masked K, zeroed V), both layers of the pool."""
    from imp_mem.engine.kernels import paged as paged_kernel

    q, kv, tables, positions = make_case(batch, max_ctx, holes=True, seed=batch + splits + tile)
    for layer in (0, 1):
        ref = paged_decode_attention_reference(q, kv, layer, tables, positions, window=window)
        out = paged_kernel.paged_decode(
            q, kv, layer, tables, positions, window=window, scale=HEAD_DIM**-0.5,
            splits=splits, tile=tile, loads="tma",
        )  # fmt: skip
        check(out, ref)


def test_tma_loads_captured_in_a_cuda_graph():
    """The host-side descriptor is a launch argument: a captured TMA call
    replays over new positions, tables and pages written in place."""
    from imp_mem.engine.kernels import paged as paged_kernel

    q, kv, tables, positions = make_case(32, 512, holes=True, seed=19)
    static_q, static_t, static_p = q.clone(), tables.clone(), positions.clone()

    def call():
        return paged_kernel.paged_decode(
            static_q, kv, 1, static_t, static_p, window=256, scale=HEAD_DIM**-0.5,
            loads="tma",
        )  # fmt: skip

    call()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    replay_over_new_cases(graph, out, kv, static_q, static_t, static_p, (20, 21))
