"""The memory system end to end: plan a model, open its tiers, load, serve.

``MemorySystem`` itself is compiled (``imp_mem._core``); every rule —
the open order, the clean failure, the budget, the report, the metrics —
lives in the Rust core (``crates/imp-mem-core/src/system/``). This module
holds :func:`run_demo`, the walk-through ``imp-mem demo`` prints.

Typical use::

    plan = imp_mem.plan_memory(plan_input)
    with imp_mem.MemorySystem(backend, plan, context=measured_context) as system:
        weights = system.weights_arena        # T1: load the weights here
        ...
        system.begin_serving()                # nothing is acquired after this
        kv = system.kv_manager()              # paged KV on the system's KV pool
        kv.admit(seq_id, prompt_tokens)
        ...
        system.step(fence)                    # once per engine step: the KV pool's shrink
        print(system.mem_report_text())       # plan vs actual, attribution
        body = system.metrics()               # Prometheus text for /metrics
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from imp_mem._core import Features, Limits, MemorySystem, ModelShape, PlanInput, plan_memory
from imp_mem._format import human_bytes

__all__ = ["DEMO_METRICS", "MemorySystem", "run_demo"]

# The metric families the demo prints: per-tier reserved / live, the KV
# pool's blocks, and criterion 3's counter.
DEMO_METRICS = (
    "imp_mem_tier_committed_bytes",
    "imp_mem_tier_live_bytes",
    "imp_mem_pool_live_blocks",
    "imp_mem_pool_capacity_blocks",
    "imp_mem_steady_state_allocations_total",
    "imp_mem_attribution_ratio",
)


# The demo's requests in flight at once; an older one finishes first.
IN_FLIGHT = 6


def _load_and_serve(
    system: MemorySystem,
    shape: ModelShape,
    steps: int,
    out,
    max_seq_len: int | None = None,
    report: dict | None = None,
) -> None:
    """LOADING: the weights go into T1 and a workspace into T2; SERVING: each
    step admits a request through a KVCacheManager on the system's KV pool
    (every prompt opens with the same system prompt, so later requests hit
    its cached blocks), prefills and decodes a token, runs a forward pass on
    scratch marks, retires the oldest request into the prefix cache, and
    steps the system (the KV pool's hysteretic shrink). The report is
    printed with requests in flight. Every handle dies with this frame, so
    the system can release everything when it closes."""
    weights = system.weights_arena
    tensors = shape.num_layers + 2  # layers, embeddings, LM head
    chunk = weights.capacity // tensors // 256 * 256
    loaded = [weights.take(chunk) for _ in range(tensors)]
    out(
        f"[{system.phase}] loaded {len(loaded)} weight tensors into T1: "
        f"{human_bytes(weights.used)} of {human_bytes(weights.capacity)}"
    )
    engine = system.engine_arena
    if engine is not None:
        engine.take(min(32 << 20, engine.capacity))
        out(f"[{system.phase}] T2 workspace: {human_bytes(engine.used)}")

    system.begin_serving()
    out(f"[{system.phase}] serving {steps} steps; the tiers are fixed from here on")
    scratch = system.scratch
    # A model whose every layer slides (Mistral-7B-v0.1) keeps its KV in
    # the SWA pool alone; the manager's full tables are ids without memory.
    pool_name, pool = "KV pool", system.kv_pool
    planned = system.plan.kv_blocks
    if pool is None:
        pool_name, pool = "SWA pool", system.swa_pool
        planned = (system.plan.swa or {}).get("blocks", 0)
    kv = system.kv_manager()
    block = kv.block_size
    per_sequence = system.plan.kv["blocks_per_sequence"]
    # No request is longer than the limit it was planned for, counting its
    # decoded token (the blocks round the limit up).
    longest = (max_seq_len or per_sequence * block) - 1
    # A system prompt of an eighth of a sequence, shared by every request.
    shared = list(range(min(max(1, per_sequence // 8) * block, max(0, longest - 1))))
    running: list[int] = []
    start_capacity = pool.capacity
    decommitted = 0
    for step in range(steps):
        # Requests of a quarter to a whole sequence; at most IN_FLIGHT at once.
        tokens = min(max(1, per_sequence * (step % 4 + 1) // 4) * block, longest)
        own = (step + 1) << 20  # this request's own token ids
        prompt = shared + list(range(own, own + max(1, tokens - len(shared))))
        cached = kv.admit(step, prompt)
        kv.cache_computed(step, len(prompt))  # prefilled: its blocks serve others now
        kv.append(step, [own - 1])  # one decoded token
        running.append(step)
        out(f"  request {step}: {len(prompt)} tokens, {cached} served from the prefix cache")
        if scratch is not None:
            with scratch.mark() as forward:
                forward.take(scratch.capacity // 4)  # attention
                with scratch.mark() as ffn:
                    ffn.take(scratch.capacity // 4)
        if len(running) > IN_FLIGHT:
            kv.free(running.pop(0))
        decommitted += system.step()
    stats = kv.stats()
    out(
        f"  {pool_name}: {pool.live} blocks live, capacity {start_capacity} -> {pool.capacity} of "
        f"{planned} planned (growth commits inside the reservation; it is not "
        f"an acquisition); scratch high-water {human_bytes(scratch.high_water if scratch else 0)}"
    )
    out(
        f"  KV manager: {stats['sequences']} sequences in flight (at most {IN_FLIGHT}; "
        f"{steps - stats['sequences']} finished, their blocks kept in the prefix cache), "
        f"{stats['cached']} cached blocks, "
        f"prefix hits {stats['prefix_hit_blocks']} of {stats['prefix_query_blocks']} blocks; "
        f"system.step() decommitted {human_bytes(decommitted)}"
    )
    kv.check_invariants()
    system.check()
    if report is not None:
        report["kv_manager"] = stats
        report["longest_request_tokens"] = longest + 1
        report["mem_report"] = system.mem_report()
    out("")
    out(system.mem_report_text())
    out("metrics (excerpt):")
    for line in system.metrics().splitlines():
        if line.startswith(DEMO_METRICS) and (
            "steady_state" not in line or 'tag="kv_cache"' in line
        ):
            out(f"  {line}")
    for seq in running:
        kv.free(seq)


def run_demo(
    backend: Any = None,
    out: Callable[[str], Any] = print,
    *,
    model: str = "llama-3-8b",
    max_batch: int = 16,
    max_seq_len: int = 8192,
    steps: int = 8,
    context: int | None = None,
    library_reserve: int | None = None,
    report: dict | None = None,
) -> int:
    """Plans ``model`` (a preset) for the backend's budget, opens the
    memory system, loads the weights into T1, serves ``steps`` simulated
    steps, prints the memory report and a few metrics, and closes. The
    backend defaults to ``FakeBackend(capacity="80GiB", backed=False)``.
    ``context`` / ``library_reserve`` are measured charges (default: the
    H200 figures the planner uses). No request is longer than
    ``max_seq_len``. A ``report`` dict receives the plan, the KV manager's
    counters and the memory report. Returns 0."""
    import imp_mem
    from imp_mem._presets import preset
    from imp_mem._vision import tower_bytes

    if backend is None:
        backend = imp_mem.FakeBackend(capacity="80GiB", backed=False)
    config = preset(model)
    shape = ModelShape.from_hf_config(config)
    # The KV pool holds max_batch full sequences or the plan fails, as
    # `imp-mem plan` plans it: the header's "N x L tokens" is what is served.
    plan = plan_memory(
        PlanInput(
            shape,
            Limits(max_batch, max_seq_len),
            Features(vision_tower_bytes=tower_bytes(config)),
            budget=backend.budget,
            context=context,
            library_reserve=library_reserve,
        )
    )
    out(
        f"backend: {backend.kind}, device {backend.device}, capacity "
        f"{human_bytes(backend.capacity)}, budget {human_bytes(backend.budget)}"
    )
    out(f"plan: {model}, {max_batch} x {max_seq_len} tokens, budget {human_bytes(plan.budget)}")
    out(plan.table())
    if report is not None:
        import json

        report["plan"] = json.loads(plan.to_json())
    with MemorySystem(backend, plan, context=context, library_reserve=library_reserve) as system:
        out(f"[{system.phase}] opened in plan order: {' -> '.join(system.tiers)}")
        _load_and_serve(system, shape, steps, out, max_seq_len, report)
    out(f"closed: every tier released, backend live = {backend.live} B")
    return 0
