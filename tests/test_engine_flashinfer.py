"""``attention_backend="flashinfer"`` on the CPU: FlashInfer's CSR page table
built from the engine's block tables (`flashinfer_decode.page_table`, property
tested), its buffers and workspaces planned in T2 to the byte, and the
typed refusals at Engine construction (FlashInfer missing, a family it
does not serve, a CPU model). The kernel itself runs in
tests/gpu/test_engine_flashinfer_gpu.py."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from imp_mem import FakeBackend, InvalidArgument  # noqa: E402
from imp_mem.engine import Engine  # noqa: E402
from imp_mem.engine.config import ModelConfig, swa_config  # noqa: E402
from imp_mem.engine.kernels import flashinfer_decode  # noqa: E402
from imp_mem.engine.model_runner import _layout, t2_bytes, t2_groups  # noqa: E402


def qwen3_tiny(kind: str = "full") -> dict:
    config = swa_config(window=7, pattern=2)
    config.update(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        torch_dtype="float32",
    )
    if kind == "swa":
        config["layer_types"] = ["sliding_attention", "full_attention"]
    else:
        config.update(use_sliding_window=False, sliding_window=None, layer_types=None)
    return config


@st.composite
def batches(draw):
    block = draw(st.sampled_from([1, 4, 16]))
    width = draw(st.integers(1, 12))
    n = draw(st.integers(0, 9))
    positions = np.array(
        draw(st.lists(st.integers(0, width * block - 1), min_size=n, max_size=n)), dtype=np.int64
    )
    tables = np.array(
        draw(
            st.lists(
                st.lists(st.integers(0, 10_000), min_size=width, max_size=width),
                min_size=n,
                max_size=n,
            )
        ),
        dtype=np.int32,
    ).reshape(n, width)
    # Past a row's context, whatever the table holds (-1 included) is not read.
    for b, p in enumerate(positions):
        tail = draw(st.booleans())
        if tail:
            tables[b, p // block + 1 :] = -1
    return block, positions, tables


@settings(max_examples=300, deadline=None)
@given(batches())
def test_page_table_lists_each_rows_context_pages_in_order(case):
    block, positions, tables = case
    n, width = tables.shape
    indptr = np.full(n + 1, -7, dtype=np.int32)
    indices = np.full(n * width + 3, -7, dtype=np.int32)
    last = np.full(n, -7, dtype=np.int32)
    total = flashinfer_decode.page_table(positions, tables, block, indptr, indices, last)
    assert indptr[0] == 0 and indptr[n] == total
    assert (indices[total:] == -7).all(), "wrote past the pages"
    for b in range(n):
        pages = indptr[b + 1] - indptr[b]
        assert pages >= 1
        # FlashInfer's kv length: (pages - 1) * page_size + last_page_len.
        assert 1 <= last[b] <= block
        assert (pages - 1) * block + last[b] == positions[b] + 1
        assert (indices[indptr[b] : indptr[b + 1]] == tables[b, :pages]).all()


@settings(max_examples=100, deadline=None)
@given(batches(), st.data())
def test_a_hole_inside_a_context_is_refused(case, data):
    block, positions, tables = case
    if len(positions) == 0:
        return
    b = data.draw(st.integers(0, len(positions) - 1))
    j = data.draw(st.integers(0, int(positions[b]) // block))
    tables[b, j] = -1
    n, width = tables.shape
    with pytest.raises(InvalidArgument, match=f"row {b}'s table has no block"):
        flashinfer_decode.page_table(
            positions,
            tables,
            block,
            np.zeros(n + 1, np.int32),
            np.zeros(n * width, np.int32),
            np.zeros(n, np.int32),
        )


def test_a_position_past_the_table_is_refused():
    tables = np.zeros((2, 3), np.int32)
    for pos in (-1, 12):
        with pytest.raises(InvalidArgument, match=r"positions must be in \[0, 12\)"):
            flashinfer_decode.page_table(
                np.array([0, pos]),
                tables,
                4,
                np.zeros(3, np.int32),
                np.zeros(6, np.int32),
                np.zeros(2, np.int32),
            )


@pytest.mark.parametrize("max_batch,max_seq_len,block", [(64, 1024, 16), (3, 100, 4)])
def test_t2_plans_the_page_table_and_the_workspaces_to_the_byte(max_batch, max_seq_len, block):
    config = ModelConfig.from_hf_config(qwen3_tiny())
    kw = dict(
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        prefill_chunk=8,
        block_size=block,
        keep_logits=True,
    )
    plain = t2_groups(config, **kw)
    fi = t2_groups(config, **kw, flashinfer=True)
    width = -(-max_seq_len // block)
    assert set(fi) == set(plain) | {"fi_work"}
    assert fi["fi_work"] == {
        "fi_float": ((flashinfer_decode.FLOAT_WORKSPACE_BYTES,), torch.uint8),
        "fi_int": ((flashinfer_decode.INT_WORKSPACE_BYTES,), torch.uint8),
    }
    assert fi["decode_in"] == {
        **plain["decode_in"],
        "fi_indptr": ((max_batch + 1,), torch.int32),
        "fi_indices": ((max_batch * width,), torch.int32),
        "fi_last": ((max_batch,), torch.int32),
    }
    # T2 grows by exactly the workspaces and the input region's new bytes.
    grown = t2_bytes(fi) - t2_bytes(plain)
    inputs = _layout(fi["decode_in"])[1] - _layout(plain["decode_in"])[1]
    assert (
        grown
        == flashinfer_decode.FLOAT_WORKSPACE_BYTES + flashinfer_decode.INT_WORKSPACE_BYTES + inputs
    )
    assert inputs >= 4 * (2 * max_batch + 1 + max_batch * width)


def test_engine_refuses_flashinfer_when_it_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    with pytest.raises(InvalidArgument, match="pip install flashinfer-python") as err:
        Engine(
            qwen3_tiny(),
            load_format="dummy",
            backend=FakeBackend(capacity="1GiB"),
            max_batch=2,
            max_seq_len=32,
            attention_backend="flashinfer",
        )
    assert "attention_backend='flashinfer'" in str(err.value)
    assert isinstance(err.value.__cause__, ImportError)


def test_engine_refuses_flashinfer_for_another_family():
    config = qwen3_tiny()
    config["model_type"] = "llama"
    with pytest.raises(InvalidArgument, match="serves the qwen3 family; 'llama'"):
        Engine(
            config,
            load_format="dummy",
            backend=FakeBackend(capacity="1GiB"),
            max_batch=2,
            max_seq_len=32,
            attention_backend="flashinfer",
        )


def test_engine_refuses_flashinfer_on_the_cpu(monkeypatch):
    # A FlashInfer that imports (an empty module stands in) but no GPU.
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    with pytest.raises(InvalidArgument, match="runs on a GPU only"):
        Engine(
            qwen3_tiny(),
            load_format="dummy",
            backend=FakeBackend(capacity="1GiB"),
            max_batch=2,
            max_seq_len=32,
            attention_backend="flashinfer",
        )


def test_the_model_names_its_backends_and_needs_the_wrappers_to_decode():
    from imp_mem.engine.checkpoint import random_weights
    from imp_mem.engine.model import KvViews, PagedModel

    config_dict = qwen3_tiny()
    config = ModelConfig.from_hf_config(config_dict)
    weights = random_weights(config_dict, seed=0)
    with pytest.raises(InvalidArgument, match="'triton', 'torch' or 'flashinfer'"):
        PagedModel(config, weights, attention_backend="flash")
    model = PagedModel(config, weights, attention_backend="flashinfer")
    kv = torch.zeros((4, 2, 2, 4, 2, 16))
    with pytest.raises(InvalidArgument, match="planned wrappers"):
        model.decode(
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.zeros((1, 4), dtype=torch.int32),
            None,
            KvViews(full=kv, swa=None, block_size=4),
        )


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import _fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer)
    wrapper = _fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper
    monkeypatch.setattr(wrapper, "plans", 0)
    monkeypatch.setattr(wrapper, "runs", 0)
    return wrapper


@pytest.mark.parametrize("kind", ["full", "swa"])
def test_engine_decode_through_flashinfers_api_equals_the_torch_backend(fake_flashinfer, kind):
    """The engine's plumbing (page table, staging, the T2 copy, one wrapper
    a bucket, the model's call) against a FlashInfer stand-in that follows
    its API and attends through the buffers it was given
    (`_fake_flashinfer`): the same greedy tokens as the torch backend, at
    buckets 4 (with a padding row), 2 and 1, across page boundaries; with
    sliding-window layers (``swa``: they stay on ours) too."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 257, size=n).tolist() for n in (5, 9, 14)]

    def serve(attention_backend):
        with Engine(
            qwen3_tiny(kind),
            load_format="dummy",
            seed=3,
            backend=FakeBackend(capacity="2GiB"),
            max_batch=4,
            max_seq_len=64,
            block_size=4,
            prefill_chunk=8,
            attention_backend=attention_backend,
        ) as e:
            if attention_backend == "flashinfer":
                wrappers = e.runner.flashinfer
                assert e.model.flashinfer is wrappers
                assert sorted(wrappers.wrappers) == [1, 2, 4]
                fi_work = (
                    flashinfer_decode.FLOAT_WORKSPACE_BYTES + flashinfer_decode.INT_WORKSPACE_BYTES
                )
                assert e.runner.t2_raw["fi_work"].numel() == fi_work
                del wrappers  # the engine's own references go at close
            outs = [e.generate(prompts, 11), e.generate(prompts[:2], 6), e.generate(prompts[:1], 4)]
            return outs, dict(e.stats.bucket_steps)

    ref, ref_steps = serve(None)
    got, steps = serve("flashinfer")
    assert got == ref
    assert steps == ref_steps and set(steps) == {1, 2, 4}
    # Every decode step planned once and ran each full-attention layer once
    # (the warm-up's decodes too, one a bucket).
    decodes = sum(steps.values()) + 3
    assert fake_flashinfer.plans == decodes
    assert fake_flashinfer.runs == (2 if kind == "full" else 1) * decodes
