"""Numerics shared by every model: RMSNorm and rotary tables, in the Hugging Face rounding order.

RMSNorm: variance and normalisation in float32, cast back to the activation dtype, then the weight
multiply in the activation dtype (models.md §5.2). RoPE: inverse frequencies and angles in float32
(never stored in a low-precision dtype). Two layouts (models.md §5.3):

* split-half (Ouro, Nanbeige): cos/sin ``[N, d]`` cast to the activation dtype before rotation;
* interleaved pairs (Huginn): dims ``(2i, 2i+1)`` rotate by angle i; cos/sin ``[N, d/2]`` stay
  float32 and the rotation runs in float32 on upcast q/k, the result cast back.
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


def rope_pair_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin ``[N, head_dim / 2]`` of the interleaved-pair layout."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of x ``[N, heads, d]`` in float32, returned in x's dtype.

    ``x'[2i] = x[2i] cos_i - x[2i+1] sin_i``, ``x'[2i+1] = x[2i+1] cos_i + x[2i] sin_i``.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
