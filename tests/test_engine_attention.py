"""The Triton paged decode kernel against the torch reference, on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported), small shapes (issue 13). The same comparison at the real shapes
runs on the GPU in ``tests/gpu/test_engine_attention_gpu.py``.

Cases: GQA groups of 1, 2 and 3 (padded rows), several splits with the
merge, a window that starts inside a split, holes (-1) in the table,
padding rows on a scratch block, NaN in every slot no context covers, a
pool view that is a non-leading layer of a multi-layer pool, and a pool
whose memory is head-major (read through its strides).
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
if "imp_mem.engine.kernels.paged" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel was already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
pytest.importorskip("triton")

from imp_mem.engine.kernels import paged as paged_kernel  # noqa: E402
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
    # Three splits of each live range, so the merge has work (a split of a
    # short range can be empty: -inf, skipped).
    out = paged_decode_attention(
        q, kv, 1, tables, positions, window=window, backend="triton", splits=3
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # One split: the program writes the output itself, no merge.
    one = paged_decode_attention(
        q, kv, 1, tables, positions, window=window, backend="triton", splits=1
    )
    torch.testing.assert_close(one, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 2, 5, 32])
@pytest.mark.parametrize("tile", [16, 32])
def test_every_split_count_matches_the_reference(splits, tile):
    """The live range is cut into `splits` whole tiles from the positions,
    not the table: more splits than tiles leaves the trailing ones empty."""
    q, kv, tables, positions = random_case(
        splits * 3 + tile, batch=3, kv_heads=2, group=4, head_dim=16, block_size=4,
        width=24, blocks=96, holes=True,
    )  # fmt: skip
    ref = paged_decode_attention_reference(q, kv, 0, tables, positions, window=None)
    out = paged_kernel.paged_decode(
        q, kv, 0, tables, positions, window=None, scale=q.shape[-1] ** -0.5, splits=splits,
        tile=tile,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tile", [4, 8])
def test_tma_loads_match_the_reference(group, window, splits, tile):
    """``loads="tma"`` (issue 25's probe: a page a descriptor box, whole
    pages a split, one or two pages an iteration) reads what the pointer
    kernel reads: a non-leading layer, holes, a window starting inside a
    page, NaN in every slot no context covers (masked K, zeroed V)."""
    q, kv, tables, positions = random_case(
        group * 7 + splits + tile, batch=4, kv_heads=2, group=group, head_dim=16, block_size=4,
        width=12, blocks=64, holes=True,
    )  # fmt: skip
    ref = paged_decode_attention_reference(q, kv, 1, tables, positions, window=window)
    out = paged_kernel.paged_decode(
        q, kv, 1, tables, positions, window=window, scale=q.shape[-1] ** -0.5, splits=splits,
        tile=tile, loads="tma",
    )  # fmt: skip
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_tma_loads_refuse_what_they_cannot_read():
    q, kv, tables, positions = random_case(
        5, batch=2, kv_heads=2, group=2, head_dim=16, block_size=4, width=4, blocks=16,
        holes=False,
    )  # fmt: skip
    call = dict(window=None, scale=0.25, loads="tma")
    with pytest.raises(InvalidArgument, match="contiguous"):
        paged_kernel.paged_decode(q, kv.transpose(3, 4), 0, tables, positions, **call)
    with pytest.raises(InvalidArgument, match="loads"):
        paged_kernel.paged_decode(q, kv, 0, tables, positions, window=None, scale=0.25, loads="x")


@pytest.mark.parametrize("splits", [1, 3])
def test_a_head_major_pool_reads_the_same_through_its_strides(splits):
    """The kernel takes the pool's strides, not its layout: the same values
    with each block's heads one after another in memory (FlashInfer's HND,
    as `tools/sweep_paged_kernel.paged_case(layout="hnd")` lays them out
    to time it), seen through a transposed view, give the same output."""
    q, kv, tables, positions = random_case(
        7 + splits, batch=3, kv_heads=2, group=2, head_dim=16, block_size=4, width=10,
        blocks=48, holes=True,
    )  # fmt: skip
    hnd = kv.transpose(3, 4).contiguous().transpose(3, 4)
    assert hnd.shape == kv.shape and hnd.stride(3) == kv.shape[-1]
    scale = q.shape[-1] ** -0.5
    nhd_out = paged_kernel.paged_decode(
        q, kv, 2, tables, positions, window=None, scale=scale, splits=splits
    )
    hnd_out = paged_kernel.paged_decode(
        q, hnd, 2, tables, positions, window=None, scale=scale, splits=splits
    )
    torch.testing.assert_close(hnd_out, nhd_out, atol=0, rtol=0)
    ref = paged_decode_attention_reference(q, kv, 2, tables, positions, window=None)
    torch.testing.assert_close(hnd_out, ref, atol=2e-5, rtol=2e-5)


def test_a_sequence_of_holes_reads_zero():
    """Every block a hole: nothing to attend to reads 0 with one split or
    several (the merge divides by no weight)."""
    q, kv, tables, positions = random_case(
        4, batch=2, kv_heads=2, group=2, head_dim=16, block_size=4, width=6, blocks=32, holes=False
    )
    tables[1] = -1
    for splits in (1, 3):
        out = paged_kernel.paged_decode(
            q, kv, 0, tables, positions, window=None, scale=0.25, splits=splits
        )
        assert torch.isfinite(out).all()
        assert (out[1] == 0).all()


def test_default_split_and_bf16():
    q, kv, tables, positions = random_case(
        7, batch=3, kv_heads=2, group=2, head_dim=32, block_size=8, width=40, blocks=128, holes=True
    )
    q, kv = q.bfloat16(), kv.bfloat16()
    ref = paged_decode_attention_reference(q, kv, 2, tables, positions, window=None)
    out = paged_decode_attention(q, kv, 2, tables, positions, backend="triton")
    # bf16 in, fp32 accumulate; P is rounded to bf16 before P @ V.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_store_then_attend_sees_the_new_token():
    """store_kv writes the slot the kernel then reads for the current token."""
    q, kv, tables, positions = random_case(
        3, batch=3, kv_heads=2, group=2, head_dim=16, block_size=4, width=6, blocks=32, holes=False
    )
    k = torch.randn(3, 2, 16) * 4
    v = torch.randn(3, 2, 16) * 4
    store_kv(kv, 0, k, v, *slots(tables, positions, 4))
    out = paged_decode_attention(q, kv, 0, tables, positions, backend="triton", splits=1)
    ref = paged_decode_attention_reference(q, kv, 0, tables, positions)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # Row with position 0 attends to its own token only: the output is v.
    torch.testing.assert_close(out[-1].view(2, 2, 16), v[-1][:, None].expand(2, 2, 16))


def test_the_default_splits_follow_the_grid():
    """Enough programs for the SMs, no more: batch 64 x 8 KV heads fill an
    H200 (132 SMs) with one split, batch 32 needs two, one sequence many,
    never more than MAX_SPLITS nor splits under MIN_SPLIT_TOKENS of the
    table's width."""
    choose = paged_kernel.choose_splits
    assert choose(64, 8, 65, 16, 132) == 1
    assert choose(32, 8, 65, 16, 132) == 2
    assert choose(1, 8, 4096, 16, 132) == paged_kernel.MAX_SPLITS
    assert choose(1, 8, 8, 16, 132) == 2  # 128 tokens: two of 64
    assert choose(1, 8, 1, 16, 132) == 1
    for batch in range(1, 300, 7):
        for width in (1, 3, 65, 257):
            splits = choose(batch, 8, width, 16, 132)
            assert 1 <= splits <= paged_kernel.MAX_SPLITS
            assert splits == 1 or width * 16 // splits >= paged_kernel.MIN_SPLIT_TOKENS
            assert splits == 1 or batch * 8 * (splits - 1) < paged_kernel.PROGRAMS_PER_SM * 132
    few, many = paged_kernel.FEW_PROGRAMS, paged_kernel.MANY_PROGRAMS
    assert paged_kernel.launch_defaults(512, 132) == few
    assert paged_kernel.launch_defaults(1024, 132) == many


def test_bad_splits_and_tiles_are_refused():
    q, kv, tables, positions = random_case(
        5, batch=2, kv_heads=2, group=2, head_dim=16, block_size=4, width=4, blocks=16, holes=False
    )
    for name, bad in (("splits", 0), ("splits", -2), ("tile", 0)):
        with pytest.raises(InvalidArgument, match=f"{name} must be at least 1"):
            paged_kernel.paged_decode(
                q, kv, 1, tables, positions, window=None, scale=0.25, **{name: bad}
            )
    with pytest.raises(InvalidArgument, match="splits must be at most"):
        paged_kernel.paged_decode(
            q, kv, 1, tables, positions, window=None, scale=0.25,
            splits=paged_kernel.MAX_SPLITS + 1,
        )  # fmt: skip
