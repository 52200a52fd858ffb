"""Engine configuration: one frozen value, validated once, from which the engine is built."""

from __future__ import annotations

import attrs

from rlt.attention import KVLayout
from rlt.platform.errors import ConfigError


def _positive(name):
    def check(inst, attr, value):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return check


@attrs.frozen
class EngineConfig:
    #: checkpoint directory; None means the built-in demo model.
    model: str | None = None
    device: str = "auto"
    #: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_layout: KVLayout = attrs.field(default=KVLayout.LAST_EXITED, converter=KVLayout)
    block_size: int = attrs.field(default=16, validator=_positive("block_size"))
    #: KV pool size in blocks; None sizes it from memory.
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive("num_kv_blocks"))
    #: fraction of free device memory the KV pool may take (GPU/NPU).
    gpu_memory_utilization: float = 0.9
    #: KV budget in GiB when there is no device memory to query (CPU); None = 1 GiB.
    kv_cache_memory_gib: float | None = None
    max_num_seqs: int = attrs.field(default=256, validator=_positive("max_num_seqs"))
    max_model_len: int | None = attrs.field(default=None, validator=_positive("max_model_len"))
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_positive("max_num_batched_tokens"))
    #: depth planes (and the most loops a request may ask for); None = the model's loop count.
    num_loops: int | None = attrs.field(default=None, validator=_positive("num_loops"))
    #: default τ for requests that do not set one; None = 1.0 (fixed full depth).
    exit_threshold: float | None = None
    #: promise that no request exits before its max_loops (requests with τ < 1 are rejected). Every
    #: context token then reached every plane a query reads, which lets FlashAttention (one page
    #: table per row, no per-token exit indirection) serve the LAST_EXITED layout exactly.
    fixed_depth: bool = False
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.exit_threshold is not None and not 0.0 <= self.exit_threshold <= 1.0:
            raise ConfigError(f"exit_threshold must be in [0, 1], got {self.exit_threshold}")
        if self.fixed_depth and self.exit_threshold is not None and self.exit_threshold < 1.0:
            raise ConfigError(f"fixed_depth serving cannot have a default exit_threshold below 1 "
                              f"(got {self.exit_threshold})")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
