"""Chunked prefill and wavefront chunked prefill (WCPB): the scheduler policy of ``chunked_prefill``.

A prompt runs in chunks of at most ``chunk_size`` positions, each sized when it starts to what
is left of the step budget, so a prompt of any length up to ``max_model_len`` is served under
any budget and decode rows keep running in the same steps.

The work unit is (chunk c, depth d): a :class:`~rlt.platform.engine.interfaces.Row` of the
chunk's positions at loop d. It is runnable when (c, d-1) produced its hidden state (the row
exists at depth d) and (c-1, d) wrote its KV at plane d (the previous in-flight chunk is
deeper than d, or gone). Completing (c, d) makes (c, d+1) runnable. A new chunk starts

- *sequential* (default): when the previous chunk completed its last depth (vllm-rlt's
  depth-major chunked prefill);
- *wavefront* (``wavefront=True``): as soon as the previous chunk completed depth 0, so one
  step mixes chunks of one request at several depths with other requests' chunks and decode
  rows. LAST_EXITED only: under SHARED a later chunk would read plane 0 of an earlier chunk
  that a deeper loop is overwriting.

Budget, in row-loops: a row of n positions costs n in each step it runs (one loop). Decode rows
(1 each) and every in-flight chunk are reserved first; new chunks take what is left, in
arrival order, so the sum of a step's rows never exceeds ``max_num_batched_tokens`` and every
in-flight chunk runs in every step (the pipeline never stalls once started). Intermediate hidden
states are bounded: in-flight chunks hold at most ``max_inflight_tokens`` positions (default:
the step budget). Admission charges one token: a newly admitted request starts with whatever the
running requests leave.

This module owns the rows of every running request; KV allocation and admission are the base
policy's (:class:`~rlt.platform.engine.scheduler.LoopScheduler`).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from rlt.attention import KVLayout
from rlt.platform.engine.interfaces import Row, StepPlan, StepResult
from rlt.platform.engine.request import Request
from rlt.platform.engine.scheduler import LoopScheduler
from rlt.platform.errors import ConfigError


@attrs.define(eq=False)
class PromptState:
    """Where a running request's prompt is: its in-flight chunks (by start) and the next position."""

    chunks: list[Row] = attrs.field(factory=list)
    next_start: int = 0


class ChunkedPrefillScheduler(LoopScheduler):
    def __init__(self, *, chunk_size: int, wavefront: bool = False, max_inflight_tokens: int | None = None,
                 **base) -> None:
        super().__init__(**base)
        budget = self.max_num_batched_tokens
        if not 1 <= chunk_size <= budget:
            raise ConfigError(f"--prefill-chunk-size {chunk_size} must be between 1 and the step budget "
                              f"--max-num-batched-tokens ({budget})")
        if wavefront and self.layout is KVLayout.SHARED:
            raise ConfigError("--chunked-prefill-wavefront needs --kv-layout last_exited: under SHARED every loop "
                              "overwrites a position's one KV slot, so a later chunk cannot read an earlier chunk's "
                              "shallower loop while a deeper loop runs (SHARED semantics forbid cross-chunk wavefronts)")
        inflight = budget if max_inflight_tokens is None else max_inflight_tokens
        if inflight < chunk_size:
            raise ConfigError(f"--chunked-prefill-max-inflight-tokens {inflight} must be at least the chunk size "
                              f"({chunk_size}), or no chunk could start")
        self.chunk_limit = 1 if self.layout is KVLayout.SHARED else chunk_size
        self.wavefront = wavefront
        self.max_inflight_tokens = inflight
        self._prompts: dict[Request, PromptState] = {}

    @classmethod
    def from_options(cls, ctx, *, chunk_size: int, wavefront: bool, max_inflight_tokens: int | None):
        return cls(kv=ctx.parts.kv_manager, slots=ctx.parts.slots, max_num_seqs=ctx.max_num_seqs,
                   max_num_batched_tokens=ctx.max_num_batched_tokens, layout=ctx.kv.layout,
                   chunk_size=chunk_size, wavefront=wavefront, max_inflight_tokens=max_inflight_tokens)

    # -- budget ---------------------------------------------------------------------------------
    def admission_cost(self, request: Request) -> int:
        return 1  # its first chunk shrinks to what is left

    def _reserved(self) -> int:
        """Tokens of the next step taken by decode rows and in-flight chunks."""
        decoding = sum(1 for r in self._running if r not in self._prompts)
        return decoding + sum(c.length for p in self._prompts.values() for c in p.chunks)

    def _wants_chunk(self, req: Request, p: PromptState) -> bool:
        if p.next_start >= req.num_prompt:
            return False
        if not p.chunks:
            return True
        return self.wavefront and p.chunks[-1].depth >= 1  # (c, 0) completed: (c + 1, 0) may start

    def step_budget_left(self) -> int:
        # Running requests that are about to start a chunk keep their place ahead of admissions.
        wanted = sum(min(self.chunk_limit, req.num_prompt - p.next_start)
                     for req, p in self._prompts.items() if self._wants_chunk(req, p))
        return self.max_num_batched_tokens - self._reserved() - wanted

    # -- steps ------------------------------------------------------------------------------------
    def _start_chunks(self, budget: int) -> int:
        inflight = sum(c.length for p in self._prompts.values() for c in p.chunks)
        for req in self._running:
            p = self._prompts.get(req)
            if p is None or not self._wants_chunk(req, p):
                continue
            n = min(self.chunk_limit, req.num_prompt - p.next_start, budget, self.max_inflight_tokens - inflight)
            if n < 1:
                break  # arrival order: later requests do not overtake
            start = p.next_start
            p.chunks.append(Row(req, req.slot, start, n, 0, samples=start + n >= req.num_prompt, in_prompt=True))
            p.next_start = start + n
            budget -= n
            inflight += n
        return budget

    def schedule(self) -> StepPlan:
        failed = self._admit()
        for req in self._running:
            if req not in self._prompts and self._rows.get(req) is not None and self._rows[req].in_prompt:
                del self._rows[req]  # newly admitted: its prompt is chunked here, sized per step
                self._prompts[req] = PromptState()
        self._start_chunks(self.max_num_batched_tokens - self._reserved())
        rows: list[Row] = []
        for req in self._running:
            p = self._prompts.get(req)
            if p is None:
                rows.append(self._rows[req])
                continue
            ready_below = None  # the depth (c - 1) has reached: (c - 1, d) done for every d below it
            for chunk in p.chunks:
                if ready_below is None or chunk.depth < ready_below:
                    rows.append(chunk)
                ready_below = chunk.depth
        return StepPlan(tuple(rows), tuple(failed))

    def advance(self, rows: Sequence[Row], result: StepResult, done: set[Request]) -> None:
        exited = np.asarray(result.exited, bool)
        produced = np.asarray(result.num_tokens) > 0
        base_rows: list[int] = []
        for i, row in enumerate(rows):
            req = row.request
            p = self._prompts.get(req)
            if p is None:  # a decode row: the base policy moves it on
                base_rows.append(i)
                continue
            if req in done:
                continue
            k = next(j for j, c in enumerate(p.chunks) if c.start == row.start)
            if not exited[i]:
                p.chunks[k] = row.deeper()
            elif produced[i]:  # the last chunk's last loop sampled the first token: decoding starts
                del self._prompts[req]
                self._rows[req] = row
                base_rows.append(i)
            else:
                del p.chunks[k]
        if base_rows:
            idx = np.asarray(base_rows)
            super().advance([rows[i] for i in base_rows],
                            attrs.evolve(result, exited=exited[idx], num_tokens=np.asarray(result.num_tokens)[idx]),
                            done)

    def finish(self, request: Request) -> None:
        self._prompts.pop(request, None)
        super().finish(request)

    def inflight_tokens(self) -> int:
        """Positions of in-flight prompt chunks (their hidden states live in the executor)."""
        return sum(c.length for p in self._prompts.values() for c in p.chunks)
