"""The child process of ``test_preload_gpu.py``: started with imp-mem's
interposer in ``LD_PRELOAD``, it runs torch code inside
``imp_mem.torch._hook_region(region) + imp_mem._preload.routing()`` and
outside, pauses and resumes the region, and prints one JSON line of what it
saw (and a readable account on stderr). Run by hand:
``LD_PRELOAD=$(python -c 'import imp_mem._preload as p; print(p.library_path())')
python tests/gpu/_preload_torch_child.py``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import imp_mem
import imp_mem.torch as tm
from imp_mem import _core, _preload

MIB, GIB = 1 << 20, 1 << 30


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def main() -> dict:
    out: dict = {"loaded": _preload.loaded(), "card": torch.cuda.get_device_name(0)}
    say(f"card: {out['card']}; torch {torch.__version__}; interposer loaded: {out['loaded']}")
    torch.ones(1, device="cuda")  # the context, outside any region
    backend = imp_mem.VmmBackend(device=0)
    pool = _core.ActivationPool(backend, 8 * GIB, strict=True, growable=True)
    _core.add_hook_region(pool, device=0)

    def in_region(t: torch.Tensor) -> bool:
        return pool.base <= t.data_ptr() < pool.base + pool.capacity

    before = pool.stats()
    if not out["loaded"]:
        try:
            with tm._hook_region(pool), _preload.routing():
                pass
        except imp_mem.BackendUnavailable as e:
            out["refused"] = str(e)
        return out

    hooks0 = _core.hook_stats()
    with tm._hook_region(pool), _preload.routing():
        torch.manual_seed(0)
        w = torch.randn(64 * MIB, device="cuda")  # 256 MiB
        a = torch.randn(2048, 2048, device="cuda")
        b = torch.randn(2048, 2048, device="cuda")
        c = a @ b  # cuBLAS, its workspace made here at the first GEMM
        torch.cuda.synchronize()
    inside = pool.stats()
    out["inside_in_region"] = [in_region(t) for t in (w, a, b, c)]
    out["region_allocated_growth"] = inside["allocated"] - before["allocated"]
    out["region_live"] = inside["live"]
    out["hook_mallocs"] = _core.hook_stats()["malloc_ok"] - hooks0["malloc_ok"]
    say(
        f"inside routing: w, a, b, c in the region: {out['inside_in_region']}; region "
        f"allocated +{out['region_allocated_growth'] / MIB:.0f} MiB in {inside['live']} "
        f"segment(s) ({out['hook_mallocs']} hook mallocs)"
    )
    ref_c = (a.double().cpu() @ b.double().cpu()).float()
    out["gemm_inside_ok"] = bool(torch.allclose(c.cpu(), ref_c, rtol=1e-3, atol=1e-2))

    # torch keeps what it got inside in its cache and would serve a later
    # allocation outside from it: the preload mode's user empties the cache
    # on leaving (as with torch_memory_saver's), live segments stay.
    torch.cuda.empty_cache()
    # Outside: bigger than anything torch cached inside, so a new segment.
    outside = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    outside.fill_(7)
    x, y = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    z = x @ y
    torch.cuda.synchronize()
    out["outside_in_region"] = in_region(outside) or in_region(z)
    out["outside_region_growth"] = pool.stats()["allocated"] - inside["allocated"]
    say(
        f"outside routing: a 512 MiB tensor in the region: {in_region(outside)}; region "
        f"grew by {out['outside_region_growth']} bytes"
    )

    expect_w, expect_c = w.cpu(), c.cpu()
    torch.cuda.synchronize()
    free0 = imp_mem.cuda_mem_get_info(0)[0]
    t0 = time.perf_counter()
    copied = pool.pause(cpu_backup=True)
    t1 = time.perf_counter()
    free_paused = imp_mem.cuda_mem_get_info(0)[0]
    pool.resume()
    t2 = time.perf_counter()
    out["paused_copied"] = copied
    out["freed_while_paused"] = free_paused - free0
    out["bytes_kept"] = bool(torch.equal(w.cpu(), expect_w) and torch.equal(c.cpu(), expect_c))
    out["same_addresses"] = in_region(w) and in_region(c)
    say(
        f"pause: {copied / MIB:.0f} MiB to pinned host in {t1 - t0:.3f} s, device free "
        f"+{out['freed_while_paused'] / MIB:.0f} MiB; resume in {t2 - t1:.3f} s; bytes "
        f"kept: {out['bytes_kept']}"
    )
    with tm._hook_region(pool), _preload.routing():
        d = a @ b
        torch.cuda.synchronize()
    out["gemm_after_resume_ok"] = bool(torch.allclose(d.cpu(), expect_c, rtol=1e-5, atol=1e-5))
    out["outside_intact"] = bool((outside == 7).all().item()) and bool(
        torch.allclose(z.cpu(), x.cpu() @ y.cpu(), rtol=1e-3, atol=1e-2)
    )

    # torch frees its segments (outside any routing scope): home to imp-mem.
    del w, a, b, c, d
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    out["region_live_after_empty_cache"] = pool.stats()["live"]
    hooks = _core.hook_stats()
    out["hook_malloc_ok"] = hooks["malloc_ok"] - hooks0["malloc_ok"]
    out["hook_free_ok"] = hooks["free_ok"] - hooks0["free_ok"]
    out["hook_misuse"] = {
        k: v
        for k, v in hooks.items()
        if k in ("foreign_frees", "double_frees", "wrong_device", "panics", "ooms") and v
    }
    say(
        f"after empty_cache: {out['hook_free_ok']} of {out['hook_malloc_ok']} segments freed "
        f"home (torch's cudaFree outside routing); region live segments "
        f"{out['region_live_after_empty_cache']}; hook misuse counters {out['hook_misuse']}"
    )
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
