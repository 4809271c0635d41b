"""The Triton varlen prefill kernel (`kernels.prefill`) against the torch
reference (`prefill_attention` chunk by chunk), on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set before Triton is imported), small
shapes. The same comparison at real shapes runs on the GPU in
``tests/gpu/test_engine_prefill_batch_gpu.py``.

Cases (hypothesis): several chunks of mixed lengths, each of its own
sequence, starting at 0 or after a prefix already in the pages (a prefix
hit, with holes punched below the chunk), GQA groups of 1 to 3, with and
without a sliding window, block sizes below and above the kernel's tiles,
NaN in every slot no context covers; and bfloat16.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    pytest.skip("a CUDA device is present: tests/gpu covers the kernel", allow_module_level=True)
if "imp_mem.engine.kernels.prefill" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel was already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from imp_mem.engine.kernels import prefill as prefill_kernel  # noqa: E402
from imp_mem.engine.model.attention import varlen_prefill_attention  # noqa: E402


def random_batch(seed, *, spans, kv_heads, group, head_dim, block_size, holes, layers=2):
    """Pages holding each chunk's sequence up to its end (NaN elsewhere),
    one table row a chunk, and the chunks' queries back to back."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(s + n) // block_size) for s, n in spans) + 1
    blocks = 1 + sum(-(-(s + n) // block_size) for s, n in spans)
    kv = torch.full((blocks, layers, 2, block_size, kv_heads, head_dim), float("nan"))
    tables = torch.full((len(spans), width), -1, dtype=torch.int32)
    perm = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    for r, (s, n) in enumerate(spans):
        used = -(-(s + n) // block_size)
        tables[r, :used] = torch.tensor([perm.pop() for _ in range(used)], dtype=torch.int32)
        for j in range(s + n):
            b = int(tables[r, j // block_size])
            kv[b, :, :, j % block_size] = torch.randn(layers, 2, kv_heads, head_dim, generator=gen)
        below = s // block_size  # blocks wholly before the chunk's first token
        if holes and below > 1:
            hole = torch.randint(0, below, (max(1, below // 3),), generator=gen)
            tables[r, hole] = -1
    total = sum(n for _, n in spans)
    q = torch.randn(total, kv_heads * group, head_dim, generator=gen)
    cu = torch.tensor([0] + [sum(n for _, n in spans[: r + 1]) for r in range(len(spans))])
    starts = torch.tensor([s for s, _ in spans], dtype=torch.int64)
    return q, kv, tables, cu.to(torch.int32), starts


span = st.tuples(st.integers(0, 40), st.integers(1, 37))


@settings(max_examples=25, deadline=None)
@given(
    spans=st.lists(span, min_size=1, max_size=4),
    group=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    window=st.one_of(st.none(), st.integers(1, 20)),
    block_size=st.sampled_from([4, 8, 32]),
    holes=st.booleans(),
    layer=st.integers(0, 1),
    seed=st.integers(0, 1000),
)
def test_kernel_matches_reference(spans, group, kv_heads, window, block_size, holes, layer, seed):
    q, kv, tables, cu, starts = random_batch(
        seed,
        spans=spans,
        kv_heads=kv_heads,
        group=group,
        head_dim=16,
        block_size=block_size,
        holes=holes and window is None,
    )
    args = (q, kv, layer, tables, cu, starts, spans)
    ref = varlen_prefill_attention(*args, window=window, backend="torch")
    out = varlen_prefill_attention(*args, window=window, backend="triton")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_padded_head_dim_and_a_chunk_longer_than_a_tile():
    """A head_dim that is not a power of two (masked lanes), a chunk of
    several query blocks, and a custom scale."""
    spans = [(0, 3 * prefill_kernel.BLOCK_M + 5), (9, 2)]
    q, kv, tables, cu, starts = random_batch(
        4, spans=spans, kv_heads=2, group=2, head_dim=24, block_size=8, holes=False
    )
    args = (q, kv, 1, tables, cu, starts, spans)
    ref = varlen_prefill_attention(*args, scale=0.3, backend="torch")
    out = varlen_prefill_attention(*args, scale=0.3, backend="triton")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_bf16():
    spans = [(5, 20), (0, 7), (30, 1)]
    q, kv, tables, cu, starts = random_batch(
        9, spans=spans, kv_heads=2, group=2, head_dim=32, block_size=8, holes=True
    )
    q, kv = q.bfloat16(), kv.bfloat16()
    args = (q, kv, 0, tables, cu, starts, spans)
    ref = varlen_prefill_attention(*args, window=11, backend="torch")
    out = varlen_prefill_attention(*args, window=11, backend="triton")
    # bf16 in, fp32 accumulate; P is rounded to bf16 before P @ V.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
