"""Decode-kernel micro-benchmarks on a GPU: where a decode loop step's device time goes, kernel by kernel.

Two parts, each timed as CUDA-graph replays of a sequence of calls over distinct weights / KV layers
(as a loop step runs them, so nothing is served from L2 that would not be in a real step):

* ``linear`` — the small-M kernels of ``rlt.platform.models.fused_linear`` against what they replace
  (cuBLAS ``F.linear`` plus the separate RoPE / KV-store / SiLU kernels), for the Ouro-1.4B layer
  shapes at several row counts, with a tile sweep; reports us per call and achieved GB/s of weight
  traffic, and checks each fused result against the unfused one; the plain projections (o_proj,
  down_proj, LM head) are timed on cuBLAS for the per-layer accounting, and o_proj / down_proj also with
  the add_norm_norm that consumes them: cuBLAS + the plain kernel against split-K pieces summed inside it
  (``linear_split_k``), at the default plan and over a plan sweep, and (rows <= MAX_ROWS_FOLD) with the
  add_norm_norm folded into the split-K launch (``rlt.attention.fold``).
* ``attention`` — the Triton paged decode kernel per layer at C rows x context, for split policies
  (``min_keys_per_split``) and split tile sizes, with slots resolved once per step (``prepare``) or
  per call, and the default policy with the merge folded into the decode kernel (``rlt.attention.fold``);
  reports us per layer against the KV byte floor; with ``--attention-tiles``, the launch shapes and grid order of
  the tiles the default policy picks instead (their winners go to ``RLT_DECODE_TILES``).

    python -m benchmarks.decode_kernels --out results.json            # everything
    python -m benchmarks.decode_kernels --parts linear --rows 1,64     # a subset
    python -m benchmarks.decode_kernels --tiles-from results.json      # the sweep's winners as RLT_LINEAR_TILES

Prints one table per part (``m=128*``: a row count above the kernel's default limit, timed to choose it)
and writes the numbers as JSON. GPU only (the kernels are Triton).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from rlt.attention import fold
from rlt.attention.backends.triton_backend import tma_ready
from rlt.platform.models import fused_linear as fl
from rlt.platform.models.fused_ops import add_norm_norm, rope_qk_, silu_mul
from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq

#: Ouro-1.4B (hidden 2048, intermediate 5632, 16 x 128 MHA heads, vocab 49152).
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 5632, 16, 16, 128, 49152


def graph_time_ms(fn, reps: int = 20, batches: int = 5) -> float:
    """Median over ``batches`` of (time of ``reps`` graph replays of ``fn``) / reps, in ms."""
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# -- linear --------------------------------------------------------------------------------------------
SHAPES = {  # name: (kind, weight rows, K)
    "qkv+rope+kv": ("rope", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": ("plain", HIDDEN, HEADS * HEAD_DIM),
    "gate_up+silu": ("silu", 2 * INTER, HIDDEN),
    "down_proj": ("plain", HIDDEN, INTER),
    "lm_head": ("plain", VOCAB, HIDDEN),
}


def _sweep_tiles(m: int, two: bool, tma: bool = False) -> list[tuple[fl.Tiles, int]]:
    """(tiles, K splits) to sweep. The two-weight kernels (q/k/v + RoPE, gate/up + SiLU) also get
    64-wide column tiles on 8 warps (compiled for sm_90 without spills: 64-111 registers) and 2 / 4 K
    splits (the last program of a tile sums them): at 64 rows a program of 32-wide tiles loads as many
    activation bytes as weight bytes, wider tiles halve that and the splits keep the SMs busy. ``tma``:
    the same shapes with X and W read through TMA descriptors (``Tiles.tma``) instead."""
    bms = [16] if m <= 16 else ([32, 64] if m <= 32 else ([64] if m <= 64 else [64, 128]))
    out = []
    for bm, bn, bk, warps, stages in itertools.product(bms, (16, 32, 64), (64, 128, 256), (4, 8), (3, 4)):
        if (warps == 8 and bn < 64) or (two and bn > 32 and warps == 4) or (bk == 64 and not (two and bn == 64)):
            continue
        for splits in ((1, 2, 4) if two else (1,)):
            out.append((fl.Tiles(bm, bn, bk, warps, stages, tma), splits))
    return out


def bench_linear(rows: list[int], sweep_rows: list[int], dtype=torch.bfloat16, budget_bytes: int = 256 << 20,
                 shapes: tuple[str, ...] = tuple(SHAPES), tma: bool = False) -> list[dict]:
    """Every row count on the kernels, its limit lifted (``served``: whether the default limit serves it)."""
    with _lifted_row_limits() as limits:
        return _bench_linear(rows, sweep_rows, dtype, budget_bytes, shapes, tma, limits)


def _bench_linear(rows, sweep_rows, dtype, budget_bytes, shapes, tma, limits: dict[str, int]) -> list[dict]:
    dev = torch.device("cuda")
    results = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (kind, n, k) in SHAPES.items():
        if name not in shapes:
            continue
        copies = max(2, math.ceil(budget_bytes / (n * k * 2)))
        ws = [(torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * k ** -0.5).to(dtype) for _ in range(copies)]
        nbytes = n * k * 2
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.float32).to(dtype)
            cos, sin = rope_cos_sin(torch.arange(m, device=dev) + 1000, rope_inv_freq(HEAD_DIM, 1e6, device=dev), dtype)
            kc = torch.zeros(4096, KV_HEADS * HEAD_DIM, device=dev, dtype=dtype)
            vc = torch.zeros_like(kc)
            slots = torch.arange(m, device=dev, dtype=torch.int64) * 7

            def unfused(w, x=x, cos=cos, sin=sin, kc=kc, vc=vc, slots=slots):
                if kind == "rope":
                    q, kk, v, _ = rope_qk_(F.linear(x, w), cos, sin, HEADS, KV_HEADS, HEAD_DIM)
                    kc.index_copy_(0, slots, kk.reshape(m, -1))
                    vc.index_copy_(0, slots, v.reshape(m, -1))
                    return q
                if kind == "silu":
                    return silu_mul(F.linear(x, w))
                return F.linear(x, w)

            def fused(w, tiles=None, splits=None, x=x, cos=cos, sin=sin, kc=kc, vc=vc, slots=slots):
                if kind == "rope":
                    return fl.linear_rope_kv(x, w, cos, sin, HEADS, KV_HEADS, HEAD_DIM, (kc, vc, slots), tiles,
                                             splits)[0]
                return fl.linear_silu_mul(x, w, tiles, splits)

            base = graph_time_ms(lambda: [unfused(w) for w in ws]) / copies
            limit = {"rope": "MAX_ROWS_ROPE_KV", "silu": "MAX_ROWS_SILU_MUL"}.get(kind, "MAX_ROWS_SPLIT_K")
            row = {"shape": name, "rows": m, "weight_mb": nbytes / 2**20, "unfused_us": base * 1e3,
                   "unfused_gbps": nbytes / base / 1e6, "served": m <= limits[limit]
                   and (kind == "rope" or m not in limits["CUBLAS_ROWS"])}
            if kind == "plain":
                if name in SPLIT_K_SHAPES:
                    row.update(bench_split_k(ws, x, nbytes, m in sweep_rows, tma))
                results.append(row)
                print(f"{name:14s} m={m:4d}{' ' if row['served'] else '*'} cuBLAS {row['unfused_us']:7.1f} us ({row['unfused_gbps']:6.0f} GB/s)"
                      + (f"  | +add_norm_norm: cuBLAS {row['cublas_norm_us']:6.1f} us, split-K {row['split_norm_us']:6.1f} us "
                         f"{tuple(row['split_plan'])} err {row['split_err']:.1e}" if "split_norm_us" in row else "")
                      + (f"  best {row['split_best_us']:6.1f} us {tuple(row['split_best_plan'])}" if "split_best_us" in row else "")
                      + (f"  folded {row['fold_norm_us']:6.1f} us (equal: {row['fold_equal']})" if "fold_norm_us" in row else ""),
                      flush=True)
                continue
            err = rel_err(fused(ws[0]), unfused(ws[0]))
            dflt = graph_time_ms(lambda: [fused(w) for w in ws]) / copies
            row.update(fused_us=dflt * 1e3, fused_gbps=nbytes / dflt / 1e6, rel_err=err,
                       default_tiles=list(fl._launch_shape(m, "rope_kv" if kind == "rope" else "silu_mul", None, None,
                                                           tma_ready(x) and tma_ready(ws[0]))[0]))
            with _fold():  # rlt.attention.fold: the projection split over K, the last program finishing a tile
                folded = graph_time_ms(lambda: [fused(w) for w in ws]) / copies
                row.update(fold_us=folded * 1e3, fold_err=rel_err(fused(ws[0]), unfused(ws[0])))
            if m in sweep_rows:
                best = None
                for t, sp in _sweep_tiles(m, kind != "plain", tma):
                    if kind == "rope" and t.block_n > HEAD_DIM // 2:
                        continue
                    try:
                        with _fold(sp > 1):  # K splits are summed by the fold's last program of each tile
                            ms = graph_time_ms(lambda t=t, sp=sp: [fused(w, t, sp) for w in ws], reps=10,
                                               batches=3) / copies
                            e = rel_err(fused(ws[0], t, sp), unfused(ws[0]))
                    except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (resources)
                        print(f"  {name} m={m} {tuple(t)} x{sp}: {type(exc).__name__}: {str(exc)[:80]}")
                        continue
                    if e > 2e-2:
                        print(f"  {name} m={m} {tuple(t)} x{sp}: rel err {e:.2e} (rejected)")
                        continue
                    print(f"  {name} m={m} {tuple(t)} x{sp}: {ms * 1e3:7.1f} us ({nbytes / ms / 1e6:6.0f} GB/s)",
                          flush=True)
                    if best is None or ms < best[0]:
                        best = (ms, t, sp)
                if best:
                    row.update(best_us=best[0] * 1e3, best_tiles=list(best[1]), best_splits=best[2],
                               best_gbps=nbytes / best[0] / 1e6)
            results.append(row)
            print(f"{name:14s} m={m:4d}{' ' if row['served'] else '*'} unfused {row['unfused_us']:7.1f} us ({row['unfused_gbps']:6.0f} GB/s)  "
                  f"fused {row['fused_us']:7.1f} us ({row['fused_gbps']:6.0f} GB/s)"
                  + (f"  best {row['best_us']:7.1f} us {tuple(row['best_tiles'])} x{row['best_splits']}"
                     if "best_us" in row else "")
                  + f"  err {err:.1e}  folded {row['fold_us']:7.1f} us err {row['fold_err']:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    return results


#: Plain projections followed by add_norm_norm in an Ouro layer: split-K candidates (fused_linear.linear_split_k).
SPLIT_K_SHAPES = ("o_proj", "down_proj")


def _split_plans(m: int, tma: bool = False) -> list[fl.SplitPlan]:
    bms = [16] if m <= 16 else ([64] if m <= 64 else [64, 128])
    return [fl.SplitPlan(fl.Tiles(bm, bn, bk, 4, st, tma), sp)
            for bm, bn, bk, st, sp in itertools.product(bms, (16, 32, 64), (128, 256), (3, 4), (2, 4, 8))]


@contextlib.contextmanager
def _lifted_row_limits():
    """The fused / split-K kernels serve any row count inside (rows above their limits are timed to choose
    the limits: ``RLT_FUSED_ROWS`` then takes a winner end to end); the limits after."""
    names = ("MAX_ROWS_ROPE_KV", "MAX_ROWS_SILU_MUL", "MAX_ROWS_SPLIT_K", "CUBLAS_ROWS")
    saved = {n: getattr(fl, n) for n in names}
    for n in names:
        setattr(fl, n, range(0) if n == "CUBLAS_ROWS" else 1 << 20)
    try:
        yield saved
    finally:
        for n, v in saved.items():
            setattr(fl, n, v)


@contextlib.contextmanager
def _fold(on: bool = True):
    """RLT_FOLD=1 (or 0) for the calls inside, the caller's setting after (rlt.attention.fold reads it on refresh)."""
    saved = os.environ.get("RLT_FOLD")
    os.environ["RLT_FOLD"] = "1" if on else "0"
    fold.refresh()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RLT_FOLD", None)
        else:
            os.environ["RLT_FOLD"] = saved
        fold.refresh()


def bench_split_k(ws: list[torch.Tensor], x: torch.Tensor, nbytes: int, sweep: bool, tma: bool = False) -> dict:
    """The projection plus the add_norm_norm that consumes it (as an Ouro layer runs them): cuBLAS +
    the plain kernel against split-K pieces summed by the kernel, at the default plan and (``sweep``)
    over plans. Rows above MAX_ROWS_SPLIT_K are timed too (bench_linear lifts the limits to choose them)."""
    m, n = x.shape[0], ws[0].shape[0]
    g = torch.Generator(device=x.device).manual_seed(1)
    h = torch.randn(m, n, device=x.device, generator=g).to(x.dtype)
    w1 = (1 + 0.1 * torch.randn(n, device=x.device, generator=g)).to(x.dtype)
    w2 = (1 + 0.1 * torch.randn(n, device=x.device, generator=g)).to(x.dtype)

    def base(w):
        return add_norm_norm(h, F.linear(x, w), w1, w2, 1e-6)[1]

    def split(w, plan=None):
        return add_norm_norm(h, fl.linear_split_k(x, w, plan), w1, w2, 1e-6)[1]

    out = {"cublas_norm_us": graph_time_ms(lambda: [base(w) for w in ws]) / len(ws) * 1e3}
    plan = fl.split_plan(m, n, x.shape[1])
    if plan is None:
        return out
    out.update(split_plan=[list(plan.tiles), plan.splits], split_err=rel_err(split(ws[0]), base(ws[0])),
               split_norm_us=graph_time_ms(lambda: [split(w) for w in ws]) / len(ws) * 1e3)
    if m <= fl.MAX_ROWS_FOLD:  # rlt.attention.fold: add_norm_norm run by the last split-K program
        def folded(w):
            return fl._FoldedSplitK(x, w, plan).add_norm_norm(h, w1, w2, 1e-6)[1]

        out.update(fold_norm_us=graph_time_ms(lambda: [folded(w) for w in ws]) / len(ws) * 1e3,
                   fold_equal=bool(torch.equal(folded(ws[0]), split(ws[0]))))
    if sweep:
        best = None
        for p in _split_plans(m, tma):
            if x.shape[1] % (p.splits * p.tiles.block_k):
                continue
            try:
                us = graph_time_ms(lambda p=p: [split(w, p) for w in ws], reps=10, batches=3) / len(ws) * 1e3
                e = rel_err(split(ws[0], p), base(ws[0]))
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (resources)
                print(f"  split-K m={m} {p}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            if e < 2e-2 and (best is None or us < best[0]):
                best = (us, p)
        if best:
            out.update(split_best_us=best[0], split_best_plan=[list(best[1].tiles), best[1].splits],
                       split_best_gbps=nbytes / best[0] / 1e3)
    return out


# -- attention ---------------------------------------------------------------------------------------------
def bench_attention(cases: list[tuple[int, int]], dtype=torch.bfloat16, tile_sweep: bool = False) -> list[dict]:
    """Per (rows, context): the split-policy sweep, or with ``tile_sweep`` the launch shapes of the tiles the default
    policy uses at that shape (``DecodeTiles``: keys per iteration, warps, stages, heads-fastest grid order)."""
    from rlt.attention import AttentionMetadata, KVCache, KVLayout
    from rlt.attention.backends.triton_backend import DecodeTiles, TritonBackend

    dev = torch.device("cuda")
    bs, planes = 16, 4
    results = []
    for rows, ctx in cases:
        layers = 24 if rows * ctx * KV_HEADS * HEAD_DIM * 4 < (64 << 20) else 1
        pages = -(-ctx // bs)
        nblocks = rows * pages * planes
        kv = KVCache.allocate(num_layers=layers, num_blocks=nblocks, block_size=bs, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, num_planes=planes, layout=KVLayout.LAST_EXITED, dtype=dtype, device=dev)
        kv.k.normal_()
        kv.v.normal_()
        kv.token_depth.fill_(planes - 1)
        perm = torch.randperm(nblocks, device=dev).to(torch.int32)
        bt = perm.view(rows, planes, pages)
        depth = torch.randint(0, planes, (rows,), device=dev, dtype=torch.int32)
        seq = torch.full((rows,), ctx, device=dev, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(rows + 1, device=dev, dtype=torch.int32), seq_lens=seq, query_depth=depth,
            block_tables=bt, slot_mapping=torch.zeros(rows, device=dev, dtype=torch.int64),
            plane0_slot_mapping=torch.zeros(rows, device=dev, dtype=torch.int64), token_query_depth=depth,
            positions=seq.long() - 1, max_query_len=1, max_seq_len=ctx, layout=KVLayout.LAST_EXITED)
        q = torch.randn(rows, HEADS, HEAD_DIM, device=dev, dtype=dtype)
        floor_us = rows * ctx * KV_HEADS * HEAD_DIM * 2 * 2 / 4.2e12 * 1e6
        reference = None
        if tile_sweep:
            kind = "split_decode_tiles" if TritonBackend().splits_for(rows, KV_HEADS, ctx, dev) > 1 else "decode_tiles"
            variants = [("prepare, default", TritonBackend(), True)]
            for bn, (warps, st), hf in itertools.product((32, 64, 128), ((4, 2), (4, 3), (8, 2), (8, 3)), (False, True)):
                tiles = DecodeTiles(block_n=bn, num_warps=warps, num_stages=st, heads_fastest=hf)
                variants.append((f"prepare, {kind} {bn}x{warps}x{st}x{int(hf)}", TritonBackend(**{kind: tiles}), True))
        else:
            variants = [("current (per-call resolve)", TritonBackend(), False)]
            for mk, bn, st in itertools.product((32, 64, 128, 256), (16, 32, 64), (3,)):
                variants.append((f"prepare, min_keys {mk}, split tiles {bn}x{st}",
                                 TritonBackend(min_keys_per_split=mk, split_decode_tiles=DecodeTiles(block_n=bn, num_stages=st)), True))
            variants.append(("prepare, default split policy, folded merge", TritonBackend(), True))
        for label, be, use_prepare in variants:
            def step(be=be, use_prepare=use_prepare):
                m = be.prepare(kv, meta) if use_prepare else meta
                return [be.forward(q, kv, layer, m, HEAD_DIM ** -0.5) for layer in range(layers)]

            with _fold("folded merge" in label):
                out = step()[0]
                if reference is None:
                    reference = out
                err = rel_err(out, reference)
                ms = graph_time_ms(step, reps=10, batches=3) / layers
            splits = be.splits_for(rows, KV_HEADS, ctx, dev)
            results.append({"rows": rows, "context": ctx, "variant": label, "us_per_layer": ms * 1e3,
                            "floor_us": floor_us, "splits": splits, "rel_err": err})
        mine = [r for r in results if r["rows"] == rows and r["context"] == ctx]
        best = min(mine, key=lambda r: r["us_per_layer"])
        if tile_sweep:
            dflt = next(r for r in mine if r["variant"] == "prepare, default")
            print(f"attention C={rows:4d} ctx={ctx:6d}: default {dflt['us_per_layer']:.1f} us, best "
                  f"{best['us_per_layer']:.1f} us ({best['variant']}, rel err {best['rel_err']:.1e}), floor {floor_us:.1f} us",
                  flush=True)
        else:
            cur = next(r for r in mine if r["variant"].startswith("current"))
            dflt = next(r for r in mine if r["variant"] == "prepare, min_keys 256, split tiles 32x3")
            folded = next(r for r in mine if r["variant"].endswith("folded merge"))
            plain = next(r for r in mine if r["variant"] == "prepare, min_keys 32, split tiles 32x3")  # the default policy, unfolded
            print(f"attention C={rows:4d} ctx={ctx:6d}: default {plain['us_per_layer']:.1f} us, folded merge "
                  f"{folded['us_per_layer']:.1f} us (rel err {folded['rel_err']:.1e})", flush=True)
            print(f"attention C={rows:4d} ctx={ctx:6d}: current {cur['us_per_layer']:.1f} us, prepare+default "
                  f"{dflt['us_per_layer']:.1f} us, best {best['us_per_layer']:.1f} us ({best['variant']}, splits "
                  f"{best['splits']}), floor {floor_us:.1f} us", flush=True)
        del kv
        torch.cuda.empty_cache()
    return results


#: The sweep's fused shapes and the ``fused_linear`` kinds whose launch shape ``RLT_LINEAR_TILES`` sets.
TILE_KIND = {"qkv+rope+kv": "rope_kv", "gate_up+silu": "silu_mul"}


def tile_overrides(linear: list[dict], min_gain: float = 0.03) -> str:
    """``RLT_LINEAR_TILES`` from sweeps' rows (``bench_linear``, one or several sweeps' rows together): for each
    swept shape and row count, its best launch shape over every sweep, if that beat the default by more than
    ``min_gain`` (a fraction of the default's time)."""
    best: dict[tuple[str, int], dict] = {}
    for row in linear:
        key = (row["shape"], row["rows"])
        if TILE_KIND.get(row["shape"]) and "best_us" in row and (key not in best or row["best_us"] < best[key]["best_us"]):
            best[key] = row
    entries = []
    for (shape, rows), row in best.items():
        if row["best_us"] < row["fused_us"] * (1 - min_gain):
            tiles = "x".join(str(int(v)) for v in row["best_tiles"])
            entries.append(f"{TILE_KIND[shape]}:{rows}={tiles}/{row['best_splits']}")
    # The split-K plans (o_proj, down_proj): one ``split_k`` entry per row count serves both shapes, so it gives
    # tiles only (each shape keeps the rule's split count) — the largest saving among best plans that kept it.
    split: dict[int, tuple[float, dict]] = {}
    for row in linear:
        if "split_best_us" not in row or row["split_best_plan"][1] != row["split_plan"][1]:
            continue
        saving = row["split_norm_us"] - row["split_best_us"]
        if row["split_best_us"] < row["split_norm_us"] * (1 - min_gain) and saving > split.get(row["rows"], (0.0,))[0]:
            split[row["rows"]] = (saving, row)
    for rows, (_, row) in split.items():
        entries.append(f"split_k:{rows}=" + "x".join(str(int(v)) for v in row["split_best_plan"][0]))
    return ",".join(entries)


def decode_tile_overrides(attention: list[dict], min_gain: float = 0.03) -> str:
    """``RLT_DECODE_TILES`` from an ``--attention-tiles`` sweep: per kind (``decode`` for the one-split shapes,
    ``split``), the launch shape with the least time summed over that kind's cases, if it beats the default's
    sum by more than ``min_gain``."""
    entries = []
    for kind, env in (("decode_tiles", "decode"), ("split_decode_tiles", "split")):
        cases = {(r["rows"], r["context"]) for r in attention if f" {kind} " in r["variant"]}
        if not cases:
            continue
        totals: dict[str, float] = {}
        for r in attention:
            if (r["rows"], r["context"]) in cases and (f" {kind} " in r["variant"] or r["variant"] == "prepare, default"):
                totals[r["variant"]] = totals.get(r["variant"], 0.0) + r["us_per_layer"]
        label, best = min(totals.items(), key=lambda kv: kv[1])
        if best < totals["prepare, default"] * (1 - min_gain):
            entries.append(f"{env}={label.rsplit(' ', 1)[1]}")
    return ",".join(entries)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="linear,attention")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--sweep-rows", default="1,64")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="linear shapes to run (%(default)s)")
    ap.add_argument("--attention-cases", default="1x1024,1x4096,8x1024,64x1024,128x1024")
    ap.add_argument("--attention-tiles", action="store_true", help="sweep the decode tiles' launch shapes and grid "
                    "order (RLT_DECODE_TILES) instead of the split policy")
    ap.add_argument("--out", default="")
    ap.add_argument("--tiles-from", default="", help="print RLT_LINEAR_TILES for sweeps' JSON files (comma-separated "
                    "--out of linear sweeps) and exit: the shapes whose best launch beat the default by more than --min-gain")
    ap.add_argument("--decode-tiles-from", default="", help="print RLT_DECODE_TILES for an --attention-tiles sweep's "
                    "JSON (--out) and exit: per kind, the launch shape beating the default by more than --min-gain")
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--tma", action="store_true", help="sweep the fused projections and the split-K plans with X / W "
                    "read through TMA")
    args = ap.parse_args()
    if args.tiles_from:
        rows = []
        for path in filter(None, args.tiles_from.split(",")):
            if os.path.exists(path):
                with open(path) as f:
                    rows += json.load(f).get("linear", [])
        print(tile_overrides(rows, args.min_gain))
        return 0
    if args.decode_tiles_from:
        with open(args.decode_tiles_from) as f:
            print(decode_tile_overrides(json.load(f).get("attention", []), args.min_gain))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels needs a CUDA/ROCm GPU")
    t0 = time.time()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    parts = args.parts.split(",")
    if "linear" in parts:
        res["linear"] = bench_linear([int(r) for r in args.rows.split(",")], [int(r) for r in args.sweep_rows.split(",") if r],
                                     shapes=tuple(args.shapes.split(",")), tma=args.tma)
    if "attention" in parts:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.attention_cases.split(",") if c]
        res["attention"] = bench_attention(cases, tile_sweep=args.attention_tiles)
    res["seconds"] = time.time() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
