"""The engine's arguments, checked once (issue 53).

`EngineArgs` holds every keyword `Engine` takes, as given, and refuses a
bad one with the exception that names it: `TypeError` for a value of the
wrong kind where the engine always said so, else `InvalidArgument`. The
checks that need no model run when the arguments are made; those that
need the model's config (`max_seq_len` against its positions, the default
`prefill_chunk`, an image's tokens in one chunk, FlashInfer's family) run
in `for_model`, which returns the arguments resolved for that model. The
documentation of each argument is `Engine`'s.

Two views of the arguments serve the warm-up's measurement
(`imp_mem.engine.warmup`): `probe_kwargs`, what a probe child re-runs,
and `warmup_decides`, what decides the warm-up's bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imp_mem.engine.config import ModelConfig, read_config_json
from imp_mem.engine.shared import SharedGPU
from imp_mem.errors import InvalidArgument

__all__ = ["EngineArgs"]


@dataclass(frozen=True)
class EngineArgs:
    """`Engine`'s arguments, checked when made (module doc).

    `model_dir`: a model directory (HF ``config.json`` + safetensors).
    `max_batch` sequences of `max_seq_len` tokens are served at once.
    `backend`: default `VmmBackend` when CUDA is there (torch too), else a
    backed `FakeBackend` of `budget` (CPU tensors over its host memory).
    `budget`: the plan's budget (default: the backend's). `graphs`: capture
    decode in CUDA graphs (default: on a GPU). `buckets`: the batch sizes
    captured. `attention_backend`: ``"triton"`` (a GPU's default),
    ``"torch"`` (the CPU's) or ``"flashinfer"`` (Qwen3's decode on a GPU
    through FlashInfer, its buffers planned in T2: `kernels.flashinfer_decode`;
    `InvalidArgument` here when it does not import). `torch_pool`: where
    torch's own allocations go (`imp_mem.engine.memory`). `prefill_chunk`:
    tokens per prefill call (default 512; a sliding model's window).
    `prefill_batch_tokens`: the tokens of one batched prefill forward, which
    runs one chunk of each of several requests at once (`model_runner`'s
    module doc); default 4 x `prefill_chunk`, 16 x on a device of 70 GiB or
    more (`default_prefill_batch_tokens`); 0 prefills one request a
    forward; otherwise at least `prefill_chunk`. `features` replaces the
    plan's `Features` (default: T2 sized to the engine's buffers, T4 at
    1 MiB unless `torch_pool` or `scratch_bytes` is given). The plan serves
    `max_batch` sequences of `max_seq_len` plus the blocks the engine holds
    itself (the padding block; a sliding model's ring), planned as
    `Features.engine_kv_blocks`.
    `fused`: the fused decode kernels (`kernels.fused`; default: on
    a GPU). `warmup_probe`: on a cold boot (no remembered figure for this
    engine's fingerprint), measure what the warm-up leaves outside the tiers
    in a child process before planning, so the plan's ``warmup`` line and
    the KV pool are exact on the first boot (`imp_mem.engine.warmup`;
    default: on a GPU with torch's own allocator, TP = 1 and the default
    backend). ``warmup_probe="inline"`` measures it in this process
    instead, no child (issue 25): a cold boot plans the line at 0 (the
    largest KV pool any figure gives), opens the KV pool growable with the
    warm-up's blocks committed, warms up and captures under the meter,
    re-plans with the measured figure, caps the pool at the re-planned
    blocks and grows it to them before serving (the graphs stay valid: the
    pool's base never moves), and remembers the figure; a warm boot plans it
    directly. It needs a backend with growable regions (`InvalidArgument`
    otherwise), TP = 1 and no shared GPU; on the CPU the warm-up leaves
    nothing outside the tiers (`warmup.cpu_meter`).
    `load_format`: ``"safetensors"`` (default: the checkpoint in `model_dir`)
    or ``"dummy"``: random weights drawn in T1 from `seed` (scale
    `dummy_scale`, default `checkpoint.DEFAULT_SCALE`), planned from the
    config alone; `model_dir` is then a checkpoint directory, a
    ``config.json`` path or a config dict (`imp_mem.engine.dummy`).
    `group`: a ``torch.distributed`` process group to serve a tensor-parallel
    shard over (`llm_engine`'s module doc); default None, TP = 1. With a
    group, the default backend is `VmmBackend` on device ``LOCAL_RANK``
    (else the group rank). `shared`: serve on a GPU shared with other
    engines (`imp_mem.engine.shared`: ``True``, a `SharedGPU` or a dict of
    its fields); its KV pool is then growable and its `cap` the budget.
    `kv_growable`: a KV pool that grows while serving and shrinks when
    idle. `pin_sleep_host`: pin the level-1 sleep buffer beside the first
    load (default: on a backend whose T1 can sleep). `context`,
    `library_reserve`: the CUDA context's and the libraries' bytes (default:
    measured on this machine, else the planner's). `activation_bytes`,
    `scratch_bytes`: the activations tier and T4. `keep_logits`,
    `enable_prefix_caching`, `progress`: as named.
    """

    model_dir: str | Path | dict[str, Any]
    max_batch: int = 32
    max_seq_len: int = 2048
    backend: Any = None
    budget: int | str | None = None
    block_size: int | None = None
    prefill_chunk: int | None = None
    prefill_batch_tokens: int | None = None
    buckets: Any = None
    graphs: bool | None = None
    attention_backend: str | None = None
    torch_pool: Any = None
    enable_prefix_caching: bool = True
    kv_growable: bool = False
    context: int | None = None
    library_reserve: int | None = None
    keep_logits: bool = True
    progress: bool | None = None
    features: Any = None
    scratch_bytes: int | None = None
    activation_bytes: int | None = None
    group: Any = None
    pin_sleep_host: bool | None = None
    fused: bool | None = None
    warmup_probe: bool | str | None = None
    load_format: str = "safetensors"
    seed: int = 0
    dummy_scale: float | None = None
    shared: Any = None

    def __post_init__(self) -> None:
        fused, probe = self.fused, self.warmup_probe
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be True, False or None, got {fused!r}")
        if probe is not None and not isinstance(probe, bool):
            if not isinstance(probe, str):
                raise TypeError(
                    f"warmup_probe must be True, False, None or 'inline', got {probe!r}"
                )
            if probe != "inline":
                raise InvalidArgument(
                    f"warmup_probe={probe!r}: pass True (a cold boot measures the warm-up in a "
                    "probe child), False (no probe), None (the default) or 'inline' (a cold boot "
                    "measures it in its own warm-up and grows the KV pool to the re-planned size)"
                )
            if self.group is not None or self.shared not in (None, False):
                raise InvalidArgument(
                    "warmup_probe='inline' serves tp=1 outside a shared GPU (a shared engine "
                    "settles its warm-up with the ledger); pass group=None and shared=None, or "
                    "warmup_probe=True"
                )
        if self.load_format not in ("safetensors", "dummy"):
            raise InvalidArgument(
                f"load_format={self.load_format!r}: pass 'safetensors' (the checkpoint in "
                "model_dir) or 'dummy' (random weights from `seed`, planned from the config alone)"
            )
        if isinstance(self.model_dir, dict) and self.load_format != "dummy":
            raise InvalidArgument(
                "model_dir: a config dict has no weights; pass load_format='dummy' or a "
                "checkpoint directory"
            )

    @classmethod
    def of_call(cls, given: dict[str, Any]) -> EngineArgs:
        """`Engine.__init__`'s keywords as arguments: made from them, or the
        `EngineArgs` passed as its `model_dir` (no keyword beside it)."""
        first = given["model_dir"]
        if not isinstance(first, EngineArgs):
            return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls)})
        passed = [
            f.name
            for f in dataclasses.fields(cls)[1:]
            if given[f.name] is not f.default and given[f.name] != f.default
        ]
        if passed:
            raise InvalidArgument(
                f"Engine(EngineArgs(...), {', '.join(passed)}=...): pass the arguments in the "
                "EngineArgs alone (dataclasses.replace makes one with others)"
            )
        return first

    def read_model(self) -> tuple[Path, dict[str, Any], ModelConfig]:
        """The model's directory, ``config.json`` and `ModelConfig`; a
        config dict's directory is named ``dummy-<model_type>``."""
        if isinstance(self.model_dir, dict):
            config_dict = dict(self.model_dir)
            config = ModelConfig.from_hf_config(config_dict)
            return Path(f"dummy-{config.model_type}"), config_dict, config
        directory = Path(self.model_dir)
        config_dict = read_config_json(directory, "model_dir")
        return directory, config_dict, ModelConfig.from_hf_config(config_dict)

    @property
    def inline_probe(self) -> bool:
        """``warmup_probe="inline"``: a cold boot measures its own warm-up."""
        return self.warmup_probe == "inline"

    def for_model(self, config: ModelConfig) -> EngineArgs:
        """The checks that need the model's `config`, in the engine's order;
        returns the arguments with `prefill_chunk` resolved (its default a
        sliding model's window, else 512; at most `max_seq_len`)."""
        if self.load_format == "dummy" and self.group is not None:
            raise InvalidArgument(
                "load_format='dummy' serves tp=1; open a tensor-parallel engine on a checkpoint"
            )
        if self.attention_backend == "flashinfer" and config.model_type != "qwen3":
            raise InvalidArgument(
                f"attention_backend='flashinfer' serves the qwen3 family; {config.model_type!r} "
                "runs attention_backend='triton'"
            )
        if self.attention_backend == "flashinfer":
            from imp_mem.engine.kernels import flashinfer_decode as _flashinfer

            _flashinfer.require()  # before any planning: says how to install it
        if self.max_seq_len > config.max_position_embeddings:
            raise InvalidArgument(
                f"max_seq_len={self.max_seq_len} is above the model's max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
        chunk = self.prefill_chunk
        if chunk is None:
            # A sliding model's ring grows with the chunk: keep it a window.
            chunk = config.sliding_window if config.sliding_layers else 512
        if chunk < 1:
            raise InvalidArgument(f"prefill_chunk must be at least 1, got {chunk}")
        if config.vision is not None and chunk < config.vision["mm_tokens_per_image"]:
            # An image's tokens are prefilled in one call (they attend both ways).
            raise InvalidArgument(
                f"prefill_chunk={chunk} is below the model's mm_tokens_per_image "
                f"({config.vision['mm_tokens_per_image']}); an image is prefilled in one chunk"
            )
        chunk = min(chunk, self.max_seq_len)
        tokens = self.prefill_batch_tokens
        if tokens is not None and (
            isinstance(tokens, bool)
            or not isinstance(tokens, int)
            or (tokens != 0 and tokens < chunk)
        ):
            raise InvalidArgument(
                f"prefill_batch_tokens={tokens!r}: pass 0 (one request a prefill forward) or an "
                f"int of at least prefill_chunk={chunk} (the tokens one batched prefill forward "
                "holds)"
            )
        shared = SharedGPU.of(self.shared)
        budget, growable = self.budget, self.kv_growable
        if shared is not None:
            if self.group is not None:
                raise InvalidArgument(
                    "shared: a tensor-parallel engine cannot share its GPUs yet; pass group=None"
                )
            # Elastic KV: the pool grows as the ledger grants.
            growable = True
            if shared.cap is not None:
                budget = shared.cap
        return dataclasses.replace(
            self, prefill_chunk=chunk, shared=shared, budget=budget, kv_growable=growable
        )

    def probe_kwargs(self) -> dict[str, Any]:
        """The engine arguments a warm-up probe child re-runs (resolved
        arguments: `for_model`'s)."""
        routed = self.torch_pool == "imp_mem"
        return dict(
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            budget=self.budget if isinstance(self.budget, (int, str)) else None,
            block_size=self.block_size,
            prefill_chunk=self.prefill_chunk,
            prefill_batch_tokens=self.prefill_batch_tokens,
            buckets=list(self.buckets) if self.buckets is not None else None,
            graphs=self.graphs,
            attention_backend=self.attention_backend,
            enable_prefix_caching=self.enable_prefix_caching,
            context=self.context,
            library_reserve=self.library_reserve,
            keep_logits=self.keep_logits,
            fused=self.fused,
            progress=False,
            load_format=self.load_format,
            seed=self.seed,
            dummy_scale=self.dummy_scale,
            # torch routed into the activations tier: the child routes it
            # too, so it measures only what stays outside (the modules).
            torch_pool="imp_mem" if routed else None,
            activation_bytes=self.activation_bytes if routed else None,
        )

    @property
    def probe_source(self) -> str | dict[str, Any]:
        """What a probe child boots: the caller's model_dir (a dummy
        engine's may be a config dict)."""
        return self.model_dir if isinstance(self.model_dir, dict) else str(self.model_dir)
