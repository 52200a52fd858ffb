"""Exit policies: when a row stops looping.

A policy has an explicit decision latency: :class:`OuroGateExit` decides from the gate read after
loop t (latency 0). A lookahead policy (latency 1, for pipelined execution) is a different
component with the same interface, supplied by rlt-decode.

The Ouro rule (fp32): λ_t = sigmoid(gate(H_t)), ``remaining *= 1 - λ_t``; exit after the first
t with t >= min_loops and 1 - remaining >= τ; always at max_loops; τ >= 1 never exits early.
Loops before min_loops still enter the product.
"""

from __future__ import annotations

import torch


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
        adaptive = (threshold < 1.0) & (loop >= min_loops) & ((1.0 - remaining) >= threshold)
        return (loop >= max_loops) | adaptive, remaining
