"""GPU: the fused model kernels against the eager HF-order ops (bit-identical where every rounding point is kept)."""

from __future__ import annotations

import pytest
import torch

from rlt.platform.models.fused_ops import add_norm_norm
from rlt.platform.models.layers import rms_norm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 2048), (37, 2048), (512, 2048), (3, 96)])
def test_fused_norm_matches_eager(dtype, rows, cols):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator(device="cuda").manual_seed(rows * cols)
    h = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
    x = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)
    w1 = (1 + 0.3 * torch.randn(cols, device="cuda", generator=g)).to(dtype)
    w2 = (1 + 0.3 * torch.randn(cols, device="cuda", generator=g)).to(dtype)
    fh, fn = add_norm_norm(h, x, w1, w2, 1e-6, use_triton=True)
    eh = h + rms_norm(x, w1, 1e-6)
    en = rms_norm(eh, w2, 1e-6)
    if dtype == torch.float32:
        assert torch.allclose(fh, eh, atol=1e-5) and torch.allclose(fn, en, atol=1e-5)
    else:
        # identical rounding points; only the fp32 variance sum order differs -> rare 1-ulp flips
        assert torch.equal(fh, eh)
        assert (fn != en).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_and_silu_mul_bit_identical(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import apply_rope, rope_cos_sin, rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(7)
    n, nq, nkv, d = 300, 16, 16, 128
    qkv = torch.randn(n, (nq + 2 * nkv) * d, device="cuda", generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(n, device="cuda") * 37, rope_inv_freq(d, 1e6, device="cuda"), dtype)
    q0 = apply_rope(qkv[:, : nq * d].reshape(n, nq, d), cos, sin)
    k0 = apply_rope(qkv[:, nq * d:(nq + nkv) * d].reshape(n, nkv, d), cos, sin)
    q, k, _ = rope_qk_(qkv, cos, sin, nq, nkv, d, use_triton=True)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    gu = torch.randn(n, 2 * 5632, device="cuda", generator=g).to(dtype)
    assert torch.equal(silu_mul(gu, use_triton=True), torch.nn.functional.silu(gu[:, :5632]) * gu[:, 5632:])
