"""Plain helpers the test files share: the small model shapes, a plan of
them, and a memory system over a fake backend. Fixtures are in conftest.py."""

from __future__ import annotations

from imp_mem import (
    FakeBackend,
    Features,
    Limits,
    MemoryPlan,
    MemorySystem,
    ModelShape,
    PlanInput,
    plan_memory,
)

MIB = 1 << 20
GIB = 1 << 30

# A small llama shape: the system, KV, activation and fleet tests plan it.
SMALL = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# A tiny llama shape: the engine scheduler and the safetensors loader use it.
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# A hybrid model: sliding-window layers (an SWA pool) and linear-attention
# state (a state pool) besides full attention.
HYBRID = {
    "model_type": "qwen3_next",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    # Dense: transformers' Qwen3-Next default is 512 experts.
    "num_experts": 0,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def make_plan(
    config=SMALL,
    budget=GIB,
    max_batch=4,
    max_seq_len=1024,
    *,
    features: Features | None = None,
    tp: int | None = None,
    context=8 * MIB,
    library_reserve=4 * MIB,
    **limits,
) -> MemoryPlan:
    """A plan of `config` that fits its KV pool to the budget ("fit")."""
    return plan_memory(
        PlanInput(
            ModelShape.from_hf_config(config),
            Limits(max_batch, max_seq_len, kv_policy="fit", **limits),
            features if features is not None else Features(),
            budget=budget,
            tp=tp,
            context=context,
            library_reserve=library_reserve,
        )
    )


def open_system(plan, backed=True, **kw) -> tuple[FakeBackend, MemorySystem]:
    """A system whose growable KV pool commits 8 blocks and grows by 8."""
    fb = FakeBackend(capacity=GIB, backed=backed)
    kw.setdefault("kv_initial_blocks", 8)
    kw.setdefault("kv_grow_blocks", 8)
    return fb, MemorySystem(fb, plan, **kw)
