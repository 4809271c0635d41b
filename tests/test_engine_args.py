"""`imp_mem.engine.args.EngineArgs` (issue 53): the engine's keyword
arguments checked once, with the messages `Engine` gives; an `Engine`
made from an `EngineArgs` serves as one made from its keywords. CPU,
torch needed for the engine itself."""

from __future__ import annotations

import dataclasses

import pytest

from imp_mem import FakeBackend, InvalidArgument
from imp_mem.engine.args import EngineArgs
from imp_mem.engine.config import ModelConfig

CONFIG = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    ("kw", "kind", "words"),
    [
        (dict(fused="yes"), TypeError, "fused must be True, False or None"),
        (dict(warmup_probe=3), TypeError, "warmup_probe must be True, False, None or 'inline'"),
        (dict(warmup_probe="later"), InvalidArgument, "warmup_probe='later'"),
        (dict(warmup_probe="inline", shared=True), InvalidArgument, "pass group=None"),
        (dict(load_format="gguf"), InvalidArgument, "load_format='gguf'"),
        (dict(load_format="safetensors"), InvalidArgument, "a config dict has no weights"),
    ],
)
def test_arguments_that_need_no_model_are_refused_when_made(kw, kind, words):
    with pytest.raises(kind, match=words):
        EngineArgs(dict(CONFIG), **{"load_format": "dummy", **kw})


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(max_seq_len=129), r"max_seq_len=129 is above the model's max_position_embeddings"),
        (dict(prefill_chunk=0), "prefill_chunk must be at least 1, got 0"),
        (dict(prefill_batch_tokens=8, prefill_chunk=16), "prefill_batch_tokens=8"),
        (dict(prefill_batch_tokens=True), "prefill_batch_tokens=True"),
        (dict(attention_backend="flashinfer"), "serves the qwen3 family"),
    ],
)
def test_arguments_that_need_the_model_are_refused_by_for_model(kw, words):
    args = EngineArgs(dict(CONFIG), load_format="dummy", **{"max_seq_len": 64, **kw})
    with pytest.raises(InvalidArgument, match=words):
        args.for_model(ModelConfig.from_hf_config(CONFIG))


def test_for_model_resolves_the_chunk_and_a_shared_gpus_budget():
    config = ModelConfig.from_hf_config(CONFIG)
    args = EngineArgs(dict(CONFIG), load_format="dummy", max_seq_len=64).for_model(config)
    assert args.prefill_chunk == 64, "512 by default, at most max_seq_len"
    shared = EngineArgs(
        dict(CONFIG), load_format="dummy", max_seq_len=64, shared={"cap": 1 << 30}, budget="8GiB"
    ).for_model(config)
    assert shared.budget == 1 << 30 and shared.kv_growable
    assert shared.shared is not None and shared.shared.cap == 1 << 30
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_batch = 3  # type: ignore[misc]


def test_an_engine_of_engine_args_serves_as_one_of_keywords():
    pytest.importorskip("torch")
    from imp_mem.engine import Engine

    kw = dict(load_format="dummy", seed=3, max_batch=2, max_seq_len=64)
    prompts = [[1, 2, 3], [4, 5]]
    with Engine(dict(CONFIG), backend=FakeBackend(capacity="1GiB"), **kw) as e:
        expected = e.generate(prompts, 4)
        assert e.args.max_batch == 2 and e.max_batch == 2
    args = EngineArgs(dict(CONFIG), backend=FakeBackend(capacity="1GiB"), **kw)
    with Engine(args) as e:
        assert e.generate(prompts, 4) == expected
        assert e.args.prefill_chunk == 64
    with pytest.raises(InvalidArgument, match=r"max_batch=\.\.\.\): pass the arguments"):
        Engine(args, max_batch=4)
