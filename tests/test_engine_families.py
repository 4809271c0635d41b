"""The families after Qwen3 (issue 26) on the CPU: each family's config,
weight names and plan lines against its ``config.json`` and the planner,
and a tiny random model of each against transformers' model of the same
type on the same weights, through the engine (fake backend, dummy load:
random weights drawn in T1 from a seed, the same values
`write_random_checkpoint` writes for transformers).

Tolerance as in `test_engine_model`: float32 on both sides, the same
operations up to attention's summation order (and, for the MoE, the
experts' accumulation order), so teacher-forced logits agree to 1e-4 and
greedy tokens wherever transformers' top-2 margin is above 1e-3.
"""

from __future__ import annotations

import json
import math
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _paged_kv import PagedCache  # noqa: E402

from imp_mem import FakeBackend, InvalidArgument, ModelShape  # noqa: E402
from imp_mem.engine import Engine  # noqa: E402
from imp_mem.engine.checkpoint import random_weights, write_random_checkpoint  # noqa: E402
from imp_mem.engine.config import SUPPORTED_MODEL_TYPES, ModelConfig  # noqa: E402
from imp_mem.engine.dummy import layout_bytes  # noqa: E402
from imp_mem.engine.model import build_model, weight_names  # noqa: E402

TOL = 1e-4
MARGIN = 1e-3
SCALE = 0.1

COMMON = {
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}


def tiny(family: str) -> dict:
    """A tiny float32 config.json of `family` (every feature the family has)."""
    if family == "llama":
        return {
            **COMMON,
            "model_type": "llama",
            "rope_theta": 500000.0,
            # Llama-3.1's scaling, with a short original context so the
            # three frequency bands all occur at 16 channels.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        }
    if family == "llama_tied":
        return {**tiny("llama"), "tie_word_embeddings": True}
    if family == "qwen3_moe":
        return {
            **COMMON,
            "model_type": "qwen3_moe",
            "head_dim": 16,
            "rope_theta": 10000.0,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "tie_word_embeddings": False,
        }
    if family == "deepseek_v2":
        # DeepSeek-V2-Lite's form (no q_lora_rank), shrunk.
        return {
            **COMMON,
            "model_type": "deepseek_v2",
            "num_key_value_heads": 4,
            "rope_theta": 10000.0,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.5,
            "topk_method": "greedy",
            "tie_word_embeddings": False,
        }
    if family == "deepseek_v2_qlora":
        # With q LoRA and DeepSeek-V2's YaRN scaling (a short original
        # context so the ramp falls inside the 8 rotary channels).
        return {
            **tiny("deepseek_v2"),
            "q_lora_rank": 24,
            "n_shared_experts": 2,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 64,
            },
        }
    if family == "gemma3_text":
        return {
            **COMMON,
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "head_dim": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 24,
            "sliding_window": 7,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
        }
    raise KeyError(family)


FAMILIES = ["llama", "llama_tied", "qwen3_moe", "deepseek_v2", "deepseek_v2_qlora", "gemma3_text"]
MLA = ("deepseek_v2", "deepseek_v2_qlora")


def hf_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    config = tiny(name)
    directory = write_random_checkpoint(
        tmp_path_factory.mktemp(f"fam-{name}"), config, seed=11, scale=SCALE
    )
    return name, config, directory, hf_model(directory)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def check(ours, ref, what):
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{what}: max |Δlogit| {diff:.3g} > {TOL}"
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > MARGIN
    same = ours.argmax(-1) == ref.argmax(-1)
    assert same[decisive].all(), f"{what}: greedy token differs where HF's margin is decisive"


# -- config, names, plan ------------------------------------------------------


def test_unserved_model_type_is_refused_naming_the_served():
    with pytest.raises(InvalidArgument) as e:
        ModelConfig.from_hf_config({**COMMON, "model_type": "mistral"})
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(e.value)
    assert "mistral" in str(e.value)


def test_weight_names_are_transformers_own(family, tmp_path):
    """Every name and shape the engine reads is what transformers'
    ``save_pretrained`` writes for a model of the same config (the
    checkpoint format: per-expert tensors, not its fused stacks), and
    transformers loads the engine's checkpoint with nothing missing."""
    _, config, _, hf = family
    from safetensors import safe_open

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert weight_names(ModelConfig.from_hf_config(config)) == saved
    # The fixture's transformers model (loaded from the engine's names) has
    # as many parameters as they hold (a tied head counted once).
    params = sum(p.numel() for p in hf.parameters())
    assert params == sum(math.prod(s) for s in saved.values())


def test_plan_lines_match_what_is_loaded(family):
    """The planner's parameter count (what its weights line is priced
    from, norms aside) is the engine's tensors; for the MoE, its expert
    line is exactly the routed experts' bytes."""
    name, config, _, _ = family
    c = ModelConfig.from_hf_config(config)
    shape = ModelShape.from_hf_config(config)
    names = weight_names(c)
    norms = sum(math.prod(s) for n, s in names.items() if n.endswith("norm.weight"))
    total = sum(math.prod(s) for s in names.values())
    assert shape.params == total - norms
    assert shape.num_layers == c.num_layers
    per_token = shape.kv_bytes_per_token("f32")
    if name in MLA:
        # The latent line: kv_lora_rank + qk_rope_head_dim per token per layer.
        assert shape.attention_kind == "mla"
        assert per_token["total"] == c.num_layers * (32 + 8) * 4
    else:
        assert shape.attention_kind == "gqa"
        assert per_token["total"] == c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    assert shape.sliding_layers == len(c.sliding_layers)
    assert shape.sliding_window == c.sliding_window
    spec = json.loads(shape.to_json())["weights"]
    expert_bytes = sum(4 * math.prod(s) for n, s in names.items() if ".mlp.experts." in n)
    assert spec["expert_params"] * 4 == expert_bytes
    if c.extra.get("num_experts"):
        moe = shape.moe
        assert moe is not None
        assert moe["num_experts"] == c.extra["num_experts"] == 8
        assert moe["experts_per_token"] == c.extra["top_k"] == 2
        assert moe["moe_layers"] == len(c.extra["moe_layers"]) == 2
        assert moe["shared_intermediate_size"] == 32 * c.extra["shared_experts"]
        assert expert_bytes == 2 * 8 * 3 * 64 * 32 * 4
    else:
        assert shape.moe is None and expert_bytes == 0
    # A dummy engine's weights line is the layout it takes, to the byte.
    assert layout_bytes(c) >= 4 * total


# -- the model against transformers ---------------------------------------------


def test_prefill_and_decode_match_transformers(family):
    name, config, directory, hf = family
    from safetensors.torch import load_file

    c = ModelConfig.from_hf_config(config)
    model = build_model(c, load_file(str(directory / "model.safetensors")))
    rng = random.Random(3)
    total = 30
    seqs = {s: [rng.randrange(c.vocab_size) for _ in range(total)] for s in range(3)}
    prompt = {0: 11, 1: 4, 2: 17}
    ref = {s: hf_logits(hf, t) for s, t in seqs.items()}
    cache = PagedCache(c, num_blocks=64, block_size=4, max_blocks_per_seq=10)
    if name in MLA:
        # MLA's pages: one latent per token per layer (NaN outside contexts).
        cache.pools["full"] = torch.full((64, c.num_layers, 4, 32 + 8), float("nan"))
    for s in seqs:
        cache.new_sequence(s)
        # The prompt in two pieces (a prefix already in the pages).
        for start, end in ((0, prompt[s] // 2), (prompt[s] // 2, prompt[s])):
            if end <= start:
                continue
            cache.ensure(s, end)
            cache.slide(s, start)
            out = model.prefill(
                torch.tensor(seqs[s][start:end]),
                start,
                cache.table(s, "full"),
                cache.table(s, "swa"),
                cache.kv,
            )
            check(out, ref[s][start:end], f"{name} prefill of {s} [{start}, {end})")
    pos = dict(prompt)
    order = [1, None, 0, 2]
    while any(pos[s] < total for s in seqs):
        live = [s if s is not None and pos[s] < total else None for s in order]
        for s in live:
            if s is not None:
                cache.ensure(s, pos[s] + 1)
                cache.slide(s, pos[s])
        ids = torch.tensor([0 if s is None else seqs[s][pos[s]] for s in live])
        positions = torch.tensor([0 if s is None else pos[s] for s in live])
        logits = model.decode(
            ids,
            positions,
            cache.batch_tables(live, "full"),
            cache.batch_tables(live, "swa"),
            cache.kv,
        )
        for row, s in enumerate(live):
            if s is not None:
                check(logits[row], ref[s][pos[s]], f"{name} decode of {s} at {pos[s]}")
                pos[s] += 1


def test_engine_dummy_load_serves_greedy_tokens_of_transformers(family):
    """A dummy engine (no checkpoint: the config dict and a seed) holds in
    T1 exactly the weights transformers was given, and serves its greedy
    tokens."""
    name, config, _, hf = family
    engine = Engine(
        config,
        load_format="dummy",
        seed=11,
        dummy_scale=SCALE,
        backend=FakeBackend(capacity="1GiB"),
        max_batch=4,
        max_seq_len=64,
        block_size=4,
        prefill_chunk=8,
    )
    try:
        ref = random_weights(config, seed=11, scale=SCALE)
        assert set(engine.weights) == set(ref)
        for n, t in ref.items():
            assert torch.equal(engine.weights[n], t), n
        # Every tensor views T1, and the plan's weights line is the layout.
        assert engine.system.weights_arena.used == layout_bytes(engine.config)
        assert engine.plan.weights >= engine.system.weights_arena.used
        rng = random.Random(5)
        ps = [[rng.randrange(257) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
        outs = engine.generate(ps, 6)
        for p, o in zip(ps, outs, strict=True):
            logits = hf_logits(hf, p + o[:-1])
            for k, tok in enumerate(o):
                row = logits[len(p) - 1 + k]
                top2 = row.topk(2).values
                if (top2[0] - top2[1]).item() > MARGIN:
                    assert tok == row.argmax().item(), f"{name}: token {k} of {o} differs"
        stats = engine.backend.stats()
        assert sum(stats["steady_state_allocations_total"].values()) == 0
        # The KV views are the planner's KV line: a block of the pool is
        # block_size tokens of the plan's bytes per token, in the model's layout.
        c = engine.config
        per_token = ModelShape.from_hf_config(config).kv_bytes_per_token("f32")
        full = engine.kv_views.full
        assert engine.system.kv_pool.block_bytes == 4 * per_token["full"]
        assert full[0].numel() * full.element_size() == 4 * per_token["full"]
        if name in MLA:
            assert tuple(full.shape[1:]) == (c.num_layers, 4, 32 + 8)
        if c.sliding_layers:
            assert engine.system.swa_pool.block_bytes == 4 * per_token["sliding"]
        del full
    finally:
        engine.close()


def test_engine_loads_a_family_checkpoint(family):
    """The safetensors loader (the default) serves a family's checkpoint
    too; its greedy tokens are the dummy engine's on the same weights."""
    name, config, directory, _ = family
    if name not in ("llama", "qwen3_moe", "deepseek_v2"):
        pytest.skip("the loader's path is the same for every family; three cover it")
    kw = dict(max_batch=2, max_seq_len=32, block_size=4, prefill_chunk=8)
    ps = [[1, 2, 3, 4, 5], [9, 8, 7]]
    with Engine(directory, backend=FakeBackend(capacity="1GiB"), **kw) as e:
        from_disk = e.generate(ps, 5)
        # The loader lays each MoE layer's experts end to end (the model's
        # stacks, for the grouped GEMM), as the dummy load does.
        stacks = getattr(e.model, "stacks", {})
        assert all(pair is not None for pair in stacks.values())
        assert len(stacks) == len(e.config.extra.get("moe_layers", ()))
        del stacks
    with Engine(
        config,
        load_format="dummy",
        seed=11,
        dummy_scale=SCALE,
        backend=FakeBackend(capacity="1GiB"),
        **kw,
    ) as e:
        assert e.generate(ps, 5) == from_disk


def test_dummy_is_deterministic_and_seeded():
    config = tiny("llama")
    a = random_weights(config, seed=1)
    b = random_weights(config, seed=1)
    c = random_weights(config, seed=2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    # Sensible scale: finite, not degenerate logits from a dummy engine.
    with Engine(
        config,
        load_format="dummy",
        backend=FakeBackend(capacity="1GiB"),
        max_batch=2,
        max_seq_len=32,
        block_size=4,
    ) as e:
        e.generate([[1, 2, 3]], 2)
        logits = e.runner.t2["logits"][:1].clone()
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_dummy_arguments_are_checked(tmp_path):
    with pytest.raises(InvalidArgument, match="load_format"):
        Engine(tiny("llama"), load_format="gguf")
    with pytest.raises(InvalidArgument, match="dummy"):
        Engine(tiny("llama"))


def test_moe_grouped_path_equals_masked_loop():
    """The grouped-GEMM experts (over stacked views of T1, as the dummy
    load lays them) against the masked loop, on the CPU."""
    from imp_mem.engine.model import moe

    if not moe.grouped_mm_available():
        pytest.skip("torch has no _grouped_mm")
    gen = torch.Generator().manual_seed(0)
    e, i, h, n, k = 8, 32, 64, 13, 2
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.1
    down = torch.randn(e, h, i, generator=gen) * 0.1
    x = torch.randn(n, h, generator=gen)
    logits = torch.randn(n, e, generator=gen)
    weights, ids = moe.route_softmax_topk(logits, k, norm_topk_prob=True)
    experts = [(gate_up[j, :i], gate_up[j, i:], down[j]) for j in range(e)]
    ref = moe.experts_masked(x, ids, weights, experts)
    out = moe.experts_grouped(x, ids, weights, gate_up, down)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The stacks are found again from the per-expert views, without a copy.
    flat = [t for g, u, _ in experts for t in (g, u)]
    view = moe.stack_views([flat[0]], (e, 2 * i, h), [[g, u] for g, u, _ in experts])
    assert view is not None and view.data_ptr() == gate_up.data_ptr()
    assert torch.equal(view, gate_up)
    # Separate tensors are no stack.
    loose = [(g.clone(), u.clone(), d) for g, u, d in experts]
    assert moe.stack_views([loose[0][0]], (e, 2 * i, h), [[g, u] for g, u, _ in loose]) is None


def test_moe_dummy_engine_runs_the_grouped_path(family):
    """In a dummy engine the experts lie stacked in T1: the model finds
    every MoE layer's stacks, and the grouped path serves the masked
    loop's tokens."""
    name, config, _, _ = family
    if name not in ("qwen3_moe", "deepseek_v2"):
        pytest.skip("MoE families only")
    from imp_mem.engine.model import moe

    with Engine(
        config,
        load_format="dummy",
        seed=11,
        dummy_scale=SCALE,
        backend=FakeBackend(capacity="1GiB"),
        max_batch=2,
        max_seq_len=32,
        block_size=4,
    ) as e:
        model = e.model
        assert sorted(model.stacks) == list(e.config.extra["moe_layers"])
        for index, pair in model.stacks.items():
            assert pair is not None
            w = e.weights[f"model.layers.{index}.mlp.experts.3.up_proj.weight"]
            assert torch.equal(pair[0][3, 32:], w)
            assert pair[0][3, 32:].data_ptr() == w.data_ptr()
        ps = [[1, 2, 3, 4], [7, 7, 9]]
        model.moe_backend = "masked"
        masked = e.generate(ps, 4)
        if moe.grouped_mm_available():
            model.moe_backend = "grouped"
            assert e.generate(ps, 4) == masked
        del model, pair, w


def test_transformers_model_holds_the_dummy_weights(family):
    """`transformers_model` (the GPU test's and the benchmark's peer, built
    without a checkpoint) equals transformers' load of the checkpoint."""
    from imp_mem.engine.dummy import transformers_model

    _, config, _, hf = family
    built = transformers_model(config, seed=11, scale=SCALE, device="cpu").state_dict()
    loaded = hf.state_dict()
    assert set(built) == set(loaded)
    for k, t in loaded.items():
        assert torch.equal(built[k], t), k


def test_demo_serves_a_family_with_dummy_weights():
    """The demo's engine path (the CLI's ``demo --engine-config ...
    --load-format dummy`` on a GPU) on the fake backend: no checkpoint is
    written, the family serves."""
    from imp_mem.engine.demo import run_engine_demo

    lines: list[str] = []
    rc = run_engine_demo(
        FakeBackend(capacity="1GiB"),
        lines.append,
        seconds=0.3,
        max_batch=2,
        max_seq_len=64,
        prompt_len=(2, 8),
        max_new_tokens=(2, 4),
        config=tiny("qwen3_moe"),
        load_format="dummy",
        seed=4,
    )
    assert rc == 0
    text = "\n".join(lines)
    assert "load_format='dummy'" in text and "writing" not in text
    assert "decode tokens" in text


def test_dummy_engine_sleeps_and_refills_from_its_seed():
    """A dummy engine's lifecycle: its load pins exactly the layout for a
    level-1 sleep; after a level-2 sleep (weights dropped) `reload_weights()`
    draws the seed's values again in place and the tokens come back; a
    swap is refused (there is no checkpoint)."""
    config = tiny("qwen3_moe")
    kw = dict(max_batch=2, max_seq_len=32, block_size=4, prefill_chunk=8)
    ps = [[3, 1, 4, 1, 5], [9, 2, 6]]
    with Engine(
        config, load_format="dummy", seed=2, backend=FakeBackend(capacity="256MiB"), **kw
    ) as e:
        assert e.memory.pinned_bytes == e.system.weights_arena.used == layout_bytes(e.config)
        before = e.generate(ps, 4)
        e.sleep(2)
        e.wake()
        with pytest.raises(InvalidArgument, match="level-2 sleep dropped the weights"):
            e.generate(ps, 4)
        report = e.reload_weights()
        assert report["tensors"] == len(weight_names(e.config))
        assert e.generate(ps, 4) == before
        with pytest.raises(InvalidArgument, match="dummy"):
            e.swap_model("/nonexistent")


def test_families_refuse_tensor_parallelism():
    from imp_mem.engine.tensor_parallel import TensorParallel

    config = tiny("llama")
    c = ModelConfig.from_hf_config(config)
    weights = random_weights(config, seed=0)
    with pytest.raises(InvalidArgument, match="tp=1"):
        build_model(c, weights, tp=TensorParallel(c, tp=2, rank=0))
    # Its weights by HF name and shape are checked as PagedModel checks them.
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InvalidArgument, match="up_proj"):
        build_model(c, weights)
