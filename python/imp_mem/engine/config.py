"""The model configuration the reference engine runs, read from a Hugging Face
``config.json``.

`ModelConfig.from_hf_config` reads a config the way transformers 5.17's
``Qwen3Config`` reads it (its class defaults fill what the file omits, and
``use_sliding_window: false`` switches the window off), because the engine's
model is the Qwen3 architecture: RMSNorm, RoPE, per-head q/k RMSNorm, SwiGLU,
grouped-query attention. A config whose ``layer_types`` mixes
``"sliding_attention"`` and ``"full_attention"`` gives a model with both kinds
of layers; transformers' Qwen3 honours the same field, so HF can be compared
with it, and imp-mem's planner reads it into a full and an SWA pool.

Two presets, as ``config.json`` dicts:

* `qwen3_0_6b_config`: the numbers of Qwen/Qwen3-0.6B's ``config.json``.
* `swa_config`: the same width and depth with Gemma-3's layer pattern (five
  sliding-window layers of 256 tokens, then one full-attention layer) written
  as ``layer_types``. It is the cheapest shape that serves both pools and that
  an unmodified transformers model class runs: the weights have the same
  names and shapes as Qwen3-0.6B's, and only the attention mask differs.

Pure Python, no torch; a `ModelConfig` is an immutable value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imp_mem.errors import InvalidArgument

FULL = "full_attention"
SLIDING = "sliding_attention"

# transformers 5.17 Qwen3Config class defaults, for fields a config.json may omit.
_QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}

SUPPORTED_MODEL_TYPES = ("qwen3",)


def qwen3_0_6b_config() -> dict[str, Any]:
    """Qwen/Qwen3-0.6B's ``config.json`` (the fields transformers reads)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def swa_config(window: int = 256, pattern: int = 6) -> dict[str, Any]:
    """Qwen3-0.6B's shape with sliding-window layers: every `pattern`-th layer
    is full attention, the others slide over `window` tokens (Gemma-3's 5:1
    pattern by default). 28 layers give 4 full and 24 sliding layers."""
    if window < 1:
        raise InvalidArgument(f"swa_config: window must be at least 1 token, got {window}")
    if pattern < 2:
        raise InvalidArgument(
            f"swa_config: pattern must be at least 2 (one full layer in `pattern`), got {pattern}"
        )
    config = qwen3_0_6b_config()
    layers = config["num_hidden_layers"]
    config.update(
        use_sliding_window=True,
        sliding_window=window,
        layer_types=[FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)],
    )
    return config


def read_config_json(path: str | Path, what: str) -> Any:
    """The JSON of `path`, a ``config.json`` or a checkpoint directory that
    holds one; a file that cannot be read is `InvalidArgument` naming the
    argument `what`."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"{what}: cannot read {path} as JSON: {err}") from err


@dataclass(frozen=True)
class ModelConfig:
    """What the paged model needs to know about a Qwen3-architecture model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    dtype: str = "bfloat16"

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> ModelConfig:
        """Reads a ``config.json`` dict, a path to one, or a checkpoint
        directory that holds one."""
        if isinstance(config, (str, Path)):
            config = read_config_json(config, "config")
        if not isinstance(config, dict):
            raise TypeError(
                f"config: expected a config.json dict or path, got {type(config).__name__}"
            )
        if "text_config" in config and isinstance(config["text_config"], dict):
            config = {**config, **config["text_config"]}
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(
                f"config: model_type {model_type!r} is not supported by the reference engine; "
                f"it runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def get(key: str) -> Any:
            value = config.get(key)
            return _QWEN3_DEFAULTS[key] if value is None else value

        def positive(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(
                    f"config: field {key!r} must be a positive integer, got {value!r}"
                )
            return value

        num_layers = positive("num_hidden_layers", get("num_hidden_layers"))
        num_heads = positive("num_attention_heads", get("num_attention_heads"))
        kv = config.get("num_key_value_heads")
        num_kv_heads = positive("num_key_value_heads", num_heads if kv is None else kv)
        if num_heads % num_kv_heads:
            raise InvalidArgument(
                f"config: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if get("hidden_act") != "silu":
            raise InvalidArgument(
                f"config: hidden_act {get('hidden_act')!r} is not supported; use 'silu'"
            )
        if get("attention_bias"):
            raise InvalidArgument("config: attention_bias true is not supported; use false")

        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise InvalidArgument(
                f"config: rope type {rope_type!r} is not supported; only the default RoPE is"
            )
        rope_theta = float(rope.get("rope_theta") or get("rope_theta"))

        # Qwen3Config: the window exists only when use_sliding_window is true.
        window = get("sliding_window") if get("use_sliding_window") else None
        if window is not None:
            window = positive("sliding_window", window)
        layer_types = config.get("layer_types")
        if layer_types is None:
            start = get("max_window_layers")
            layer_types = [
                SLIDING if window is not None and i >= start else FULL for i in range(num_layers)
            ]
        layer_types = tuple(layer_types)
        if len(layer_types) != num_layers or any(t not in (FULL, SLIDING) for t in layer_types):
            raise InvalidArgument(
                f"config: field 'layer_types' must list {num_layers} entries, each "
                f"{FULL!r} or {SLIDING!r}; got {list(layer_types)!r}"
            )
        if SLIDING in layer_types and window is None:
            raise InvalidArgument(
                "config: 'layer_types' has sliding_attention layers but no window: set "
                "'sliding_window' and 'use_sliding_window': true"
            )
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if dtype not in ("bfloat16", "float16", "float32"):
            raise InvalidArgument(
                f"config: torch_dtype {dtype!r} is not supported; use bfloat16, float16 or float32"
            )
        return cls(
            model_type=model_type,
            vocab_size=positive("vocab_size", get("vocab_size")),
            hidden_size=positive("hidden_size", get("hidden_size")),
            intermediate_size=positive("intermediate_size", get("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=positive("head_dim", get("head_dim")),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            max_position_embeddings=positive(
                "max_position_embeddings", get("max_position_embeddings")
            ),
            sliding_window=window if SLIDING in layer_types else None,
            layer_types=layer_types,
            dtype=dtype,
        )

    @property
    def full_layers(self) -> list[int]:
        """Indices of the full-attention layers, in model order."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def sliding_layers(self) -> list[int]:
        """Indices of the sliding-window layers, in model order."""
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def pool_slot(self, layer: int) -> tuple[str, int]:
        """``("full" | "swa", index)``: the pool a layer's KV lives in and its
        layer index inside that pool's view."""
        if self.layer_types[layer] == FULL:
            return "full", self.full_layers.index(layer)
        return "swa", self.sliding_layers.index(layer)
