"""The rule by which imp-mem draws random weights, one tensor at a time:
what a random checkpoint writes (`checkpoint.random_weights`) and what a
dummy load fills T1 with (`dummy.fill`), bit for bit the same on one
device with one seed and scale, so a test or a benchmark can compare the
engine with transformers on the same weights.

Every matrix and the embedding are drawn from N(0, scale²); the norm
weights from N(center, `NORM_JITTER`²), the centre the family's
(`norm_center`: 1, or 0 for Gemma's ``1 + w`` norms), so a mix-up of two
norms shows in the logits; a vision tower's LayerNorm weights centre on 1
whatever the family's norms do. One generator draws the tensors in name
order, each in float32 (`draw`).

The scale. `DEFAULT_SCALE` = 0.02, transformers' own
``initializer_range``, chosen by measurement
(`tools/measure_checkpoint_scale.py`: Qwen3-0.6B's shape, 28 layers,
random prompts, bf16 against float32 on the same weights, CPU):

| scale | top-2 margin p50 | bf16 flips | margin > bf16 noise p99 | distinct greedy tokens |
|---|---|---|---|---|
| 0.005 | 0.035 | 6 % | 86 % | 7 of 64 positions |
| 0.01 | 0.039 | 11 % | 67 % | 10 of 64 |
| 0.02 | 0.078 | 5.5 % | 62 % | 64 of 256 |
| 0.05 | 0.250 | 12 % | 30 % | 254 of 256 |

Smaller scales make the blocks' outputs tiny and alike, so every position
predicts the same few tokens (margins above the noise, but greedy decoding
says nothing about the context); larger ones raise bf16's rounding noise
faster than the margins, so more greedy tokens flip. At 0.02 the greedy
token depends on the context and 62 % of positions have a margin above
bf16's noise (69 % above the noise of the top-2 gap alone): those are the
positions where a test can demand identical greedy tokens. No scale makes
random logits peaked the way a trained model's are (a near-Gaussian cloud
over 151 936 tokens has top-2 gaps of about a tenth of its spread).
"""

from __future__ import annotations

from typing import Any

from imp_mem.engine.config import ModelConfig

DEFAULT_SCALE = 0.02
NORM_JITTER = 0.1


def norm_center(config: ModelConfig) -> float:
    """Where the family's norm weights centre: 1, or 0 for ``(1 + w)`` norms."""
    from imp_mem.engine.model import model_class

    return float(getattr(model_class(config), "norm_center", 1.0))


def draw(name: str, shape: tuple[int, ...], gen: Any, device: Any, scale: float, center: float):
    """One tensor's float32 values (module doc): a vision tower's
    LayerNorm weights centre on 1 whatever the family's norms do."""
    import torch

    from imp_mem.engine.model.siglip import is_layer_norm

    t = torch.randn(shape, generator=gen, device=device)
    if is_layer_norm(name):
        return t.mul_(NORM_JITTER).add_(1.0)
    if name.endswith("norm.weight"):
        return t.mul_(NORM_JITTER).add_(center)
    return t.mul_(scale)
