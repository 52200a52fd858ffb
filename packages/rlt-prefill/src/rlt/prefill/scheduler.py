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
"""

from __future__ import annotations

from rlt.attention import KVLayout
from rlt.platform.engine.chunking import PromptChunker, PromptRun
from rlt.platform.errors import ConfigError


class ChunkedPrefillChunker(PromptChunker):
    def __init__(self, *, layout: KVLayout, budget: int, chunk_size: int, wavefront: bool = False,
                 max_inflight_tokens: int | None = None) -> None:
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

    @classmethod
    def from_options(cls, ctx, *, chunk_size: int, wavefront: bool,
                     max_inflight_tokens: int | None) -> "ChunkedPrefillChunker":
        return cls(layout=ctx.kv.layout, budget=ctx.max_num_batched_tokens, chunk_size=chunk_size,
                   wavefront=wavefront, max_inflight_tokens=max_inflight_tokens)

    def admission_cost(self, run: PromptRun) -> int:
        return 1  # its first chunk shrinks to what is left

    def wants_chunk(self, run: PromptRun) -> bool:
        if run.next_start >= run.end:
            return False
        if not run.chunks:
            return True
        return self.wavefront and run.chunks[-1].depth >= 1  # (c, 0) completed: (c + 1, 0) may start

    def size(self, run: PromptRun, budget: int, inflight: int) -> int:
        return min(self.next_len(run), budget, self.max_inflight_tokens - inflight)
