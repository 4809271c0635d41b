"""The reference engine on the GPU (issue 13): criteria 3, 4, 6 and 8, V8 on
the recorded load, and the engine's greedy tokens against Hugging Face.

One random-weight checkpoint per shape (Qwen3-0.6B, and its sliding-window
variant `swa_config`) is written once per module; one engine per shape
(`VmmBackend`, strict: an acquisition while serving would raise) serves
the workloads of several tests.

* Criterion 3: no acquisition while serving, by imp-mem's counter over
  the whole of serving and by independent counts over a second workload
  (the first one warms what torch keeps lazily): torch's device allocations
  (`num_device_alloc`), its allocator calls during decode-only steps
  (`allocation.all.allocated`, 0: the graphs replay over T2 tensors), and
  the device's free memory (`cuda_mem_get_info`).
* Criterion 4: after random arrivals and cancellations drain, only the
  engine's own sequences hold blocks; evicting the prefix cache brings the
  pools' live blocks back to their baseline.
* Criterion 6: >= 99 % of the device memory in use is attributed, in a fresh
  child process (nothing else of this process on the device), with the
  child's CUDA context measured from outside.
* Criterion 8: peak memory per configuration against
  `engine_peak_thresholds.json`; `IMP_MEM_UPDATE_THRESHOLDS=1` rewrites the
  file from this run (measured + 2 %).
* V8: the load's journal replays within the plan; with
  `IMP_MEM_RECORD_JOURNAL=1` it is written to `tests/data/` for CI.
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("safetensors")

from _device_plan import check_peak_thresholds, child_report, workload  # noqa: E402

from imp_mem.engine import journal  # noqa: E402
from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.config import qwen3_0_6b_config, swa_config  # noqa: E402
from imp_mem.engine.llm_engine import Engine  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"
MIB = 1 << 20
CONFIGS = {"qwen3_0_6b": qwen3_0_6b_config, "qwen3_0_6b_swa": swa_config}
ENGINE = {"max_batch": 32, "max_seq_len": 1024}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-ckpt")
    return {name: write_random_checkpoint(root / name, make()) for name, make in CONFIGS.items()}


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine(request, checkpoints):
    torch.cuda.reset_peak_memory_stats()
    backend = imp_mem.VmmBackend(device=0, strict=True)
    e = Engine(checkpoints[request.param], backend=backend, **ENGINE)
    e.name = request.param
    yield e
    e.close()


def decode_only_alloc_calls(e, batch=16, steps=8):
    """Torch allocator calls during decode-only steps (no admission)."""
    vocab = e.config.vocab_size
    rng = random.Random(3)
    reqs = [e.submit([rng.randrange(vocab) for _ in range(32)], steps + 4) for _ in range(batch)]
    e.step()  # admits and prefills them all, and decodes once
    assert all(not r.done for r in reqs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(steps):
        e.step()
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    e.run()
    return (after - before) / steps


def test_zero_acquisitions_while_serving(engine):
    e = engine
    assert str(e.system.phase) == "SERVING"
    assert e.use_graphs and e.graphs
    workload(e, 48, seed=1, cancel=0.02)  # warms torch's lazy state
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    free0, _ = imp_mem.cuda_mem_get_info(0)
    workload(e, 64, seed=2, cancel=0.02)
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    free1, _ = imp_mem.cuda_mem_get_info(0)
    steady = e.backend.stats()["steady_state_allocations_total"]
    print(
        f"\n{e.name}: imp-mem acquisitions while serving {steady}; torch device allocs "
        f"{stats1['num_device_alloc'] - stats0['num_device_alloc']}; device free "
        f"{free0 - free1:+d} B over the second workload"
    )
    assert sum(steady.values()) == 0
    assert e.system.mem_report()["steady_state_allocations_total"] == 0
    assert stats1["num_device_alloc"] == stats0["num_device_alloc"], "torch called cudaMalloc"
    # Exact but for kernel modules the driver loads at a kernel's first launch
    # (CUDA_MODULE_LOADING=LAZY, the default): a prompt length the first
    # workload did not have picks other GEMM kernels. The H200 runs of
    # 2026-12-01 (issue 13) saw 6 and 8 MiB with torch's num_device_alloc flat (above); an
    # allocation of any tier is a multiple of 2 MiB granules and would also
    # show in the counters.
    assert abs(free1 - free0) <= 16 * MIB, "the device's free memory moved while serving"
    calls = decode_only_alloc_calls(e)
    print(f"{e.name}: torch allocator calls per decode-only step: {calls}")
    assert calls == 0


def test_live_blocks_back_to_baseline_after_draining(engine):
    e = engine
    kv = e.kv
    kv.evict(kv.stats()["capacity"])
    base_full = e.system.kv_pool.live
    base_swa = e.system.swa_pool.live if e.sliding else 0
    reqs = workload(e, 96, seed=4, cancel=0.05)
    assert any(r.state.value == "cancelled" for r in reqs)
    assert any(r.state.value == "finished" for r in reqs)
    assert sorted(kv.sequences()) == sorted(e.engine_seqs)
    kv.evict(kv.stats()["capacity"])
    assert e.system.kv_pool.live == base_full
    if e.sliding:
        assert e.system.swa_pool.live == base_swa
    kv.check_invariants()
    e.system.check()


def test_greedy_tokens_match_hf_where_its_margin_is_decisive(engine, checkpoints):
    transformers = pytest.importorskip("transformers")
    e = engine
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints[e.name], dtype=torch.bfloat16
    ).cuda()
    hf.eval()
    try:
        rng = random.Random(5)
        vocab = e.config.vocab_size
        shared = [rng.randrange(vocab) for _ in range(160)]
        prompts = [
            shared[: 16 * (i % 8)] + [rng.randrange(vocab) for _ in range(300)] for i in range(32)
        ]
        # Two waves: the second's shared prefixes hit the first's blocks
        # (full attention; prefix caching is off with sliding layers).
        hits0 = e.scheduler.stats.prefix_hit_tokens
        reqs = [e.submit(p, 24) for p in prompts[:8]]
        e.step()
        reqs += [e.submit(p, 24) for p in prompts[8:]]
        cancelled = {reqs[3].seq_id, reqs[17].seq_id}
        while e.scheduler.has_work:
            e.step()
            for sid in list(cancelled):
                e.cancel(sid)
        if not e.sliding:
            assert e.scheduler.stats.prefix_hit_tokens > hits0
        checked = decisive = 0
        for r in reqs:
            if r.seq_id in cancelled and r.state.value == "cancelled":
                continue
            tokens = r.prompt + r.output
            with torch.no_grad():
                logits = hf(torch.tensor([tokens[:-1]], device="cuda")).logits[0].float()
            rows = logits[len(r.prompt) - 1 :]
            top2 = rows.topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            ok = rows.argmax(-1).cpu() == torch.tensor(r.output)
            sure = margin.cpu() > 0.2
            checked += len(r.output)
            decisive += int(sure.sum())
            assert ok[sure].all(), f"seq {r.seq_id}: a greedy token differs where HF is decisive"
        print(f"\n{e.name}: {decisive} of {checked} tokens decisive, all equal to HF's")
        assert decisive > checked // 4
    finally:
        del hf
        torch.cuda.empty_cache()


def measure_peak(e):
    """Peak device bytes of this configuration: imp-mem's backend peak plus
    torch's peak reserved, over a workload."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    workload(e, 32, seed=6)
    return {
        "imp_mem_peak": int(e.backend.stats()["peak"]),
        "torch_peak_reserved": int(torch.cuda.max_memory_reserved()),
    }


def test_peak_memory_within_the_checked_in_thresholds(engine):
    check_peak_thresholds(engine.name, measure_peak(engine), dict(ENGINE, model=engine.name))


def test_the_load_journal_replays_within_the_plan(checkpoints):
    backend = imp_mem.VmmBackend(device=0, strict=True)
    rows, plan, granularity = journal.record_engine_load(
        backend, checkpoints["qwen3_0_6b"], **ENGINE
    )
    result = journal.replay(rows, plan, granularity)
    assert result.ok, "\n".join(result.violations)
    assert result.peaks["weights"] > 1 << 30
    if os.environ.get("IMP_MEM_RECORD_JOURNAL"):
        journal.save(
            DATA / "engine_load_journal_gpu_qwen3_0_6b.json",
            rows,
            plan,
            granularity,
            f"VmmBackend on {torch.cuda.get_device_name()}, random-weight Qwen3-0.6B, "
            f"Engine({ENGINE}): load, warm-up, graph capture, two requests served",
        )


CHILD = r"""
import json, sys
import torch
import imp_mem
from imp_mem.engine.llm_engine import Engine

torch.zeros(1, device="cuda")  # this process's context, and torch's CUDA state
backend = imp_mem.VmmBackend(device=0, strict=True)
torch.cuda.synchronize()
print("ready", torch.cuda.memory_reserved(), flush=True)
context, other = (int(x) for x in sys.stdin.readline().split())
# The library reserve stays the plan's measured cuBLAS figure.
with Engine(sys.argv[1], backend=backend, max_batch=128, max_seq_len=2048,
            context=context) as e:
    e.generate([[1, 2, 3] * 40] * 8, 16)
    torch.cuda.synchronize()
    report = e.mem_report(other_processes=other)
    text = e.mem_report_text(other_processes=other)
print(json.dumps({"report": report, "text": text}), flush=True)
"""


def test_at_least_99_percent_of_device_memory_is_attributed(checkpoints):
    result = child_report(CHILD, str(checkpoints["qwen3_0_6b"]))
    device = result["report"]["device"]
    print("\n" + result["text"])
    assert device["attribution_pct"] >= 99.0, result["text"]
    assert device["attribution_pct"] <= 101.0, "attributed more than is in use"


def test_engine_on_the_imp_mem_torch_pool_allocates_nothing_while_serving(checkpoints):
    """torch's own allocations (prefill activations, the graphs' pool) in the
    activations tier through imp_mem.torch: planned from a measured warm-up,
    nothing acquired while serving, and the same greedy tokens as the engine
    on torch's own allocator."""
    import imp_mem.torch as imt
    from imp_mem.engine.memory import measure_torch_high_water

    path = checkpoints["qwen3_0_6b"]
    high = measure_torch_high_water(path, requests=48, **ENGINE)
    rng = random.Random(7)
    prompts = [
        [rng.randrange(1000, 100000) for _ in range(rng.randint(16, 300))] for _ in range(48)
    ]

    def tokens(e):
        reqs = [e.submit(p, 24) for p in prompts]
        e.run()
        return [list(r.output) for r in reqs]

    with Engine(path, backend=imp_mem.VmmBackend(device=0, strict=True), **ENGINE) as e:
        reference = tokens(e)
    backend = imp_mem.VmmBackend(device=0, strict=True)
    retired = imp_mem._core.hook_stats()["retired_pools"]  # earlier tests' leftovers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Engine(
            path,
            backend=backend,
            torch_pool="imp_mem",
            activation_bytes=int(high * 1.1) + 64 * MIB,
            **ENGINE,
        ) as e:
            acts = e.system.activations
            assert acts is not None and acts.strict
            tier = acts.id
            workload(e, 48, seed=3, cancel=0.02)  # the first workload warms torch's lazy state
            torch.cuda.synchronize()
            h0, s0 = imt.hook_stats(), torch.cuda.memory_stats()
            free0, _ = imp_mem.cuda_mem_get_info(0)
            got = tokens(e)
            torch.cuda.synchronize()
            h1, s1 = imt.hook_stats(), torch.cuda.memory_stats()
            free1, _ = imp_mem.cuda_mem_get_info(0)
            steady = backend.stats()["steady_state_allocations_total"]
            report = e.mem_report_text()
            print("\n" + report)
            print(
                f"tier: {acts.stats()}; hook calls while serving: "
                f"{ {k: h1[k] - h0[k] for k in h1 if h1[k] != h0.get(k)} }"
            )
            assert sum(steady.values()) == 0
            # torch counts a segment its MemPool took from the tier as a device
            # allocation: every one of them must be a hook call into the tier
            # (a sub-allocation of the planned region), none a cudaMalloc.
            segments = s1["num_device_alloc"] - s0["num_device_alloc"]
            assert segments == h1["malloc_ok"] - h0["malloc_ok"], "torch called cudaMalloc"
            assert abs(free1 - free0) <= 16 * MIB, "the device's free memory moved while serving"
            assert h1["ooms"] == h0["ooms"] and h1["panics"] == 0
            for misuse in ("foreign_frees", "double_frees", "wrong_device", "size_mismatches"):
                assert h1[misuse] == h0[misuse], misuse
            assert acts.stats()["fallbacks_total"] == 0
            acts.check_invariants()
            del acts
    # The engine's Pool closes with it: its tier leaves the hooks, and the
    # system releases every byte (it warned "still referenced" before).
    held = [w for w in caught if issubclass(w.category, imp_mem.ImpMemWarning)]
    assert held == [], [str(w.message) for w in held]
    hooks = imp_mem._core.hook_stats()
    assert not hooks["installed"] and hooks["retired_pools"] == retired
    assert all(p._tier != tier for p in imt._pools.values())
    same = sum(a == b for a, b in zip(reference, got, strict=True))
    print(f"greedy outputs identical to torch's allocator's: {same} of {len(prompts)}")
    assert same >= 0.9 * len(prompts)


def test_the_engine_swaps_between_two_shapes_and_serves_each_as_a_fresh_one(tmp_path):
    """Issue 19 with the engine serving before and after: a VMM engine (strict:
    an acquisition while serving raises) swaps from one Qwen3-shaped
    checkpoint to another with other layers and KV heads and back; each
    serves the greedy tokens a fresh engine on it serves, T2 and T1 keep
    their addresses, the KV pool is re-laid, nothing is acquired while
    serving."""
    small = qwen3_0_6b_config()
    small["num_hidden_layers"] = 4
    other = qwen3_0_6b_config()
    other.update(num_hidden_layers=6, num_key_value_heads=4)
    a = write_random_checkpoint(tmp_path / "a", small)
    b = write_random_checkpoint(tmp_path / "b", other)
    kw = {"max_batch": 8, "max_seq_len": 256}
    rng = random.Random(11)
    prompts = [
        [rng.randrange(small["vocab_size"]) for _ in range(rng.randint(8, 96))] for _ in range(8)
    ]

    def fresh(directory):
        with Engine(directory, backend=imp_mem.VmmBackend(device=0, strict=True), **kw) as e:
            return e.generate(prompts, 16)

    want_a, want_b = fresh(a), fresh(b)
    backend = imp_mem.VmmBackend(device=0, strict=True)
    with Engine(a, backend=backend, **kw) as e:
        assert e.generate(prompts, 16) == want_a
        t2 = {k: t.data_ptr() for k, t in e.runner.t2_raw.items()}
        report = e.swap_model(b)
        assert report["t1_in_place"] and report["t1_base"][0] == report["t1_base"][1], report
        assert "kv_pool" in report["relaid"], report
        assert {k: t.data_ptr() for k, t in e.runner.t2_raw.items()} == t2
        assert e.generate(prompts, 16) == want_b
        e.swap_model(a)
        assert e.generate(prompts, 16) == want_a
        assert sum(backend.stats()["steady_state_allocations_total"].values()) == 0
        e.system.check()
