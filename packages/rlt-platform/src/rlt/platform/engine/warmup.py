"""Warm-up: run a short synthetic workload through an engine before it serves.

Triton compiles a kernel the first time it sees a new specialisation (an integer argument that
becomes 1 or a multiple of 16, a tile chosen for a new row count), and each compile stalls the
step that hit it for 0.3-1.5 s. A benchmark harness hides that with a warm-up pass of its own
workload; a server cannot, so its first concurrent burst paid for every compile: on the H200 the
first 64-client burst after start had ITL p99 1.4 s and took twice the offline time (lease 3,
``benchmarks/results/h200-20261204-decode-3``). vLLM runs a dummy batch at start for the same
reason.

:func:`warm_up` drives the engine's public API only (``add_request`` / ``step`` /
``abort_request``), so every installed feature's kernels compile along the path they take in
serving: one request alone (a prompt per query tile size, :func:`alone_lengths`), then requests
arriving one per step with prompt lengths on both sides of the specialisation boundaries (mixed
prompt + decode steps at growing row counts), then a burst admitted at once (packed prompts), with
adaptive exit on half of them when the engine accepts per-request thresholds, then speculative requests
where the engine takes them (alone and two together). Prompts are seeded
random token ids, outputs are discarded, every request is finished or aborted before it returns (KV
freed: the pool is as before, except prefix pages a prefix cache may keep, which are evictable), and
it stops at ``deadline_s``.
Graph capture is not its job (rlt-decode captures at startup); compiles it misses, it misses —
Triton's on-disk cache makes the next start cheaper either way.
"""

from __future__ import annotations

import random
import time
from typing import Any

import attrs

from rlt.platform.errors import InvalidRequestError
from rlt.platform.sampling_params import SamplingParams

#: prompt lengths: 1, around the 16-multiple specialisation boundaries, and up to 1K
LENGTHS = (1, 3, 16, 17, 31, 64, 100, 255, 512, 1000, 1024)
PREFIX = "rlt-warmup-"
#: the speculative requests' setting (refused without rlt-spec, or with one loop: then skipped)
SPECULATION = {"num_tokens": 4, "draft_loops": 1}


def alone_lengths(lengths) -> list[int]:
    """The longest of ``lengths`` in each power-of-two bucket from 16 up: the prompt-attention kernels pick
    their query tile from the step's longest prompt (16, 32, 64, 128 rows) and compile a variant for a
    prompt that runs alone (no other row to skip), so a request arriving alone at an idle server meets one
    of these. The H200 compiled the 128-row one mid-traffic when the warm-up ran a lone 64-token prompt only
    (lease 9, ``tests/gpu/test_compiles_gpu.py``)."""
    buckets: dict[int, int] = {}
    for n in lengths:
        bucket = max(16, 1 << max(0, n - 1).bit_length())
        buckets[bucket] = max(buckets.get(bucket, 0), n)
    return [buckets[b] for b in sorted(buckets)]


@attrs.frozen
class WarmupReport:
    requests: int
    steps: int
    seconds: float
    #: requests the engine refused (prompt too long for this configuration, ...), with the reason
    refused: tuple[str, ...] = ()
    #: True when ``deadline_s`` cut it short (the rest were aborted)
    cut: bool = False

    def summary(self) -> str:
        s = f"{self.requests} requests, {self.steps} steps in {self.seconds:.2f} s"
        if self.cut:
            s += " (deadline reached: the rest aborted)"
        if self.refused:
            s += f"; {len(self.refused)} refused ({self.refused[0]})"
        return s


def warm_up(engine: Any, *, max_concurrency: int = 48, max_prompt_len: int = 1024, output_len: int = 8,
            deadline_s: float = 120.0, seed: int = 0) -> WarmupReport:
    """Run the warm-up workload (module docstring) on ``engine``; it must hold no requests."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine (requests are running or waiting)")
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    longest = max(1, min(max_prompt_len, engine.max_model_len - output_len - 1, engine.max_num_batched_tokens))
    lengths = sorted({min(n, longest) for n in LENGTHS})
    n = max(1, min(max_concurrency, engine.ctx.max_num_seqs))
    state = _Run(engine, rng, vocab, output_len, time.perf_counter() + deadline_s)
    t0 = time.perf_counter()
    # 1. one request alone (the C = 1 path: single-row prompt and decode steps), once per prompt tile
    for length in alone_lengths(lengths):
        state.add(length, adaptive=False)
        state.drain()
    # ... and where the engine chunks prompts longer than a step (chunked prefill, a budget below
    # max_model_len), one of those alone: its later chunks read earlier ones from the cache (other kernels)
    chunked = min(engine.max_model_len - output_len - 1, 2 * engine.max_num_batched_tokens + 1)
    if chunked > engine.max_num_batched_tokens:
        state.add(chunked, adaptive=False, optional=True)
        state.drain()
    # 2. arrivals one per step: mixed prompt + decode steps at every row count up to n
    for i in range(n):
        state.add(lengths[i % len(lengths)], adaptive=i % 2 == 1)
        state.step()
    state.drain()
    # 3. a burst admitted together: many prompts packed into one step
    for i in range(n):
        state.add(lengths[(i * 7) % len(lengths)], adaptive=i % 2 == 0)
    state.drain()
    # 4. where the engine takes speculation (rlt-spec): one request alone, then two together — the
    # speculative steps' shapes and their heads' kernels (the chains' fused greedy heads compile on first use)
    for count in (1, 2):
        for _ in range(count):
            state.add(lengths[min(2, len(lengths) - 1)], adaptive=False, optional=True, speculation=SPECULATION)
        state.drain()
    return WarmupReport(state.count, state.steps, time.perf_counter() - t0, tuple(state.refused), state.cut)


class _Run:
    def __init__(self, engine, rng, vocab, output_len, deadline) -> None:
        self.engine, self.rng, self.vocab, self.output_len, self.deadline = engine, rng, vocab, output_len, deadline
        self.count = self.steps = 0
        self.refused: list[str] = []
        self.adaptive_ok = True  # until the engine refuses a per-request threshold
        self.cut = False

    def add(self, length: int, *, adaptive: bool, optional: bool = False, **extra) -> None:
        """Submit a prompt of ``length`` tokens (``extra``: more sampling parameters); a refusal is
        recorded unless ``optional`` (a shape only some compositions take)."""
        if self.cut:
            return
        prompt = [self.rng.randrange(self.vocab) for _ in range(length)]
        params = dict(max_tokens=self.output_len, temperature=0.0, ignore_eos=True, **extra)
        if adaptive and self.adaptive_ok:
            try:
                self._submit(prompt, SamplingParams(**params, exit_threshold=0.7))
                return
            except InvalidRequestError:
                self.adaptive_ok = False  # e.g. --fixed-depth: plain requests only
        try:
            self._submit(prompt, SamplingParams(**params))
        except InvalidRequestError as exc:
            if not optional:
                self.refused.append(str(exc))

    def _submit(self, prompt, params) -> None:
        self.engine.add_request(f"{PREFIX}{self.count}", prompt, params)
        self.count += 1

    def step(self) -> None:
        if self.cut or not self.engine.has_unfinished_requests():
            return
        if time.perf_counter() > self.deadline:
            self.cut = True
            for rid in list(self.engine.running_request_ids()) + [f"{PREFIX}{i}" for i in range(self.count)]:
                self.engine.abort_request(rid)
            return
        self.engine.step()
        self.steps += 1

    def drain(self) -> None:
        while self.engine.has_unfinished_requests() and not self.cut:
            self.step()
