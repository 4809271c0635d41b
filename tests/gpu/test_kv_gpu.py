"""The KV manager on device memory: prefix-cache persistence copies block
contents device -> host -> file and back, so a restored prefix serves
the same bytes (issue 6). Skipped where no CUDA device exists."""

from __future__ import annotations

import ctypes
import hashlib

import pytest

import imp_mem
from imp_mem import KVCacheManager

pytestmark = pytest.mark.gpu

BS = 16
BLOCKS = 64
BLOCK_BYTES = 64 << 10


def pattern(h: int, n: int) -> bytes:
    out, seed = b"", h.to_bytes(16, "little")
    while len(out) < n:
        seed = hashlib.blake2b(seed, digest_size=64).digest()
        out += seed
    return out[:n]


def _write(address: int, data: bytes) -> None:
    cupy = pytest.importorskip("cupy")
    host = ctypes.create_string_buffer(data, len(data))
    rt = cupy.cuda.runtime
    rt.memcpy(address, ctypes.addressof(host), len(data), rt.memcpyHostToDevice)


def _read(address: int, n: int) -> bytes:
    cupy = pytest.importorskip("cupy")
    host = ctypes.create_string_buffer(n)
    rt = cupy.cuda.runtime
    rt.memcpy(ctypes.addressof(host), address, n, rt.memcpyDeviceToHost)
    return host.raw


@pytest.mark.parametrize("kind", ["cuda", "vmm"])
def test_a_restored_prefix_serves_the_same_device_bytes(kind, tmp_path):
    cls = imp_mem.CudaBackend if kind == "cuda" else imp_mem.VmmBackend
    backend = cls(device=0)
    m = KVCacheManager(
        BLOCKS, BS, backend=backend, block_bytes=BLOCK_BYTES, model_fingerprint="m", dtype="bf16"
    )
    tokens = list(range(5 * BS + 3))
    m.admit(1, tokens)
    hashes = m.sequence_hashes(1)
    assert len(hashes) == 5
    for i, h in enumerate(hashes):
        address, nbytes = m.block_span(1, i)
        assert nbytes == BLOCK_BYTES
        _write(address, pattern(h, nbytes))
    m.free(1)
    path = tmp_path / "prefix.imp"
    assert m.save_prefix_cache(str(path)) == 5
    assert m.evict(100) == 5

    # Overwrite every block, so a load that did not copy the bytes back shows.
    m.admit(9, list(range(10_000, 10_000 + BLOCKS * BS)))
    for i in range(BLOCKS):
        address, nbytes = m.block_span(9, i)
        _write(address, b"\0" * nbytes)
    m.abort(9)

    assert m.load_prefix_cache(path) == 5
    cached = m.cached_blocks()
    assert sorted(h for h, _, _ in cached) == sorted(hashes)
    for h, _, address in cached:
        assert _read(address, BLOCK_BYTES) == pattern(h, BLOCK_BYTES)
    assert m.admit(2, tokens) == 5 * BS, "the restored prefix is a hit"
    for i, h in enumerate(m.sequence_hashes(2)[:5]):
        address, _ = m.block_span(2, i)
        assert _read(address, BLOCK_BYTES) == pattern(h, BLOCK_BYTES)
    m.free(2)
