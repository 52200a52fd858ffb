"""The decode-sized linear kernels (``rlt.platform.models.fused_linear``) against the eager ops they
replace, under the Triton interpreter on CPU (the GPU versions: tests/gpu/test_fused_ops_gpu.py)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlt.platform.models import fused_linear

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from rlt.platform.models import fused_linear as fl
    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        tol = 1e-4 if dtype == torch.float32 else 2e-2   # fp16: the dot's sum order may flip a rounding
        for m in (1, 3, 17):                            # 17: two row blocks of the dot tile
            for n, k in ((80, 96), (48, 300)):          # K not a multiple of the K tile; N tail masked
                x = torch.randn(m, k, generator=g).to(dtype)
                gu = torch.randn(2 * n, k, generator=g).to(dtype)
                assert fl.small_m_usable(x, gu, fl.MAX_ROWS_SILU_MUL)
                got, want = fl.linear_silu_mul(x, gu), silu_mul(F.linear(x, gu), use_triton=False)
                assert got.shape == want.shape and (got.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (dtype, m)
            nq, nkv, d = 4, 2, 32
            x = torch.randn(m, 96, generator=g).to(dtype)
            wq = torch.randn((nq + 2 * nkv) * d, 96, generator=g).to(dtype)
            cos, sin = rope_cos_sin(torch.arange(m) * 7 + 3, rope_inv_freq(d, 1e4), dtype)
            kc = torch.full((20, nkv * d), 7.0, dtype=dtype)
            vc = torch.full((20, nkv * d), 7.0, dtype=dtype)
            slots = torch.tensor([9, -1, 4, 2, 0, 1, 3, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15][:m])
            q, k, v, stored = fl.linear_rope_kv(x, wq, cos, sin, nq, nkv, d, (kc, vc, slots))
            q0, k0, v0, _ = rope_qk_(F.linear(x, wq), cos, sin, nq, nkv, d, use_triton=False)
            assert stored
            for got, want in ((q, q0), (k, k0), (v, v0)):
                assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, dtype
            written = {s: i for i, s in enumerate(slots.tolist()) if s >= 0}
            for s in range(20):   # each slot holds its token's rotated k / plain v; the rest untouched
                if s in written:
                    assert torch.equal(kc[s], k[written[s]].reshape(-1)) and torch.equal(vc[s], v[written[s]].reshape(-1))
                else:
                    assert bool((kc[s] == 7).all()) and bool((vc[s] == 7).all()), s
            q2, k2, v2, stored2 = fl.linear_rope_kv(x, wq, cos, sin, nq, nkv, d, None)
            assert not stored2 and torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
        # split-K pieces of a plain projection, summed by add_norm_norm in its own pass
        from rlt.platform.models.fused_ops import SplitSum, add_norm_norm
        for m in (1, 5, 17, 65):                        # 17: two row blocks; 65: cuBLAS's at its own plan (CUBLAS_ROWS); N = 80: a masked column tail
            n, k = 80, 2048
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            h = torch.randn(m, n, generator=g).to(dtype)
            w1, w2 = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype), (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)
            want = F.linear(x, w)
            for plan in (None, fl.SplitPlan(fl.Tiles(16, 32, 64, 4, 2), 8), fl.SplitPlan(fl.Tiles(16, 16, 128, 4, 2), 2)):
                got = fl.linear_split_k(x, w, plan)
                if plan is None and m in fl.CUBLAS_ROWS:  # left to cuBLAS: F.linear itself
                    assert not isinstance(got, SplitSum) and torch.equal(got, want)
                    continue
                assert isinstance(got, SplitSum) and got.parts.dtype == torch.float32
                assert got.parts.shape[0] == (plan.splits if plan else fl.split_plan(m, n, k, x.element_size()).splits)
                total = got.total()
                assert total.dtype == dtype and (total.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (dtype, m, plan)
                fh, fn = add_norm_norm(h, got, w1, w2, 1e-6, use_triton=True)
                th, tn = add_norm_norm(h, total, w1, w2, 1e-6, use_triton=True)   # the same sum, rounded once
                assert torch.equal(fh, th) and torch.equal(fn, tn), (dtype, m, plan)
                eh, en = add_norm_norm(h, got, w1, w2, 1e-6, use_triton=False)    # eager fallback sums the pieces too
                assert (eh.float() - fh.float()).abs().max() <= 2e-2 * fh.float().abs().max()
    print("ok")
""")


FOLD_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from rlt.attention import fold
    from rlt.platform.models import fused_linear as fl
    from rlt.platform.models.fused_ops import PendingProjection, SplitSum, add_norm_norm
    assert fold.fold_enabled(torch.empty(1))          # RLT_FOLD=1 under the interpreter
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float16):
        for m in (1, 3, 4, 5):                          # 5: above MAX_ROWS_FOLD, the unfolded pair
            n, k = 80, 2048                             # N = 80: a masked column tail; three column blocks
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            h = torch.randn(m, n, generator=g).to(dtype)
            w1, w2 = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype), (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)
            for plan in (fl.SplitPlan(fl.Tiles(16, 32, 64, 4, 2), 8), fl.SplitPlan(fl.Tiles(16, 16, 128, 4, 2), 2)):
                pieces = SplitSum(fl._launch_split_k(x, w, plan), dtype)
                got = fl.linear_split_k(x, w, plan)
                if m > fl.MAX_ROWS_FOLD:
                    assert isinstance(got, SplitSum)
                    continue
                assert isinstance(got, PendingProjection)
                for second in (w2, None):               # the last layer's second norm is the final norm; None: none
                    want_h, want_n = add_norm_norm(h, pieces, w1, second, 1e-6, use_triton=True)
                    got_h, got_n = add_norm_norm(h, got, w1, second, 1e-6)
                    assert torch.equal(got_h, want_h), (dtype, m, plan)   # same sums, same order: bit for bit
                    assert (got_n is None) == (second is None) and (second is None or torch.equal(got_n, want_n))
                    assert int(fl._fold_counters(x.device).abs().sum()) == 0   # every launch leaves them zero
                assert torch.equal(got.total(), pieces.total())
                eh, _ = add_norm_norm(h, got, w1, w2, 1e-6, use_triton=False)  # eager consumer: total() first
                assert torch.equal(eh, add_norm_norm(h, pieces.total(), w1, w2, 1e-6, use_triton=False)[0])
    # q/k/v + RoPE + KV store and gate/up + SiLU split over K (the interpreter pretends 16 SMs: a few tiles
    # split 2-4 ways), the last program of each tile summing the pieces and finishing it
    import os
    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq
    def both(fn):
        outs = []
        for flag in ("1", "0"):
            os.environ["RLT_FOLD"] = flag
            fold.refresh()
            outs.append(fn())
        os.environ["RLT_FOLD"] = "1"
        fold.refresh()
        return outs
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        for m in (1, 3, 17):
            x = torch.randn(m, 2048, generator=g).to(dtype)
            gu = (torch.randn(160, 2048, generator=g) * 0.03).to(dtype)     # I = 80: three column tiles, a masked tail
            assert fl._tile_splits(x, 3 * -(-m // 16), 2048, 128, 16, 32)[0] > 1
            folded, plain = both(lambda: fl.linear_silu_mul(x, gu))
            want = silu_mul(F.linear(x, gu), use_triton=False)
            for got in (folded, plain):
                assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (dtype, m)
            nq, nkv, d = 4, 2, 32
            wq = (torch.randn((nq + 2 * nkv) * d, 2048, generator=g) * 0.03).to(dtype)
            cos, sin = rope_cos_sin(torch.arange(m) * 5 + 2, rope_inv_freq(d, 1e4), dtype)
            slots = torch.randperm(40)[:m]
            caches = []
            def rope():
                kc, vc = torch.full((40, nkv * d), 7.0, dtype=dtype), torch.full((40, nkv * d), 7.0, dtype=dtype)
                caches.append((kc, vc))
                return fl.linear_rope_kv(x, wq, cos, sin, nq, nkv, d, (kc, vc, slots))
            (q1, k1, v1, s1), (q0, k0, v0, s0) = both(rope)
            assert s1 and s0
            qe, ke, ve, _ = rope_qk_(F.linear(x, wq), cos, sin, nq, nkv, d, use_triton=False)
            for got, want in ((q1, qe), (k1, ke), (v1, ve), (q0, qe), (k0, ke), (v0, ve)):
                assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (dtype, m)
            (kc1, vc1), (kc0, vc0) = caches
            assert torch.equal(kc1[slots], k1.reshape(m, -1)) and torch.equal(vc1[slots], v1.reshape(m, -1))
            untouched = [r for r in range(40) if r not in set(slots.tolist())]
            assert bool((kc1[untouched] == 7).all()) and bool((vc1[untouched] == 7).all())
            assert int(fl._fold_counters(x.device).abs().sum()) == 0
    # a tile sweep's launch shapes: wide column tiles (64 weight rows per tile, 8 warps) and any whole K split
    x = torch.randn(40, 2048, generator=g)
    gu = (torch.randn(256, 2048, generator=g) * 0.03)
    want = silu_mul(F.linear(x, gu), use_triton=False)
    for splits in (1, 2, 4, 8):
        got = fl.linear_silu_mul(x, gu, fl.Tiles(64, 64, 128, 8, 3), splits=splits)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-3, splits
        assert int(fl._fold_counters(x.device).abs().sum()) == 0
    for bad in (3, 64):  # 3: not whole K tiles; 64: ranges of 32 columns in K tiles of 64 (fp32 halves 128)
        try:
            fl.linear_silu_mul(x, gu, fl.Tiles(64, 64, 128, 8, 3), splits=bad)
            raise AssertionError(f"{bad} splits accepted")
        except ValueError as exc:
            assert "whole tiles" in str(exc)
    folded_two = fl.linear_silu_mul(x, gu, splits=2)
    os.environ["RLT_FOLD"] = "0"
    fold.refresh()
    # asked-for K splits need a fold-capable device, not the folds on: the same kernel, the same sums
    assert not fold.fold_enabled(x) and torch.equal(fl.linear_silu_mul(x, gu, splits=2), folded_two)
    capable = fl.fold_capable
    fl.fold_capable = lambda device: (False, "ROCm: the fold's memory ordering is not verified there")
    try:
        fl.linear_silu_mul(x, gu, splits=2)
        raise AssertionError("K splits accepted on a device that cannot sum them")
    except ValueError as exc:
        assert "ROCm" in str(exc)
    finally:
        fl.fold_capable = capable
    assert torch.equal(fl.linear_silu_mul(x, gu, splits=1), fl.linear_silu_mul(x, gu))
    os.environ["RLT_FOLD"] = "1"
    fold.refresh()
    print("ok")
""")


def test_split_k_folds_add_norm_norm_under_interpreter():
    """rlt.attention.fold: the split-K program storing a row block's last piece runs add_norm_norm itself
    (under the interpreter programs run in order, so an early or missing fold leaves wrong/unwritten rows)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLT_FOLD": "1"}
    r = subprocess.run([sys.executable, "-c", FOLD_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_fused_linear_matches_eager_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_dispatch_is_decided_by_shape_and_device():
    from rlt.platform.models.fused_ops import silu_mul

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert not fused_linear.small_m_usable(x, w, 64)  # CPU tensors without the interpreter: the eager ops
    assert torch.equal(fused_linear.linear_silu_mul(x, w), silu_mul(torch.nn.functional.linear(x, w), use_triton=False))
    os.environ["TRITON_INTERPRET"] = "1"
    try:  # the interpreter would run the kernels, but not above the row limits
        assert fused_linear.small_m_usable(x, w, 64)
        assert not fused_linear.small_m_usable(torch.randn(fused_linear.MAX_ROWS_SILU_MUL + 1, 8), w,
                                               fused_linear.MAX_ROWS_SILU_MUL)
        assert not fused_linear.small_m_usable(x.to(torch.float16), w, 64)  # mixed dtypes
    finally:
        del os.environ["TRITON_INTERPRET"]


def test_split_plan_cuts_k_into_long_whole_tiles():
    # Ouro-1.4B's plain projections: the H200 sweep's best plans (o_proj [2048, 2048], down_proj [2048, 5632])
    tma = fused_linear._SPLIT_K_TMA  # on by default (lease 9); the launch falls back where TMA cannot read
    for m in (1, 16):
        assert fused_linear.split_plan(m, 2048, 2048) == fused_linear.SplitPlan(fused_linear.Tiles(16, 32, 256, 4, 4, tma), 2)
        assert fused_linear.split_plan(m, 2048, 5632) == fused_linear.SplitPlan(fused_linear.Tiles(16, 32, 128, 4, 4, tma), 4)
    assert fused_linear.split_plan(64, 2048, 5632).tiles.block_m == 64
    for m, elem in itertools.product((65, 96, 128), (2, 4)):  # above 64 rows: one 128-row block (lease 11's winner)
        for k, splits in ((2048, 2), (5632, 4)):
            plan = fused_linear.split_plan(m, 2048, k, elem)
            assert plan == fused_linear.SplitPlan(fused_linear.Tiles(128, 64, 256 // elem, 4, 4, tma), splits)
            t = plan.tiles  # one weight tile per stage beside the X tile; fp32 narrows the K tile
            assert t.num_stages * (t.block_m + t.block_n) * t.block_k * elem <= fused_linear.SHARED_MEMORY_BYTES
    for n, k in ((2048, 2048), (2048, 5632), (4096, 11008), (2560, 9728)):
        for m in (1, 17, 64):
            for elem in (2, 4):
                plan = fused_linear.split_plan(m, n, k, elem)
                t = plan.tiles
                assert plan.splits in (2, 4, 8) and k % (plan.splits * t.block_k) == 0 and k // plan.splits >= fused_linear.MIN_SPLIT_K
                assert t.num_stages * (t.block_m + 2 * t.block_n) * t.block_k * elem <= fused_linear.SHARED_MEMORY_BYTES
    assert fused_linear.split_plan(1, 2048, 2000) is None   # no whole K tiles: cuBLAS keeps it
    assert fused_linear.split_plan(1, 2048, 1024) is None   # too short to split
    x, w = torch.randn(2, 8), torch.randn(4, 8)             # CPU without the interpreter: plain F.linear
    assert torch.equal(fused_linear.linear_split_k(x, w), torch.nn.functional.linear(x, w))


def test_tiles_fit_shared_memory_in_every_dtype():
    """The H200 run of 2026-12-04 found fp32 at the bf16 tiles needing 240 KB of shared memory."""
    for m in (1, 16, 17, 64, 128):
        for kind in ("rope_kv", "silu_mul"):
            for elem in (2, 4):
                for k, tma in itertools.product((64, 1024, 2048, 5632), (False, True)):
                    t = fused_linear._fit(fused_linear._tiles(m, kind, tma), k, elem)
                    assert t.num_stages * (t.block_m + 2 * t.block_n) * t.block_k * elem <= fused_linear.SHARED_MEMORY_BYTES
                    assert t.block_k <= max(16, 1 << (k - 1).bit_length())
    # bf16 keeps the swept tiles
    assert fused_linear._fit(fused_linear._tiles(1, "rope_kv"), 2048, 2) == fused_linear._tiles(1, "rope_kv")


def test_prefetch_constexprs(monkeypatch):
    """One L2 line (128 bytes) per prefetch request, a power-of-two count covering the row's K range; none
    where rlt.attention.pdl.weight_prefetch is off (always on CPU)."""
    x = torch.empty(1, 8, dtype=torch.bfloat16)
    assert fused_linear._prefetch(x, 2048) == {"PREFETCH": False}
    monkeypatch.setattr(fused_linear, "weight_prefetch", lambda t: True)
    assert fused_linear._prefetch(x, 2048) == {"PREFETCH": True, "LINE": 64, "LINES": 32}
    assert fused_linear._prefetch(x, 1408) == {"PREFETCH": True, "LINE": 64, "LINES": 32}   # 22 lines, 10 clamped
    assert fused_linear._prefetch(x.float(), 5632) == {"PREFETCH": True, "LINE": 32, "LINES": 256}


def test_balanced_splits_fill_the_waves():
    """The fold's K split for the fused projections (132 SMs, Ouro-1.4B): q/k/v at one row 96 tiles -> 4
    splits (384 programs, 3 % over whole waves), gate/up 176 -> 2 (352); none where one split is already
    within 10 % of whole waves or the K ranges would fall under the minimum."""
    split = fused_linear._balanced_splits
    assert split(96, 2048, 256, 132, 512) == 4
    assert split(176, 2048, 128, 132, 512) == 2
    assert split(264, 2048, 128, 132, 512) == 1      # two whole waves already
    assert split(96, 1024, 256, 132, 512) == 1       # 2 fill no better (192 = 1.45 waves), 4 would cut K to 256
    assert fused_linear._wave_excess(384, 132) == pytest.approx(396 / 384)


OVERRIDE_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from rlt.attention import fold
    from rlt.platform.models import fused_linear as fl
    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq
    assert not fold.fold_enabled(torch.empty(1))      # RLT_FOLD=0: the override's splits alone
    wide = fl.Tiles(64, 64, 128, 8, 3)
    assert fl._launch_shape(40, "silu_mul", None, None) == (wide, 2)
    assert fl._launch_shape(3, "silu_mul", None, None) == (fl._tiles(3, "silu_mul"), None)   # other bucket
    assert fl._launch_shape(1, "rope_kv", None, None) == (fl.Tiles(16, 16, 128, 4, 3), None)
    assert fl._launch_shape(40, "silu_mul", fl._tiles(40, "silu_mul"), 1) == (fl._tiles(40, "silu_mul"), 1)
    seen = []
    real = fl._tile_splits
    fl._tile_splits = lambda *a: seen.append((a[3], a[4], a[5], a[6])) or real(*a)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2048, generator=g)
    gu = torch.randn(256, 2048, generator=g) * 0.03
    got = fl.linear_silu_mul(x, gu)
    assert seen[-1] == (64, 64, 64, 2), seen       # K tile (fp32 halves 128 to fit), rows and columns per tile, splits: the override's
    assert torch.equal(got, fl.linear_silu_mul(x, gu, wide, 2))
    want = silu_mul(F.linear(x, gu), use_triton=False)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-3
    nq, nkv, d = 4, 2, 32
    x1 = torch.randn(1, 2048, generator=g)
    wq = torch.randn((nq + 2 * nkv) * d, 2048, generator=g) * 0.03
    cos, sin = rope_cos_sin(torch.tensor([5]), rope_inv_freq(d, 1e4), torch.float32)
    q, k, v, _ = fl.linear_rope_kv(x1, wq, cos, sin, nq, nkv, d)
    assert seen[-1][:3] == (128, 16, 16), seen
    qe, ke, ve, _ = rope_qk_(F.linear(x1, wq), cos, sin, nq, nkv, d, use_triton=False)
    for a, b in ((q, qe), (k, ke), (v, ve)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-3
    assert fl._launch_shape(100, "silu_mul", None, None) == (fl._tiles(100, "silu_mul"), None)   # bucket 2: default
    # split_k:128 — above 64 rows the split-K plans take its tiles (and the rule's counts); below, the rule's
    big = fl.Tiles(128, 64, 128, 4, 4)
    assert fl.split_plan(100, 2048, 5632) == fl.SplitPlan(big, 4)           # down_proj: 4 splits of 1408
    assert fl.split_plan(100, 2048, 2048) == fl.SplitPlan(big, 2)           # o_proj: 2 splits of 1024
    assert fl.split_plan(40, 2048, 5632).tiles.block_m == 64                # other bucket: the rule
    assert fl.split_plan(100, 64, 2048 + 64).tiles != big                   # its K tiles do not divide: the rule
    x = torch.randn(100, 2048, generator=g)
    w = torch.randn(64, 2048, generator=g) * 0.03
    plan = fl.split_plan(100, 64, 2048, 4)
    assert plan.tiles == big._replace(block_k=64), plan     # fp32: half the K tile, the stage bytes the sweep ran
    got = fl.SplitSum(fl._launch_split_k(x, w, plan), x.dtype).total()
    want = F.linear(x, w)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-4
    print("ok")
""")


def test_linear_tiles_override_sets_the_launch_shape():
    """``RLT_LINEAR_TILES`` (a sweep's winner timed end to end): its bucket's launches take its tiles and K
    splits — without RLT_FOLD — and stay exact; other buckets keep the defaults."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLT_FOLD": "0",
           "RLT_LINEAR_TILES": "silu_mul:64=64x64x128x8x3/2, rope_kv:1=16x16x128x4x3, split_k:128=128x64x128x4x4"}
    r = subprocess.run([sys.executable, "-c", OVERRIDE_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_linear_tiles_override_parsing():
    parse = fused_linear.parse_tile_overrides
    assert parse("") == {}
    assert parse("rope_kv:64=64x32x128x4x4,silu_mul:1=16x32x128x4x4/4") == {
        ("rope_kv", 1): (fused_linear.Tiles(64, 32, 128, 4, 4), None),
        ("silu_mul", 0): (fused_linear.Tiles(16, 32, 128, 4, 4), 4)}
    assert parse("silu_mul:64=64x64x128x8x3x1/2") == {("silu_mul", 1): (fused_linear.Tiles(64, 64, 128, 8, 3, True), 2)}
    assert parse("silu_mul:64=64x64x128x8x3x0")[("silu_mul", 1)][0].tma is False
    # three row buckets: at most 16 rows, 17-64 (C=64's steps), more (C=128's)
    assert parse("rope_kv:16=16x32x128x4x4,rope_kv:17=64x32x128x4x4,rope_kv:65=128x32x128x4x4,split_k:128=128x64x128x4x4x1").keys() \
        == {("rope_kv", 0), ("rope_kv", 1), ("rope_kv", 2), ("split_k", 2)}
    assert [fused_linear.row_bucket(m) for m in (1, 16, 17, 64, 65, 128, 4096)] == [0, 0, 1, 1, 2, 2, 2]
    for bad in ("qkv:64=64x32x128x4x4", "rope_kv=64x32x128x4x4", "rope_kv:64=64x32x128x4", "rope_kv:64=8x32x128x4x4",
                "rope_kv:64=64x48x128x4x4", "rope_kv:64=64x32x128x4x4/0", "rope_kv:0=64x32x128x4x4",
                "silu_mul:64=64x32x128x4x4/two", "silu_mul:64=64x32x128x4x4x2", "silu_mul:64=64x32x128x4x4x1x1",
                "silu_mul:64=64x32x128x6x4"):   # Triton compiles power-of-two warp counts only
        with pytest.raises(ValueError, match="RLT_LINEAR_TILES entry"):
            parse(bad)


def test_row_limits_parsing():
    parse = fused_linear.parse_row_limits
    assert parse("") == {}
    assert parse("silu_mul=128, split_k=96") == {"silu_mul": 128, "split_k": 96}
    for bad in ("silu_mul", "silu_mul=", "silu_mul=0", "silu_mul=-4", "silu_mul=big", "qkv=64", "split_k:64"):
        with pytest.raises(ValueError, match="RLT_FUSED_ROWS entry"):
            parse(bad)


ROWS_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from rlt.platform.models import fused_linear as fl
    from rlt.platform.models.fused_ops import SplitSum, silu_mul
    assert (fl.MAX_ROWS_SILU_MUL, fl.MAX_ROWS_SPLIT_K, fl.MAX_ROWS_ROPE_KV) == (96, 80, 128)
    def eager_used(*a, **k):
        raise AssertionError("the eager gate/up path ran")
    fl.silu_mul = eager_used    # the kernel, not F.linear + silu_mul, must serve the raised limit
    g = torch.Generator().manual_seed(0)
    x, gu, w = torch.randn(72, 96, generator=g), torch.randn(160, 96, generator=g), torch.randn(48, 2048, generator=g)
    got, want = fl.linear_silu_mul(x, gu), silu_mul(F.linear(x, gu), use_triton=False)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max() + 1e-3
    xs = torch.randn(72, 2048, generator=g)
    parts = fl.linear_split_k(xs, w)
    assert isinstance(parts, SplitSum) and (parts.total() - F.linear(xs, w)).abs().max() <= 1e-3
    assert not isinstance(fl.linear_split_k(torch.randn(81, 2048, generator=g), w), SplitSum)  # above it: F.linear
    print("ok")
""")


def test_raised_row_limits_take_the_kernels():
    """``RLT_FUSED_ROWS`` (an A/B switch for C=128 decode steps): above the default limits the fused gate/up +
    SiLU and the split-K projections serve the rows, exactly; above the raised limit F.linear again."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLT_FUSED_ROWS": "silu_mul=96,split_k=80"}
    r = subprocess.run([sys.executable, "-c", ROWS_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    bad = subprocess.run([sys.executable, "-c", "import rlt.platform.models.fused_linear"], capture_output=True,
                         text=True, env={**env, "RLT_FUSED_ROWS": "silu_mul=lots"})
    assert bad.returncode != 0 and "RLT_FUSED_ROWS entry 'silu_mul=lots'" in bad.stderr


GAP_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from rlt.platform.models import fused_linear as fl
    from rlt.platform.models.fused_ops import SplitSum
    assert (fl.MAX_ROWS_SILU_MUL, fl.MAX_ROWS_SPLIT_K) == (128, 128) and fl.CUBLAS_ROWS == range(65, 96)
    real, calls = fl.silu_mul, []
    def eager(*a, **k):
        calls.append(1)
        return real(*a, **k)
    fl.silu_mul = eager         # counts the eager gate/up path
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16):
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        gu = torch.randn(160, 256, generator=g).to(dtype)   # rows of 256 elements: 16-byte aligned, TMA-ready
        w = torch.randn(48, 2048, generator=g).to(dtype)
        for m, fused in ((64, True), (65, False), (95, False), (96, True), (128, True)):
            x = torch.randn(m, 256, generator=g).to(dtype)
            calls.clear()
            got, want = fl.linear_silu_mul(x, gu), real(F.linear(x, gu), use_triton=False)
            assert bool(calls) != fused, (m, dtype)
            assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (m, dtype)
            xs = torch.randn(m, 2048, generator=g).to(dtype)
            got = fl.linear_split_k(xs, w)
            assert isinstance(got, SplitSum) == fused, (m, dtype)
            total, want = got.total() if fused else got, F.linear(xs, w)
            assert (total.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (m, dtype)
        # above 64 rows without TMA (rows of 300 half-precision elements: not 16-byte aligned): cuBLAS
        x, gu3 = torch.randn(100, 300, generator=g).half(), torch.randn(160, 300, generator=g).half()
        calls.clear()
        fl.linear_silu_mul(x, gu3)
        assert calls
        xu = torch.randn(100, 2049, generator=g).half()[:, :2048]   # rows 4,098 bytes apart: no TMA, a plan exists
        assert fl.split_plan(100, 48, 2048) is not None and not isinstance(fl.linear_split_k(xu, w.half()), SplitSum)
    print("ok")
""")


def test_large_row_counts_skip_the_cublas_rows():
    """Above 64 rows the gate/up + SiLU and split-K kernels serve 96-128 rows (one 128-row TMA block, exact against
    the eager ops) and leave 65-95 rows, and rows TMA cannot read, to cuBLAS (:data:`fused_linear.CUBLAS_ROWS`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RLT_FUSED_ROWS", "RLT_LINEAR_TILES")}
    r = subprocess.run([sys.executable, "-c", GAP_SCRIPT], capture_output=True, text=True,
                       env={**env, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_leaves_to_cublas():
    for kind in ("silu_mul", "split_k"):
        assert not fused_linear.leaves_to_cublas(kind, 64, tma=False)
        assert fused_linear.leaves_to_cublas(kind, 65, tma=True) and fused_linear.leaves_to_cublas(kind, 95, tma=True)
        assert not fused_linear.leaves_to_cublas(kind, 96, tma=True) and not fused_linear.leaves_to_cublas(kind, 128, tma=True)
        assert fused_linear.leaves_to_cublas(kind, 100, tma=False)


TMA_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from rlt.platform.models import fused_linear as fl
    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq
    seen = []
    real = fl._operands
    fl._operands = lambda *a: (lambda r: seen.append(r[2]) or r)(real(*a))
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        for m in (1, 3, 17):                             # 17: two row blocks; rows past M read zeros
            for n, k, splits in ((80, 96, 1), (48, 296, 1), (64, 512, 2)):   # I = 80: the last gate tile runs into
                x = torch.randn(m, k, generator=g).to(dtype)                  # up rows; K = 296: past K reads zeros
                gu = (torch.randn(2 * n, k, generator=g) * 0.1).to(dtype)
                tiles = fl.Tiles(16, 32, 128, 4, 3, True)
                got = fl.linear_silu_mul(x, gu, tiles, splits)
                assert seen.pop() is True
                want = silu_mul(F.linear(x, gu), use_triton=False)
                assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max() + 1e-3, (dtype, m, n, k)
                plain = fl.linear_silu_mul(x, gu, tiles._replace(tma=False), splits)
                assert seen.pop() is False
                assert (got.float() - plain.float()).abs().max() <= tol * want.float().abs().max() + 1e-3
            nq, nkv, d = 4, 2, 32
            x = torch.randn(m, 96, generator=g).to(dtype)
            wq = (torch.randn((nq + 2 * nkv) * d, 96, generator=g) * 0.1).to(dtype)
            cos, sin = rope_cos_sin(torch.arange(m) * 7 + 3, rope_inv_freq(d, 1e4), dtype)
            kc = torch.full((20, nkv * d), 7.0, dtype=dtype)
            vc = torch.full((20, nkv * d), 7.0, dtype=dtype)
            slots = torch.tensor([9, -1, 4, 2, 0, 1, 3, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15][:m])
            q, kk, v, stored = fl.linear_rope_kv(x, wq, cos, sin, nq, nkv, d, (kc, vc, slots),
                                                 fl.Tiles(16, 16, 64, 4, 3, True))
            assert stored and seen.pop() is True
            q0, k0, v0, _ = rope_qk_(F.linear(x, wq), cos, sin, nq, nkv, d, use_triton=False)
            for a, b in ((q, q0), (kk, k0), (v, v0)):
                assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max() + 1e-3, (dtype, m)
            written = {sl: i for i, sl in enumerate(slots.tolist()) if sl >= 0}
            for sl in range(20):
                if sl in written:
                    assert torch.equal(kc[sl], kk[written[sl]].reshape(-1)) and torch.equal(vc[sl], v[written[sl]].reshape(-1))
                else:
                    assert bool((kc[sl] == 7).all()) and bool((vc[sl] == 7).all())
    # the split-K o_proj / down_proj with RLT_SPLIT_K_TMA=1: the rule's plans read through TMA
    from rlt.platform.models.fused_ops import SplitSum
    assert fl._SPLIT_K_TMA
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        for m in (1, 5, 17):
            x = torch.randn(m, 2048, generator=g).to(dtype)
            w = (torch.randn(80, 2048, generator=g) * 0.03).to(dtype)       # N = 80: the last column tile past N
            got = fl.linear_split_k(x, w)
            assert seen.pop() is True and isinstance(got, SplitSum) and got.parts.shape[0] == 2
            want = F.linear(x.float(), w.float())
            assert (got.total().float() - want).abs().max() <= tol * want.abs().max() + 1e-3, (dtype, m)
    # a tensor TMA cannot read (rows not 16-byte aligned: K = 3 fp32 columns) takes the pointer loads
    x = torch.randn(2, 3, generator=g)
    gu = torch.randn(8, 3, generator=g)
    got = fl.linear_silu_mul(x, gu, fl.Tiles(16, 32, 128, 4, 3, True))
    assert seen.pop() is False
    assert (got - silu_mul(F.linear(x, gu), use_triton=False)).abs().max() < 1e-4
    # the defaults: above 16 rows, where both operands allow it, TMA tiles (lease 9's sweep); else the pointer ones
    assert fl._launch_shape(40, "silu_mul", None, None, True) == (fl.Tiles(64, 64, 128, 8, 4, True), None)
    assert fl._launch_shape(40, "rope_kv", None, None, True) == (fl.Tiles(64, 32, 256, 4, 3, True), None)
    # above 64 rows q/k/v + RoPE (lease 12) and gate/up + SiLU (from 96 rows, CUBLAS_ROWS) take every row in one
    # 128-row block
    assert fl._launch_shape(100, "rope_kv", None, None, True) == (fl.Tiles(128, 32, 128, 4, 4, True), None)
    assert fl._launch_shape(100, "silu_mul", None, None, True) == (fl.Tiles(128, 64, 128, 8, 3, True), None)
    assert fl._launch_shape(100, "rope_kv", None, None) == (fl.Tiles(64, 32, 128, 4, 4), None)
    assert not fl._tiles(40, "silu_mul").tma and fl._tiles(1, "silu_mul", True) == fl._tiles(1, "silu_mul")
    x = torch.randn(40, 256, generator=g)
    gu = torch.randn(160, 256, generator=g) * 0.1
    got = fl.linear_silu_mul(x, gu)
    assert seen.pop() is True
    want = silu_mul(F.linear(x, gu), use_triton=False)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-3
    x, gu = x[:, :255].contiguous(), gu[:, :255].contiguous()   # rows of 255 fp32: not 16-byte aligned, pointer loads
    got = fl.linear_silu_mul(x, gu)
    assert seen.pop() is False
    want = silu_mul(F.linear(x, gu), use_triton=False)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-3
    print("ok")
""")


def test_tma_operand_loads_match_the_eager_ops_under_interpreter():
    """``Tiles.tma``: the fused projections read X and W through TMA descriptors (the interpreter has TMA): the
    same results as the eager ops and the pointer loads — rows past M, gate rows past I and columns past K
    read through the descriptors' bounds — and the pointer loads where a tensor is not TMA-readable; the
    split-K projections too, with ``RLT_SPLIT_K_TMA=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLT_FOLD": "0", "RLT_SPLIT_K_TMA": "1"}
    r = subprocess.run([sys.executable, "-c", TMA_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]

