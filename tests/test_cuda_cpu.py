"""The CUDA backends on a machine without CUDA (the measured-reserve
cache, which needs no GPU either, is tested in test_reserve.py)."""

from __future__ import annotations

import pytest

import imp_mem

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
