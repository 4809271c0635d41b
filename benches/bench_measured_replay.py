"""The measured activations tier against the work it measured (issue 28),
on the fake backend: an allocation trace shaped like Hugging Face's
``generate()`` with a ``DynamicCache`` (each layer's K and V re-allocated
one token longer every step, beside the layer's temporaries), replayed
through ``imp_mem.torch.serve``'s tier the way a process would:

* the warm-up on a measuring tier, then ``begin_serving()`` (frozen at the
  high-water plus the margin) and the same work again;
* a second start, planned at the remembered size (not measuring), running
  the work twice.

Printed: the measured size and the fallbacks (acquisitions past the tier)
of each run; 0 everywhere is the goal. On the H200 the real generate()
(32 x 1024 + 64, Qwen3-0.6B's shapes) fell back 3 times a run at its
measured size before the tier listed its top block last.

    python benches/bench_measured_replay.py [--batch 32 --prompt 1024 --new 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import imp_mem
import imp_mem.torch as imt

MIB = 1 << 20


def trace(batch, prompt, new, layers=28, kv_heads=8, head_dim=128, hidden=1024, vocab=151936):
    """``[("a", id, bytes) | ("f", id)]`` of one greedy generate()."""
    ops: list[tuple] = []
    count = [0]

    def alloc(n):
        count[0] += 1
        ops.append(("a", count[0], n))
        return count[0]

    def free(i):
        ops.append(("f", i))

    def kv(tokens):
        return batch * kv_heads * tokens * head_dim * 2

    caches = [[0, 0] for _ in range(layers)]
    for step in range(new + 1):
        t = prompt if step == 0 else 1
        h = alloc(batch * t * hidden * 2)
        for layer in caches:
            x, q = alloc(batch * t * hidden * 2), alloc(batch * t * 16 * head_dim * 2)
            k, v = alloc(kv(t)), alloc(kv(t))
            for c in range(2):  # torch.cat: the longer tensor, then the old one freed
                longer = alloc(kv(prompt + step))
                if layer[c]:
                    free(layer[c])
                layer[c] = longer
            free(k)
            free(v)
            att = alloc(batch * t * 16 * head_dim * 2)
            free(q)
            up, gate = alloc(batch * t * 3072 * 2), alloc(batch * t * 3072 * 2)
            free(up)
            out = alloc(batch * t * hidden * 2)
            free(gate)
            free(x)
            free(att)
            free(h)
            h = out
        logits = alloc(batch * vocab * 4)
        free(logits)
        free(h)
    for layer in caches:
        free(layer[0])
        free(layer[1])
    return ops


def run(tier, ops) -> int:
    """Replays `ops`; returns the fallbacks it took."""
    before = tier.stats()["fallbacks_total"]
    live = {}
    for op in ops:
        if op[0] == "a":
            live[op[1]] = tier.allocate(op[2])
        else:
            tier.free(live.pop(op[1]))
    return tier.stats()["fallbacks_total"] - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--weights-mib", type=int, default=1200)
    args = ap.parse_args()
    ops = trace(args.batch, args.prompt, args.new)
    cache = os.path.join(tempfile.mkdtemp(prefix="bench-measured-"), "measured.json")
    warnings.simplefilter("ignore", imp_mem.ImpMemWarning)

    def start():
        backend = imp_mem.FakeBackend(capacity="64GiB", backed=False, strict=False)
        served = imt.serve(
            backend=backend, budget="64GiB", fingerprint={"trace": vars(args)}, cache_path=cache
        )
        tier = served.system.activations
        tier.allocate(args.weights_mib * MIB)  # the weights, held throughout
        return served, tier

    served, tier = start()
    warm = run(tier, ops)
    served.begin_serving()
    (line,) = served.system.measured()
    print(f"{len(ops)} allocations and frees; measured {line['high_water'] / MIB:.0f} MiB, "
          f"frozen at {line['size'] / MIB:.0f} MiB")  # fmt: skip
    print(f"first start:  warm-up fallbacks {warm}, served run {run(tier, ops)}")
    second, tier2 = start()
    assert not second.measuring, "the second start plans the remembered size"
    print(f"second start: run 1 fallbacks {run(tier2, ops)}, run 2 {run(tier2, ops)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
