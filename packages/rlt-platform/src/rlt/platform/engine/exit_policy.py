"""Exit policies: when a row stops looping.

A policy has an explicit decision latency: :class:`OuroGateExit` decides from the gate read after
loop t (latency 0). A lookahead policy (latency 1, for pipelined execution) is a different
component with the same interface; an executor declares the latency of the policy it runs as its
``exit_latency``.

The Ouro rule (fp32): λ_t = sigmoid(gate(H_t)), ``remaining *= 1 - λ_t``; exit after the first
t with t >= min_loops and 1 - remaining >= τ; always at max_loops. Loops before min_loops still
enter the product. τ >= 1 never exits early — :func:`is_adaptive` is the one place that says so;
rows that are not adaptive carry the threshold :data:`NEVER`, which no CDF reaches.
"""

from __future__ import annotations

import numpy as np
import torch

#: the threshold of rows that never exit before max_loops (the exit CDF never exceeds 1)
NEVER = 2.0


def is_adaptive(threshold):
    """Whether τ turns on adaptive exit (works on floats and arrays)."""
    return threshold < 1.0


def row_thresholds(threshold: np.ndarray, adaptive: np.ndarray) -> np.ndarray:
    """τ per row for :meth:`OuroGateExit.decide`: the request's τ where the row consults the gate."""
    return np.where(adaptive, threshold, NEVER).astype(np.float32)


class OuroGateExit:
    decision_latency = 0

    @staticmethod
    def decide(
        gate_logit: torch.Tensor,
        remaining: torch.Tensor,
        loop: torch.Tensor,
        min_loops: torch.Tensor,
        max_loops: torch.Tensor,
        threshold: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Vectorised over rows; ``loop`` is 1-based. Returns (exit mask, new remaining)."""
        lam = torch.sigmoid(gate_logit.float())
        remaining = remaining * (1.0 - lam)
        early = (loop >= min_loops) & ((1.0 - remaining) >= threshold)
        return (loop >= max_loops) | early, remaining
