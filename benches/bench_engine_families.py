"""The engine's families at their real sizes against transformers'
``generate()`` on the same weights (issue 26), random weights drawn on the
GPU from a seed (``load_format="dummy"``; no checkpoint on disk: the H200's
64 GiB disk cannot hold Qwen3-30B-A3B's 61 GB).

Models (their ``config.json`` numbers): Llama-3.1-8B, Qwen3-30B-A3B,
gemma-3-4b (its language model), gemma-3-4b with its vision tower (each
prompt holds one 896 x 896 image's 256 tokens; transformers is given the
same pixel values and ``token_type_ids``), DeepSeek-V2-Lite (with its YaRN
RoPE).

Per model and batch size (32 and 128; ``--quick``: 32 only, fewer tokens):

1. Decode tokens/s, ours and transformers' ``generate()`` (greedy, exactly
   N new tokens). Transformers: ``batch x (N - 1) / (t(N) - t(1))``. Ours:
   the decode-only steps' tokens over their wall time. The two sides run
   one after the other (each holds the model alone). Where transformers'
   model is too slow or too large at full depth (the MoE models' per-expert
   loops), both sides run the first ``--hf-layers`` layers for the
   comparison, and ours also runs the whole model.
2. Greedy tokens against transformers' on the same weights (at the
   compared depth): our greedy tokens of the first ``--check`` requests of
   each batch, teacher-forced through transformers' model; every token
   where transformers' top-2 margin is decisive (> 0.2) must be its argmax
   (the GPU tests' rule). The bench exits 1 when one is not.
3. The fraction of the HBM roofline our decode reaches: the bytes a step
   must read (the dense weights, the routed experts a step's picks hit in
   expectation, ``E * (1 - (1 - k/E)^B)`` of E per layer, and every
   sequence's KV so far) over the step time, against ``--hbm-tbs`` (4.8
   TB/s, the H200's).

Prints one summary table; ``--json`` writes the rows. Needs a CUDA device
with torch, transformers and triton, and the imp_mem wheel. Meant to finish
in under 5 minutes on an H200.

Usage: ``python benches/bench_engine_families.py [--quick] [--json out.json]
[--only llama,qwen3_moe,...]``.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time

from bench_json import write_json


def llama_3_1_8b() -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def qwen3_30b_a3b() -> dict:
    return {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def gemma_3_4b() -> dict:
    return {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }


def gemma_3_4b_vision() -> dict:
    """google/gemma-3-4b-it's config: the language model above and its
    SigLIP tower (the planner's preset)."""
    from imp_mem._presets import preset

    return preset("gemma-3-4b")


IMAGE_TOKEN = 262144


def deepseek_v2_lite() -> dict:
    return {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


MODELS = {
    "llama": ("Llama-3.1-8B", llama_3_1_8b, None),
    "qwen3_moe": ("Qwen3-30B-A3B", qwen3_30b_a3b, 8),
    "gemma3_text": ("gemma-3-4b (text)", gemma_3_4b, None),
    "gemma3": ("gemma-3-4b (vision)", gemma_3_4b_vision, None),
    "deepseek_v2": ("DeepSeek-V2-Lite", deepseek_v2_lite, 8),
}

ROWS: list[dict] = []


def with_layers(config: dict, layers: int | None) -> dict:
    if layers is None or layers >= config.get("num_hidden_layers", layers):
        return config
    out = dict(config, num_hidden_layers=layers)
    if "layer_types" in out:
        out["layer_types"] = out["layer_types"][:layers]
    return out


def step_bytes(config: dict, batch: int, context: int) -> float:
    """The bytes one decode step must read: weights (the routed experts a
    step hits, in expectation) and the KV of every sequence."""
    import imp_mem
    from imp_mem.engine.config import ModelConfig
    from imp_mem.engine.model import weight_names
    from imp_mem.engine.model.siglip import is_vision_name

    c = ModelConfig.from_hf_config(config)
    # A decode step reads the language model only (the tower runs at prefill).
    names = {n: s for n, s in weight_names(c).items() if not is_vision_name(n)}
    item = 2
    dense = sum(math.prod(s) for n, s in names.items() if ".mlp.experts." not in n) * item
    experts = sum(math.prod(s) for n, s in names.items() if ".mlp.experts." in n) * item
    if experts:
        e, k = c.extra["num_experts"], c.extra["top_k"]
        experts *= 1 - (1 - k / e) ** batch
    if not c.tie_word_embeddings:
        dense -= c.vocab_size * c.hidden_size * item  # the input embedding: B rows only
    kv = imp_mem.ModelShape.from_hf_config(config).kv_bytes_per_token("bf16")
    return dense + experts + batch * context * kv["total"]


def make_prompt(rng: random.Random, top: int, length: int, image: list[int]) -> list[int]:
    """`length` random tokens below `top`, with `image`'s tokens after the eighth."""
    t = [rng.randrange(top) for _ in range(length)]
    return t[:8] + image + t[8:]


def image_for(config: dict, prompt: list[int]):
    """A vision model's pixel values for `prompt` (None without image tokens)."""
    import torch

    if config.get("model_type") != "gemma3" or IMAGE_TOKEN not in prompt:
        return None
    g = torch.Generator().manual_seed(len(prompt))
    return torch.rand(3, 896, 896, generator=g).mul_(2).sub_(1)


def ours(config, prompts, new_tokens, max_batch, keep=0):
    import torch

    import imp_mem
    from imp_mem.engine.llm_engine import Engine, EngineStats

    backend = imp_mem.VmmBackend(device=0, strict=True)
    out = {}
    prompt_len = len(next(iter(prompts.values()))[0])
    t_open = time.perf_counter()
    with Engine(
        config,
        load_format="dummy",
        seed=0,
        backend=backend,
        max_batch=max_batch,
        max_seq_len=prompt_len + new_tokens + 8,
        keep_logits=False,
    ) as e:
        out["open_s"] = time.perf_counter() - t_open
        for batch, ps in prompts.items():
            e.generate(ps[:2], 2, images=[image_for(config, p) for p in ps[:2]])  # warm up
            e.stats = EngineStats()
            reqs = [e.submit(p, new_tokens, image=image_for(config, p)) for p in ps]
            e.step()  # admits and prefills every request, decodes once
            torch.cuda.synchronize()
            tokens0, steps0 = e.stats.decode_tokens, e.stats.decode_steps
            t0 = time.perf_counter()
            while e.scheduler.has_work:
                e.step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            steps = e.stats.decode_steps - steps0
            out[batch] = {
                "tok_s": (e.stats.decode_tokens - tokens0) / dt,
                "step_s": dt / max(1, steps),
                # The first `keep` requests' greedy tokens, in submission order.
                "outputs": [list(r.output) for r in reqs[:keep]],
            }
            for sid in [s for s, r in e.scheduler.requests.items() if r.done]:
                e.scheduler.reap(sid)
        out["steady_state"] = sum(backend.stats()["steady_state_allocations_total"].values())
        report = e.mem_report()
        out["attribution_pct"] = (report.get("device") or {}).get("attribution_pct")
    gc.collect()
    backend.trim_cache()
    return out


def teacher_forced(model, prompt, output, config):
    """Transformers' float logits at the positions that chose `output`."""
    import torch

    ids = torch.tensor([prompt + output[:-1]], device="cuda")
    extra = {}
    image = image_for(config, prompt)
    if image is not None:
        extra = {
            "pixel_values": image[None].to("cuda", torch.bfloat16),
            "token_type_ids": (ids == IMAGE_TOKEN).long(),
        }
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0].float()
    return logits[len(prompt) - 1 :]


def greedy_check(model, config, prompts, outputs) -> dict:
    """Decisive tokens (transformers' top-2 margin > 0.2) and how many of
    them our greedy token differs on."""
    import torch

    decisive = checked = wrong = 0
    for p, o in zip(prompts, outputs, strict=False):
        rows = teacher_forced(model, p, o, config)
        top2 = rows.topk(2, dim=-1).values
        sure = ((top2[:, 0] - top2[:, 1]) > 0.2).cpu()
        same = rows.argmax(-1).cpu() == torch.tensor(o)
        checked += len(o)
        decisive += int(sure.sum())
        wrong += int((sure & ~same).sum())
    return {"decisive": decisive, "checked": checked, "wrong": wrong}


def transformers_side(config, prompts, new_tokens, outputs=None):
    import torch

    from imp_mem.engine.dummy import transformers_model

    model = transformers_model(config, seed=0, device="cuda")
    model.generation_config.eos_token_id = None
    out = {}
    for batch, ps in prompts.items():
        ids = torch.tensor(ps, device="cuda")
        mask = torch.ones_like(ids)
        extra = {}
        imgs = [image_for(config, p) for p in ps]
        if imgs[0] is not None:
            extra = {
                "pixel_values": torch.stack(imgs).to("cuda", torch.bfloat16),
                "token_type_ids": (ids == IMAGE_TOKEN).long(),
            }

        def gen(n, ids=ids, mask=mask, model=model, extra=extra):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    **extra,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        gen(2)  # warm-up
        t1 = gen(1)
        tn = gen(new_tokens)
        out[batch] = {"tok_s": batch * (new_tokens - 1) / max(tn - t1, 1e-9)}
        if outputs:
            out[batch]["greedy"] = greedy_check(model, config, ps, outputs[batch])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="batch 32 only, fewer tokens")
    ap.add_argument("--only", default=",".join(MODELS), help="families, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--hf-layers", type=int, default=None, help="override the MoE comparison depth")
    ap.add_argument(
        "--check", type=int, default=8, help="requests a batch whose greedy tokens are checked"
    )
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8)")
    args = ap.parse_args(argv)

    import torch

    import imp_mem

    if not (imp_mem.cuda_available() and torch.cuda.is_available()):
        print("bench_engine_families: needs a CUDA device", file=sys.stderr)
        return 2
    batches = [32] if args.quick else [32, 128]
    prompt_len = args.prompt_len or (64 if args.quick else 128)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    t_all = time.perf_counter()
    failed = False
    for family in args.only.split(","):
        title, make, hf_layers = MODELS[family]
        hf_layers = args.hf_layers or hf_layers
        full = make()
        rng = random.Random(0)
        text = full.get("text_config", full)
        vocab = text.get("vocab_size", 262208)
        # A vision model's prompts: text, one image's 256 tokens, text.
        image = [IMAGE_TOKEN] * 256 if full["model_type"] == "gemma3" else []
        top = IMAGE_TOKEN if image else vocab
        prompts = {b: [make_prompt(rng, top, prompt_len, image) for _ in range(b)] for b in batches}
        compared = with_layers(full, hf_layers)
        depth = compared.get("text_config", compared)["num_hidden_layers"]
        layers = text["num_hidden_layers"]
        print(f"== {title}: {layers} layers; transformers at {depth}", flush=True)
        # Ours first, so that transformers can check our greedy tokens.
        mine = ours(compared, prompts, new_tokens, max(batches), keep=args.check)
        peer = transformers_side(
            compared, prompts, new_tokens, {b: mine[b]["outputs"] for b in batches}
        )
        gc.collect()  # transformers' model is gone with its frame
        torch.cuda.empty_cache()
        whole = mine if compared is full else ours(full, prompts, new_tokens, max(batches))
        for b in batches:
            context = prompt_len + len(image) + new_tokens // 2
            roofline = step_bytes(full, b, context) / whole[b]["step_s"] / (args.hbm_tbs * 1e12)
            ROWS.append(
                {
                    "name": f"{title} decode tokens/s, batch {b} ({depth} layers)",
                    "ours": mine[b]["tok_s"],
                    "peer": "transformers generate()",
                    "peer_value": peer[b]["tok_s"],
                    "ratio": mine[b]["tok_s"] / peer[b]["tok_s"],
                    "goal": "> 1x",
                }
            )
            g = peer[b]["greedy"]
            failed |= g["wrong"] > 0
            ROWS.append(
                {
                    "name": f"{title} greedy tokens vs transformers, batch {b} ({depth} layers)",
                    "ours": g["wrong"],
                    "peer": f"{g['decisive']} decisive of {g['checked']}",
                    "peer_value": None,
                    "ratio": None,
                    "goal": "0 differ where decisive",
                    "greedy": g,
                }
            )
            ROWS.append(
                {
                    "name": f"{title} HBM roofline fraction, batch {b} (full model)",
                    "ours": roofline,
                    "peer": "",
                    "peer_value": None,
                    "ratio": None,
                    "goal": "report",
                    "tok_s_full": whole[b]["tok_s"],
                }
            )
        print(
            f"   open {whole['open_s']:.1f} s, steady-state acquisitions "
            f"{whole['steady_state']}, attribution {whole['attribution_pct']}",
            flush=True,
        )
    print(f"\nsummary ({time.perf_counter() - t_all:.0f} s)")
    for r in ROWS:
        if "greedy" in r:
            g = r["greedy"]
            print(
                f"  {r['name']:<62} {g['wrong']} differ of {g['decisive']} decisive "
                f"({g['checked']} checked)"
            )
        elif r["ratio"] is not None:
            print(
                f"  {r['name']:<62} ours {r['ours']:>10.0f}  transformers "
                f"{r['peer_value']:>10.0f}  x{r['ratio']:.2f}"
            )
        else:
            print(
                f"  {r['name']:<62} {100 * r['ours']:>6.1f} % "
                f"({r['tok_s_full']:.0f} tok/s full model)"
            )
    if args.json:
        write_json(args.json, ROWS)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
