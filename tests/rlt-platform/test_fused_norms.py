"""The fused sandwich-norm kernel against the eager ops it replaces (Triton interpreter on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlt.platform.models.fused_norms import add_norm_norm
from rlt.platform.models.layers import rms_norm

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from rlt.platform.models.fused_norms import add_norm_norm
    from rlt.platform.models.layers import rms_norm
    for dtype, seed in [(torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2)]:
        g = torch.Generator().manual_seed(seed)
        rows, cols = 5, 96   # cols not a power of two: the masked tail is exercised
        h, x = (torch.randn(rows, cols, generator=g) * 3).to(dtype), torch.randn(rows, cols, generator=g).to(dtype)
        w1, w2 = (1 + 0.3 * torch.randn(cols, generator=g)).to(dtype), (1 + 0.3 * torch.randn(cols, generator=g)).to(dtype)
        for second in (w2, None):
            fh, fn = add_norm_norm(h, x, w1, second, 1e-6, use_triton=True)
            eh = h + rms_norm(x, w1, 1e-6)
            en = rms_norm(eh, second, 1e-6) if second is not None else None
            if dtype == torch.float16:  # every rounding point kept: bit-identical
                assert torch.equal(fh, eh) and (second is None or torch.equal(fn, en)), dtype
            elif dtype == torch.float32:
                assert torch.allclose(fh, eh, atol=1e-5, rtol=1e-6) and (second is None or torch.allclose(fn, en, atol=1e-5))
            else:  # the CPU interpreter truncates bf16 casts; bit-exactness is checked on GPU (tests/gpu)
                assert (fh.float() - eh.float()).norm() / eh.float().norm() < 1e-2
                assert second is None or (fn.float() - en.float()).norm() / en.float().norm() < 1e-2
            assert second is not None or fn is None
    print("ok")
""")


def test_fused_kernel_matches_eager_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_fallback_is_the_eager_order():
    g = torch.Generator().manual_seed(3)
    h, x = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    w1, w2 = torch.rand(16, generator=g), torch.rand(16, generator=g)
    fh, fn = add_norm_norm(h, x, w1, w2, 1e-6, use_triton=False)
    assert torch.equal(fh, h + rms_norm(x, w1, 1e-6)) and torch.equal(fn, rms_norm(fh, w2, 1e-6))
