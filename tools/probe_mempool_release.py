"""Does torch give a *live* ``MemPool``'s cached free segments back when the
pool's allocator returns null? (GPU; the scope mode's question, issue 28.)

A scope-mode tier (:func:`imp_mem.torch.serve`, ``mode="scope"``) is
filled with six 30 MiB tensors, frozen at that high-water, and the tensors
are dropped: torch keeps their segments cached in the pool. A 100 MiB
tensor then needs a new segment the frozen tier cannot hold unless torch
hands the cached ones back. Each case runs in a fresh process, once with
torch's default settings and once with ``max_split_size_mb`` set (which
turns on torch's release of "oversize" cached blocks before its full
release). Printed per case: whether the 100 MiB tensor was made, the
tier's live bytes before and after, torch's reserved bytes.

    python tools/probe_mempool_release.py
"""

from __future__ import annotations

import json
import subprocess
import sys

MIB = 1 << 20


def child(max_split: int) -> dict:
    import torch

    import imp_mem.torch as imt

    if max_split:
        torch.cuda.memory._set_allocator_settings(f"max_split_size_mb:{max_split}")
    served = imt.serve(mode="scope", margin=0)
    act = served.system.activations
    with served.scope():
        held = [torch.empty(30 * MIB, dtype=torch.uint8, device="cuda") for _ in range(6)]
    torch.cuda.synchronize()
    act.freeze(0)
    del held
    before = act.stats()["allocated"]
    reserved_before = torch.cuda.memory_reserved()
    made, error = False, None
    with served.scope():
        try:
            big = torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            made = True
            del big
        except torch.OutOfMemoryError as exc:
            error = str(exc).split("\n")[0][:200]
    return {
        "max_split_size_mb": max_split,
        "tier_capacity_mib": act.capacity / MIB,
        "made_100_mib": made,
        "tier_live_before_mib": before / MIB,
        "tier_live_after_mib": act.stats()["allocated"] / MIB,
        "torch_reserved_before_mib": reserved_before / MIB,
        "torch_reserved_after_mib": torch.cuda.memory_reserved() / MIB,
        "error": error,
        "torch": torch.__version__,
    }


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--child":
        print("RESULT " + json.dumps(child(int(argv[1]))), flush=True)
        return 0
    for max_split in (0, 21):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(max_split)], capture_output=True, text=True
        )
        rows = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        print(rows[0] if rows else f"case {max_split} failed: {proc.stderr[-2000:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
