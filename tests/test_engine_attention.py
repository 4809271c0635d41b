"""The Triton paged decode kernel against the torch reference, on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported), small shapes (issue 13). The same comparison at the real shapes
runs on the GPU in ``tests/gpu/test_engine_attention_gpu.py``.

Cases: GQA groups of 1, 2 and 3 (padded rows), several splits with the
merge, a window that starts inside a split, holes (-1) in the table,
padding rows on a scratch block, NaN in every slot no context covers, and
a pool view that is a non-leading layer of a multi-layer pool.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    # The interpreter would also take over the GPU tests' kernels in this
    # process; there the GPU test compares the compiled kernel instead.
    pytest.skip("a CUDA device is present: tests/gpu covers the kernel", allow_module_level=True)
if (
    "imp_mem.engine.model._paged_kernel" in sys.modules
    and os.environ.get("TRITON_INTERPRET") != "1"
):
    pytest.skip("the kernel was already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
pytest.importorskip("triton")

from imp_mem.engine.model import _paged_kernel  # noqa: E402
from imp_mem.engine.model.attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
    slots,
    store_kv,
)
from imp_mem.errors import InvalidArgument  # noqa: E402


def random_case(seed, *, batch, kv_heads, group, head_dim, block_size, width, blocks, holes):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.full((blocks, 3, 2, block_size, kv_heads, head_dim), float("nan"))
    tables = torch.full((batch, width), -1, dtype=torch.int32)
    perm = torch.randperm(blocks - 1, generator=gen) + 1
    positions = torch.randint(0, width * block_size, (batch,), generator=gen)
    positions[0] = width * block_size - 1  # one full table
    positions[-1] = 0  # a padding row: position 0 on scratch block 0
    used = 0
    for b in range(batch):
        if b == batch - 1:
            tables[b, 0] = 0
            continue
        n = int(positions[b]) // block_size + 1
        tables[b, :n] = perm[used : used + n]
        used += n
        if holes and n > 2:
            # Punch holes, never in the current token's block.
            hole = torch.randint(0, n - 1, (max(1, n // 3),), generator=gen)
            tables[b, hole] = -1
    for b in range(batch):
        for j in range(int(positions[b]) + 1):
            block = int(tables[b, j // block_size])
            if block >= 0:
                kv[block, :, :, j % block_size] = torch.randn(
                    3, 2, kv_heads, head_dim, generator=gen
                )
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen)
    return q, kv, tables, positions


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("holes", [False, True])
def test_kernel_matches_reference(group, window, holes):
    q, kv, tables, positions = random_case(
        group * 10 + bool(holes),
        batch=4,
        kv_heads=2,
        group=group,
        head_dim=16,
        block_size=4,
        width=12,
        blocks=64,
        holes=holes,
    )
    ref = paged_decode_attention_reference(q, kv, 1, tables, positions, window=window)
    # split_blocks=2: eight-token splits, six of them, so the merge has work.
    out = paged_decode_attention(
        q, kv, 1, tables, positions, window=window, backend="triton", split_blocks=2
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # The grid with a sequence's KV heads fastest computes the same.
    fast = _paged_kernel.paged_decode(
        q, kv, 1, tables, positions, window=window, scale=q.shape[-1] ** -0.5,
        split_blocks=2, head_fast=True,
    )  # fmt: skip
    torch.testing.assert_close(fast, out, atol=0, rtol=0)
    # One program for every KV head of a split (contiguous loads, the
    # other heads' columns masked): the same attention, its tiles shorter.
    every = _paged_kernel.paged_decode(
        q, kv, 1, tables, positions, window=window, scale=q.shape[-1] ** -0.5,
        split_blocks=2, all_heads=True,
    )  # fmt: skip
    torch.testing.assert_close(every, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("kv_heads", "per"), [(4, 2), (3, 2), (3, 4), (5, 4)])
@pytest.mark.parametrize("window", [None, 9])
def test_a_program_over_several_kv_heads_matches_the_reference(kv_heads, per, window):
    """``heads_per_program``: one program reads `per` KV heads' rows side by
    side; where `per` does not divide the KV heads the last program's
    missing heads are masked (their query rows neither read nor written)."""
    q, kv, tables, positions = random_case(
        kv_heads * 7 + per, batch=3, kv_heads=kv_heads, group=2, head_dim=16, block_size=4,
        width=10, blocks=48, holes=True,
    )  # fmt: skip
    ref = paged_decode_attention_reference(q, kv, 1, tables, positions, window=window)
    out = _paged_kernel.paged_decode(
        q, kv, 1, tables, positions, window=window, scale=q.shape[-1] ** -0.5,
        split_blocks=2, heads_per_program=per,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_default_split_and_bf16():
    q, kv, tables, positions = random_case(
        7, batch=3, kv_heads=2, group=2, head_dim=32, block_size=8, width=40, blocks=128, holes=True
    )
    q, kv = q.bfloat16(), kv.bfloat16()
    ref = paged_decode_attention_reference(q, kv, 2, tables, positions, window=None)
    out = paged_decode_attention(q, kv, 2, tables, positions, backend="triton")
    # bf16 in, fp32 accumulate; P is rounded to bf16 before P @ V.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    every = _paged_kernel.paged_decode(
        q, kv, 2, tables, positions, window=None, scale=q.shape[-1] ** -0.5, all_heads=True
    )
    torch.testing.assert_close(every.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_store_then_attend_sees_the_new_token():
    """store_kv writes the slot the kernel then reads for the current token."""
    q, kv, tables, positions = random_case(
        3, batch=3, kv_heads=2, group=2, head_dim=16, block_size=4, width=6, blocks=32, holes=False
    )
    k = torch.randn(3, 2, 16) * 4
    v = torch.randn(3, 2, 16) * 4
    store_kv(kv, 0, k, v, *slots(tables, positions, 4))
    out = paged_decode_attention(q, kv, 0, tables, positions, backend="triton", split_blocks=1)
    ref = paged_decode_attention_reference(q, kv, 0, tables, positions)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # Row with position 0 attends to its own token only: the output is v.
    torch.testing.assert_close(out[-1].view(2, 2, 16), v[-1][:, None].expand(2, 2, 16))


def test_the_default_split_is_whole_tiles():
    """A split the default tile does not divide walks a mostly masked last
    tile (80 tokens: 45.7 % of the H200's HBM peak against 68.7 %)."""
    for block_size in (8, 16, 32):
        for width in range(1, 600):
            blocks = _paged_kernel.choose_split_blocks(width, block_size)
            tokens = blocks * block_size
            assert tokens % _paged_kernel.DEFAULT_TILE == 0, (width, block_size, blocks)
            assert -(-width // blocks) <= _paged_kernel.MAX_SPLITS
            assert tokens >= _paged_kernel.MIN_SPLIT_TOKENS
    # A larger tile (as paged_decode passes it): whole tiles of it.
    assert _paged_kernel.choose_split_blocks(65, 16, tile=128) % 8 == 0
    # Blocks of a tile or more: any count is whole tiles, the fewest that
    # keep the splits at MAX_SPLITS.
    assert _paged_kernel.choose_split_blocks(65, 128) == -(-65 // _paged_kernel.MAX_SPLITS)
    assert _paged_kernel.choose_split_blocks(8, 128) == 1


def test_heads_per_program_below_one_is_refused():
    q, kv, tables, positions = random_case(
        5, batch=2, kv_heads=2, group=2, head_dim=16, block_size=4, width=4, blocks=16, holes=False
    )
    for bad in (0, -2):
        with pytest.raises(InvalidArgument, match="heads_per_program must be at least 1"):
            _paged_kernel.paged_decode(
                q, kv, 1, tables, positions, window=None, scale=0.25, heads_per_program=bad
            )
