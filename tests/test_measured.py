"""Measured tiers on the CPU (issue 28): the binding's freeze as a property
(high-water kept, the rest decommitted, nothing live moved, the commit never
past the budget), the fingerprint cache, a plan with no KV pool, and
``imp_mem.torch.serve`` on the fake backend (measure on the first start,
remember, plan without measuring on the second). Routing torch's CUDA
allocations needs a GPU: ``tests/gpu/test_torch_serve_gpu.py``; the freeze is
proved in Rust too (``crates/imp-mem-core/tests/measured_props.rs``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import InvalidArgument, measured

MIB = 1 << 20
GRANULE = 64 * 1024
CHUNK = 4 * GRANULE
RESERVE = 32 * CHUNK


def _committed(fb) -> int:
    return int(fb.stats()["tags"]["activations"]["committed"])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 3 * CHUNK)),
        st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, margin=st.integers(0, 4 * CHUNK), budget_chunks=st.integers(6, 40))
def test_freeze_keeps_the_high_water_and_moves_nothing(ops, margin, budget_chunks):
    budget = budget_chunks * CHUNK
    fb = imp_mem.FakeBackend(capacity=64 * MIB, budget=budget, granularity=GRANULE)
    pool = imp_mem.ActivationPool(fb, RESERVE, strict=True, measure_chunk=CHUNK)
    assert pool.measuring and pool.committed == 0
    live: dict[int, bytes] = {}
    for i, (kind, n) in enumerate(ops):
        if kind == "alloc":
            try:
                addr = pool.allocate(n)
            except imp_mem.OutOfMemory:
                continue
            data = bytes([i % 251 + 1]) * n
            fb.write(addr, data)  # refused if any byte were not committed
            live[addr] = data
        elif live:
            addr = sorted(live)[n % len(live)]
            assert fb.read(addr, len(live[addr])) == live.pop(addr)
            pool.free(addr)
        c = _committed(fb)
        assert c <= budget and c % CHUNK == 0
        assert c == min(-(-pool.high_water // CHUNK) * CHUNK, RESERVE)
    high_water = pool.high_water
    before = _committed(fb)
    size = min(max(-(-(high_water + margin) // CHUNK) * CHUNK, CHUNK), RESERVE)
    if size > budget:
        with pytest.raises(imp_mem.ImpMemError):
            pool.freeze(margin)
        assert pool.measuring and _committed(fb) == before
        return
    frozen = pool.freeze(margin)
    assert frozen == {
        "high_water": high_water,
        "margin": margin,
        "size": size,
        "committed_before": before,
        "decommitted": max(0, before - size),
    }
    assert pool.frozen == frozen and not pool.measuring
    assert _committed(fb) == size == pool.capacity
    for addr, data in live.items():
        assert fb.read(addr, len(data)) == data
    pool.check_invariants()
    # Nothing is committed after the freeze: a request past the size is refused.
    with pytest.raises(imp_mem.OutOfMemory):
        pool.allocate(size + 1)
    assert _committed(fb) == size
    with pytest.raises(InvalidArgument, match="already frozen"):
        pool.freeze(0)
    for addr in live:
        pool.free(addr)


def test_measure_arguments_are_checked():
    fb = imp_mem.FakeBackend(capacity=64 * MIB, granularity=GRANULE)
    with pytest.raises(InvalidArgument, match="measure_chunk"):
        imp_mem.ActivationPool(fb, RESERVE, measure_chunk=0)
    with pytest.raises(InvalidArgument, match="growable and measure_chunk"):
        imp_mem.ActivationPool(fb, RESERVE, growable=True, measure_chunk=CHUNK)
    fixed = imp_mem.ActivationPool(fb, RESERVE)
    with pytest.raises(InvalidArgument, match="does not measure"):
        fixed.freeze()
    pool = imp_mem.ActivationPool(fb, RESERVE, measure_chunk=CHUNK)
    with pytest.raises(InvalidArgument, match="margin"):
        pool.freeze(-1)
    assert pool.stats()["measuring"] is True
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=8))
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
figures = st.fixed_dictionaries(
    {
        "high_water": st.integers(0, 1 << 40),
        "margin": st.integers(0, 1 << 30),
        "size": st.integers(1, 1 << 41),
    }
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    model=json_value.filter(lambda m: m not in (None, "")),
    shapes=json_value,
    other=json_value,
    fig=figures,
    fig2=figures,
)
def test_the_cache_recalls_what_it_remembered_under_that_fingerprint_only(
    tmp_path, model, shapes, other, fig, fig2
):
    path = tmp_path / "m.json"
    path.unlink(missing_ok=True)
    env = {"torch": "x", "cuda": "12.8", "driver": 1}
    fp = measured.fingerprint(model, shapes, env=env)
    assert measured.recall(fp, path=path) is None
    measured.remember(fp, dict(fig, extra="ignored"), path=path)
    assert measured.recall(fp, path=path) == fig
    assert measured.recall(fp, "graphs", path=path) is None
    # Any other model, shapes or software is a miss.
    for fp2 in (
        measured.fingerprint(model, [shapes, other], env=env),
        measured.fingerprint(model, shapes, env=dict(env, torch="y")),
        measured.fingerprint([model], shapes, env=env),
    ):
        assert measured.recall(fp2, path=path) is None
    # A second tier under the same key, and a second store replaces.
    measured.remember(fp, fig2, "graphs", path=path)
    measured.remember(fp, fig2, path=path)
    assert measured.recall(fp, path=path) == fig2
    assert measured.recall(fp, "graphs", path=path) == fig2


def test_an_unreadable_cache_is_a_miss_and_is_replaced(tmp_path):
    path = tmp_path / "m.json"
    fp = measured.fingerprint("m", None, env={})
    fig = {"high_water": 5, "margin": 1, "size": 8}
    for junk in ("{", "[]", json.dumps({"version": 99, "entries": {}}), "\x00"):
        path.write_text(junk)
        assert measured.recall(fp, path=path) is None
    measured.remember(fp, fig, path=path)
    assert measured.recall(fp, path=path) == fig
    # A hand-edited entry with a bad figure is a miss, not an error.
    data = json.loads(path.read_text())
    key = measured.fingerprint_key(fp)
    data["entries"][key]["tiers"]["activations"]["size"] = "big"
    path.write_text(json.dumps(data))
    assert measured.recall(fp, path=path) is None
    with pytest.raises(InvalidArgument, match="measured"):
        measured.remember(fp, {"high_water": -1, "margin": 0, "size": 1}, path=path)
    with pytest.raises(InvalidArgument, match="model"):
        measured.fingerprint("", None, env={})
    with pytest.raises(InvalidArgument, match="model"):
        measured.fingerprint(object(), None, env={})


def test_a_plan_with_no_kv_pool():
    shape = imp_mem.ModelShape.from_hf_config(
        {
            "model_type": "qwen3",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "torch_dtype": "bfloat16",
        }
    )
    limits = imp_mem.Limits(32, 1088, kv_policy="none")
    assert limits.kv_policy == "none"
    features = imp_mem.Features(activation_bytes=4 << 30)
    plan = imp_mem.plan_memory(imp_mem.PlanInput(shape, limits, features, budget=40 << 30))
    assert plan.kv["blocks"] == 0 and plan.kv["bytes"] == 0
    fb = imp_mem.FakeBackend(capacity=40 << 30, backed=False)
    system = imp_mem.MemorySystem(fb, plan, activation_measure=2 * MIB)
    assert "kv_pool" not in [t["key"] for t in system.mem_report()["tiers"]]
    assert system.kv_pool is None
    with pytest.raises(InvalidArgument, match="full, fit or none"):
        imp_mem.Limits(1, 16, kv_policy="nothing")


torch_mod = pytest.importorskip("imp_mem.torch")


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(64 * MIB, 200 << 30),
    context=st.integers(0, 2 << 30),
)
def test_serves_placeholder_plan_fits_any_budget_and_context(budget, context):
    """serve()'s one-tier plan fits wherever the tier is positive: the
    planner counts the budget in whole MiB down and the context up, and a
    device's readings are rarely whole MiB (the H200's were off by one)."""
    from imp_mem import torch as imp_torch

    tier = imp_torch._tier_bytes(budget, context)
    if tier <= 0:
        return
    assert tier % MIB == 0
    plan = imp_torch._placeholder_plan(tier, budget, context)
    assert plan.activations == tier
    assert plan.total() <= budget
    # Nothing left on the table: one MiB more would not fit.
    with pytest.raises(imp_mem.PlanFailure):
        imp_torch._placeholder_plan(tier + MIB, budget, context)


def test_the_environment_takes_the_gpus_name_without_asking_torch(monkeypatch):
    """serve() names the GPU from its backend: torch's get_device_name
    initialises torch's CUDA allocator, after which install() cannot swap
    it (on the H200 every serve() failed so). The device is simulated."""
    torch = pytest.importorskip("torch")
    from imp_mem import _core

    def asked(*args):
        raise AssertionError("torch was asked for the GPU's name")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", asked)
    monkeypatch.setattr(_core, "cuda_driver_version", lambda: 13000)
    env = measured.environment(0, "NVIDIA H200")
    assert env["gpu"] == "NVIDIA H200" and env["driver"] == 13000
    with pytest.raises(AssertionError, match="asked"):
        measured.environment(0)


def test_a_device_without_an_index_leaves_torchs_cuda_state_alone(monkeypatch):
    """`serve(device="cuda")` and the other entry points name device 0 while
    torch has not initialised CUDA, instead of asking torch's current device
    (which initialises it, and then its allocator cannot be swapped)."""
    torch = pytest.importorskip("torch")
    from imp_mem import torch as imp_torch

    def asked():
        raise AssertionError("torch's current device was asked")

    monkeypatch.setattr(torch.cuda, "current_device", asked)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert imp_torch._device_index("cuda") == 0
    assert imp_torch._device_index(None) == 0
    assert imp_torch._device_index("cuda:3") == 3
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert imp_torch._device_index("cuda") == 2


def test_serve_measures_then_the_second_start_recalls(tmp_path):
    path = tmp_path / "measured.json"
    fp = {"model": "toy", "batch": 4}

    def start():
        fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
        return torch_mod.serve(fingerprint=fp, backend=fb, margin=MIB, chunk=CHUNK, cache_path=path)

    first = start()
    assert first.measuring and first.recalled is None
    act = first.activations
    assert act.measuring and act.committed == 0
    assert "kv_pool" not in [t["key"] for t in first.mem_report()["tiers"]]
    # The warm-up: 5 MiB + a bit at the peak.
    a = act.allocate(5 * MIB + 1)
    b = act.allocate(MIB)
    act.free(a)
    first.begin_serving()
    line = first.measured()[0]
    want = -(-(6 * MIB + 512 + MIB) // CHUNK) * CHUNK
    assert (line["state"], line["high_water"], line["size"]) == ("frozen", 6 * MIB + 512, want)
    assert act.committed == want
    assert first.remembered == path
    assert measured.recall(first.fingerprint, path=path)["size"] == want
    act.free(b)

    second = start()
    assert not second.measuring and second.recalled["size"] == want
    act2 = second.activations
    # Planned at the remembered size (the planner counts whole MiB).
    assert not act2.measuring and second.measured() == []
    assert act2.capacity == -(-want // MIB) * MIB
    second.begin_serving()
    assert "activations" in second.mem_report_text()
    # A share as the margin.
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    third = torch_mod.serve(backend=fb, margin=0.5, chunk=CHUNK)
    c = third.activations.allocate(4 * MIB)
    third.begin_serving()
    assert third.measured()[0]["size"] == 6 * MIB and third.remembered is None
    third.activations.free(c)
    # Served.close closes the system, which then holds nothing.
    assert third.close()["still_held"] == {}
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    with torch_mod.serve(backend=fb, chunk=CHUNK) as fifth:
        assert fifth.activations.allocate(MIB)
    assert fb.stats()["tags"].get("activations", {"live": 0})["live"] == 0
    # The default margin: a fifth of a per cent where work past the tier
    # falls back (the process mode); in the scope mode, where it is torch's
    # OOM, bytes for more than one of torch's 20 MiB segments.
    assert isinstance(torch_mod.DEFAULT_MARGIN, float) and torch_mod.DEFAULT_MARGIN < 0.01
    assert isinstance(torch_mod.DEFAULT_SCOPE_MARGIN, int)
    assert torch_mod.DEFAULT_SCOPE_MARGIN >= 2 * 20 * MIB
    assert torch_mod.default_margin("scope") == torch_mod.DEFAULT_SCOPE_MARGIN
    assert torch_mod.default_margin("process") == torch_mod.DEFAULT_MARGIN
    with pytest.raises(InvalidArgument, match="mode"):
        torch_mod.default_margin("both")
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    fourth = torch_mod.serve(backend=fb, chunk=CHUNK)
    assert fourth.margin_share == torch_mod.DEFAULT_MARGIN


def test_serve_arguments_are_checked():
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    with pytest.raises(InvalidArgument, match="mode"):
        torch_mod.serve(backend=fb, mode="both")
    with pytest.raises(InvalidArgument, match="margin"):
        torch_mod.serve(backend=fb, margin=-0.1)
    with pytest.raises(InvalidArgument, match="budget"):
        torch_mod.serve(backend=fb, budget=0)
    with pytest.raises(InvalidArgument, match="chunk"):
        torch_mod.serve(backend=fb, chunk="nope")
    with pytest.raises(InvalidArgument, match=r"^budget: .* more than the device offers"):
        torch_mod.serve(backend=fb, budget=512 * MIB)
    with pytest.raises(InvalidArgument, match=r"^device: "):
        torch_mod.serve(backend=fb, device=-1)
    with pytest.raises(TypeError, match=r"^device: "):
        torch_mod.serve(backend=fb, device=True)
    with pytest.raises(InvalidArgument, match=r"^fingerprint: "):
        torch_mod.serve(backend=fb, fingerprint="")
    with pytest.raises(InvalidArgument, match=r"^fingerprint: expected JSON-like"):
        torch_mod.serve(backend=fb, fingerprint={"model": object()})
    with pytest.raises(InvalidArgument, match=r"^shapes: expected JSON-like"):
        torch_mod.serve(backend=fb, fingerprint="m", shapes={"batch": object()})
    with pytest.raises(TypeError, match=r"^cache_path: "):
        torch_mod.serve(backend=fb, cache_path=5)
    with pytest.raises(InvalidArgument, match=r"^other_processes: "):
        torch_mod.serve(backend=fb, other_processes=-1)
    with pytest.raises(TypeError, match=r"^other_processes: "):
        torch_mod.serve(backend=fb, other_processes="1GiB")
    # Nothing was opened by a refused call: the whole budget is still there.
    served = torch_mod.serve(backend=fb, budget=256 * MIB)
    served.begin_serving()
    # Serving, a reset would start recording every allocation of the work.
    with pytest.raises(imp_mem.PhaseViolation, match="reset_high_water"):
        served.reset_high_water()
    assert not served.activations.recording
    served.close()


def test_reset_high_water_forgets_a_compile_peak_and_the_freeze_gives_it_back():
    fb = imp_mem.FakeBackend(capacity=64 * MIB, granularity=GRANULE)
    pool = imp_mem.ActivationPool(fb, RESERVE, strict=True, measure_chunk=CHUNK)
    weights = pool.allocate(CHUNK)
    compile_tmp = pool.allocate(8 * CHUNK)
    pool.free(compile_tmp)
    assert pool.high_water == 9 * CHUNK and _committed(fb) == 9 * CHUNK
    pool.reset_high_water()
    assert pool.high_water == CHUNK
    step = pool.allocate(2 * CHUNK)
    pool.free(step)
    frozen = pool.freeze(0)
    assert frozen["size"] == 3 * CHUNK and frozen["decommitted"] == 6 * CHUNK
    assert _committed(fb) == 3 * CHUNK
    pool.free(weights)


def _readme_serve_example() -> str:
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parent.parent / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    found = [b for b in blocks if "imp_mem.torch.serve(" in b]
    assert len(found) == 1, "the README has one serve() example"
    return found[0]


def test_the_readme_serve_example_runs_on_the_cpu(monkeypatch, tmp_path, capsys):
    """The README's one-call example, on the fake backend and the CPU (torch's
    tensors stay on the CPU, so the tier sees none; the GPU test runs it for
    real: tests/gpu/test_torch_serve_gpu.py)."""
    pytest.importorskip("transformers")
    import functools

    example = _readme_serve_example()
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    monkeypatch.setenv("IMP_MEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch_mod, "serve", functools.partial(torch_mod.serve, backend=fb))
    ns: dict = {}
    exec(example.replace('"cuda"', '"cpu"'), ns)
    system = ns["system"]
    assert system.measured()[0]["state"] == "frozen"
    assert system.remembered == tmp_path / "measured.json"
    assert ns["out"].shape == (4, 64 + 8)
    assert "measured tier activations: frozen" in capsys.readouterr().out


def test_the_outside_charge_leaves_out_what_the_backends_source_holds():
    """`begin_serving()` charges what the device lost across the warm-up
    less what the backend holds more: its regions' commits *and* what its
    source keeps past them (a VMM backend's handle cache, chunk rounding,
    charged in the report on lines of their own). A second start whose
    warm-up fallbacks went back to the handle cache once had those bytes
    charged twice (attribution 100.06 % on the H200)."""
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    served = torch_mod.serve(backend=fb, chunk=CHUNK)
    a = served.activations.allocate(3 * MIB)
    # The fake source keeps nothing past its ledger: the commits alone.
    assert torch_mod._held_by_backend(served.system) == int(fb.stats()["committed"]) > 0
    served.activations.free(a)

    class Source:
        """A system whose backend's source keeps a handle cache."""

        def __init__(self, committed, cache, rounding):
            self.figures = committed, cache, rounding
            self.backend = self

        def stats(self):
            return {"committed": self.figures[0]}

        def mem_report(self):
            charges = [
                {"key": "vmm_handle_cache", "bytes": self.figures[1]},
                {"key": "vmm_rounding", "bytes": self.figures[2]},
                {"key": "torch_runtime", "bytes": 999 * MIB},
            ]
            return {"charges": charges}

    # torch's own charge is never part of what the backend holds.
    assert torch_mod._held_by_backend(Source(10 * MIB, 4 * MIB, MIB)) == 15 * MIB
    assert torch_mod._held_by_backend(Source(10 * MIB, 0, 0)) == 10 * MIB


_WRITER = """
import sys
from pathlib import Path
from imp_mem import _jsonfile, measured
path, kind, n, me = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
for i in range(n):
    if kind == "count":
        _jsonfile.update(path, lambda d: {"n": (d or {}).get("n", 0) + 1})
    elif kind == "reserve":
        from imp_mem import reserve
        fp = {"gpu_name": f"gpu-{me}-{i}", "driver_version": "1", "cuda_version": "1"}
        reserve.store({"context_bytes": i, "library_reserve_bytes": i}, path, fp=fp)
    else:
        fp = measured.fingerprint({"writer": me, "i": i}, env={})
        measured.remember(fp, {"high_water": i, "margin": 0, "size": i + 1}, path=path)
"""


def _writers(path, kind: str, processes: int, each: int) -> None:
    import subprocess
    import sys

    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), kind, str(each), str(me)])
        for me in range(processes)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * processes


def test_processes_writing_the_cache_at_once_lose_nothing(tmp_path):
    """Read, changed and written under the file's lock: six processes
    counting in one file reach the sum, and four remembering at once keep
    every figure (unlocked, a writer's read-modify-write drops the others'
    entries written between its read and its rename)."""
    from imp_mem import _jsonfile

    counter = tmp_path / "count.json"
    _writers(counter, "count", 6, 40)
    assert _jsonfile.read(counter) == {"n": 240}
    cache = tmp_path / "measured.json"
    _writers(cache, "remember", 4, 12)
    for me in range(4):
        for i in range(12):
            fp = measured.fingerprint({"writer": str(me), "i": i}, env={})
            assert measured.recall(fp, path=cache) == {"high_water": i, "margin": 0, "size": i + 1}
    assert not list(tmp_path.glob(".measured-*")), "a temporary file left behind"
    # The library reserve's cache (written by the core) takes the same lock.
    reserve_cache = tmp_path / "reserve.json"
    _writers(reserve_cache, "reserve", 4, 12)
    assert len(json.loads(reserve_cache.read_text())["entries"]) == 48


def test_a_cache_that_cannot_be_written_is_a_warning_not_a_failed_start(tmp_path, monkeypatch):
    """The caches only save the next start a measurement: a read-only or
    broken cache folder (a container's home) warns and serves on."""
    from imp_mem import reserve
    from imp_mem.engine import warmup

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    fb = imp_mem.FakeBackend(capacity=256 * MIB, granularity=GRANULE)
    served = torch_mod.serve(
        backend=fb, chunk=CHUNK, fingerprint="m", cache_path=blocked / "measured.json"
    )
    ptr = served.activations.allocate(CHUNK)
    with pytest.warns(imp_mem.ImpMemWarning, match="not remembered"):
        served.begin_serving()
    assert served.remembered is None and served.system.phase == imp_mem.Phase.SERVING
    served.activations.free(ptr)
    served.close()
    with pytest.warns(imp_mem.ImpMemWarning, match="not remembered"):
        warmup.store({"model": "m"}, {"torch": 1, "modules": 2}, path=blocked / "warmup.json")
    monkeypatch.setattr(
        reserve, "measure", lambda samples: {"context_bytes": 1, "library_reserve_bytes": 2}
    )
    monkeypatch.setattr(
        reserve,
        "fingerprint",
        lambda: {"gpu_name": "x", "driver_version": "1", "cuda_version": "1"},
    )
    with pytest.warns(imp_mem.ImpMemWarning, match="not remembered"):
        with pytest.warns(imp_mem.ImpMemWarning, match="could not be read"):
            got = reserve.load_or_measure(blocked / "reserve.json")
    assert got["cached"] is False and got["library_reserve_bytes"] == 2
