"""Several models on one GPU across processes: the device ledger.

Each process joins the device's ledger as a tenant with a floor (what its
plan must always have) and a cap; what it commits is granted against the
others' shares. A tenant whose floor does not fit is refused up front with
a `PlanFailure` naming every tenant, and a process that dies (SIGKILL
included) has its share reaped by the next one to look.

    python examples/two_tenants.py

Runs on a ledger of its own in a temporary directory ("example-gpu", 1 GiB),
so it needs no GPU; an engine on a real device joins the same way
(`Engine(..., shared=SharedGPU(cap="60GiB"))`), keyed by the GPU's UUID.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time

import imp_mem
from imp_mem import cli

DEVICE, BUDGET = "example-gpu", "1GiB"
MIB = 1 << 20


def tenant_a(ledger_dir: str, ready) -> None:
    """Another process: a model that grows its KV cache to 600 MiB and
    serves until it is killed (at most a minute)."""
    os.environ["IMP_MEM_LEDGER_DIR"] = ledger_dir
    me = imp_mem.DeviceLedger(DEVICE, BUDGET).join("model-a", "300MiB", BUDGET)
    me.grow("600MiB")
    ready.set()
    time.sleep(60)


def main() -> int:
    with tempfile.TemporaryDirectory() as ledger_dir:
        os.environ["IMP_MEM_LEDGER_DIR"] = ledger_dir
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        child = ctx.Process(target=tenant_a, args=(ledger_dir, ready))
        child.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("model-a did not join the ledger within 60 s")
            led = imp_mem.DeviceLedger(DEVICE, BUDGET)
            me = led.join("model-b", "200MiB", BUDGET)
            print(f"model-b joined beside model-a: {me.headroom() // MIB} MiB it may grow into")
            try:
                led.join("model-c", "600MiB", BUDGET)
            except imp_mem.PlanFailure as err:
                print(f"model-c refused up front ({err.kind}): {err}")
            else:
                raise AssertionError("a floor that does not fit was admitted")
            cli.main(["ledger", "--once"])
            os.kill(child.pid, signal.SIGKILL)  # model-a dies without a word
            child.join(10)
            me.grow("700MiB")  # the look reaps model-a: its 600 MiB are free again
            names = [t["name"] for t in led.tenants()]
            assert names == ["model-b"], names
            held = me.record()["committed"] // MIB
            print(f"model-a killed and reaped; model-b now holds {held} MiB")
        finally:
            if child.is_alive():
                child.kill()
            child.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
