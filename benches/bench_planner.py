"""One plan from Python, against a plain-Python peer computing the same formula.

    python benches/bench_planner.py            # needs the wheel installed (release build)

The peer is the planner's success-path arithmetic for a dense GQA model,
written out in plain Python (no imp-mem): KV bytes per token, blocks, T4
scratch, T2 workspaces, each charge rounded up to a MiB, the total. The bench
first checks that both give the same total, then times each and prints the
ratio. The target is one plan in <= 50 us.
"""

from __future__ import annotations

import statistics
import sys
import time

import imp_mem
from imp_mem._presets import preset

MIB = 1 << 20
TARGET_US = 50.0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def mib_up(n: int) -> int:
    return ceil_div(n, MIB) * MIB


def peer_plan(cfg: dict, weights_bytes: int, batch: int, seq: int, tp: int, budget: int) -> dict:
    """The planner's arithmetic for a dense GQA model, in plain Python."""
    layers = cfg["num_hidden_layers"]
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", hidden // heads)
    act = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.get("torch_dtype", "bfloat16")]
    block = 16
    kv_per_token = layers * ceil_div(kv_heads, tp) * 2 * head_dim * act
    blocks_per_seq = ceil_div(seq, block)
    target = batch * blocks_per_seq
    decode = batch
    forward = max(min(8192, batch * seq), decode)
    q_dim = ceil_div(heads * head_dim, tp)
    kv_dim = ceil_div(kv_heads, tp) * 2 * head_dim
    ffn = ceil_div(cfg["intermediate_size"], tp)
    charges = {
        "weights": mib_up(ceil_div(weights_bytes, tp)),
        "kv_pool": mib_up(kv_per_token * block * target),
        "scratch": mib_up(forward * (2 * hidden + max(2 * q_dim + kv_dim, 2 * ffn)) * act),
        "engine_persistent": mib_up(
            32 * MIB
            + decode * ceil_div(cfg["vocab_size"], tp) * 4
            + batch * blocks_per_seq * 4
            + decode * hidden * act * 4
        ),
        "context": mib_up(imp_mem._core.H200_CONTEXT_BYTES),
        "library_reserve": mib_up(imp_mem._core.H200_LIBRARY_RESERVE_BYTES),
    }
    total = sum(charges.values())
    if total > budget:
        raise MemoryError(f"over by {total - budget}")
    return {"charges": charges, "total": total, "kv_blocks": target, "headroom": budget - total}


def best_us(fn, number: int, repeat: int = 7) -> float:
    """Median over `repeat` runs of the mean time of `number` calls, in us."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter_ns() - start) / number / 1000)
    return statistics.median(runs)


def main() -> int:
    cfg = preset("llama-3-8b")
    shape = imp_mem.ModelShape.from_hf_config(cfg)
    batch, seq, tp, budget = 32, 8192, 1, 80 << 30
    plan_input = imp_mem.PlanInput(shape, imp_mem.Limits(batch, seq), budget=budget, tp=tp)

    ours = imp_mem.plan_memory(plan_input)
    peer = peer_plan(cfg, shape.weights_bytes, batch, seq, tp, budget)
    assert ours.total() == peer["total"], (ours.total(), peer["total"])
    assert ours.kv_blocks == peer["kv_blocks"]

    number = 20000
    t_plan = best_us(lambda: imp_mem.plan_memory(plan_input), number)
    t_peer = best_us(lambda: peer_plan(cfg, shape.weights_bytes, batch, seq, tp, budget), number)

    def build_and_plan():
        inp = imp_mem.PlanInput(shape, imp_mem.Limits(batch, seq), budget="80GiB", tp=tp)
        return imp_mem.plan_memory(inp)

    t_build = best_us(build_and_plan, number // 4)

    failing = imp_mem.PlanInput(shape, imp_mem.Limits(batch, seq), budget="40GiB")

    def fail():
        try:
            imp_mem.plan_memory(failing)
        except imp_mem.PlanFailure:
            pass

    t_fail = best_us(fail, number // 10)

    print(f"Llama-3-8B, {batch} x {seq} tokens, tp {tp}, 80 GiB (same total: {ours.total():,} B)")
    print(f"{'case':<52}{'imp-mem':>10}{'peer':>10}{'ratio':>8}")
    print(
        f"{'plan_memory(input) vs plain-Python arithmetic':<52}{t_plan:>8.2f}us{t_peer:>8.2f}us"
        f"{t_peer / t_plan:>7.2f}x"
    )
    print(f"{'PlanInput(...) + plan_memory':<52}{t_build:>8.2f}us")
    print(f"{'failing plan: report + 3 levers, raised':<52}{t_fail:>8.2f}us")
    ok = t_plan <= TARGET_US and t_build <= TARGET_US
    print(f"target: one plan <= {TARGET_US:.0f} us -> {'met' if ok else 'MISSED'}")
    print(
        "(ratio = peer time / imp-mem time; the peer computes only the dense success path,"
        " imp-mem the full plan with every charge labelled)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
