"""Gemma-3 with its vision tower (``model_type: gemma3``, issue 26) on the
CPU: the config, the checkpoint's names, the plan's ``vision_tower`` line,
and a tiny random model against transformers'
``Gemma3ForConditionalGeneration`` on the same weights with an image
(teacher-forced logits, greedy tokens), through the model and through the
engine (fake backend; dummy load and a safetensors checkpoint), a request
without an image, bad images refused, and the prefix cache keyed by the
image.

Tolerance as in `test_engine_families`: float32 on both sides, so logits
agree to 1e-4 and greedy tokens wherever transformers' top-2 margin is
above 1e-3.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _paged_kv import PagedCache  # noqa: E402

from imp_mem import FakeBackend, InvalidArgument  # noqa: E402
from imp_mem.engine import Engine  # noqa: E402
from imp_mem.engine.checkpoint import random_weights, write_random_checkpoint  # noqa: E402
from imp_mem.engine.config import SUPPORTED_MODEL_TYPES, ModelConfig  # noqa: E402
from imp_mem.engine.dummy import layout_bytes, vision_bytes  # noqa: E402
from imp_mem.engine.model import build_model, weight_names  # noqa: E402
from imp_mem.engine.model.siglip import is_vision_name  # noqa: E402

TOL = 1e-4
MARGIN = 1e-3
SCALE = 0.1
IMG = 256  # image_token_index: inside the vocabulary, as gemma-3-4b's
MM = 4  # mm_tokens_per_image
MIB = 1 << 20


def tiny(layer_types=None) -> dict:
    """A tiny float32 gemma3 config.json: a 4-layer Gemma-3 text model
    (sliding and full layers, window 7) and a 2-layer SigLIP tower over
    16 x 16 images in 4 x 4 patches, pooled to 4 image tokens."""
    return {
        "model_type": "gemma3",
        "torch_dtype": "float32",
        "mm_tokens_per_image": MM,
        "image_token_index": IMG,
        "text_config": {
            "model_type": "gemma3_text",
            "vocab_size": 257,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 24,
            "sliding_window": 7,
            "layer_types": layer_types
            or ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 4,
            "vision_use_head": False,
        },
    }


def image(seed: int) -> torch.Tensor:
    return torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(seed))


def prompt(rng: random.Random, before: int, after: int) -> list[int]:
    return (
        [rng.randrange(IMG) for _ in range(before)]
        + [IMG] * MM
        + [rng.randrange(IMG) for _ in range(after)]
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny()
    directory = write_random_checkpoint(
        tmp_path_factory.mktemp("gemma3-vision"), config, seed=11, scale=SCALE
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    return config, directory, hf


def hf_logits(hf, tokens, pixels=None):
    ids = torch.tensor([tokens])
    kw = {}
    if pixels is not None:
        kw = {"pixel_values": pixels.reshape(1, 3, 16, 16), "token_type_ids": (ids == IMG).long()}
    with torch.no_grad():
        return hf(input_ids=ids, **kw).logits[0].float()


def check(ours, ref, what):
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{what}: max |Δlogit| {diff:.3g} > {TOL}"
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > MARGIN
    assert (ours.argmax(-1) == ref.argmax(-1))[decisive].all(), f"{what}: greedy token differs"


def check_greedy(hf, p, out, pixels, what):
    logits = hf_logits(hf, p + out[:-1], pixels)
    decisive = 0
    for k, tok in enumerate(out):
        row = logits[len(p) - 1 + k]
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() > MARGIN:
            decisive += 1
            assert tok == row.argmax().item(), f"{what}: token {k} of {out} differs"
    return decisive


def engine(config, **kw):
    args = dict(
        load_format="dummy",
        seed=11,
        dummy_scale=SCALE,
        backend=FakeBackend(capacity="1GiB"),
        max_batch=4,
        max_seq_len=64,
        block_size=4,
        prefill_chunk=8,
    )
    args.update(kw)
    if not isinstance(config, dict):
        args.pop("load_format"), args.pop("seed"), args.pop("dummy_scale")
    return Engine(config, **args)


# -- config and names ------------------------------------------------------------


def test_config_reads_the_text_model_as_gemma3_text_and_the_tower():
    config = tiny()
    c = ModelConfig.from_hf_config(config)
    assert "gemma3" in SUPPORTED_MODEL_TYPES and c.model_type == "gemma3"
    text = ModelConfig.from_hf_config({**config["text_config"], "torch_dtype": "float32"})
    assert text.model_type == "gemma3_text"
    for field in ("hidden_size", "num_layers", "num_heads", "head_dim", "layer_types", "dtype"):
        assert getattr(c, field) == getattr(text, field), field
    assert c.extra["rope_local_base_freq"] == text.extra["rope_local_base_freq"] == 10000.0
    v = c.vision
    assert v["hidden_size"] == 32 and v["image_size"] == 16 and v["patch_size"] == 4
    assert v["mm_tokens_per_image"] == MM and v["image_token_index"] == IMG
    assert v["num_channels"] == 3 and v["layer_norm_eps"] == 1e-6  # SigLIP's defaults
    assert text.vision is None
    # gemma-3-4b's config.json leaves most fields to the class defaults.
    real = {
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "image_token_index": 262144,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
        "torch_dtype": "bfloat16",
    }
    r = ModelConfig.from_hf_config(real)
    assert (r.num_heads, r.num_kv_heads, r.head_dim, r.vocab_size) == (8, 4, 256, 262208)
    assert r.tie_word_embeddings and r.dtype == "bfloat16"
    assert r.layer_types.count("full_attention") == 5  # every sixth of 34
    assert r.vision["image_size"] == 896 and r.vision["mm_tokens_per_image"] == 256
    # The planner's preset (the GPU test's and the bench's config) writes
    # the defaults in: the engine reads the same model from it.
    from imp_mem._presets import preset

    assert ModelConfig.from_hf_config(preset("gemma-3-4b")) == r


@pytest.mark.parametrize(
    "change, match",
    [
        ({"vision_config": {"vision_use_head": True}}, "vision_use_head"),
        ({"mm_tokens_per_image": 3}, "mm_tokens_per_image"),
        ({"vision_config": {"image_size": 18, "vision_use_head": False}}, "patch grid"),
        ({"vision_config": {"hidden_act": "relu", "vision_use_head": False}}, "hidden_act"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"image_token_index": -1}, "image_token_index"),
    ],
)
def test_config_refuses_what_is_not_served(change, match):
    config = tiny()
    for key, value in change.items():
        if isinstance(value, dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    if "tie_word_embeddings" in change:
        config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    with pytest.raises(InvalidArgument, match=match):
        ModelConfig.from_hf_config(config)


def test_weight_names_are_transformers_own(checkpoint, tmp_path):
    """The names and shapes are what transformers' ``save_pretrained``
    writes, the tower's after the language model's (the plan's lines)."""
    config, _, hf = checkpoint
    from safetensors import safe_open

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = weight_names(ModelConfig.from_hf_config(config))
    assert names == saved
    flags = [is_vision_name(n) for n in names]
    assert flags == sorted(flags) and any(flags)
    assert sum(p.numel() for p in hf.parameters()) == sum(math.prod(s) for s in names.values())


# -- the model against transformers -------------------------------------------------


def test_prefill_and_decode_with_an_image_match_transformers(checkpoint):
    """Teacher-forced logits with an image: the image in the middle of a
    chunk and across the sliding window, a prefix before it in the pages;
    then decode. The image's bidirectional attention and the image itself
    both move transformers' logits well past the tolerance."""
    config, directory, hf = checkpoint
    from safetensors.torch import load_file

    c = ModelConfig.from_hf_config(config)
    model = build_model(c, load_file(str(directory / "model.safetensors")))
    rng = random.Random(3)
    seq = prompt(rng, 5, 16)
    pixels = image(1)
    ref = hf_logits(hf, seq, pixels)
    ids = torch.tensor([seq])
    with torch.no_grad():
        causal = hf(input_ids=ids, pixel_values=pixels[None]).logits[0].float()
    assert (ref - causal).abs().max() > 0.1
    assert (ref - hf_logits(hf, seq, image(2))).abs().max() > 0.1
    emb = model.encode_images(pixels[None])
    with torch.no_grad():
        want = hf.model.get_image_features(pixels[None]).pooler_output
    assert (emb - want).abs().max() <= 1e-5
    cache = PagedCache(c, num_blocks=64, block_size=4, max_blocks_per_seq=10)
    cache.new_sequence(0)
    mm = (5, 9, emb[0])
    for start, end in ((0, 3), (3, 14)):
        cache.ensure(0, end)
        cache.slide(0, start)
        out = model.prefill(
            torch.tensor(seq[start:end]),
            start,
            cache.table(0, "full"),
            cache.table(0, "swa"),
            cache.kv,
            mm=mm,
        )
        check(out, ref[start:end], f"prefill [{start}, {end})")
    for pos in range(14, len(seq)):
        cache.ensure(0, pos + 1)
        cache.slide(0, pos)
        logits = model.decode(
            torch.tensor([seq[pos]]),
            torch.tensor([pos]),
            cache.batch_tables([0], "full"),
            cache.batch_tables([0], "swa"),
            cache.kv,
        )
        check(logits[0], ref[pos], f"decode at {pos}")
    # An image split across two calls is refused, not computed wrongly.
    cache.new_sequence(1)
    cache.ensure(1, 7)
    with pytest.raises(InvalidArgument, match="image"):
        model.prefill(
            torch.tensor(seq[:7]), 0, cache.table(1, "full"), cache.table(1, "swa"), cache.kv, mm=mm
        )


@pytest.fixture(scope="module")
def model(checkpoint):
    config, directory, _ = checkpoint
    from safetensors.torch import load_file

    return build_model(
        ModelConfig.from_hf_config(config), load_file(str(directory / "model.safetensors"))
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_chunking_that_keeps_the_image_whole_gives_the_same_logits(model, data):
    """Invariant of the prefill with an image: cut the prompt into chunks
    anywhere outside the image's tokens (a prefix in the pages, the rest
    later) and the logits are the one-call prefill's; a cut inside the
    image is refused, never computed with half its bidirectional keys."""
    c = model.config
    lo = data.draw(st.integers(0, 14), label="image start")
    total = data.draw(st.integers(lo + MM + 1, 30), label="length")
    rng = random.Random(data.draw(st.integers(0, 2**16), label="seed"))
    seq = [rng.randrange(IMG) for _ in range(lo)] + [IMG] * MM
    seq += [rng.randrange(IMG) for _ in range(total - len(seq))]
    emb = model.encode_images(image(rng.randrange(100))[None])[0]
    mm = (lo, lo + MM, emb)
    legal = [x for x in range(1, total) if not lo < x < lo + MM]
    cuts = sorted(data.draw(st.sets(st.sampled_from(legal), max_size=4), label="cuts"))

    def run(bounds):
        cache = PagedCache(c, num_blocks=64, block_size=4, max_blocks_per_seq=10)
        cache.new_sequence(0)
        out = []
        for start, end in itertools.pairwise(bounds):
            cache.ensure(0, end)
            cache.slide(0, start)
            out.append(
                model.prefill(
                    torch.tensor(seq[start:end]),
                    start,
                    cache.table(0, "full"),
                    cache.table(0, "swa"),
                    cache.kv,
                    mm=mm,
                )
            )
        return torch.cat(out)

    whole = run([0, total])
    chunked = run([0, *cuts, total])
    assert (chunked - whole).abs().max().item() <= 1e-5
    inside = data.draw(st.integers(lo + 1, lo + MM - 1), label="bad cut")
    with pytest.raises(InvalidArgument, match="image"):
        run([0, inside, total])


# -- the engine ---------------------------------------------------------------------


def test_engine_serves_images_with_the_tower_in_t1_on_its_plan_line(checkpoint):
    """A dummy engine holds in T1 exactly transformers' weights, the tower
    on the plan's ``vision_tower`` line at its bytes; it serves greedy
    tokens of transformers with images (an image across a chunk boundary
    included) and without."""
    config, _, hf = checkpoint
    with engine(config) as e:
        c = e.config
        ref = random_weights(config, seed=11, scale=SCALE)
        assert set(e.weights) == set(ref)
        assert all(torch.equal(e.weights[n], t) for n, t in ref.items())
        # The tower's tensors view T1, and their bytes are the plan's line.
        tower = vision_bytes(c)
        params = sum(
            p.numel() * 4
            for n, p in hf.named_parameters()
            if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))
        )
        count = sum(1 for n in ref if is_vision_name(n))
        assert params <= tower < params + 256 * (count + 1)
        assert e.plan_input.features.vision_tower_bytes == tower
        assert e.plan.to_dict()["vision_tower"] == -(-tower // MIB) * MIB
        assert e.plan.weights == -(-(layout_bytes(c) - tower) // MIB) * MIB
        assert e.system.weights_arena.used == layout_bytes(c)
        assert "vision_tower" in {line["key"] for line in e.plan.to_dict()["charges"]}
        # The first tensor sits at T1's start, the tower past the language model.
        base = e.weights["language_model.model.embed_tokens.weight"].data_ptr()
        for n in (
            "multi_modal_projector.mm_input_projection_weight",
            "vision_tower.post_layernorm.bias",
        ):
            at = e.weights[n].data_ptr() - base
            assert layout_bytes(c) - tower <= at < layout_bytes(c), n
        rng = random.Random(5)
        ps = [prompt(rng, 5, 4), prompt(rng, 1, 9), prompt(rng, 6, 2), [1, 2, 3, 4, 5, 6]]
        imgs = [image(1), image(2), image(3).to(torch.bfloat16).float(), None]
        outs = e.generate(ps, 6, images=imgs)
        decisive = 0
        for p, o, img in zip(ps, outs, imgs, strict=True):
            decisive += check_greedy(hf, p, o, img, "engine")
        assert decisive >= 12
        assert sum(e.backend.stats()["steady_state_allocations_total"].values()) == 0
        # The same prompt with another image gives other tokens somewhere.
        other = e.generate(ps[:3], 6, images=[image(7), image(8), image(9)])
        assert other != outs[:3]


def test_engine_loads_a_gemma3_checkpoint(checkpoint):
    """The safetensors loader lays the tower into T1 too, within the
    plan's weights and vision lines; greedy tokens are the dummy engine's."""
    config, directory, _ = checkpoint
    rng = random.Random(9)
    ps = [prompt(rng, 3, 5), [7, 8, 9]]
    imgs = [image(4), None]
    with engine(directory) as e:
        tower = vision_bytes(e.config)
        assert e.plan.to_dict()["vision_tower"] == -(-tower // MIB) * MIB
        assert e.system.weights_arena.used <= e.plan.weights + e.plan.to_dict()["vision_tower"]
        from_disk = e.generate(ps, 5, images=imgs)
    with engine(config) as e:
        assert e.generate(ps, 5, images=imgs) == from_disk


def test_bad_images_are_refused_naming_the_argument(checkpoint):
    config, _, _ = checkpoint
    rng = random.Random(2)
    p = prompt(rng, 2, 3)
    with engine(config) as e:
        cases = [
            (torch.zeros(3, 16, 15), "shape"),
            (torch.zeros(2, 3, 16, 16), "shape"),
            (torch.zeros(1, 16, 16), "shape"),
            (torch.zeros(3, 16, 16, dtype=torch.int64), "dtype"),
            (torch.full((3, 16, 16), float("nan")), "NaN"),
            ("a picture", "tensor"),
        ]
        for bad, match in cases:
            with pytest.raises(InvalidArgument, match=match) as err:
                e.submit(p, 2, image=bad)
            assert "image" in str(err.value)
        with pytest.raises(InvalidArgument, match="no image tokens"):
            e.submit([1, 2, 3], 2, image=image(1))
        with pytest.raises(InvalidArgument, match="no image was given"):
            e.submit(p, 2)
        with pytest.raises(InvalidArgument, match="exactly 4 image tokens"):
            e.submit([1, IMG, IMG, 2, IMG, IMG], 2, image=image(1))
        with pytest.raises(InvalidArgument, match="images"):
            e.generate([p, p], 2, images=[image(1)])
        # One bad image among several queues none of them.
        with pytest.raises(InvalidArgument, match="shape"):
            e.generate([p, p], 2, images=[image(1), torch.zeros(3, 8, 8)])
        assert not e.scheduler.has_work
        # A NumPy array is pixel values too.
        out = e.generate([p], 2, images=[image(1).numpy()])
        assert out == e.generate([p], 2, images=[image(1)])
    with pytest.raises(InvalidArgument, match="prefill_chunk"):
        engine(config, prefill_chunk=3)


def test_text_model_refuses_an_image():
    from test_engine_families import tiny as family

    with engine(family("llama")) as e:
        with pytest.raises(InvalidArgument, match="no vision tower"):
            e.submit([1, 2, 3], 2, image=image(1))


def test_prefix_cache_is_keyed_by_the_image():
    """With prefix caching on (no sliding layers), a prompt seen with one
    image hits the cache with that image only: another image behind the
    same token ids shares only the blocks before the image's tokens, and
    its tokens are those of an engine that never saw the first."""
    config = tiny(["full_attention"] * 4)
    rng = random.Random(4)
    p = prompt(rng, 5, 11)  # 20 tokens; the image at [5, 9)
    with engine(config) as e:
        first = e.generate([p], 4, images=[image(1)])
        e.submit(p, 4, image=image(1))
        e.run()
        same_hits = e.scheduler.stats.prefix_hit_tokens
        assert same_hits >= 16
        before = e.scheduler.stats.prefix_hit_tokens
        other = e.generate([p], 4, images=[image(2)])
        assert e.scheduler.stats.prefix_hit_tokens - before == 4  # block 0 only
    with engine(config) as fresh:
        assert fresh.generate([p], 4, images=[image(2)]) == other
        assert fresh.generate([p], 4, images=[image(1)]) == first


def test_demo_serves_gemma3_with_images():
    """The demo's engine path (``demo --engine-config ... --load-format
    dummy``) serves a vision model: every other prompt holds an image."""
    from imp_mem.engine.demo import run_engine_demo

    lines: list[str] = []
    rc = run_engine_demo(
        FakeBackend(capacity="1GiB"),
        lines.append,
        seconds=0.3,
        max_batch=2,
        max_seq_len=64,
        prompt_len=(6, 20),
        max_new_tokens=(2, 4),
        config=tiny(),
        load_format="dummy",
        seed=4,
    )
    assert rc == 0
    assert "decode tokens" in "\n".join(lines)


def test_update_weights_takes_transformers_parameter_names():
    """A trainer's ``named_parameters()`` (transformers' module names, the
    tower's included) updates T1 in place: the engine then serves what an
    engine drawn from the trainer's seed serves."""
    from imp_mem.engine.dummy import transformers_model

    config = tiny()
    rng = random.Random(6)
    ps, imgs = [prompt(rng, 2, 5)], [image(5)]
    with engine(config, seed=12) as e:
        want = e.generate(ps, 4, images=imgs)
    trainer = transformers_model(config, seed=12, scale=SCALE, device="cpu")
    with engine(config) as e:
        before = e.generate(ps, 4, images=imgs)
        done = e.update_weights(trainer.named_parameters())
        assert done["tensors"] == len(e.weights)
        assert e.generate(ps, 4, images=imgs) == want != before


def test_the_tower_runs_in_the_warm_up_and_once_per_image(monkeypatch):
    """The warm-up encodes one image of the tower's shape (its working set
    then sits where the warm-up's is measured and planned); serving
    encodes each request's image once, however many chunks its prompt
    takes, and a request without an image not at all."""
    from imp_mem.engine.model.gemma3 import Gemma3VisionModel

    calls: list[tuple[int, ...]] = []
    encode = Gemma3VisionModel.encode_images

    def counted(self, pixels):
        calls.append(tuple(pixels.shape))
        return encode(self, pixels)

    monkeypatch.setattr(Gemma3VisionModel, "encode_images", counted)
    rng = random.Random(8)
    with engine(tiny(), prefill_chunk=5) as e:
        assert calls == [(1, 3, 16, 16)]
        ps = [prompt(rng, 12, 9), prompt(rng, 0, 3), [5, 6, 7]]
        e.generate(ps, 3, images=[image(1), image(2), None])
        assert calls == [(1, 3, 16, 16)] * 3


def test_an_image_token_past_the_vocabulary_is_embedded_as_transformers_does():
    """``image_token_index`` at or past the vocabulary (transformers embeds
    it as token 0 before the image replaces it): the engine's tokens are
    transformers' with the image."""
    from imp_mem.engine.dummy import transformers_model

    config = {**tiny(), "image_token_index": 300}
    hf = transformers_model(config, seed=3, scale=SCALE, device="cpu")
    rng = random.Random(1)
    p = [rng.randrange(IMG) for _ in range(3)] + [300] * MM + [rng.randrange(IMG) for _ in range(4)]
    with engine(config, seed=3) as e:
        out = e.generate([p], 5, images=[image(3)])[0]
    ids = torch.tensor([p + out[:-1]])
    with torch.no_grad():
        logits = hf(
            input_ids=ids, pixel_values=image(3)[None], token_type_ids=(ids == 300).long()
        ).logits[0]
    rows = logits[len(p) - 1 :]
    top2 = rows.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > MARGIN
    assert sure.sum() >= 3
    assert (rows.argmax(-1) == torch.tensor(out))[sure].all()
