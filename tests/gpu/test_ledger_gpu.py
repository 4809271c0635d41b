"""Issue 27 on a GPU: two processes' engines share the device through the
ledger keyed by its UUID; a VmmBackend commits only what the ledger grants,
and the device's free memory follows the ledger's books. Skipped where no
CUDA device exists."""

from __future__ import annotations

import gc

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_a_vmm_backend_on_the_ledger_commits_what_it_grants(tmp_path):
    torch = pytest.importorskip("torch")
    from imp_mem.engine.shared import device_key

    vmm = imp_mem.VmmBackend(0)
    key = device_key(vmm, True)
    assert key.startswith("GPU-")
    led = imp_mem.DeviceLedger(key, "1GiB", str(tmp_path))
    other = led.join("other", "512MiB", "1GiB")
    me = led.join("me", "64MiB", "1GiB")
    vmm.attach_ledger(me)
    region = vmm.acquire_growable("1GiB", 0, tag="kv_cache")
    free0 = torch.cuda.mem_get_info(0)[0]
    region.commit(512 * MIB)
    assert me.record()["committed"] == 512 * MIB
    with pytest.raises(imp_mem.OutOfMemory) as info:
        region.commit(514 * MIB)
    assert info.value.ledger_headroom == 0
    # The device really holds what the ledger says (within the handle cache).
    used = free0 - torch.cuda.mem_get_info(0)[0]
    assert used >= 512 * MIB
    region.decommit(0)
    vmm.trim_cache()
    assert me.record()["committed"] == 0
    other.grow("900MiB")
    del region
    gc.collect()
    vmm.detach_ledger()
