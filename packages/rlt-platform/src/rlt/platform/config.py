"""Engine configuration: one frozen value, validated once, from which the engine is built.

It is also the one source of the engine's command-line flags: :func:`add_engine_arguments`
generates ``--<field>`` for every field (help, choices and parser from the field's metadata; the
default shown is the field's), and :func:`engine_config_from_args` builds the config from the
flags that were given, so no default is written twice.
"""

from __future__ import annotations

import argparse

import attrs

from rlt.attention import KVLayout
from rlt.platform.attention_select import ATTENTION_CHOICES
from rlt.platform.errors import ConfigError
from rlt.platform.platforms import DEVICE_CHOICES


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _meta(help: str, **kw) -> dict:
    return {"help": help, **kw}


def _positive(name):
    def check(inst, attr, value):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return check


@attrs.frozen
class EngineConfig:
    #: checkpoint directory; None means the built-in demo model.
    model: str | None = attrs.field(default=None, metadata=_meta(
        "checkpoint directory (Hugging Face layout); default: the built-in demo model"))
    device: str = attrs.field(default="auto", metadata=_meta("hardware platform", choices=DEVICE_CHOICES))
    #: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
    dtype: str = attrs.field(default="auto", metadata=_meta(
        "serving dtype (auto: the checkpoint's)", choices=("auto", "float32", "bfloat16", "float16")))
    attention_backend: str = attrs.field(default="auto", metadata=_meta(
        "attention backend (auto: the platform's order)", choices=ATTENTION_CHOICES))
    kv_layout: KVLayout = attrs.field(default=KVLayout.LAST_EXITED, converter=KVLayout, metadata=_meta(
        "depth-aware KV semantics", choices=tuple(k.value for k in KVLayout)))
    block_size: int = attrs.field(default=16, validator=_positive("block_size"), metadata=_meta(
        "tokens per KV block", type=positive_int))
    #: KV blocks requests can hold; None sizes the pool from memory. Blocks an enabled feature reserves
    #: (rlt-spec's wide chains) come on top of an explicit count.
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive("num_kv_blocks"), metadata=_meta(
        "KV blocks requests can hold (default: from memory; blocks a feature reserves come on top)",
        type=positive_int))
    #: fraction of free device memory the KV pool may take (GPU/NPU).
    gpu_memory_utilization: float = attrs.field(default=0.9, metadata=_meta(
        "fraction of free device memory the KV pool may take"))
    #: KV budget in GiB when there is no device memory to query (CPU); None = 1 GiB.
    kv_cache_memory_gib: float | None = attrs.field(default=None, metadata=_meta(
        "KV budget in GiB where device memory cannot be queried (CPU; default 1 GiB)"))
    max_num_seqs: int = attrs.field(default=256, validator=_positive("max_num_seqs"), metadata=_meta(
        "requests running at once (sequence slots)", type=positive_int))
    max_model_len: int | None = attrs.field(default=None, validator=_positive("max_model_len"), metadata=_meta(
        "context length limit (default: the model's max_position_embeddings)", type=positive_int))
    max_num_batched_tokens: int | None = attrs.field(
        default=None, validator=_positive("max_num_batched_tokens"), metadata=_meta(
            "tokens in one step (default: the larger of 8192 and max_model_len)", type=positive_int))
    #: depth planes (and the most loops a request may ask for); None = the model's loop count. For a
    #: model whose depth is a per-request choice (Huginn) it is the most recurrences a request may ask
    #: for (``max_loops``); requests that give none run the model's own count (``mean_recurrence``).
    num_loops: int | None = attrs.field(default=None, validator=_positive("num_loops"), metadata=_meta(
        "depth planes / most loops per token (default: the model's; Huginn: the most recurrences a "
        "request may ask for, requests default to mean_recurrence)", type=positive_int))
    #: default τ for requests that do not set one; None = 1.0 (fixed full depth).
    exit_threshold: float | None = attrs.field(default=None, metadata=_meta(
        "exit threshold τ for requests that give none (none: 1.0, fixed full depth)",
        flag="--default-exit-threshold"))
    #: promise that no request exits before its max_loops (requests with τ < 1 are rejected). Every
    #: context token then reached every plane a query reads, which lets FlashAttention (one page
    #: table per row, no per-token exit indirection) serve the LAST_EXITED layout exactly.
    fixed_depth: bool = attrs.field(default=False, metadata=_meta(
        "no request may exit early (exit_threshold < 1 is rejected); lets FlashAttention serve the "
        "last_exited layout"))
    #: scale of the random initial recurrent state (Huginn) for requests that give none; 0: zero state.
    init_state_scale: float = attrs.field(default=1.0, metadata=_meta(
        "scale of the random initial state of models that have one (Huginn; 0: the deterministic zero "
        "state) for requests that give no init_state_scale (default: 1.0, as the reference)"))
    seed: int = attrs.field(default=0, metadata=_meta(
        "seeds the sampling of requests that give no seed", flag="--engine-seed"))

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.exit_threshold is not None and not 0.0 <= self.exit_threshold <= 1.0:
            raise ConfigError(f"exit_threshold must be in [0, 1], got {self.exit_threshold}")
        if self.fixed_depth and self.exit_threshold is not None and self.exit_threshold < 1.0:
            raise ConfigError(f"fixed_depth serving cannot have a default exit_threshold below 1 "
                              f"(got {self.exit_threshold})")
        scale = self.init_state_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale < float("inf"):
            raise ConfigError(f"init_state_scale must be a finite number >= 0, got {scale!r}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")


def _flag(field: attrs.Attribute) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``engine`` flag group, one flag per :class:`EngineConfig` field."""
    from rlt.platform.features import add_attrs_argument

    group = parser.add_argument_group("engine")
    for field in attrs.fields(EngineConfig):
        default = field.default.value if isinstance(field.default, KVLayout) else field.default
        help_ = field.metadata.get("help", "")
        if "default" not in help_:
            help_ = f"{help_} (default: {default})"
        shown = field.evolve(metadata={**field.metadata, "help": help_})
        add_attrs_argument(group, _flag(field), shown, f"engine__{field.name}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config from the engine flags that were given (the others keep their defaults)."""
    ns = vars(args)
    given = {f.name: ns[f"engine__{f.name}"] for f in attrs.fields(EngineConfig)
             if ns.get(f"engine__{f.name}") is not None}
    return EngineConfig(**given)
