"""Gemma-3 with its vision tower on the GPU (issue 26): gemma-3-4b's
``config.json`` numbers (34 layers, a 27-layer SigLIP over 896 x 896
images, 256 image tokens), random weights drawn in T1 from a seed
(``load_format="dummy"``), bf16:

* the tower and projector on the plan's ``vision_tower`` line at their
  bytes in T1 (transformers' tower and projector parameters, each tensor
  256-byte aligned), the weights line the language model's;
* greedy tokens with an image (and without) against transformers'
  ``Gemma3ForConditionalGeneration`` on the same weights
  (`imp_mem.engine.dummy.transformers_model`, ``token_type_ids`` given so
  its image tokens attend both ways as ours do), wherever transformers'
  top-2 margin is decisive (> 0.2, as `test_engine_families_gpu`), with at
  least an eighth of the tokens decisive (262 208 random logits have
  smaller top-2 gaps than the families' 32 000);
* in a fresh child process at a roomy limit: torch's activations (the
  tower's image working set included, which the warm-up encodes) routed
  into a planned tier sized from a measured warm-up, requests with images
  served, the plan's total against the device memory the process uses
  within 1 %, >= 99 % of it attributed, no acquisition while serving.
"""

from __future__ import annotations

import random

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from _device_plan import decisive_tokens, plan_against_device  # noqa: E402

from imp_mem.engine.llm_engine import Engine  # noqa: E402

MIB = 1 << 20


def gemma_3_4b() -> dict:
    """google/gemma-3-4b-it's numbers (the planner's preset, the class
    defaults its config.json leaves out written in)."""
    from imp_mem._presets import preset

    return preset("gemma-3-4b")


IMG = 262144


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Text, 256 image tokens, text; every other prompt without an image."""
    out = []
    for i in range(n):
        text = [rng.randrange(2, 250000) for _ in range(40 + 8 * i)]
        out.append(text[:20] + [IMG] * 256 + text[20:] if i % 2 == 0 else text)
    return out


def images(n: int) -> list:
    g = torch.Generator(device="cpu").manual_seed(3)
    return [
        torch.rand(3, 896, 896, generator=g).mul_(2).sub_(1) if i % 2 == 0 else None
        for i in range(n)
    ]


def test_gemma3_4b_with_images_matches_transformers_and_plans_its_tower():
    from imp_mem.engine.dummy import layout_bytes, transformers_model, vision_bytes
    from imp_mem.engine.model.siglip import is_vision_name

    config = gemma_3_4b()
    backend = imp_mem.VmmBackend(device=0, strict=True)
    rng = random.Random(5)
    ps = prompts(rng, 8)
    imgs = images(8)
    with Engine(
        config, load_format="dummy", seed=7, backend=backend, max_batch=8, max_seq_len=1024
    ) as e:
        c = e.config
        tower = vision_bytes(c)
        assert e.plan.to_dict()["vision_tower"] == -(-tower // MIB) * MIB
        assert e.plan.weights == -(-(layout_bytes(c) - tower) // MIB) * MIB
        assert e.system.weights_arena.used == layout_bytes(c)
        outs = e.generate(ps, 16, images=imgs)
        steady = sum(backend.stats()["steady_state_allocations_total"].values())
        print(f"\ngemma-3-4b: tower {tower / MIB:.1f} MiB in T1, the plan's vision_tower line")
    assert steady == 0
    hf = transformers_model(config, seed=7, device="cuda")
    try:
        params = sum(
            p.numel() * p.element_size()
            for n, p in hf.named_parameters()
            if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))
        )
        count = sum(1 for n, _ in hf.named_parameters() if is_vision_name(n[len("model.") :]))
        assert params <= tower < params + 256 * (count + 1)

        def rows(hf=hf):
            for p, o, img in zip(ps, outs, imgs, strict=True):
                ids = torch.tensor([p + o[:-1]], device="cuda")
                kw = {}
                if img is not None:
                    kw = {
                        "pixel_values": img[None].to("cuda", torch.bfloat16),
                        "token_type_ids": (ids == IMG).long(),
                    }
                with torch.no_grad():
                    logits = hf(input_ids=ids, **kw).logits[0].float()
                yield logits[len(p) - 1 :]

        decisive, checked = decisive_tokens("gemma3 (vision)", rows(), outs)
        assert decisive >= checked // 8
    finally:
        del hf
        torch.cuda.empty_cache()


def test_gemma3_4b_plan_matches_the_device_with_images():
    plan_against_device(gemma_3_4b(), 32, 2048, label="gemma-3-4b with images")
