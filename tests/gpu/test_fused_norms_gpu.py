"""GPU: the fused sandwich-norm kernel is bit-identical to the eager HF-order ops in bf16/fp16."""

from __future__ import annotations

import pytest
import torch

from rlt.platform.models.fused_norms import add_norm_norm
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
