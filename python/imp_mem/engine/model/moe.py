"""Mixture of experts: the router and the experts, shared by `qwen3_moe`
and `deepseek_v2`.

Routing (`route_softmax_topk`): router logits, softmax in float32, the
top-k experts of each token, their weights renormalised to sum to 1 when
the config says so (``norm_topk_prob``), then scaled, then cast to the
model dtype, as transformers' routers compute them.

The experts, two implementations of one result:

* `experts_grouped`: a fused path over the experts' weights *stacked*
  (``gate_up`` ``[E, 2I, H]``, gate rows then up rows per expert, as
  transformers' fused ``gate_up_proj``; ``down`` ``[E, H, I]``): the
  ``N * k`` (token, expert) picks sorted by expert, the rows gathered, one
  grouped GEMM for gate and up and one for down (``torch._grouped_mm``,
  the group boundaries from a search in the sorted picks), the outputs
  weighted and summed back per token. No host sync and static shapes, so
  a decode step using it is captured in a CUDA graph. The engine's dummy
  loader lays each layer's experts out as such stacks in T1
  (`imp_mem.engine.dummy`), and the model finds them there
  (`stack_views`): no copy.
* `experts_masked`: a loop over the experts, each over every row with the
  row's weight for that expert (0 where it was not picked), accumulated in
  expert order as transformers accumulates. Also free of host syncs; its
  work grows with the expert count, not the picks. The path for
  per-expert tensors in any layout (a safetensors checkpoint) and the
  reference the grouped path is tested against on the CPU.

The routing's transients (sorted picks, gathered rows) are the forward
pass's activations: torch's allocator (or the activations tier) holds
them, measured and charged like every other activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_softmax_topk(
    logits: torch.Tensor, top_k: int, *, norm_topk_prob: bool, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] in logits' dtype, expert ids [N, k])``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights.to(logits.dtype), ids


def experts_masked(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The sum over each row's picked experts of weight * SwiGLU expert(row);
    `experts` is ``[(gate [I, H], up [I, H], down [H, I])]`` by expert id."""
    out = torch.zeros_like(x)
    for e, (gate, up, down) in enumerate(experts):
        # The row's weight for expert e; 0 where e was not picked.
        w = torch.where(ids == e, weights, torch.zeros((), dtype=weights.dtype, device=x.device))
        y = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
        out += y * w.sum(dim=-1, keepdim=True)
    return out


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def experts_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`experts_masked`'s result through two grouped GEMMs (module doc)."""
    num_experts, two_i, _ = gate_up.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    picked = flat[order]
    rows = torch.div(order, k, rounding_mode="floor")
    # offs[e]: the end of expert e's rows among the sorted picks.
    bounds = torch.arange(num_experts, device=x.device, dtype=picked.dtype)
    offs = torch.searchsorted(picked, bounds, right=True).to(torch.int32)
    xs = x[rows]
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    gate, up = gu[:, : two_i // 2], gu[:, two_i // 2 :]
    act = (F.silu(gate) * up).contiguous()
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    y = (y * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


def stack_views(
    firsts: list[torch.Tensor], shape: tuple[int, ...], members: list[list[torch.Tensor]]
) -> torch.Tensor | None:
    """The tensor of `shape` (``[E, ...]``) whose row-major bytes are the
    `members` (expert by expert, each expert's tensors in order) laid end
    to end from ``firsts[0]``, viewed without a copy; None when they are
    not laid out so (a checkpoint's per-expert tensors) or the view would
    leave their storage."""
    base = firsts[0]
    item = base.element_size()
    at = base.data_ptr()
    for group in members:
        for t in group:
            if t.data_ptr() != at or not t.is_contiguous() or t.dtype != base.dtype:
                return None
            at += t.numel() * item
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    try:
        return torch.as_strided(base, shape, tuple(reversed(strides)))
    except RuntimeError:
        return None
