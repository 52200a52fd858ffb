"""Chunked prefill and wavefront chunked prefill (WCPB): the prompt chunker of ``chunked_prefill``.

:class:`ChunkedPrefillChunker` is a :class:`~rlt.platform.engine.chunking.PromptChunker`: it
decides which prompt rows of which request run in a step, and nothing else. The feature installs
it into whatever scheduler policy the engine has (the base one, or rlt-kvcache's with prefix
cache and preemption) through the policy's ``prompt_chunker`` attribute, so it composes with a
policy that replaces the scheduler; admission, KV, decode rows and victims stay the policy's.

A prompt (or any run of positions the policy hands over, e.g. a recompute range) runs in chunks
of at most ``chunk_size`` positions, each sized when it starts to what is left of the step budget,
so a prompt of any length up to ``max_model_len`` is served under any budget and decode rows keep
running in the same steps.

The work unit is (chunk c, depth d); it is runnable when (c, d-1) produced its hidden state and
(c-1, d) wrote its KV at plane d (the base chunker's rows). A new chunk starts

- *sequential* (default): when the previous chunk completed its last depth (vllm-rlt's
  depth-major chunked prefill);
- *wavefront* (``wavefront=True``): as soon as the previous chunk completed depth 0, so one
  step mixes chunks of one request at several depths with other requests' chunks and decode
  rows. LAST_EXITED only: under SHARED a later chunk would read plane 0 of an earlier chunk
  that a deeper loop is overwriting.

Budget, in row-loops: a row of n positions costs n in each step it runs (one loop). Decode rows
(1 each) and every in-flight chunk are reserved first; new chunks take what is left, in
arrival order, so the sum of a step's rows never exceeds ``max_num_batched_tokens`` and every
in-flight chunk runs in every step it is runnable. Intermediate hidden states are bounded:
in-flight chunks hold at most ``max_inflight_tokens`` positions (default: the step budget).
Admission charges one token: a newly admitted request starts with whatever the running requests
leave.

Decode smoothness (:class:`StepCost`): a step carrying decode rows also caps its prompt rows by
cost, so no such step costs much more than a decode-only step. One step is one loop of every
row; a decoding request's inter-token latency is the sum of its ``num_loops`` steps, so the ITL
ratio under a long prompt is the ratio of a mixed step's time to a decode-only step's. The model:

    T(step) = T0 + a0 * (D + sum over prompt rows of cost(row))
    cost(row of n positions from s) = n * (1 + (s + (n + 1) / 2) / K)

``T0`` is what every step pays once (the recurrent block's weights read once, kernel launches,
host work), ``a0`` the time of one row-loop's linear FLOPs, ``D`` the decode tokens, and the
attention term counts each row's mean causal context against ``K`` = the context at which a
row's attention FLOPs equal its linear FLOPs (about ``6 * hidden_size`` for a Llama-style layer:
24 h^2 linear FLOPs against 4 h per key; Ouro-1.4B: 12.3K). With ``C0 = T0 / a0``
(``step_overhead_tokens``) a step with decode rows keeps

    sum of prompt costs <= (ratio - 1) * (C0 + D)

so T(mixed) <= ratio * T(decode-only). In-flight chunks count first; a new chunk gets the longest
length whose cost fits what is left (so late chunks of a long prompt, whose attention costs more,
are shorter); when no prompt row is in the step yet, a chunk of at least one position starts, so
prompts always progress. Without decode rows only the token budget applies (nothing to protect:
a lone prompt runs at full speed). The price is TTFT: a prompt of total cost S takes about
``S / cap`` steps of ``ratio * T0`` each, i.e. ``ratio / (ratio - 1)`` times its compute time
``a0 * S`` (2x at ratio 2, 3x at 1.5), whatever ``T0`` is. ``ratio = 0`` turns the cap off.
"""

from __future__ import annotations

import math
from typing import Iterable

import attrs

from rlt.attention import KVLayout
from rlt.platform.engine.chunking import PromptChunker, PromptRun
from rlt.platform.errors import ConfigError

#: ``--chunked-prefill-decode-step-ratio`` default: off. The cap is opt-in: it throttles bursts of
#: new prompts whenever anything decodes, and its step-cost constants were fitted to the eager
#: executor (not to rlt-decode's graph-replayed decode steps) and not yet measured with the cap on.
DEFAULT_STEP_RATIO = 0.0
#: The ratio the docs and the smoothness benchmark use for the ITL p99 <= 2x p50 target: a mixed
#: step at most 1.5x a decode-only step, leaving room for host jitter.
SMOOTH_STEP_RATIO = 1.5
#: ``--chunked-prefill-step-overhead-tokens`` default: C0 = T0 / a0 on the H200 with the eager
#: executor at Ouro-1.4B shapes (T0 ~ 11 ms per decode-only step of 32 rows, a0 ~ 4.3 us per
#: row-loop from the full 16K prefill step: 119 ms for 16,384 rows at mean context 8K).
DEFAULT_STEP_OVERHEAD_TOKENS = 2048


def attention_tokens_for(hidden_size: int) -> int:
    """``K`` of :class:`StepCost` from the model width: a Llama-style layer has about 12 h^2
    weights (24 h^2 FLOPs per row-loop) and 4 h attention FLOPs per key, so K = 6 h."""
    return 6 * hidden_size


@attrs.frozen
class StepCost:
    """The step-time model of the module docstring, in row-loop units (``a0`` = 1)."""

    ratio: float = DEFAULT_STEP_RATIO
    overhead_tokens: int = DEFAULT_STEP_OVERHEAD_TOKENS
    attention_tokens: int = 12288

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    def row(self, start: int, n: int) -> float:
        """Cost of a prompt row of ``n`` positions from ``start`` (one loop)."""
        return n * (1.0 + (start + (n + 1) / 2) / self.attention_tokens)

    def cap(self, decode_tokens: int) -> float:
        """The most prompt cost a step may carry next to ``decode_tokens`` decode tokens."""
        if not self.enabled or decode_tokens <= 0:
            return math.inf
        return (self.ratio - 1.0) * (self.overhead_tokens + decode_tokens)

    def fit(self, start: int, cost: float, limit: int) -> int:
        """The longest row from ``start`` (at most ``limit`` positions) whose cost is <= ``cost``."""
        if cost == math.inf:
            return limit
        if cost <= 0 or limit <= 0:
            return 0
        k = self.attention_tokens
        b = 1.0 + (start + 0.5) / k  # cost(n) = n^2 / (2k) + b n
        n = int(min(limit, k * (math.sqrt(b * b + 2.0 * cost / k) - b)))
        while n < limit and self.row(start, n + 1) <= cost:
            n += 1
        while n > 0 and self.row(start, n) > cost:
            n -= 1
        return n


class ChunkedPrefillChunker(PromptChunker):
    def __init__(self, *, layout: KVLayout, budget: int, chunk_size: int, wavefront: bool = False,
                 max_inflight_tokens: int | None = None, step_cost: StepCost | None = None) -> None:
        if not 1 <= chunk_size <= budget:
            raise ConfigError(f"--prefill-chunk-size {chunk_size} must be between 1 and the step budget "
                              f"--max-num-batched-tokens ({budget})")
        if wavefront and layout is KVLayout.SHARED:
            raise ConfigError("--chunked-prefill-wavefront needs --kv-layout last_exited: under SHARED every loop "
                              "overwrites a position's one KV slot, so a later chunk cannot read an earlier chunk's "
                              "shallower loop while a deeper loop runs (SHARED semantics forbid cross-chunk wavefronts)")
        inflight = budget if max_inflight_tokens is None else max_inflight_tokens
        if inflight < chunk_size:
            raise ConfigError(f"--chunked-prefill-max-inflight-tokens {inflight} must be at least the chunk size "
                              f"({chunk_size}), or no chunk could start")
        super().__init__(layout, chunk_size, max_chunk=budget)
        self.wavefront = wavefront
        self.max_inflight_tokens = inflight
        #: the decode-smoothness cap (:class:`StepCost`; ratio 0: only the token budget)
        self.step_cost = StepCost(ratio=0) if step_cost is None else step_cost
        #: prompt cost the step being built may still take (set by :meth:`start_chunks`)
        self._cost_left = math.inf
        #: whether the step being built has a prompt row yet (one always may start)
        self._has_prompt_rows = False

    @classmethod
    def from_options(cls, ctx, *, chunk_size: int, wavefront: bool, max_inflight_tokens: int | None,
                     step_cost: StepCost | None = None) -> "ChunkedPrefillChunker":
        return cls(layout=ctx.kv.layout, budget=ctx.max_num_batched_tokens, chunk_size=chunk_size,
                   wavefront=wavefront, max_inflight_tokens=max_inflight_tokens, step_cost=step_cost)

    def admission_cost(self, run: PromptRun) -> int:
        return 1  # its first chunk shrinks to what is left

    def wants_chunk(self, run: PromptRun) -> bool:
        if run.next_start >= run.end:
            return False
        if not run.chunks:
            return True
        return self.wavefront and run.chunks[-1].depth >= 1  # (c, 0) completed: (c + 1, 0) may start

    def inflight_cost(self) -> float:
        """The step cost of the chunks in flight (one loop each)."""
        return sum(self.step_cost.row(c.start, c.length) for r in self._runs.values() for c in r.chunks)

    def start_chunks(self, requests: Iterable, budget: int) -> int:
        """The base chunker's start, under the decode-smoothness cap. The policy passes the budget
        left after decode rows and in-flight chunks (``max_num_batched_tokens - decode tokens -
        reserved()``), so the step's decode tokens are what the budget lost besides in-flight chunks."""
        reserved = self.reserved()
        decode = self.max_chunk - reserved - budget
        self._has_prompt_rows = reserved > 0
        self._cost_left = self.step_cost.cap(decode) - (self.inflight_cost() if reserved else 0.0)
        return super().start_chunks(requests, budget)

    def size(self, run: PromptRun, budget: int, inflight: int) -> int:
        """Called once per chunk start by :meth:`start_chunks`; accounts the chunk's cost."""
        n = min(self.next_len(run), budget, self.max_inflight_tokens - inflight)
        fit = self.step_cost.fit(run.next_start, self._cost_left, n)
        n = max(fit, min(n, 1)) if not self._has_prompt_rows else fit
        if n >= 1:
            self._cost_left -= self.step_cost.row(run.next_start, n)
            self._has_prompt_rows = True
        return n
