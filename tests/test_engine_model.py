"""`PagedModel` against Hugging Face transformers on the CPU (issue 13).

Tiny configs of the two engine architectures (Qwen3 with full attention
only, and Qwen3 with sliding-window and full layers mixed), random weights
written once as a checkpoint that transformers loads. For each, the paged
model runs prompts in pieces (a prefix split across prefill calls, a prefix
shared between sequences through the block tables, SWA blocks freed as they
slide out of the window), then batched decode steps with padding rows, and
every position's logits are compared with HF's teacher-forced forward pass
over the whole sequence.

Tolerance: in float32 both sides compute the same operations in the same
order except attention (pages, float32 softmax, a different summation
order), so they agree to rounding: |Δlogit| ≤ 1e-4 with logits of order 1
(measured ≈ 1e-6). In bfloat16 the attention output rounds differently,
and the difference grows through the layers: a measured bound of the same
order as HF's own kernel-to-kernel noise (see the GPU test) is used.
Greedy tokens must agree wherever HF's top-2 margin exceeds twice the
tolerance.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _paged_kv import PagedCache  # noqa: E402

from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402
from imp_mem.engine.config import ModelConfig, swa_config  # noqa: E402
from imp_mem.engine.model import PagedModel  # noqa: E402
from imp_mem.engine.model.attention import paged_decode_attention_reference  # noqa: E402

BLOCK = 4
WINDOW = 7


def tiny(kind: str, dtype: str = "float32") -> dict:
    config = swa_config(window=WINDOW, pattern=2) if kind == "swa" else swa_config()
    config.update(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        torch_dtype=dtype,
        rope_theta=1000.0,
    )
    if kind == "swa":
        config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    else:
        config.update(use_sliding_window=False, sliding_window=None, layer_types=None)
    return config


@pytest.fixture(scope="module", params=["full", "swa"])
def models(request, tmp_path_factory):
    from safetensors.torch import load_file

    kind = request.param
    directory = write_random_checkpoint(
        tmp_path_factory.mktemp(f"ckpt-{kind}"), tiny(kind), seed=3, scale=0.1
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = ModelConfig.from_hf_config(directory)
    weights = load_file(str(directory / "model.safetensors"))
    return kind, hf, PagedModel(config, weights), config


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def check(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"{what}: max |Δlogit| {diff:.3g} > {tol}"
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * tol
    same = ours.argmax(-1) == ref.argmax(-1)
    assert same[decisive].all(), f"{what}: greedy token differs where HF's margin is decisive"


def test_config_matches_transformers(models):
    kind, hf, _, config = models
    c = hf.config
    assert config.layer_types == tuple(c.layer_types)
    assert config.sliding_window == (WINDOW if kind == "swa" else None)
    assert (c.sliding_window if kind == "swa" else None) == config.sliding_window
    assert config.rope_theta == c.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight


def test_prefill_in_pieces_matches_hf(models):
    kind, hf, model, config = models
    rng = random.Random(1)
    tokens = [rng.randrange(config.vocab_size) for _ in range(29)]
    cache = PagedCache(config, num_blocks=32, block_size=BLOCK, max_blocks_per_seq=12)
    cache.new_sequence(0)
    pieces = []
    # Chunk boundaries inside blocks and across them.
    for start, end in ((0, 5), (5, 16), (16, 17), (17, 29)):
        cache.ensure(0, end)
        cache.slide(0, start)
        pieces.append(
            model.prefill(
                torch.tensor(tokens[start:end]),
                start,
                cache.table(0, "full"),
                cache.table(0, "swa"),
                cache.kv,
            )
        )
    check(torch.cat(pieces), hf_logits(hf, tokens), 1e-4, f"{kind} prefill")
    last = model.prefill(
        torch.tensor(tokens[29:] or [1]),
        29,
        *_ensure(cache, 0, 30),
        cache.kv,
        last_only=True,
    )
    assert last.shape == (1, config.vocab_size)


def _ensure(cache, seq, end):
    cache.ensure(seq, end)
    return cache.table(seq, "full"), cache.table(seq, "swa")


def _backend(name: str) -> str:
    """``"triton"`` runs only on the CPU under Triton's interpreter, which
    ``test_engine_attention.py`` switches on (it runs first)."""
    if name == "triton":
        import os
        import sys

        kernel = sys.modules.get("imp_mem.engine.kernels.paged")
        if kernel is None and not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
            pytest.importorskip("triton")
            from imp_mem.engine.kernels import paged as kernel
        if kernel is None or not kernel._INTERPRETING:
            pytest.skip("the Triton path is tested on the GPU (tests/gpu)")
    return name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_matches_hf(models, backend):
    kind, hf, model, config = models
    model.attention_backend = _backend(backend)
    rng = random.Random(2)
    total = 30
    base = [rng.randrange(config.vocab_size) for _ in range(total)]
    # Sequence 1 shares sequence 0's first 8 tokens (two blocks); 2 and 3 are
    # unrelated, with different prompt lengths.
    seqs = {
        0: base,
        1: base[:8] + [rng.randrange(config.vocab_size) for _ in range(total - 8)],
        2: [rng.randrange(config.vocab_size) for _ in range(total)],
        3: [rng.randrange(config.vocab_size) for _ in range(total)],
    }
    prompt = {0: 11, 1: 13, 2: 5, 3: 20}
    ref = {s: hf_logits(hf, toks) for s, toks in seqs.items()}
    cache = PagedCache(config, num_blocks=64, block_size=BLOCK, max_blocks_per_seq=10)
    for s in seqs:
        share = s == 1
        cache.new_sequence(s, share_from=0 if share else None, shared_tokens=8 if share else 0)
        start = 8 if share else 0
        full, swa = _ensure(cache, s, prompt[s])
        logits = model.prefill(torch.tensor(seqs[s][start : prompt[s]]), start, full, swa, cache.kv)
        check(logits, ref[s][start : prompt[s]], 1e-4, f"{kind} prefill of {s}")
    pos = dict(prompt)
    order = [2, None, 0, 3, None, 1]  # padding rows between live ones
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
                check(logits[row], ref[s][pos[s]], 1e-4, f"{kind} decode of {s} at {pos[s]}")
                pos[s] += 1
    model.attention_backend = "torch"
    if kind == "swa":
        # Blocks really were given back as the window slid.
        assert min(cache.tables[0]["swa"][:3]) == -1


def test_reference_attention_skips_holes_and_window():
    """The reference against a dense per-sequence loop, with holes in the
    table and a window: the rule both kernels follow."""
    gen = torch.Generator().manual_seed(0)
    blocks, bs, kvh, group, d = 12, 4, 2, 3, 8
    kv = torch.randn(blocks, 1, 2, bs, kvh, d, generator=gen)
    tables = torch.tensor([[3, -1, 5, 7, 1], [2, 4, 6, -1, -1]], dtype=torch.int32)
    positions = torch.tensor([17, 10])
    q = torch.randn(2, kvh * group, d, generator=gen)
    for window in (None, 6):
        out = paged_decode_attention_reference(q, kv, 0, tables, positions, window=window)
        for b in range(2):
            p = int(positions[b])
            keys, vals = [], []
            for j in range(p + 1):
                block = int(tables[b, j // bs])
                if block < 0 or (window is not None and j <= p - window):
                    continue
                keys.append(kv[block, 0, 0, j % bs])
                vals.append(kv[block, 0, 1, j % bs])
            k, v = torch.stack(keys), torch.stack(vals)  # [L, kvh, d]
            for h in range(kvh * group):
                s = (k[:, h // group] @ q[b, h]) * d**-0.5
                expect = torch.softmax(s, 0) @ v[:, h // group]
                torch.testing.assert_close(out[b, h], expect, atol=1e-5, rtol=1e-5)


def test_weights_are_not_copied():
    from imp_mem.engine.checkpoint import random_weights

    weights = random_weights(tiny("full"), seed=0, scale=0.1)
    m = PagedModel(ModelConfig.from_hf_config(tiny("full")), weights)
    assert m.embed.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    w = m.layers[2].w["mlp.down_proj.weight"]
    assert w.data_ptr() == weights["model.layers.2.mlp.down_proj.weight"].data_ptr()


def test_bad_weights_are_refused():
    from imp_mem.engine.checkpoint import random_weights
    from imp_mem.errors import InvalidArgument

    config = ModelConfig.from_hf_config(tiny("full"))
    weights = random_weights(tiny("full"), seed=0, scale=0.1)
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(InvalidArgument, match="k_norm"):
        PagedModel(config, weights)
    weights = random_weights(tiny("full"), seed=0, scale=0.1)
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    with pytest.raises(InvalidArgument, match=r"model\.norm\.weight.*shape"):
        PagedModel(config, weights)
