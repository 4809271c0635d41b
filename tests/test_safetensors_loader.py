"""`load_safetensors` on the fake backend (CPU torch): every tensor lands in
T1 byte for byte and views the arena in place, chunks of the staging
buffers cross tensor boundaries, a tensor-parallel rank's slices (rows,
columns, a 3-D middle dimension, empty) land as those slices, and a
checkpoint larger than the plan's weights line is refused by tensor name
before anything is taken."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from _helpers import TINY as CONFIG  # noqa: E402

from imp_mem import (  # noqa: E402
    FakeBackend,
    Features,
    InvalidArgument,
    Limits,
    MemorySystem,
    ModelShape,
    PlanInput,
    WeightsOverflow,
    plan_memory,
)
from imp_mem._safetensors import load_safetensors, read_header, shard_entry  # noqa: E402
from imp_mem.engine.tensor_parallel import Shard  # noqa: E402

MIB = 1 << 20


def checkpoint(tmp_path, shards=1):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(1000, 512, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(256, generator=g).to(torch.float32),
        "odd.bias": torch.randn(7, generator=g).to(torch.float16),  # 14 B: unaligned sizes
        "ids": torch.arange(33, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(1000, 512, generator=g).to(torch.bfloat16),
    }
    names = list(tensors)
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        safetensors_torch.save_file(part, str(tmp_path / f"model-{k:05d}.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tensors


def open_system(tmp_path, weights_bytes=None):
    shape = ModelShape.from_hf_config(tmp_path, weights_bytes=weights_bytes)
    plan = plan_memory(
        PlanInput(
            shape,
            Limits(2, 256),
            Features(),
            budget="1GiB",
            context=8 * MIB,
            library_reserve=4 * MIB,
        )
    )
    return MemorySystem(FakeBackend(capacity="1GiB"), plan)


@pytest.mark.parametrize(("shards", "chunk"), [(1, 1 << 20), (3, 4096), (2, 300)])
def test_every_tensor_lands_in_t1_in_place(tmp_path, shards, chunk):
    want = checkpoint(tmp_path, shards)
    system = open_system(tmp_path)
    arena = system.weights_arena
    base = arena.stats()["used"]
    got = load_safetensors(system, tmp_path, chunk_bytes=chunk)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name
        assert got[name].device.type == "cpu"
    # In place: the tensors live at aligned addresses inside the arena,
    # disjoint, and writing one writes T1.
    spans = sorted(
        (v.data_ptr(), v.data_ptr() + v.numel() * v.element_size())
        for v in got.values()
        if v.numel()
    )
    assert all(a % 256 == 0 for a, _ in spans)
    assert all(e <= b for (_, e), (b, _) in pairwise(spans))
    used = arena.stats()["used"]
    assert used - base >= sum(t.numel() * t.element_size() for t in want.values())
    assert used <= system.plan.weights
    got["norm.weight"][0] = 42.0
    again = arena.take(256)  # the arena moved on past the weights
    assert again.address >= spans[-1][1]
    del got, again, arena
    system.close()


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 256])
def test_shards_load_only_their_slice(tmp_path, chunk):
    want = checkpoint(tmp_path, 2)
    g = torch.Generator().manual_seed(1)
    cube = torch.randn(3, 10, 6, generator=g)
    safetensors_torch.save_file({"cube": cube}, str(tmp_path / "model-00009.safetensors"))
    shards = {
        "embed.weight": Shard(0, 500, 1000),  # rows: one range of the file
        "lm_head.weight": Shard(1, 100, 356),  # columns: a range a row
        "cube": Shard(1, 2, 7),  # a middle dimension
        "norm.weight": Shard(0, 0, 0),  # an empty slice
    }
    system = open_system(tmp_path)
    used = system.weights_arena.used
    got = load_safetensors(system, tmp_path, chunk_bytes=chunk, shards=shards)
    assert torch.equal(got["embed.weight"], want["embed.weight"][500:])
    assert torch.equal(got["lm_head.weight"], want["lm_head.weight"][:, 100:356])
    assert torch.equal(got["cube"], cube[:, 2:7])
    assert got["norm.weight"].shape == (0,)
    assert torch.equal(got["ids"], want["ids"])  # unsharded tensors whole
    # Only the slices' bytes were taken.
    sliced = 500 * 512 * 2 + 1000 * 256 * 2 + 3 * 5 * 6 * 4
    rest = sum(t.numel() * t.element_size() for n, t in want.items() if n not in shards)
    assert sliced + rest <= system.weights_arena.used - used <= sliced + rest + 8 * 256
    del got
    # A shard of a tensor the checkpoint lacks, or outside its tensor, is refused.
    with pytest.raises(InvalidArgument, match="not in the checkpoint"):
        load_safetensors(system, tmp_path, shards={"nope": Shard(0, 0, 1)})
    entry = next(t for t in read_header(tmp_path / "model-00009.safetensors"))
    with pytest.raises(InvalidArgument, match="outside"):
        shard_entry(entry, 1, 4, 11)
    # Rows of a leading dimension read as one range, columns as one a row.
    assert len(shard_entry(entry, 0, 1, 3).file_runs()) == 1
    assert len(shard_entry(entry, 2, 0, 3).file_runs()) == 30
    system.close()


def test_a_checkpoint_larger_than_the_plan_is_refused_by_tensor(tmp_path):
    checkpoint(tmp_path)
    system = open_system(tmp_path, weights_bytes=MIB // 2)
    assert system.plan.weights < 2_000_000  # the two 1 MB matrices do not both fit
    used = system.weights_arena.used
    with pytest.raises(WeightsOverflow) as e:
        load_safetensors(system, tmp_path)
    assert e.value.tensor == "lm_head.weight"
    assert e.value.limit == system.plan.weights < e.value.end
    assert "lm_head.weight" in str(e.value)
    assert system.weights_arena.used == used, "nothing was taken"
    del e  # its traceback holds the loader's frame, and the arena
    system.close()


@pytest.mark.parametrize("threads", ["1", "3", "8"])
def test_the_threads_read_the_same_bytes(tmp_path, monkeypatch, threads):
    """A chunk's reads split across threads in pieces (64 B here, so every
    tensor crosses pieces, chunks and threads) land as one thread's do,
    shards included; a file cut short is refused by tensor under threads
    too."""
    import imp_mem._safetensors as st

    monkeypatch.setattr(st, "READ_PIECE_MIN", 64)
    monkeypatch.setenv("IMP_MEM_LOAD_THREADS", threads)
    assert st.read_threads() == int(threads)
    want = checkpoint(tmp_path, 2)
    system = open_system(tmp_path)
    got = load_safetensors(system, tmp_path, chunk_bytes=4096)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    del got
    system.close()
    system = open_system(tmp_path)
    got = load_safetensors(
        system, tmp_path, chunk_bytes=1000, shards={"lm_head.weight": Shard(1, 100, 356)}
    )
    assert torch.equal(got["lm_head.weight"], want["lm_head.weight"][:, 100:356])
    del got
    system.close()
    # The last shard cut inside its last tensor once its header was read
    # (a file changed under the load).
    last = tmp_path / "model-00001.safetensors"
    whole = last.read_bytes()
    system = open_system(tmp_path)
    with pytest.raises(InvalidArgument, match="ended inside tensor"):
        load_safetensors(
            system,
            tmp_path,
            chunk_bytes=4096,
            on_layout=lambda _total: last.write_bytes(whole[:-100]),
        )
    system.close()


@pytest.mark.parametrize("bad", ["0", "-2", "many"])
def test_a_bad_thread_count_is_refused(monkeypatch, bad):
    import imp_mem._safetensors as st

    monkeypatch.setenv("IMP_MEM_LOAD_THREADS", bad)
    with pytest.raises(InvalidArgument, match="IMP_MEM_LOAD_THREADS"):
        st.read_threads()


def test_bad_files_are_refused(tmp_path):
    checkpoint(tmp_path)
    system = open_system(tmp_path)
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_safetensors(system, tmp_path / "nope.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(InvalidArgument, match=r"no \*\.safetensors"):
        load_safetensors(system, bad)
    (bad / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(InvalidArgument, match="not JSON"):
        read_header(bad / "x.safetensors")
    # A header whose byte range disagrees with its shape.
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (bad / "x.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(InvalidArgument, match="'w'"):
        read_header(bad / "x.safetensors")
    system.close()


def test_stacks_are_laid_end_to_end_in_one_span(tmp_path):
    """`stacks`: a group the checkpoint holds whole, with sizes that leave
    no alignment gap, is laid out in the group's order in one span (one
    storage: a stacked view over it needs no copy); a group with a missing
    member, or whose sizes leave gaps, is laid out as usual; every value
    lands byte for byte either way."""
    g = torch.Generator().manual_seed(1)
    tensors = {f"e.{j}.{k}": torch.randn(8, 16, generator=g) for j in range(3) for k in "ab"}
    tensors["odd.0"] = torch.randn(3, generator=g)  # 12 B: a gap after it
    tensors["odd.1"] = torch.randn(3, generator=g)
    tensors["head"] = torch.randn(4, 16, generator=g)
    order = ["head", "e.2.b", "e.0.a", "odd.1", "e.1.a", "e.0.b", "e.2.a", "odd.0", "e.1.b"]
    safetensors_torch.save_file({n: tensors[n] for n in order}, str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    stack = [f"e.{j}.{k}" for j in range(3) for k in "ab"]
    with open_system(tmp_path, weights_bytes=64 * MIB) as system:
        out = load_safetensors(
            system, tmp_path, stacks=[stack, ["odd.0", "odd.1"], ["head", "missing"]]
        )
        for name, t in tensors.items():
            assert torch.equal(out[name], t), name
        ptrs = [out[n].data_ptr() for n in stack]
        assert all(b - a == 8 * 16 * 4 for a, b in pairwise(ptrs))
        base = out[stack[0]]
        view = torch.as_strided(base, (3, 16, 16), (256, 16, 1))  # one storage
        assert torch.equal(view[1, 8:], tensors["e.1.b"])
        # The gapped pair was not fused: its storages are its own.
        with pytest.raises(RuntimeError):
            torch.as_strided(out["odd.0"], (2, 3), (4, 1)).sum()
        del out, base, view
