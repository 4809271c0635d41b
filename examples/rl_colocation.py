"""One RL colocation step on the reference engine: generate rollouts, give
the GPU to the trainer, take new weights back without a restart.

The engine sleeps by tag (weights and KV cache back to the device, the
weights' bytes kept in pinned host memory or dropped), the trainer runs,
the engine wakes its weights first, takes the trainer's tensors in place
(every address stays, so its CUDA graphs replay without re-capture), then
wakes its KV cache and serves the new policy.

    python examples/rl_colocation.py            # a tiny random Qwen3, CPU or GPU
    python examples/rl_colocation.py --steps 3  # more rollout/train rounds

On a machine without a GPU it runs on the fake backend (host memory) with
CPU torch, which is how the test suite runs it.
"""

from __future__ import annotations

import argparse
import tempfile

try:
    import torch
except ImportError:
    raise SystemExit(
        "rl_colocation.py runs the reference engine, which needs PyTorch (CPU is enough): "
        "pip install imp-mem[torch]"
    ) from None

import imp_mem
from imp_mem.engine import Engine
from imp_mem.engine.checkpoint import write_random_checkpoint
from imp_mem.engine.config import qwen3_0_6b_config


def tiny_qwen3() -> dict:
    """Qwen3-0.6B's config at a width that runs anywhere in seconds."""
    config = qwen3_0_6b_config()
    config.update(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, torch_dtype="float32",
    )  # fmt: skip
    return config


def train_step(policy: dict[str, torch.Tensor], step: int) -> None:
    """Stands in for the trainer: a step on its own copy of the weights."""
    gen = torch.Generator().manual_seed(step)
    for t in policy.values():
        t.add_(0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype))


def committed(engine: Engine) -> dict[str, int]:
    """Bytes the backend holds for each tag."""
    return {tag: v["committed"] for tag, v in engine.backend.stats()["tags"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="rollout / train rounds (default 2)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1 (got {args.steps})")
    on_gpu = imp_mem.cuda_available() and torch.cuda.is_available()
    backend = None if on_gpu else imp_mem.FakeBackend(capacity="512MiB")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7]]
    with tempfile.TemporaryDirectory() as root:
        checkpoint = write_random_checkpoint(root, tiny_qwen3(), seed=1, scale=0.1)
        with Engine(checkpoint, backend=backend, max_batch=4, max_seq_len=64) as engine:
            print(f"engine on {'the GPU' if on_gpu else 'the fake backend'}: {committed(engine)}")
            # The trainer's own copy of the policy (in RL, its parameters):
            # the engine's tensors are not read while it sleeps, as their
            # device memory is given back then.
            policy = {k: t.detach().cpu().clone() for k, t in engine.weights.items()}
            for step in range(args.steps):
                rollouts = engine.generate(prompts, 8)
                print(f"step {step}: rollouts {rollouts[0][:6]}...")
                # Weights kept in pinned host memory (level 1), KV dropped.
                engine.sleep(1, drain="abort")
                asleep = committed(engine)
                assert asleep["weights"] == 0 and asleep["kv_cache"] == 0, asleep
                print(f"  asleep: {asleep} (the trainer has the device)")
                train_step(policy, step)
                engine.wake("weights")  # staged: only the weights come back
                report = engine.update_weights(policy.items())
                print(f"  new weights: {report['tensors']} tensors, {report['bytes']} B in place")
                engine.wake("kv_cache")
            # The engine serves the weights it now holds: a fresh engine on
            # the same tensors generates the same greedy tokens.
            served = engine.generate(prompts, 8)
        fresh_dir = write_random_checkpoint(f"{root}/fresh", tiny_qwen3(), seed=1, scale=0.1)
        fresh_backend = None if on_gpu else imp_mem.FakeBackend(capacity="512MiB")
        with Engine(fresh_dir, backend=fresh_backend, max_batch=4, max_seq_len=64) as fresh:
            fresh.update_weights(policy.items())
            assert fresh.generate(prompts, 8) == served
    print("a fresh engine on the trained weights generates the same tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
