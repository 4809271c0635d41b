"""The KV host tier on a GPU (issue 17): evicted prefix blocks are copied to
pinned host memory on the tier's copy stream and onboarded back into fresh
device blocks with the same bytes; the copy stream is ordered after the
default stream's kernels that wrote a block; a stream can wait for a
sequence's onboarding on the device. Skipped where no CUDA device exists."""

from __future__ import annotations

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

BS = 16
BLOCK_BYTES = 256 << 10


class _View:
    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "strides": None,
            "data": (address, False),
            "version": 3,
            "stream": None,
        }


def block(address: int, nbytes: int = BLOCK_BYTES):
    """A uint8 tensor viewing one device block (not owning it)."""
    return torch.as_tensor(_View(address, nbytes), device="cuda")


def fill_value(h: int) -> int:
    return 1 + h % 251


def write_blocks(kv, seq_id: int) -> list[int]:
    """The engine computes every full block of a sequence: a value per
    block, from its hash, written by a kernel on the current stream."""
    hashes = kv.sequence_hashes(seq_id)
    for i, h in enumerate(hashes):
        address, nbytes = kv.block_span(seq_id, i)
        block(address, nbytes).fill_(fill_value(h))
    return hashes


def check_blocks(kv, seq_id: int, hashes: list[int]) -> None:
    for i, h in enumerate(hashes):
        address, nbytes = kv.block_span(seq_id, i)
        t = block(address, nbytes)
        assert bool((t == fill_value(h)).all()), f"block {i} of sequence {seq_id}"


def scribble(kv, n_blocks: int, seq_id: int = 999) -> None:
    """Overwrites every free device block, so a missing onboard shows."""
    kv.admit(seq_id, list(range(50_000, 50_000 + (n_blocks - 1) * BS)))
    for i in range(n_blocks - 1):
        address, nbytes = kv.block_span(seq_id, i)
        block(address, nbytes).fill_(0xEE)
    torch.cuda.synchronize()
    kv.abort(seq_id)


@pytest.mark.parametrize("kind", ["cuda", "vmm"])
def test_an_evicted_prefix_is_onboarded_with_the_same_device_bytes(kind):
    backend = (imp_mem.CudaBackend if kind == "cuda" else imp_mem.VmmBackend)(device=0)
    blocks = 32
    kv = imp_mem.KVCacheManager(
        blocks, BS, backend=backend, block_bytes=BLOCK_BYTES, host_blocks=64
    )
    prompt = list(range(6 * BS + 5))
    kv.admit(1, prompt)
    hashes = write_blocks(kv, 1)
    torch.cuda.synchronize()
    kv.free(1)
    assert kv.evict(6) == 6
    kv.poll_copies(wait=True)
    s = kv.stats()
    assert (s["cached"], s["host_cached"], s["offload_bytes"]) == (0, 6, 6 * BLOCK_BYTES)
    scribble(kv, blocks)
    assert kv.admit(2, prompt) == 6 * BS
    assert len(kv.onboarding(2)) == 6
    assert kv.wait_onboarding(2) == 6
    check_blocks(kv, 2, hashes)
    assert kv.stats()["onboard_bytes"] == 6 * BLOCK_BYTES
    kv.poll_copies()
    kv.check_invariants()


def test_a_stream_waits_for_the_onboarding_on_the_device():
    kv = imp_mem.KVCacheManager(
        32, BS, backend=imp_mem.CudaBackend(device=0), block_bytes=BLOCK_BYTES, host_blocks=64
    )
    prompt = list(range(8 * BS + 1))
    kv.admit(1, prompt)
    hashes = write_blocks(kv, 1)
    torch.cuda.synchronize()
    kv.free(1)
    kv.evict(8)
    kv.poll_copies(wait=True)
    scribble(kv, 32)
    stream = torch.cuda.Stream()
    kv.admit(2, prompt)
    assert kv.wait_onboarding(2, stream=stream.cuda_stream) == 8
    with torch.cuda.stream(stream):
        ok = [(block(*kv.block_span(2, i)) == fill_value(h)).all() for i, h in enumerate(hashes)]
    stream.synchronize()
    assert all(bool(x) for x in ok)
    kv.poll_copies(wait=True)
    kv.check_invariants()


def test_the_copy_stream_is_ordered_after_the_kernels_that_wrote_a_block():
    kv = imp_mem.KVCacheManager(
        32, BS, backend=imp_mem.CudaBackend(device=0), block_bytes=BLOCK_BYTES, host_blocks=64
    )
    prompt = list(range(4 * BS + 1))
    kv.admit(1, prompt)
    # Keep the default stream busy, then write the blocks behind that work,
    # and evict at once: no synchronize between the kernels and the copies.
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    hashes = write_blocks(kv, 1)
    kv.free(1)
    assert kv.evict(4) == 4
    kv.poll_copies(wait=True)
    scribble(kv, 32)
    kv.admit(2, prompt)
    kv.wait_onboarding(2)
    check_blocks(kv, 2, hashes)
    kv.poll_copies(wait=True)


def test_an_admission_that_needs_room_offloads_and_waits():
    blocks = 16
    kv = imp_mem.KVCacheManager(
        blocks, BS, backend=imp_mem.CudaBackend(device=0), block_bytes=BLOCK_BYTES, host_blocks=64
    )
    prompts = [list(range(k * 1000, k * 1000 + 5 * BS + 1)) for k in range(6)]
    written = {}
    for k, p in enumerate(prompts):
        kv.admit(k, p)
        written[k] = write_blocks(kv, k)
        torch.cuda.synchronize()
        kv.free(k)
    # 30 blocks were cached through a pool of 16: the oldest went to the
    # host tier as admissions needed room, and come back as hits.
    s = kv.stats()
    assert s["host_cached"] + s["cached"] == 30 and s["offloads"] >= 14
    for k, p in enumerate(prompts):
        assert kv.admit(100 + k, p) == 5 * BS, f"prompt {k}"
        kv.wait_onboarding(100 + k)
        check_blocks(kv, 100 + k, written[k])
        kv.free(100 + k)
    kv.poll_copies(wait=True)
    kv.check_invariants()


def test_onboarded_blocks_serve_the_same_paged_attention():
    """The engine's paged decode attention over a prefix, before its blocks
    were evicted to the host tier and after they were onboarded into other
    device blocks: the same output."""
    attention = pytest.importorskip("imp_mem.engine.model.attention")
    layers, kv_heads, head_dim, heads = 2, 8, 128, 16
    shape = (layers, 2, BS, kv_heads, head_dim)
    block_bytes = 2 * layers * 2 * BS * kv_heads * head_dim
    blocks = 24
    kv = imp_mem.KVCacheManager(
        blocks, BS, backend=imp_mem.CudaBackend(device=0), block_bytes=block_bytes, host_blocks=32
    )
    ctx = 5 * BS
    prompt = list(range(7, 7 + ctx + 1))
    kv.admit(1, prompt)
    address, _ = kv.block_span(1, 0)
    base = address - kv.block_table(1)[0] * block_bytes
    pool = (
        torch.as_tensor(_View(base, blocks * block_bytes), device="cuda")
        .view(torch.bfloat16)
        .view(blocks, *shape)
    )
    gen = torch.Generator(device="cuda").manual_seed(3)
    table = torch.tensor([kv.block_table(1)], dtype=torch.int32, device="cuda")
    positions = torch.arange(ctx, device="cuda")
    blk, off = attention.slots(table[0], positions, BS)
    for layer in range(layers):
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen, device="cuda")
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen, device="cuda")
        attention.store_kv(pool, layer, k, v, blk, off)
    q = torch.randn(1, heads, head_dim, generator=gen, device="cuda").bfloat16()
    last = torch.tensor([ctx - 1], device="cuda")
    try:
        import triton  # noqa: F401

        backend = "triton"
    except ImportError:
        backend = "torch"

    def attend(table):
        return [
            attention.paged_decode_attention(q, pool, layer, table, last, backend=backend)
            for layer in range(layers)
        ]

    before = attend(table)
    torch.cuda.synchronize()
    kv.free(1, ctx)
    assert kv.evict(5) == 5
    kv.poll_copies(wait=True)
    pool.fill_(float("nan"))
    torch.cuda.synchronize()
    # Another request takes the freed blocks first, so the prefix comes back
    # into other ones.
    kv.admit(2, list(range(90_000, 90_000 + 3 * BS)))
    assert kv.admit(3, prompt) == ctx
    kv.wait_onboarding(3, stream=torch.cuda.current_stream().cuda_stream)
    moved = torch.tensor([kv.block_table(3)], dtype=torch.int32, device="cuda")
    assert moved[0, :5].tolist() != table[0, :5].tolist()
    after = attend(moved)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b, a)
    kv.poll_copies(wait=True)
