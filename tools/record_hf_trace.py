"""Records the allocation trace of Hugging Face's Qwen3-0.6B (random
weights, bf16, sdpa) building itself and generating greedily with a
``DynamicCache``, on the meta device (no compute, no GPU): every storage a
torch op creates is an allocation of its bytes, freed when the storage
dies. ``bench_measured_replay.py --trace`` replays it through serve()'s
tier on the fake backend (issue 28).

Attention runs as the H200 runs it (flash: no mask in bf16), not as the
meta device would pick (the math path materialises the attention matrix).
The loop is generate()'s, written out (generate() reads a tensor's value,
which meta tensors have none of): the prompt with ``logits_to_keep=1``,
then one token a step, the cache growing by ``torch.cat``. The model's
build (in bf16, as ``bench_torch_hf`` builds it) comes first in the trace,
as the H200's warm-up measures it.

    python tools/record_hf_trace.py [--batch 32 --prompt 1024 --new 64] --out trace.json
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

# The benchmarks this tool borrows from live in benches/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import torch
from bench_torch_hf import QWEN3_0_6B
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Recorder(TorchDispatchMode):
    """``ops``: ``["a", id, bytes]`` for each new storage an op returns,
    ``["f", id]`` when it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[list] = []
        self.ids: dict[int, int] = {}
        self.count = 0

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.ids or storage.nbytes() == 0:
            return
        self.count += 1
        n = self.count
        self.ids[key] = n
        self.ops.append(["a", n, storage.nbytes()])

        def freed(ops=self.ops, ids=self.ids):
            ops.append(["f", n])
            ids.pop(key, None)

        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._track(t)
        return out


def _flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise ValueError("the recorder runs without a mask, as the H200's bf16 generate() does")
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale
    )[0]


def record(batch: int, prompt: int, new: int) -> dict:
    """The trace, and how many of its leading ops build the model."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_0_6B)
    config._attn_implementation = "sdpa"
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash
    rec = Recorder()
    try:
        with rec, torch.no_grad():
            with torch.device("meta"):
                model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
                prompt_ids = torch.zeros((batch, prompt), dtype=torch.long)
            model_ops = len(rec.ops)
            cache = DynamicCache(config=config)
            ids, cur = prompt_ids, prompt_ids
            position = torch.arange(prompt, device="meta")
            for _ in range(new):
                out = model(
                    input_ids=cur,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=position,
                    logits_to_keep=1,
                )
                token = out.logits[:, -1, :].to(torch.float32).argmax(-1)
                del out
                ids = torch.cat([ids, token[:, None]], dim=-1)
                cur, position = token[:, None], position[-1:] + 1
            del cache, ids, cur, position, token
            ops = rec.ops[:]  # the model's own teardown is not the work's
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return {"batch": batch, "prompt": prompt, "new": new, "ops": ops, "model_ops": model_ops}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    trace = record(args.batch, args.prompt, args.new)
    with open(args.out, "w") as f:
        json.dump(trace, f)
    print(f"{len(trace['ops'])} ops ({trace['model_ops']} building the model) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
