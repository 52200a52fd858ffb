"""The fused model kernels against the eager ops they replace (Triton interpreter on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlt.platform.models.fused_ops import add_norm_norm
from rlt.platform.models.layers import rms_norm

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from rlt.platform.models.fused_ops import add_norm_norm
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
    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import apply_rope, rope_cos_sin, rope_inv_freq
    for dtype, seed in [(torch.float32, 3), (torch.float16, 4)]:
        g = torch.Generator().manual_seed(seed)
        n, nq, nkv, d = 7, 4, 2, 16
        qkv = torch.randn(n, (nq + 2 * nkv) * d, generator=g).to(dtype)
        cos, sin = rope_cos_sin(torch.arange(3, 3 + n) * 5, rope_inv_freq(d, 1e4), dtype)
        q0 = apply_rope(qkv[:, : nq * d].reshape(n, nq, d), cos, sin)
        k0 = apply_rope(qkv[:, nq * d : (nq + nkv) * d].reshape(n, nkv, d), cos, sin)
        v0 = qkv[:, (nq + nkv) * d :].reshape(n, nkv, d).clone()
        src = qkv.clone()
        q, k, v, stored = rope_qk_(qkv, cos, sin, nq, nkv, d, use_triton=True)
        exact = dtype == torch.float16
        assert not stored
        for got, want in ((q, q0), (k, k0), (v, v0)):
            assert (torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-6)), dtype
        # the same launch storing the rotated k and the v rows at flat KV slots (as write_kv; slot -1: none)
        kc = torch.full((6, 4, nkv, d), -7.0).to(dtype)
        vc = kc.clone()
        slots = torch.tensor([5, -1, 0, 23, 9, 12, 3])
        q2, k2, _, stored = rope_qk_(src, cos, sin, nq, nkv, d, use_triton=True, kv_store=(kc, vc, slots))
        assert stored and torch.equal(q2, q) and torch.equal(k2, k)
        flat_k, flat_v = kc.view(-1, nkv * d), vc.view(-1, nkv * d)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(flat_k[slot], k[i].reshape(-1)) and torch.equal(flat_v[slot], v0[i].reshape(-1))
        untouched = [r for r in range(flat_k.shape[0]) if r not in set(slots.tolist())]
        assert (flat_k[untouched] == -7).all() and (flat_v[untouched] == -7).all()
        gu = torch.randn(5, 2 * 1500, generator=g).to(dtype)   # 1500: two column blocks, masked tail
        want = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
        got = silu_mul(gu, use_triton=True)
        assert (torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-6)), dtype
    print("ok")
""")

ENGINE_SCRIPT = textwrap.dedent("""
    import sys, torch
    from rlt.platform import EngineConfig, LLMEngine, SamplingParams
    from rlt.platform.checkpoint import load_checkpoint
    from rlt.platform.models.ouro_reference import reference_generate
    path, min_split = sys.argv[1], int(sys.argv[2])
    import rlt.platform.models.ouro as ouro
    from rlt.platform.models import fused_linear
    from rlt.platform.models.fused_ops import PendingProjection, SplitSum
    pieces, folded = [], []
    if min_split:  # the tiny model's K ranges are short: let split-K serve o_proj / down_proj here
        fused_linear.MIN_SPLIT_K = min_split
        def counted(x, w, plan=None):
            out = fused_linear.linear_split_k(x, w, plan)
            pieces.append(isinstance(out, (SplitSum, PendingProjection)))
            folded.append(isinstance(out, PendingProjection))
            return out
        ouro.linear_split_k = counted
    from rlt.attention.fold import fold_enabled
    tile_splits = []
    if fold_enabled(torch.empty(1), "tiles"):  # split the fused q/k/v and gate/up over K as on a 132-SM GPU
        fused_linear._sm_count = lambda device: 132
        fused_linear.MIN_TILE_SPLIT_K = 256
        plan_tiles = fused_linear._tile_splits
        def counted_tiles(*args):
            out = plan_tiles(*args)
            tile_splits.append(out[0])
            return out
        fused_linear._tile_splits = counted_tiles
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for i, p in enumerate(prompts):
        assert list(done[str(i)].token_ids) == reference_generate(ref, p, max_tokens=4)[0]
    assert not min_split or (pieces and all(pieces)), pieces   # down_proj came back in pieces every time
    from rlt.attention.fold import fold_enabled
    assert any(folded) == (bool(min_split) and fold_enabled(torch.empty(1), "split_k")), folded  # RLT_FOLD=1: decode rows fold
    assert not fold_enabled(torch.empty(1), "tiles") or max(tile_splits) > 1, tile_splits  # ... and q/k/v, gate/up split
    print("ok")
""")


# head_dim 32: q/k/v projection, RoPE and KV store in one kernel; min_split 32: o_proj and down_proj as
# split-K pieces summed in add_norm_norm (real shapes split K ranges of >= 1,024; the tiny model's are 64/128);
# fold "1": decode rows' split-K launches run add_norm_norm themselves (rlt.attention.fold)
# (hidden 512: K ranges long enough that the fold also splits q/k/v and gate/up over K); fold "tiles": only
# that split (the add_norm_norm stays unfolded: one site on alone)
@pytest.mark.parametrize("head_dim,min_split,fold,wide", [(8, 0, "0", {}), (32, 32, "0", {}),
                                                          (32, 32, "1", dict(hidden_size=512, intermediate_size=1024)),
                                                          (32, 32, "tiles", dict(hidden_size=512, intermediate_size=1024))])
def test_engine_with_fused_kernels_matches_oracle_under_interpreter(tiny_checkpoint, head_dim, min_split, fold, wide):
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLT_FOLD": fold}
    r = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_checkpoint(seed=51, head_dim=head_dim, **wide)),
                        str(min_split)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


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


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(16, 16, 128), (16, 8, 128), (20, 4, 128), (14, 2, 64),
                                                       (32, 8, 128), (40, 8, 128), (48, 8, 128), (2, 1, 16),
                                                       (64, 64, 256)])
def test_rope_warps_is_a_power_of_two(q_heads, kv_heads, head_dim):
    """Triton refuses a non-power-of-two warp count at launch; GQA head counts must still launch:
    16 + 8 rotated heads of 128 (3 warps by the old rule) failed on the H200, and Nanbeige4.2-3B's
    48 + 8 (7 warps by the old rule) would abort every prompt chunk of more than 128 rows."""
    from rlt.platform.models.fused_ops import rope_warps

    w = rope_warps(q_heads + kv_heads, head_dim)
    assert 1 <= w <= 8 and w & (w - 1) == 0
    assert w <= max(1, (q_heads + kv_heads) * head_dim // 1024)
