"""Numerics shared by every model: RMSNorm and rotary tables, in the Hugging Face rounding order.

RMSNorm: variance and normalisation in float32, cast back to the activation dtype, then the weight
multiply in the activation dtype (models.md §5.2). RoPE: inverse frequencies and angles in float32
(never stored in a low-precision dtype), cos/sin cast to the activation dtype before rotation.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[N, head_dim]`` (split-half layout: the angle vector repeated twice)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[N, heads, d]`` with cos/sin ``[N, d]``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
