"""``imp_mem.torch`` regions on the CPU (issue 24): argument checks, and
pause / resume of a region's tier on the fake backend (its pinned host is
plain memory). Routing torch's CUDA allocations into a region needs a GPU:
``tests/gpu/test_torch_region_gpu.py``. The rules are proved in Rust
(``crates/imp-mem-core/tests/activation_regions.rs``).
"""

from __future__ import annotations

import pytest

import imp_mem
from imp_mem import Asleep, BackendUnavailable, InvalidArgument

torch_mod = pytest.importorskip("imp_mem.torch")

MIB = 1 << 20


@pytest.fixture
def fb():
    backend = imp_mem.FakeBackend(capacity=64 * MIB, granularity=64 * 1024)
    yield backend
    for tag in list(torch_mod.regions()):
        for ptr in list(getattr(torch_mod.regions()[tag], "_test_live", [])):
            torch_mod.regions()[tag].activations.free(ptr)
        torch_mod.release_region(tag)


def test_region_arguments_are_checked(fb):
    with pytest.raises(InvalidArgument, match="tag"):
        torch_mod.region(fb, "", capacity=MIB)
    with pytest.raises(InvalidArgument, match="tag"):
        torch_mod.region(fb, 3, capacity=MIB)
    with pytest.raises(InvalidArgument, match="capacity"):
        torch_mod.region(fb, "train")
    with pytest.raises(InvalidArgument, match="cpu_backup"):
        torch_mod.region(fb, "train", capacity=MIB, cpu_backup="yes")
    with pytest.raises(InvalidArgument, match="target"):
        torch_mod.region(object(), "train", capacity=MIB)
    with pytest.raises(InvalidArgument, match="nope"):
        torch_mod.pause("nope")
    with pytest.raises(InvalidArgument, match="nope"):
        torch_mod.resume("nope")
    assert torch_mod.regions() == {}
    torch_mod.region(fb, "train", capacity=4 * MIB)
    with pytest.raises(InvalidArgument, match="cpu_backup"):
        torch_mod.region(fb, "train", cpu_backup=False)
    with pytest.raises(InvalidArgument, match="capacity"):
        torch_mod.region(fb, "train", capacity=8 * MIB)
    assert list(torch_mod.regions()) == ["train"]


def test_a_region_pauses_keeping_its_live_bytes_and_resumes_at_the_same_addresses(fb):
    scope = torch_mod.region(fb, "train", capacity=4 * MIB)
    if not imp_mem.cuda_available():
        with pytest.raises(BackendUnavailable), scope:
            pass
    r = torch_mod.regions()["train"]
    # What torch's segments would be: live blocks of the region's tier.
    a = r.activations.allocate(100_000)
    b = r.activations.allocate(5000)
    r._test_live = [a, b]
    data_a, data_b = bytes(range(200)) * 500, b"\x07" * 5000
    fb.write(a, data_a)
    fb.write(b, data_b)
    copied = torch_mod.pause("train")
    assert copied == r.activations.stats()["allocated"]
    assert r.activations.asleep == 1
    assert r.activations.host_bytes == copied
    assert fb.read(a, 16) != data_a[:16], "the memory was given back"
    with pytest.raises(Asleep):
        r.activations.allocate(64)
    torch_mod.resume("train")
    assert fb.read(a, len(data_a)) == data_a
    assert fb.read(b, len(data_b)) == data_b
    # A live region cannot be released.
    with pytest.raises(InvalidArgument, match="live"):
        torch_mod.release_region("train")


def test_a_region_without_cpu_backup_drops_its_bytes(fb):
    torch_mod.region(fb, "rollout", capacity=2 * MIB, cpu_backup=False)
    r = torch_mod.regions()["rollout"]
    assert torch_mod.pause("rollout") == 0
    assert r.activations.host_bytes == 0
    torch_mod.resume("rollout")
    assert r.activations.asleep is None


def test_pool_pause_arguments_are_checked(fb):
    fixed = imp_mem.ActivationPool(fb, MIB)
    with pytest.raises(BackendUnavailable):
        fixed.pause()
    pool = imp_mem.ActivationPool(fb, MIB, growable=True)
    with pytest.raises(TypeError, match="cpu_backup"):
        pool.pause(cpu_backup=2)
    with pytest.raises(TypeError, match="growable"):
        imp_mem.ActivationPool(fb, MIB, growable="no")
    with pytest.raises(InvalidArgument):
        imp_mem._core.set_hook_region(pool)
    pool.pause()
    with pytest.raises(InvalidArgument, match="already"):
        pool.pause()
    pool.resume()
    pool.resume()


def test_the_torch_helpers_refuse_bad_input_naming_the_argument(fb):
    import torch

    arena = imp_mem.Arena(fb, MIB)
    with pytest.raises(TypeError, match=r"^shape: "):
        torch_mod.arena_tensor(arena, (2.5,), torch.float32)
    with pytest.raises(TypeError, match=r"^shape: "):
        torch_mod.arena_tensor(arena, 3, torch.float32)
    with pytest.raises(TypeError, match=r"^dtype: "):
        torch_mod.arena_tensor(arena, (2,), "float32")
    assert arena.used == 0, "a refused call took nothing"
    # Integers of any kind are dimensions (torch.Size, numpy's).
    assert torch_mod.arena_tensor(arena, torch.Size([2, 3]), torch.float32).shape == (2, 3)
    with pytest.raises(TypeError, match=r"^target: expected a MemorySystem"):
        torch_mod.memory_stats(5)
    with pytest.raises(TypeError, match=r"^target: expected a MemorySystem"):
        torch_mod.Pool(5)
    with pytest.raises(TypeError, match=r"^module: "):
        torch_mod.to_arena(5, arena)
    with pytest.raises(TypeError, match=r"^step: "):
        torch_mod.measure_step_high_water(5)
    with pytest.raises(InvalidArgument, match=r"^warmup: "):
        torch_mod.measure_step_high_water(lambda: None, warmup=-1)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no CUDA device"):
            torch_mod.measure_step_high_water(lambda: None)


def test_two_threads_opening_one_tag_at_once_get_one_region(fb, monkeypatch):
    """Found or made under one lock: the loser of the race takes the
    winner's region (else a second tier stayed a hook region for nothing)."""
    import threading
    import time

    made = []
    original = torch_mod.Region.__init__

    def slow_init(self, *args, **kwargs):
        made.append(self)
        time.sleep(0.05)  # widen the window between the lookup and the store
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch_mod.Region, "__init__", slow_init)
    start = threading.Barrier(2)
    got = []

    def open_it():
        start.wait()
        torch_mod.region(fb, "shared", capacity=MIB)
        got.append(torch_mod.regions()["shared"])

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1
    assert got[0] is got[1] is made[0]
