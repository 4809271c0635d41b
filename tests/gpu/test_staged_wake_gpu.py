"""Staged wake, the sleep host pinned ahead and a wake under pressure on the
H200's VMM backend (issue 24).

* ``pin_sleep_host()`` on a background thread while T1 is filled holds
  exactly the plan's T1 weights bytes (no power-of-two rounding); the first
  ``sleep(1)`` then copies into that buffer (no new pinning: it runs near
  the copy rate) and ``wake()`` brings T1's bytes back.
* ``wake("weights")`` takes only T1's memory back (the KV pool still sleeps,
  measured with ``cuda_mem_get_info``), then ``wake("kv_cache")`` the rest;
  every address is the same.
* A wake while something else (a trainer's torch cache) holds the memory
  raises ``OutOfMemory`` with ``needed``, ``device_free`` (read from the
  device) and ``still_asleep``; the tiers still sleep, and once the memory is
  free again the retry wakes them with T1's bytes intact.

Skipped where no CUDA device exists; needs torch. Run:
``pytest -m gpu tests/gpu/test_staged_wake_gpu.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

MIB = 1 << 20
GIB = 1 << 30
# The VMM handle cache (two 64 MiB chunks by default) and driver bookkeeping.
SLACK = 192 * MIB

# The shape the sleep tests plan with.
from test_sleep_gpu import SHAPE  # noqa: E402


def _plan(weights: int):
    return imp_mem.plan_memory(
        imp_mem.PlanInput(
            imp_mem.ModelShape.from_hf_config(SHAPE).with_weights_bytes(weights),
            imp_mem.Limits(8, 4096),
            imp_mem.Features(scratch_bytes=64 * MIB, engine_persistent_bytes=64 * MIB),
            budget=weights + 4 * GIB,
            context=512 * MIB,
            library_reserve=0,
        )
    )


def _free() -> int:
    torch.cuda.synchronize()
    return imp_mem.cuda_mem_get_info(0)[0]


def _fill(system):
    t1 = system.weights_arena
    span = t1.take(t1.capacity)
    w = torch.from_dlpack(span.view(torch.uint8, (t1.capacity,)))
    w.random_(0, 255)
    return span, w


def test_the_sleep_host_pinned_ahead_makes_the_first_sleep_a_copy():
    system = imp_mem.MemorySystem(imp_mem.VmmBackend(device=0), _plan(2 * GIB))
    result: dict = {}
    pinner = threading.Thread(target=lambda: result.update(held=system.pin_sleep_host()))
    pinner.start()
    span, w = _fill(system)  # the weight load goes on meanwhile
    pinner.join()
    assert result["held"] == system.plan.sleep_host == system.weights_arena.capacity
    assert system.mem_report(device=False)["sleep_host"] == result["held"]
    expected = w[::4096].clone()

    host = torch.empty(w.numel(), dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(w)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    del host

    t0 = time.perf_counter()
    out = system.sleep(1)
    sleep_s = time.perf_counter() - t0
    assert out["host_bytes"] == w.numel()
    assert system.mem_report(device=False)["sleep_host"] == result["held"], "pinned again"
    print(f"first sleep {sleep_s:.3f} s, raw copy {copy_s:.3f} s ({copy_s / sleep_s:.2f}x)")
    assert sleep_s < 3 * copy_s + 0.1, (sleep_s, copy_s)
    system.wake()
    assert torch.equal(w[::4096], expected)
    assert system.release_sleep_host() == result["held"]
    del w, span
    system.close()


def test_a_staged_wake_takes_back_the_weights_first():
    system = imp_mem.MemorySystem(imp_mem.VmmBackend(device=0), _plan(GIB))
    span, w = _fill(system)
    expected = w[::4096].clone()
    kv = system.kv_pool.allocate()
    kv_address = kv.span().address
    kv.release()
    address = span.address
    system.sleep(1)
    free0 = _free()
    assert system.wake("weights") == ["model_resident"]
    free1 = _free()
    assert system.asleep == {"kv_pool": 1}
    t1_bytes = system.weights_arena.capacity
    assert abs((free0 - free1) - t1_bytes) <= SLACK, (free0, free1, t1_bytes)
    assert torch.equal(w[::4096], expected)
    assert system.wake(["kv_cache"]) == ["kv_pool"]
    kv = system.kv_pool.allocate()
    assert kv.span().address == kv_address
    kv.release()
    assert span.address == address
    del w, span
    system.close()


def test_a_wake_under_a_trainers_cache_says_what_it_needs_and_retries():
    system = imp_mem.MemorySystem(imp_mem.VmmBackend(device=0), _plan(2 * GIB))
    span, w = _fill(system)
    expected = w[::4096].clone()
    system.sleep(1)
    hog = torch.empty(_free() - 256 * MIB, dtype=torch.uint8, device="cuda")
    with pytest.raises(imp_mem.OutOfMemory) as info:
        system.wake()
    err = info.value
    assert err.needed >= 2 * GIB
    assert err.device_free is not None and err.device_free < err.needed
    assert "model_resident" in err.still_asleep
    assert "call wake again" in str(err)
    assert "model_resident" in system.asleep
    del hog
    torch.cuda.empty_cache()
    system.wake()
    assert system.asleep == {}
    assert torch.equal(w[::4096], expected)
    del w, span
    system.close()
