"""Host slot table: per-slot request parameters as numpy columns.

A running request owns a slot; its sampling and loop parameters are written once at admission,
and every step gathers the columns of the slots it runs with one fancy index, so building a
step's batch has no per-row Python.
"""

from __future__ import annotations

import numpy as np

from rlt.platform.engine.sampler import split_seed


class SlotTable:
    def __init__(self, max_num_seqs: int, max_stop_ids: int = 8) -> None:
        n = max_num_seqs
        self.temperature = np.zeros(n, np.float32)
        self.top_p = np.ones(n, np.float32)
        self.top_k = np.zeros(n, np.int64)
        self.seed_lo = np.zeros(n, np.int64)
        self.seed_hi = np.zeros(n, np.int64)
        self.min_tokens = np.zeros(n, np.int64)
        self.num_generated = np.zeros(n, np.int64)
        self.logprobs = np.full(n, -1, np.int64)
        self.min_loops = np.ones(n, np.int32)
        self.max_loops = np.ones(n, np.int32)
        self.threshold = np.ones(n, np.float32)
        self.stop_ids = np.full((n, max_stop_ids), -1, np.int64)
        # The running chunk, mirrored from the request for vectorised batch building.
        self.chunk_start = np.zeros(n, np.int64)
        self.chunk_len = np.zeros(n, np.int64)
        self.depth = np.zeros(n, np.int32)
        self.in_prompt = np.zeros(n, bool)
        self.samples = np.zeros(n, bool)

    def assign(self, slot: int, req, seed: int) -> None:
        p = req.params
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = p.top_k if p.top_k > 0 else 0
        self.seed_lo[slot], self.seed_hi[slot] = split_seed(seed)
        self.min_tokens[slot] = p.min_tokens
        self.num_generated[slot] = 0
        self.logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.min_loops[slot] = req.min_loops
        self.max_loops[slot] = req.max_loops
        self.threshold[slot] = req.exit_threshold
        stops = sorted(req.stop_token_ids)
        if len(stops) > self.stop_ids.shape[1]:
            grown = np.full((self.stop_ids.shape[0], len(stops)), -1, np.int64)
            grown[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = grown
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stops)] = stops
        self.set_chunk(slot, req)

    def set_chunk(self, slot: int, req) -> None:
        self.chunk_start[slot] = req.chunk_start
        self.chunk_len[slot] = req.chunk_len
        self.depth[slot] = req.depth
        self.in_prompt[slot] = req.in_prompt
        self.samples[slot] = req.chunk_samples
