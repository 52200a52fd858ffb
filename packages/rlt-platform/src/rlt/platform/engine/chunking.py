"""PromptChunker: the scheduler seam that decides which prompt rows of which request run in a step.

A *run* is a range of positions ``[start, end)`` of one request that runs as prompt-like chunks,
every chunk through the request's full depth: the prompt (from its cached prefix on), or the
positions a preempted request recomputes. A scheduler policy hands a run to its chunker
(:meth:`PromptChunker.begin`) and asks it every step for the run's rows; everything else —
admission, KV, slots, decode rows, victims — stays the policy's. So a feature that changes only
how prompts are cut (rlt-prefill's chunked and wavefront prefill) sets the policy's
``prompt_chunker`` attribute through a scheduler wrapper and composes with any policy that
replaces the scheduler (rlt-kvcache's), instead of both replacing the scheduler.

The work unit is (chunk c, depth d), a :class:`Row` of the chunk's positions at loop d. It is
runnable when (c, d-1) produced its hidden state (the row exists at depth d) and (c-1, d) wrote
its KV at plane d (the previous in-flight chunk is deeper than d, or gone). This base chunker
starts a chunk when the run has none in flight (sequential, depth-major: chunk c+1 after chunk
c's last loop) and sizes it to ``chunk_limit`` (None: the whole rest of the run; SHARED: one
position, SHARED's own semantics). Subclasses override :meth:`wants_chunk`, :meth:`size` and
:meth:`admission_cost` (rlt-prefill: budget-sized chunks, wavefront).

Must not: allocate KV, admit, or hold device state (the executor keys a chunk's hidden state by
(slot, first position)).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import attrs

from rlt.attention import KVLayout
from rlt.platform.engine.interfaces import Row
from rlt.platform.engine.request import Request


@attrs.define(eq=False)
class PromptRun:
    """One request's run: positions ``[next_start, end)`` still to start, ``chunks`` in flight."""

    slot: int
    end: int
    samples: bool  # the chunk that reaches ``end`` produces a token (it ends the prompt)
    next_start: int
    chunks: list[Row] = attrs.field(factory=list)

    @property
    def resume_start(self) -> int:
        """The first position whose KV is not written at every plane yet."""
        return self.chunks[0].start if self.chunks else self.next_start


class PromptChunker:
    def __init__(self, layout: KVLayout, chunk_limit: int | None = None, *, max_chunk: int | None = None) -> None:
        self.layout = layout
        self._chunk_limit = chunk_limit
        #: a chunk never exceeds this (the step budget): caps runs that are not prompts (recompute)
        self.max_chunk = max_chunk
        self._runs: dict[Request, PromptRun] = {}

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def chunk_limit(self) -> int | None:
        """The most positions in one chunk (None: no cap; SHARED always runs one position)."""
        return 1 if self.layout is KVLayout.SHARED else self._chunk_limit

    @chunk_limit.setter
    def chunk_limit(self, value: int | None) -> None:
        self._chunk_limit = value

    def chunk_len(self, remaining: int) -> int:
        """The longest first chunk of a prompt with ``remaining`` positions (input processing checks
        it against the step budget: a prompt whose first chunk cannot fit is refused)."""
        limit = self.chunk_limit
        return remaining if limit is None else min(remaining, limit)

    def next_len(self, run: PromptRun) -> int:
        """The longest chunk ``run`` may start next."""
        n = self.chunk_len(run.end - run.next_start)
        return n if self.max_chunk is None else min(n, self.max_chunk)

    def admission_cost(self, run: PromptRun) -> int:
        """Step-budget tokens a request needs to be admitted with ``run`` (base: its first chunk)."""
        return self.next_len(run)

    def wants_chunk(self, run: PromptRun) -> bool:
        """Whether ``run`` starts a new chunk in the step being built (base: none in flight)."""
        return run.next_start < run.end and not run.chunks

    def size(self, run: PromptRun, budget: int, inflight: int) -> int:
        """Length of the chunk ``run`` starts now, given the budget left and the positions in
        flight (base: the longest chunk, whatever the budget: admission charged it)."""
        return self.next_len(run)

    # -- runs ------------------------------------------------------------------------------------
    def begin(self, request: Request, slot: int, start: int, end: int, *, samples: bool) -> PromptRun:
        if not start < end:
            raise ValueError(f"an empty run [{start}, {end}) for {request.request_id}")
        run = self._runs[request] = PromptRun(slot, end, samples, start)
        return run

    def active(self, request: Request) -> bool:
        return request in self._runs

    def run(self, request: Request) -> PromptRun:
        return self._runs[request]

    def drop(self, request: Request) -> PromptRun | None:
        return self._runs.pop(request, None)

    def at_boundary(self, request: Request) -> bool:
        """No device state of the request's slot is live: nothing in flight beyond depth 0."""
        return all(c.depth == 0 for c in self._runs[request].chunks)

    # -- budget ----------------------------------------------------------------------------------
    def reserved(self) -> int:
        """Tokens of the next step taken by in-flight chunks (one loop of each)."""
        return sum(c.length for r in self._runs.values() for c in r.chunks)


    def wanted(self) -> int:
        """Tokens the chunks about to start would take at most (they keep their place ahead of
        admissions)."""
        return sum(self.next_len(r) for r in self._runs.values() if self.wants_chunk(r))

    def start_chunks(self, requests: Iterable[Request], budget: int) -> int:
        """Start the chunks due in this step, in the order of ``requests``; returns the budget left.
        A run that gets no room stops the loop (later requests do not overtake)."""
        inflight = self.reserved()
        for req in requests:
            run = self._runs.get(req)
            if run is None or not self.wants_chunk(run):
                continue
            n = self.size(run, budget, inflight)
            if n < 1:
                break
            start = run.next_start
            run.chunks.append(Row(req, run.slot, start, n, 0, samples=run.samples and start + n >= run.end,
                                  in_prompt=True))
            run.next_start = start + n
            budget -= n
            inflight += n
        return budget

    def frontier(self, request: Request) -> int:
        """One past the last position the run's KV must cover in the next step: its started chunks,
        and the chunk it would start (an upper bound, for growth reserves)."""
        run = self._runs[request]
        end = run.chunks[-1].end if run.chunks else run.next_start
        return run.next_start + self.next_len(run) if self.wants_chunk(run) else end

    # -- steps -----------------------------------------------------------------------------------
    def rows(self, request: Request) -> list[Row]:
        """The runnable rows of the request's run in this step, oldest chunk first."""
        out: list[Row] = []
        ready_below = None  # the depth (c - 1) has reached: (c - 1, d) done for every d below it
        for chunk in self._runs[request].chunks:
            if ready_below is None or chunk.depth < ready_below:
                out.append(chunk)
            ready_below = chunk.depth
        return out

    def advance(self, row: Row, exited: bool) -> bool:
        """Move one of the run's rows on after a step; True when the run is complete (its last
        chunk ran its last loop; the run is dropped)."""
        run = self._runs[row.request]
        k = next(j for j, c in enumerate(run.chunks) if c.start == row.start)
        if not exited:
            run.chunks[k] = row.deeper()
            return False
        del run.chunks[k]
        if row.end >= run.end:
            del self._runs[row.request]
            return True
        return False

    def running(self) -> Sequence[Request]:
        return tuple(self._runs)
