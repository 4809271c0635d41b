"""The fused decode kernels (`imp_mem.engine.kernels.fused`) against
the torch path they replace, operation for operation (issue 25).

On a machine without a GPU the kernels run under Triton's interpreter
(conftest sets ``TRITON_INTERPRET=1``), on CPU tensors. The torch path
rounds to bfloat16 after every operation; the kernels round at the same
places, so outputs agree to the bit except where a float32 reduction's
order or ``exp`` rounds differently, which may move a value by one bfloat16
step. The tests allow exactly that and no more.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
F = torch.nn.functional

from imp_mem.engine.kernels import fused as fk  # noqa: E402
from imp_mem.engine.model.attention import slots, store_kv  # noqa: E402
from imp_mem.engine.model.layers import fused_rows, rms_norm, rotate_half  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def one_step_apart(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal, or one bfloat16 step apart in at most 1 % of the elements."""
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = (a.float() - b.float()).abs()
    step = b.float().abs().clamp(min=1e-30) * 2.0**-7
    assert bool((diff <= step * 1.01).all()), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() <= 0.01


@pytest.mark.parametrize("hidden", [64, 96, 256])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_the_torch_path(hidden, with_delta):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(BF16).to(DEVICE)
    delta = torch.randn(5, hidden, generator=g).to(BF16).to(DEVICE) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(BF16).to(DEVICE)
    xo, h = fk.add_rms_norm(x, delta, w, 1e-6)
    want_x = x + delta if with_delta else x
    assert torch.equal(xo, want_x)
    one_step_apart(h, rms_norm(want_x, w, 1e-6))
    # Gemma's norm: the weight applied as 1 + w.
    _, h1 = fk.add_rms_norm(x, delta, w, 1e-6, unit_offset=True)
    one_step_apart(h1, rms_norm(want_x, (1 + w.float()).to(BF16), 1e-6))


def test_silu_mul_matches_the_torch_path():
    g = torch.Generator().manual_seed(3)
    gu = (3 * torch.randn(7, 2 * 1100, generator=g)).to(BF16).to(DEVICE)
    gate, up = gu.chunk(2, dim=-1)
    one_step_apart(fk.silu_mul(gu), F.silu(gate) * up)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_norm_rope_store_matches_the_torch_path(qk_norm):
    heads, kv_heads, d, bs, n = 4, 2, 32, 4, 6
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(BF16).to(DEVICE)
    qn = (1 + 0.1 * torch.randn(d, generator=g)).to(BF16).to(DEVICE) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).to(BF16).to(DEVICE) if qk_norm else None
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(64).float(), inv)
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().to(BF16).to(DEVICE), emb.sin().to(BF16).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 17, 33, 63], device=DEVICE)
    table = torch.tensor([7, 3, 1, 0, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15], device=DEVICE)
    blocks, offsets = slots(table.to(torch.int32), positions, bs)
    layers = 3
    pool = torch.zeros(16, layers, 2, bs, kv_heads, d, dtype=BF16, device=DEVICE)
    want_pool = pool.clone()

    q = fk.qkv_norm_rope_store(
        qkv, qn, kn, cos, sin, positions, pool[:, 1], blocks, offsets,
        heads=heads, kv_heads=kv_heads, eps=1e-6,
    )  # fmt: skip

    tq, tk, tv = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    tq, tk, tv = tq.view(n, heads, d), tk.view(n, kv_heads, d), tv.view(n, kv_heads, d)
    if qk_norm:
        tq, tk = rms_norm(tq, qn, 1e-6), rms_norm(tk, kn, 1e-6)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    tq = tq * c + rotate_half(tq) * s
    tk = tk * c + rotate_half(tk) * s
    store_kv(want_pool, 1, tk, tv, blocks, offsets)
    one_step_apart(q, tq)
    one_step_apart(pool, want_pool)
    # Nothing outside layer 1's slots was written.
    touched = torch.zeros(16, bs, dtype=torch.bool, device=DEVICE)
    touched[blocks, offsets] = True
    assert not pool[:, [0, 2]].any()
    assert not pool[:, 1].transpose(1, 2)[~touched].any()


def test_fused_rows_views_adjacent_tensors_only():
    raw = torch.arange(4 * 3 + 2 * 3, dtype=torch.float32)
    a, b = raw[:12].view(4, 3), raw[12:].view(2, 3)
    both = fused_rows([a, b])
    assert both is not None and both.shape == (6, 3)
    assert both.data_ptr() == a.data_ptr()
    assert torch.equal(both, torch.cat([a, b]))
    # Not adjacent, other columns, another storage: no view.
    assert fused_rows([b, a]) is None
    assert fused_rows([a, raw[:6].view(3, 2)]) is None
    assert fused_rows([a, b.clone()]) is None


def _open_system(directory):
    from imp_mem import (
        FakeBackend,
        Features,
        Limits,
        MemorySystem,
        ModelShape,
        PlanInput,
        plan_memory,
    )

    plan = plan_memory(
        PlanInput(
            ModelShape.from_hf_config(directory),
            Limits(2, 256),
            Features(),
            budget="1GiB",
            context=8 << 20,
            library_reserve=4 << 20,
        )
    )
    return MemorySystem(FakeBackend(capacity="1GiB"), plan)


def _tiny_config(dtype: str) -> dict:
    from imp_mem.engine.config import swa_config

    config = swa_config()
    config.update(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        torch_dtype=dtype,
        rope_theta=1000.0,
        use_sliding_window=False,
        sliding_window=None,
        layer_types=None,
    )
    return config


def test_the_loader_lays_fused_groups_back_to_back(tmp_path):
    """q/k/v and gate/up land adjacent in T1 (one matrix each, no copy),
    whatever the file's order; everything else stays 256-byte aligned."""
    from safetensors.torch import load_file

    from imp_mem._safetensors import load_safetensors
    from imp_mem.engine.checkpoint import write_random_checkpoint

    directory = write_random_checkpoint(tmp_path, _tiny_config("bfloat16"), seed=1, scale=0.1)
    want = load_file(str(directory / "model.safetensors"))
    system = _open_system(directory)
    got = load_safetensors(system, directory)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    for i in range(3):
        p = f"model.layers.{i}."
        qkv = fused_rows([got[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        gu = fused_rows([got[p + "mlp.gate_proj.weight"], got[p + "mlp.up_proj.weight"]])
        assert qkv is not None and gu is not None
        assert torch.equal(qkv, torch.cat([want[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        assert torch.equal(
            gu, torch.cat([want[p + "mlp.gate_proj.weight"], want[p + "mlp.up_proj.weight"]])
        )
        # The group's first member is aligned; the others follow it directly.
        assert got[p + "self_attn.q_proj.weight"].data_ptr() % 256 == 0
    assert got["model.norm.weight"].data_ptr() % 256 == 0
    del got, qkv, gu
    system.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_model_matches_the_unfused_one(tmp_path, dtype):
    """`PagedModel(fused=True)` over weights the loader laid out against
    the unfused path over the same weights: a prefill in two chunks, then
    decode steps; logits to rounding, greedy tokens equal."""
    from _paged_kv import PagedCache

    from imp_mem._safetensors import load_safetensors
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import ModelConfig
    from imp_mem.engine.model import PagedModel

    directory = write_random_checkpoint(tmp_path, _tiny_config(dtype), seed=2, scale=0.1)
    config = ModelConfig.from_hf_config(directory)
    system = _open_system(directory)
    weights = load_safetensors(system, directory)
    runs = {}
    for fused in (False, True):
        model = PagedModel(
            config, weights, attention_backend="torch", fused=fused, fused_prefill=fused
        )
        if fused:
            assert all(
                layer.qkv is not None and layer.gate_up is not None for layer in model.layers
            )
        cache = PagedCache(
            config, num_blocks=16, block_size=4, max_blocks_per_seq=8, dtype=getattr(torch, dtype)
        )
        out = []
        tokens = [5, 17, 200, 3, 9, 44, 101]
        for s in (0, 1):
            cache.new_sequence(s)
        for s in (0, 1):
            cache.ensure(s, len(tokens))
            out.append(
                model.prefill(torch.tensor(tokens[:3]), 0, cache.table(s, "full"), None, cache.kv)
            )
            out.append(
                model.prefill(torch.tensor(tokens[3:]), 3, cache.table(s, "full"), None, cache.kv)
            )
        nxt = [int(out[1][-1].argmax()), int(out[3][-1].argmax())]
        for step in range(3):
            pos = len(tokens) + step
            for s in (0, 1):
                cache.ensure(s, pos + 1)
            logits = model.decode(
                torch.tensor(nxt),
                torch.tensor([pos, pos]),
                cache.batch_tables([0, 1], "full"),
                None,
                cache.kv,
            )
            out.append(logits)
            nxt = logits.argmax(-1).tolist()
        runs[fused] = out
    tol = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(runs[False], runs[True], strict=True):
        assert (a - b).abs().max().item() <= tol
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    del weights, runs, model, cache, logits
    import gc

    gc.collect()
    system.close()


def test_the_dummy_load_lays_the_fused_groups_out_as_the_loader_does():
    """`load_format="dummy"` shares q/k/v's and gate/up's spans too, so a
    dummy engine runs the one-GEMM path."""
    from imp_mem.engine.config import ModelConfig
    from imp_mem.engine.dummy import layout

    spans, _ = layout(ModelConfig.from_hf_config(_tiny_config("bfloat16")))
    groups = [g for g, _ in spans]
    for i in range(3):
        p = f"model.layers.{i}."
        assert [p + f"self_attn.{x}_proj.weight" for x in "qkv"] in groups
        assert [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"] in groups
