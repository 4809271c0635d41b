"""The model configuration the reference engine runs, read from a Hugging Face
``config.json``.

The engine serves the families of `SUPPORTED_MODEL_TYPES` (one model file
each, `imp_mem.engine.model`); any other ``model_type`` is refused with a
message naming them. `ModelConfig.from_hf_config` reads the common fields
as the family's transformers config class reads them (its class defaults
fill what the file omits: the core's table, which the planner reads too,
through `imp_mem._core.transformers_defaults`) and the family's own values
(RoPE scaling, MoE and MLA geometry, Gemma's scalars) into
`ModelConfig.extra` (`_family_fields`). For ``qwen3`` it reads a config the
way transformers 5.17's ``Qwen3Config`` reads it (``use_sliding_window:
false`` switches the window off): RMSNorm, RoPE, per-head q/k RMSNorm,
SwiGLU, grouped-query attention. A config whose ``layer_types`` mixes
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from imp_mem import _core
from imp_mem.errors import InvalidArgument

FULL = "full_attention"
SLIDING = "sliding_attention"

# The families the engine serves, each a file of `imp_mem.engine.model`.
SUPPORTED_MODEL_TYPES = (
    "qwen3",
    "llama",
    "qwen3_moe",
    "deepseek_v2",
    "gemma3_text",
    "gemma3",
)


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

    # Family-specific values (`_family_fields`): RoPE scaling, MoE and MLA
    # geometry, Gemma's scalars. Not compared: the fields above decide the
    # engine's buffers.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        """The model file that serves this config (`imp_mem.engine.model`)."""
        return self.model_type

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
        if config.get("model_type") == "gemma3":
            return _gemma3_vision(cls, config)
        if "vision_config" in config:
            # Serving the text model alone would drop the tower unseen.
            raise InvalidArgument(
                f"config: model_type {config.get('model_type')!r} has a vision tower the "
                "reference engine does not serve; the multimodal model it serves is gemma3 "
                f"(it serves {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if "text_config" in config and isinstance(config["text_config"], dict):
            config = {**config, **config["text_config"]}
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(
                f"config: model_type {model_type!r} is not served by the reference engine; "
                f"it serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        defaults = _core.transformers_defaults(model_type)

        def get(key: str) -> Any:
            value = config.get(key)
            return defaults.get(key) if value is None else value

        def positive(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(
                    f"config: field {key!r} must be a positive integer, got {value!r}"
                )
            return value

        num_layers = positive("num_hidden_layers", get("num_hidden_layers"))
        num_heads = positive("num_attention_heads", get("num_attention_heads"))
        hidden = positive("hidden_size", get("hidden_size"))
        kv = config.get("num_key_value_heads")
        if kv is None:
            # Where transformers' default is None (Llama, DeepSeek), the
            # table has none: the KV heads are the query heads.
            kv = defaults.get("num_key_value_heads", num_heads)
        num_kv_heads = positive("num_key_value_heads", kv)
        if model_type == "deepseek_v2":
            # MLA: every query head has its own up-projected K/V.
            num_kv_heads = num_heads
        if num_heads % num_kv_heads:
            raise InvalidArgument(
                f"config: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        act_key = "hidden_activation" if model_type == "gemma3_text" else "hidden_act"
        act = get(act_key) or get("hidden_act")
        want_act = "gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu"
        if act != want_act:
            raise InvalidArgument(
                f"config: {act_key} {act!r} is not supported for {model_type}; use {want_act!r}"
            )
        if get("attention_bias"):
            raise InvalidArgument("config: attention_bias true is not supported; use false")
        if get("mlp_bias"):
            raise InvalidArgument("config: mlp_bias true is not supported; use false")

        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if model_type == "gemma3_text" and isinstance(rope.get("full_attention"), dict):
            # transformers 5 writes Gemma-3's two RoPEs as one dict per layer type.
            local = rope.get("sliding_attention") or {}
            rope = dict(rope["full_attention"])
            if local.get("rope_theta") is not None:
                config = {**config, "rope_local_base_freq": local["rope_theta"]}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        allowed = _ROPE_TYPES.get(model_type, ("default",))
        if rope_type not in allowed:
            raise InvalidArgument(
                f"config: rope type {rope_type!r} is not supported for {model_type}; "
                f"it takes {', '.join(allowed)}"
            )
        rope_theta = float(rope.get("rope_theta") or get("rope_theta"))

        if model_type == "qwen3":
            # Qwen3Config: the window exists only when use_sliding_window is true.
            window = get("sliding_window") if get("use_sliding_window") else None
        elif model_type == "gemma3_text":
            window = get("sliding_window")
        else:
            window = None
        if window is not None:
            window = positive("sliding_window", window)
        layer_types = config.get("layer_types")
        if layer_types is None and model_type == "gemma3_text":
            pattern = positive("sliding_window_pattern", get("sliding_window_pattern"))
            layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        if layer_types is None:
            start = get("max_window_layers") if model_type == "qwen3" else num_layers
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
        head_dim = get("head_dim") or hidden // num_heads
        extra = _family_fields(model_type, config, get, positive, rope, num_layers)
        if model_type == "deepseek_v2":
            head_dim = extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
        return cls(
            model_type=model_type,
            vocab_size=positive("vocab_size", get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive("intermediate_size", get("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=positive("head_dim", head_dim),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            max_position_embeddings=positive(
                "max_position_embeddings", get("max_position_embeddings")
            ),
            sliding_window=window if SLIDING in layer_types else None,
            layer_types=layer_types,
            dtype=dtype,
            extra=extra,
        )

    @property
    def vision(self) -> dict[str, Any] | None:
        """The vision tower's fields (``gemma3``: SigLIP's, with
        ``mm_tokens_per_image`` and ``image_token_index``); None for a text
        model."""
        return self.extra.get("vision")

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


# The RoPE types each family's model computes (`imp_mem.engine.model.rope`).
_ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "qwen3": ("default",),
    "llama": ("default", "llama3", "linear"),
    "qwen3_moe": ("default",),
    "deepseek_v2": ("default", "yarn"),
    "gemma3_text": ("default", "linear"),
}


def _family_fields(
    model_type: str,
    config: dict[str, Any],
    get: Any,
    positive: Any,
    rope: dict[str, Any],
    num_layers: int,
) -> dict[str, Any]:
    """The values a family's model reads beyond the common fields."""
    out: dict[str, Any] = {"rope": {k: v for k, v in rope.items() if k != "rope_theta"}}
    if model_type == "qwen3_moe":
        experts = positive("num_experts", get("num_experts"))
        top_k = positive("num_experts_per_tok", get("num_experts_per_tok"))
        if top_k > experts:
            raise InvalidArgument(
                f"config: num_experts_per_tok ({top_k}) is more than num_experts ({experts})"
            )
        step = positive("decoder_sparse_step", get("decoder_sparse_step"))
        dense = set(get("mlp_only_layers") or [])
        out.update(
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=positive("moe_intermediate_size", get("moe_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            moe_layers=tuple(
                i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
            ),
            shared_experts=0,
        )
    elif model_type == "deepseek_v2":
        experts = positive("n_routed_experts", get("n_routed_experts"))
        top_k = positive("num_experts_per_tok", get("num_experts_per_tok") or 1)
        if get("topk_method") != "greedy":
            raise InvalidArgument(
                f"config: topk_method {get('topk_method')!r} is not supported; use 'greedy'"
            )
        first = get("first_k_dense_replace")
        freq = positive("moe_layer_freq", get("moe_layer_freq"))
        # An explicit null is no q LoRA (DeepSeek-V2-Lite); absent, the class default.
        q_lora = config["q_lora_rank"] if "q_lora_rank" in config else get("q_lora_rank")
        out.update(
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=positive("moe_intermediate_size", get("moe_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            moe_layers=tuple(i for i in range(num_layers) if i >= first and i % freq == 0),
            shared_experts=int(get("n_shared_experts") or 0),
            kv_lora_rank=positive("kv_lora_rank", get("kv_lora_rank")),
            q_lora_rank=positive("q_lora_rank", q_lora) if q_lora else None,
            qk_nope_head_dim=positive("qk_nope_head_dim", get("qk_nope_head_dim")),
            qk_rope_head_dim=positive("qk_rope_head_dim", get("qk_rope_head_dim")),
            v_head_dim=positive("v_head_dim", get("v_head_dim")),
        )
    elif model_type == "gemma3_text":
        out.update(
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            rope_local_base_freq=float(get("rope_local_base_freq")),
            final_logit_softcapping=get("final_logit_softcapping"),
            attn_logit_softcapping=get("attn_logit_softcapping"),
        )
    return out


def _gemma3_vision(cls: Any, config: dict[str, Any]) -> ModelConfig:
    """A ``gemma3`` (``Gemma3ForConditionalGeneration``) config: its
    ``text_config`` read exactly as a ``gemma3_text`` config (the top
    level's dtype and tied head where the text config leaves them out), its
    ``vision_config`` as transformers' ``SiglipVisionConfig`` reads it, and
    the projector's ``mm_tokens_per_image`` and ``image_token_index``."""

    def positive(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(
                f"config: field {key!r} must be a positive integer, got {value!r}"
            )
        return value

    text = config.get("text_config") or {}
    vis = config.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vis, dict):
        raise InvalidArgument("config: gemma3's text_config and vision_config must be dicts")
    text = {**text, "model_type": "gemma3_text"}
    for key in ("torch_dtype", "dtype"):
        if text.get(key) is None and config.get(key) is not None:
            text[key] = config[key]
    if text.get("tie_word_embeddings") is None:
        text["tie_word_embeddings"] = config.get("tie_word_embeddings", True)
    base = cls.from_hf_config(text)
    if not base.tie_word_embeddings:
        raise InvalidArgument(
            "config: gemma3 with tie_word_embeddings false is not supported; Gemma-3 ties its "
            "output head to the embedding"
        )
    tower_defaults = _core.transformers_defaults("siglip_vision_model")
    own_defaults = _core.transformers_defaults("gemma3")

    def get(key: str) -> Any:
        value = vis.get(key)
        return tower_defaults.get(key) if value is None else value

    vision: dict[str, Any] = {
        key: positive(f"vision_config.{key}", get(key))
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_channels",
            "image_size",
            "patch_size",
        )
    }
    vision["layer_norm_eps"] = float(get("layer_norm_eps"))
    if get("hidden_act") != "gelu_pytorch_tanh":
        raise InvalidArgument(
            f"config: vision_config.hidden_act {get('hidden_act')!r} is not supported; use "
            "'gelu_pytorch_tanh'"
        )
    if get("vision_use_head"):
        raise InvalidArgument(
            "config: vision_config.vision_use_head true is not supported for gemma3 (its tower "
            "has no pooling head); set it to false"
        )
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise InvalidArgument(
            f"config: vision_config.hidden_size ({vision['hidden_size']}) must be a multiple of "
            f"num_attention_heads ({vision['num_attention_heads']})"
        )
    mm = positive(
        "mm_tokens_per_image",
        config.get("mm_tokens_per_image") or own_defaults["mm_tokens_per_image"],
    )
    token = config.get("image_token_index", config.get("image_token_id"))
    token = own_defaults["image_token_index"] if token is None else token
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise InvalidArgument(f"config: image_token_index must be a token id, got {token!r}")
    side, patch = vision["image_size"], vision["patch_size"]
    per_side = int(mm**0.5)
    if side % patch or per_side * per_side != mm or (side // patch) % per_side:
        raise InvalidArgument(
            f"config: the tower's {side // patch} x {side // patch} patch grid "
            f"(image_size {side}, patch_size {patch}) cannot pool to mm_tokens_per_image={mm} "
            "tokens: it must be a square whose side divides the grid's"
        )
    vision.update(mm_tokens_per_image=mm, image_token_index=token)
    return replace(base, model_type="gemma3", extra={**base.extra, "vision": vision})
