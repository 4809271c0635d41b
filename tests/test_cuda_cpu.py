"""The CUDA backends on a machine without CUDA, and the pure parts of the
measured-reserve cache (they need no GPU)."""

from __future__ import annotations

import json

import pytest

import imp_mem
from imp_mem import _core

MIB = 1 << 20

needs_no_gpu = pytest.mark.skipif(
    imp_mem.cuda_available(), reason="checks the no-driver path; this machine has a GPU"
)


@needs_no_gpu
@pytest.mark.parametrize(
    "make",
    [
        lambda: imp_mem.CudaBackend(),
        lambda: imp_mem.CudaBackend(0, budget="1GiB", strict=True),
        lambda: imp_mem.VmmBackend(),
        lambda: imp_mem.VmmBackend(0, chunk_bytes="32MiB", cache_chunks=0),
        lambda: imp_mem.Fence(),
        imp_mem.cuda_driver_version,
        imp_mem.cuda_mem_get_info,
    ],
    ids=["cuda", "cuda-args", "vmm", "vmm-args", "fence", "version", "meminfo"],
)
def test_without_a_driver_everything_raises_backend_unavailable(make):
    with pytest.raises(imp_mem.BackendUnavailable) as info:
        make()
    assert "CUDA" in str(info.value)
    assert isinstance(info.value, imp_mem.ImpMemError)


@needs_no_gpu
def test_cuda_device_count_is_zero_without_a_driver():
    # As torch.cuda.device_count(): a CPU machine asks without a try (issue 55).
    assert imp_mem.cuda_device_count() == 0


@needs_no_gpu
def test_cuda_available_is_false_and_stays_false():
    assert imp_mem.cuda_available() is False
    assert imp_mem.cuda_available() is False


def test_the_backends_are_backends():
    assert issubclass(imp_mem.CudaBackend, imp_mem.Backend)
    assert issubclass(imp_mem.VmmBackend, imp_mem.Backend)


H200 = {
    "gpu_name": "NVIDIA H200",
    "driver_version": "580.95.05",
    "cuda_version": "13.0",
    "libraries": {"torch": "2.9.0", "cublas": "13.0.0"},
}


def test_fingerprint_key_is_stable():
    key = _core.reserve_fingerprint_key(H200)
    assert key == "gpu=NVIDIA H200;driver=580.95.05;cuda=13.0;cublas=13.0.0;torch=2.9.0"
    with pytest.raises(imp_mem.InvalidArgument, match="gpu_name"):
        _core.reserve_fingerprint_key({"driver_version": "1", "cuda_version": "2"})


def test_reserve_cache_round_trip(tmp_path):
    path = tmp_path / "cache" / "reserve.json"
    assert _core.reserve_cache_lookup(str(path), H200) is None
    measured = {"context_bytes": 527 * MIB, "library_reserve_bytes": 66 * MIB}
    _core.reserve_cache_store(str(path), H200, measured, samples=5)
    hit = _core.reserve_cache_lookup(str(path), H200)
    assert hit["context_bytes"] == 527 * MIB and hit["library_reserve_bytes"] == 66 * MIB
    assert hit["samples"] == 5
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == "imp-mem-reserve-cache" and len(on_disk["entries"]) == 1
    other = dict(H200, driver_version="590.1")
    assert _core.reserve_cache_lookup(str(path), other) is None
    path.write_text("{broken")
    with pytest.raises(imp_mem.InvalidArgument, match="delete it"):
        _core.reserve_cache_lookup(str(path), H200)


def test_self_check_flags_over_ten_percent():
    expected = {"context_bytes": 527 * MIB, "library_reserve_bytes": 66 * MIB}
    fine = _core.reserve_self_check(expected, dict(expected, library_reserve_bytes=72 * MIB))
    assert not fine["diverged"]
    far = _core.reserve_self_check(
        expected, dict(expected, library_reserve_bytes=74 * MIB), fingerprint=H200
    )
    assert far["diverged"] and "NVIDIA H200" in far["message"]
    assert far["library_divergence"] == pytest.approx(8 / 66)
    with pytest.raises(imp_mem.InvalidArgument):
        _core.reserve_self_check(expected, expected, tolerance=-1.0)


def test_readings_give_the_charges():
    r = {
        "free_before_context": 140_000 * MIB,
        "free_after_context": 140_000 * MIB - 527 * MIB,
        "used_before_library": 1000 * MIB,
        "allocator_before_library": 200 * MIB,
        "used_after_library": 1086 * MIB,
        "allocator_after_library": 220 * MIB,
    }
    assert _core.reserve_from_readings(r) == {
        "context_bytes": 527 * MIB,
        "library_reserve_bytes": 66 * MIB,
    }
