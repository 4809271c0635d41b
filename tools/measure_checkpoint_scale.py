"""Which weight scale makes greedy decoding of a random-weight model mean
something? (issue 13; the choice is `imp_mem.engine.weight_draw.DEFAULT_SCALE`.)

For each candidate scale, the Qwen3-0.6B-shaped model of
`write_random_checkpoint`'s weights runs random prompts teacher-forced in
transformers, once in float32 and once in bfloat16 on the same (bf16-rounded)
weights, and prints per scale:

* the median and 10th percentile of the top-1 / top-2 logit margin (bf16);
* the bf16 noise: the 99th percentile over positions of max |Δlogit| between
  the bf16 and float32 runs, and the fraction of positions whose bf16 argmax
  differs from the float32 one (what a kernel change flips);
* the fraction of positions whose margin exceeds that noise, and the same
  for the noise of the top-2 difference alone (what decides a flip);
* the degenerate cases: argmax equal to the input token (the residual stream
  carries the embedding straight through), and the number of distinct argmax
  tokens (a model stuck on a few tokens).

Runs on the CPU (a few minutes) or a GPU: ``python tools/measure_checkpoint_scale.py
[--device cuda] [--prompts 4] [--length 48] [--scales 0.02,0.05,...]``.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from imp_mem.engine.checkpoint import random_weights
from imp_mem.engine.config import qwen3_0_6b_config


def hf_model(config_dict, weights, dtype, device):
    config = transformers.AutoConfig.for_model(**config_dict)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, _ = model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model.to(device=device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=48)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers, for a quick look")
    parser.add_argument("--scales", default="0.005,0.01,0.02,0.05,0.1")
    args = parser.parse_args()
    torch.manual_seed(0)
    config_dict = qwen3_0_6b_config()
    if args.layers:
        config_dict["num_hidden_layers"] = args.layers
    ids = torch.randint(0, config_dict["vocab_size"], (args.prompts, args.length))
    print(
        f"{'scale':>6} {'margin p50':>10} {'p10':>7} {'noise p99':>9} {'flips':>6} "
        f"{'>noise':>7} {'pair p99':>8} {'>pair':>6} {'=input':>7} {'distinct':>8}"
    )
    for scale in (float(s) for s in args.scales.split(",")):
        weights = random_weights(config_dict, seed=0, scale=scale)
        logits = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = hf_model(config_dict, weights, dtype, args.device)
            with torch.no_grad():
                logits[dtype] = model(ids.to(args.device)).logits.float().cpu().flatten(0, 1)
            del model
        lo, hi = logits[torch.bfloat16], logits[torch.float32]
        top2 = lo.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        noise = (lo - hi).abs().amax(-1)
        idx = lo.topk(2, dim=-1).indices
        pair_lo = lo.gather(1, idx[:, :1]) - lo.gather(1, idx[:, 1:])
        pair_hi = hi.gather(1, idx[:, :1]) - hi.gather(1, idx[:, 1:])
        pair_noise = (pair_lo - pair_hi).abs().quantile(0.99).item()
        noise_p99 = noise.quantile(0.99).item()
        flips = (lo.argmax(-1) != hi.argmax(-1)).float().mean().item()
        above = (margin > noise_p99).float().mean().item()
        arg = lo.argmax(-1)
        same_input = (arg == ids.flatten()).float().mean().item()
        distinct = arg.unique().numel()
        print(
            f"{scale:>6g} {margin.median().item():>10.3f} {margin.quantile(0.1).item():>7.3f} "
            f"{noise_p99:>9.3f} {flips:>6.1%} {above:>7.1%} {pair_noise:>8.3f} "
            f"{(margin > pair_noise).float().mean().item():>6.1%} {same_input:>7.1%} "
            f"{distinct:>4}/{arg.numel():<4}"
        )


if __name__ == "__main__":
    main()
