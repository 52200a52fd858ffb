"""Options of the rlt-kvcache features (each field is a CLI flag ``--<feature>-<field>``)."""

from __future__ import annotations

import attrs

from rlt.platform.errors import ConfigError

POLICIES = ("priority", "fcfs")
MODES = ("auto", "swap", "recompute")


@attrs.frozen
class PreemptionOptions:
    policy: str = attrs.field(default="priority", metadata={
        "help": "admission order and victims: priority (lower value first, then arrival; a strictly higher "
                "priority arrival may preempt) or fcfs (arrival only, never preempts to admit)",
        "choices": POLICIES})
    mode: str = attrs.field(default="auto", metadata={
        "help": "how a victim's KV is recovered: swap (all planes to host memory and back), recompute (drop "
                "it, rerun the positions on resume; fixed-depth requests only) or auto (per victim by cost)",
        "choices": MODES})
    watermark: float = attrs.field(default=0.01, metadata={
        "help": "fraction of KV blocks admission keeps free for running requests' growth (0 <= w < 1)"})
    recompute_max_tokens: int = attrs.field(default=1024, metadata={
        "help": "auto mode: recompute a victim with at most this many positions of KV, swap larger ones"})

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--preemption-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.mode not in MODES:
            raise ConfigError(f"--preemption-mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"--preemption-watermark must be a number in [0, 1), got {self.watermark!r}")
        if isinstance(self.recompute_max_tokens, bool) or not isinstance(self.recompute_max_tokens, int) \
                or self.recompute_max_tokens < 0:
            raise ConfigError(f"--preemption-recompute-max-tokens must be an integer >= 0, "
                              f"got {self.recompute_max_tokens!r}")

    def summary(self) -> str:
        return f"policy={self.policy}, mode={self.mode}, watermark={self.watermark:g}, incremental KV"


@attrs.frozen
class PrefixCacheOptions:
    def summary(self) -> str:
        return "depth-aware, LRU"
