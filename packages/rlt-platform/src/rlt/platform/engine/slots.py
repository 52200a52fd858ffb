"""Host slot table: per-slot request parameters as numpy columns.

A running request owns a slot; its sampling and loop parameters are written once at admission
(:meth:`SlotTable.assign`, by the scheduler policy) and read by the batch builder and the sampler,
which gather the columns of a step's slots with one fancy index — no per-row Python. Where a
request is in its computation is not here (rows carry it), nor is device state (the executor's).
"""

from __future__ import annotations

import numpy as np

from rlt.platform.engine.exit_policy import is_adaptive
from rlt.platform.engine.sampler import split_seed


class SlotTable:
    def __init__(self, max_num_seqs: int, max_stop_ids: int = 8) -> None:
        n = max_num_seqs
        self.temperature = np.zeros(n, np.float32)
        self.top_p = np.ones(n, np.float32)
        self.top_k = np.zeros(n, np.int64)
        self.min_p = np.zeros(n, np.float32)
        self.seed_lo = np.zeros(n, np.int64)
        self.seed_hi = np.zeros(n, np.int64)
        self.min_tokens = np.zeros(n, np.int64)
        self.num_generated = np.zeros(n, np.int64)
        self.logprobs = np.full(n, -1, np.int64)
        self.min_loops = np.ones(n, np.int32)
        self.max_loops = np.ones(n, np.int32)
        self.threshold = np.ones(n, np.float32)
        #: the request's decode rows consult the exit gate (τ < 1)
        self.adaptive = np.zeros(n, bool)
        self.stop_ids = np.full((n, max_stop_ids), -1, np.int64)
        #: logit_bias: token ids (-1 = none) and their biases; as wide as the widest request's (grown on demand)
        self.bias_ids = np.full((n, 0), -1, np.int64)
        self.bias_vals = np.zeros((n, 0), np.float32)
        #: how many of a slot's bias columns are its own (a step uploads only the widest of its rows')
        self.bias_len = np.zeros(n, np.int64)
        #: repetition / frequency / presence penalties (engine/penalties.py); ``penalized``: any is on
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.penalized = np.zeros(n, bool)
        #: slots assigned a penalised request whose device history the sampler has not rebuilt yet
        self.penalty_resets: dict[int, object] = {}

    def assign(self, slot: int, req) -> None:
        """Write ``req``'s parameters into ``slot``. Raises before writing anything if a value
        does not fit its column (then the slot is unchanged)."""
        p = req.params
        stops = sorted(req.stop_token_ids)
        values = {
            "temperature": np.float32(p.temperature), "top_p": np.float32(p.top_p),
            "top_k": np.int64(p.top_k if p.top_k > 0 else 0), "min_p": np.float32(p.min_p),
            "min_tokens": np.int64(p.min_tokens),
            "logprobs": np.int64(-1 if p.logprobs is None else p.logprobs),
            "min_loops": np.int32(req.min_loops), "max_loops": np.int32(req.max_loops),
            "threshold": np.float32(req.exit_threshold), "stops": np.asarray(stops, np.int64),
            "presence_penalty": np.float32(p.presence_penalty), "frequency_penalty": np.float32(p.frequency_penalty),
            "repetition_penalty": np.float32(p.repetition_penalty),
        }
        lo, hi = split_seed(req.seed)
        self.stop_ids = _widened(self.stop_ids, len(stops), -1)
        self.bias_ids = _widened(self.bias_ids, len(p.logit_bias), -1)
        self.bias_vals = _widened(self.bias_vals, len(p.logit_bias), 0)
        for name in ("temperature", "top_p", "top_k", "min_p", "min_tokens", "logprobs", "min_loops", "max_loops",
                     "threshold", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            getattr(self, name)[slot] = values[name]
        self.seed_lo[slot], self.seed_hi[slot] = lo, hi
        self.num_generated[slot] = 0
        self.adaptive[slot] = is_adaptive(req.exit_threshold)
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stops)] = values["stops"]
        self.bias_ids[slot] = -1
        self.bias_vals[slot] = 0
        self.bias_len[slot] = len(p.logit_bias)
        self.penalized[slot] = p.penalized
        if p.penalized:
            self.penalty_resets[slot] = req
        else:  # an earlier owner's pending rebuild: nobody reads this slot's history now
            self.penalty_resets.pop(slot, None)
        if p.logit_bias:
            ids, vals = zip(*p.logit_bias)
            self.bias_ids[slot, : len(ids)] = ids
            self.bias_vals[slot, : len(ids)] = vals


def _widened(column: np.ndarray, width: int, fill) -> np.ndarray:
    """``column`` ([slots, k]), or a copy widened to ``width`` columns of ``fill`` when k is smaller."""
    if width <= column.shape[1]:
        return column
    grown = np.full((column.shape[0], width), fill, column.dtype)
    grown[:, : column.shape[1]] = column
    return grown
