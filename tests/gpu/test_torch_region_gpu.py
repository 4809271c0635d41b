"""``imp_mem.torch`` regions on a GPU (issue 24, the trainer's side of RL
colocation): torch allocations made inside ``region(backend, tag)`` land in
the region's tier; ``pause(tag)`` gives the device memory back (measured
with ``cuda_mem_get_info``) and ``resume(tag)`` brings it back at the same
addresses with the same bytes (``cpu_backup=True``), while code outside
the region keeps torch's own allocator. Also: the second pause reuses the
pinned buffer; a resume the device cannot hold raises OutOfMemory and can
be retried.

Skipped where no CUDA device exists; needs torch. Run:
``pytest -m gpu tests/gpu/test_torch_region_gpu.py``.
"""

from __future__ import annotations

import time

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
tm = pytest.importorskip("imp_mem.torch")

MIB = 1 << 20
GIB = 1 << 30
# Driver bookkeeping and the VMM handle cache (two 64 MiB chunks by default)
# may move between readings.
SLACK = 192 * MIB


@pytest.fixture
def backend():
    b = imp_mem.VmmBackend(device=0)
    yield b
    for tag in list(tm.regions()):
        tm.release_region(tag)


def _free() -> int:
    torch.cuda.synchronize()
    return imp_mem.cuda_mem_get_info(0)[0]


def test_a_region_pauses_and_resumes_its_tensors_at_the_same_addresses(backend):
    with tm.region(backend, "train", capacity=2 * GIB):
        torch.manual_seed(0)
        w = torch.randn(64 * MIB // 4, device="cuda")  # 64 MiB
        g = torch.randn(256, 1024, device="cuda")
    outside = torch.randn(1024, device="cuda")
    r = tm.regions()["train"]
    assert r.activations.base <= w.data_ptr() < r.activations.base + r.activations.capacity
    assert not (
        r.activations.base <= outside.data_ptr() < r.activations.base + r.activations.capacity
    ), "torch code outside the region used it"
    expected_w, expected_g = w.clone().cpu(), g.clone().cpu()
    ptrs = (w.data_ptr(), g.data_ptr())

    free0 = _free()
    t0 = time.perf_counter()
    copied = tm.pause("train")
    pause_s = time.perf_counter() - t0
    free1 = _free()
    assert copied >= w.numel() * 4 + g.numel() * 4
    assert free1 - free0 >= 2 * GIB - SLACK, (free0, free1)
    assert r.activations.asleep == 1

    t0 = time.perf_counter()
    tm.resume("train")
    resume_s = time.perf_counter() - t0
    free2 = _free()
    assert abs(free0 - free2) <= SLACK, (free0, free2)
    assert (w.data_ptr(), g.data_ptr()) == ptrs
    assert torch.equal(w.cpu(), expected_w)
    assert torch.equal(g.cpu(), expected_g)
    # The region goes on serving torch, at its old addresses.
    with tm.region(backend, "train"):
        w.add_(1)
        x = torch.empty(MIB, device="cuda")
    assert torch.equal(w.cpu(), expected_w + 1)
    # x's segment made the live set larger: the next pause takes a larger
    # buffer, and the pause after it copies into that same buffer.
    tm.pause("train")
    tm.resume("train")
    host = r.activations.host_bytes
    tm.pause("train")
    tm.resume("train")
    assert r.activations.host_bytes == host
    assert torch.equal(w.cpu(), expected_w + 1)
    print(f"pause {copied / pause_s / 1e9:.1f} GB/s, resume {copied / resume_s / 1e9:.1f} GB/s")
    del w, g, x, outside


def test_a_resume_the_device_cannot_hold_is_refused_and_retried(backend):
    with tm.region(backend, "train", capacity=1 * GIB):
        w = torch.full((MIB,), 3.0, device="cuda")
    tm.pause("train")
    # Something else (a rollout engine) takes nearly all the device.
    free = _free()
    hog = torch.empty(free - 256 * MIB, dtype=torch.uint8, device="cuda")
    with pytest.raises(imp_mem.OutOfMemory):
        tm.resume("train")
    assert tm.regions()["train"].activations.asleep == 1
    del hog
    torch.cuda.empty_cache()
    tm.resume("train")
    assert torch.equal(w.cpu(), torch.full((MIB,), 3.0))
    del w


def test_without_cpu_backup_the_addresses_stay_and_the_bytes_go(backend):
    with tm.region(backend, "rollout", capacity=256 * MIB, cpu_backup=False):
        w = torch.ones(MIB, device="cuda")
    ptr = w.data_ptr()
    assert tm.pause("rollout") == 0
    assert tm.regions()["rollout"].activations.host_bytes == 0
    tm.resume("rollout")
    assert w.data_ptr() == ptr
    w.fill_(2.0)  # the memory is mapped again and usable
    assert torch.equal(w.cpu(), torch.full((MIB,), 2.0))
    del w
