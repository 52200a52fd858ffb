"""Attention kernel micro-benchmarks on Ouro-1.4B shapes (16 heads x 128, MHA, bf16) against the floor.

    python benchmarks/attention_bench.py --out attention_bench.json [--sweep]

Cases (the issue's targets): paged decode, 64 rows x 4K context and 1 row x 32K context (>= 70% of
copy bandwidth), and one 8K-token causal prefill (>= 60% of the bf16 matmul rate, issue 11). KV is paged
(block 16, the engine default), LAST_EXITED with 4 depth planes, rows at depth 3 over full-depth
history (fixed-depth serving), so every key goes through the in-kernel version-map indirection.

Floors, measured in the same run: the copy bandwidth (a 2 GiB device-to-device copy, bytes read +
written) and the bf16 matmul rate (8192^3, random data). Decode bytes = K + V of every context
token (+ query and output); prefill FLOPs = 4 * heads * head_dim * N(N+1)/2 (causal: QK^T and PV
over the visible half). Each number is the median of three ``triton.testing.do_bench`` medians
after one discarded warm-up call (JIT). Decode is also timed as a CUDA-graph replay (how a serving
step runs it). ``sdpa_dense`` rows time torch SDPA on the same data laid out densely (no paging,
no depth indirection): a reference point, not a floor. ``fa4``/``fa3``/``fa2`` rows run the same
problems through each FlashAttention adapter whose package imports (rows at depth 3 over full-depth
history is exactly when one page table per row is exact).

Each main case also reports its rel. error against the torch reference on the same inputs.
``--sweep`` adds tile / variant / split / pre-resolve variants and prefill diagnostics (SHARED
layout, 256-token pages) that isolate the cost of the paging and depth indirection.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("packages/rlt-attention/src", "packages/rlt-platform/src"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

HEADS, HEAD_DIM, BLOCK = 16, 128, 16
TARGETS = {"decode": 0.70, "prefill": 0.60}  # issue 11: Triton alone >= 60 % of the matmul rate at 8K


def med3(fn, graph: bool = False) -> list[float]:
    import triton.testing as tt

    fn()  # warm-up, discarded (JIT compile, scratch)
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        if graph:
            runs.append(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))
        else:
            runs.append(tt.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    return runs


def ceilings() -> dict:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = med3(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 2 / (statistics.median(copy_ms) * 1e-3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = med3(lambda: a @ b)
    mm_rate = 2 * m ** 3 / (statistics.median(mm_ms) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "copy_ms": copy_ms, "copy_bytes": 4 * n,
            "matmul_flops_per_s": mm_rate, "matmul_ms": mm_ms, "matmul_shape": [m, m, m]}


def decode_problem(rows: int, ctx: int, block_size: int = BLOCK, layout: str = "last_exited"):
    from rlt.attention import KVLayout
    from rlt.attention.synthetic import random_problem

    return random_problem([(ctx, 1, 3)] * rows, num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                          block_size=block_size, num_planes=4, layout=KVLayout(layout), dtype=torch.bfloat16,
                          device="cuda", history="full", spare_blocks=0, seed=rows * 7 + ctx)


def prefill_problem(n: int, block_size: int = BLOCK):
    from rlt.attention.synthetic import random_problem

    return random_problem([(n, n, 3)], num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=block_size,
                          num_planes=4, dtype=torch.bfloat16, device="cuda", history="full", spare_blocks=0, seed=n)


def decode_bytes(rows: int, ctx: int) -> int:
    kv = rows * ctx * HEADS * HEAD_DIM * 2 * 2
    return kv + 2 * rows * HEADS * HEAD_DIM * 2


def prefill_flops(n: int) -> float:
    return 4.0 * HEADS * HEAD_DIM * n * (n + 1) / 2


def record(name, kind, ms, work, ceiling, **extra):
    med = statistics.median(ms)
    floor_ms = work / ceiling * 1e3
    frac = floor_ms / med
    row = {"name": name, "kind": kind, "times_ms": ms, "median_ms": med, "floor_ms": floor_ms,
           "fraction_of_floor": frac, **extra}
    if kind in TARGETS:
        row["target"] = TARGETS[kind]
        row["meets_target"] = frac >= TARGETS[kind]
    return row


def run_triton(pb, backend):
    extra = {"new_kv": step_kv(pb)} if backend.takes_new_kv else {}
    return lambda: backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale, **extra)


def step_kv(pb):
    """The problem's new tokens' K/V as the model hands them to a backend that takes them
    (``AttentionBackend.takes_new_kv``): the values stored at their slots, dense ``[N, kv_heads, d]``."""
    def flat(t):
        return t[pb.layer].reshape(-1, t.shape[-2], t.shape[-1])

    return flat(pb.kv.k)[pb.meta.slot_mapping], flat(pb.kv.v)[pb.meta.slot_mapping]


def bench_decode(name, rows, ctx, ceil, backend, graph=True, **meta):
    pb = decode_problem(rows, ctx, **meta)
    fn = run_triton(pb, backend)
    work = decode_bytes(rows, ctx)
    err = check_default(name, pb, backend)
    out = [record(name, "decode", med3(fn), work, ceil["copy_bytes_per_s"], rows=rows, ctx=ctx, bytes=work,
                  mode="eager", rel_err_vs_reference=err, **meta)]
    if graph:
        out.append(record(name, "decode", med3(fn, graph=True), work, ceil["copy_bytes_per_s"], rows=rows, ctx=ctx,
                          bytes=work, mode="graph", **meta))
    del pb
    torch.cuda.empty_cache()
    return out


def bench_prefill(name, n, ceil, backend, **meta):
    pb = prefill_problem(n, **meta)
    work = prefill_flops(n)
    err = check_default(name, pb, backend)
    row = record(name, "prefill", med3(run_triton(pb, backend)), work, ceil["matmul_flops_per_s"], tokens=n,
                 flops=work, mode="eager", rel_err_vs_reference=err, **meta)
    del pb
    torch.cuda.empty_cache()
    return row


def flash_rows(ceil) -> list[dict]:
    """The same three cases through each FlashAttention adapter whose package imports here (eager
    only: FA4 declares no graph safety). FA2 pages must be a multiple of 256."""
    from rlt.attention import BACKENDS, create_backend

    out = []
    for name in ("fa4", "fa3", "fa2"):
        if BACKENDS[name].missing_modules():
            continue
        backend, bs = create_backend(name), (256 if name == "fa2" else BLOCK)
        try:
            out += bench_decode(f"{name} decode 64x4096", 64, 4096, ceil, backend, graph=False, block_size=bs)
            out += bench_decode(f"{name} decode 1x32768", 1, 32768, ceil, backend, graph=False, block_size=bs)
            # a fresh prompt: the dense varlen call over the step's K/V where it is the adapter's default (FA4)
            out.append(bench_prefill(f"{name} prefill 8192" + (" dense" if backend.takes_new_kv else ""), 8192, ceil,
                                     backend, block_size=bs))
            if backend.takes_new_kv:
                out.append(bench_prefill(f"{name} prefill 8192 paged", 8192, ceil,
                                         create_backend(name, dense_fresh=False), block_size=bs))
        except Exception as exc:  # noqa: BLE001 - an adapter failing is a result to report, not fatal here
            out.append({"name": f"{name} (failed)", "error": repr(exc)[:400]})
        torch.cuda.empty_cache()
    return out


def sdpa_rows(ceil) -> list[dict]:
    import torch.nn.functional as F

    out = []
    for rows, ctx in ((64, 4096), (1, 32768)):
        q = torch.randn(rows, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(rows, HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ms = med3(lambda: F.scaled_dot_product_attention(q, k, v))
        out.append(record(f"sdpa_dense decode {rows}x{ctx}", "reference", ms, decode_bytes(rows, ctx),
                          ceil["copy_bytes_per_s"], rows=rows, ctx=ctx))
        del q, k, v
    n = 8192
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = med3(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out.append(record("sdpa_dense prefill 8192", "reference", ms, prefill_flops(n), ceil["matmul_flops_per_s"],
                      tokens=n))
    torch.cuda.empty_cache()
    return out


def sweep(ceil) -> list[dict]:
    from rlt.attention.backends.triton_backend import DecodeTiles, PrefillTiles, TritonBackend

    out = []

    def timed(name, pb, work, ceiling, cfg, graph=False):
        desc = {k: (str(v) if not isinstance(v, (int, str, bool)) else v) for k, v in cfg.items()}
        try:
            ms = med3(run_triton(pb, TritonBackend(**cfg)), graph=graph)
            out.append(record(name, "sweep", ms, work, ceiling, config=desc, mode="graph" if graph else "eager"))
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            out.append({"name": name, "config": desc, "error": repr(exc)[:300]})

    bw, mm = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    pb = decode_problem(64, 4096)
    for cfg in (dict(decode_tiles=DecodeTiles(64, 4, 2)), dict(decode_tiles=DecodeTiles(64, 4, 2), pre_resolve_decode=True),
                dict(decode_tiles=DecodeTiles(32, 4, 3)), dict(decode_tiles=DecodeTiles(64, 8, 2)),
                dict(decode_tiles=DecodeTiles(128, 4, 2)),
                dict(decode_variant="elementwise", decode_tiles=DecodeTiles(64, 2, 2)),
                dict(decode_variant="elementwise", decode_tiles=DecodeTiles(64, 2, 2), pre_resolve_decode=True)):
        timed("sweep decode 64x4096", pb, decode_bytes(64, 4096), bw, cfg)
    del pb
    pb = decode_problem(1, 32768)
    for cfg in (dict(), dict(pre_resolve_decode=True), dict(split_decode_tiles=DecodeTiles(64, 4, 2)),
                dict(split_decode_tiles=DecodeTiles(32, 4, 2)), dict(split_decode_tiles=DecodeTiles(16, 4, 3)),
                dict(split_decode_tiles=DecodeTiles(32, 2, 3)), dict(split_decode_tiles=DecodeTiles(32, 4, 4)),
                dict(num_splits=48), dict(num_splits=64), dict(num_splits=64, pre_resolve_decode=True),
                dict(num_splits=24)):
        timed("sweep decode 1x32768", pb, decode_bytes(1, 32768), bw, cfg)
    for cfg in (dict(num_splits=64), dict(num_splits=48, pre_resolve_decode=True)):
        timed("sweep decode 1x32768", pb, decode_bytes(1, 32768), bw, cfg, graph=True)
    del pb
    torch.cuda.empty_cache()
    pb = prefill_problem(8192)
    for pre in (True, False):
        for t in (PrefillTiles(128, 64, 8, 3), PrefillTiles(128, 64, 8, 2), PrefillTiles(128, 128, 8, 3),
                  PrefillTiles(128, 128, 8, 2), PrefillTiles(128, 32, 8, 4), PrefillTiles(64, 64, 4, 3)):
            timed("sweep prefill 8192", pb, prefill_flops(8192), mm, dict(prefill_tiles=t, pre_resolve_prefill=pre))
    for t in (PrefillTiles(128, 128, 8, 2), PrefillTiles(128, 128, 8, 3), PrefillTiles(128, 64, 8, 3),
              PrefillTiles(128, 64, 8, 4), PrefillTiles(64, 128, 4, 2), PrefillTiles(128, 128, 8, 2, lazy_rescale=True)):
        timed("sweep prefill 8192 dense", pb, prefill_flops(8192), mm, dict(prefill_tiles=t, dense_prefill=True))
    del pb
    # Diagnostics: how much of the prefill time is the depth indirection / paging?
    from rlt.attention import KVLayout
    from rlt.attention.synthetic import random_problem

    for layout, bs in (("shared", 16), ("shared", 256), ("last_exited", 256)):
        pb = random_problem([(8192, 8192, 3)], num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=bs,
                            num_planes=4, layout=KVLayout(layout), dtype=torch.bfloat16, device="cuda",
                            history="full", spare_blocks=0, seed=3)
        timed(f"diag prefill 8192 {layout} block {bs}", pb, prefill_flops(8192), mm, dict())
        del pb
    torch.cuda.empty_cache()
    return out


def check_default(name, pb, backend) -> float:
    """||triton - torch reference|| / ||reference|| on the benchmarked problem itself."""
    from rlt.attention.backends.torch_ref import TorchReferenceBackend

    got = run_triton(pb, backend)().float()
    want = TorchReferenceBackend().forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale).float()
    err = ((got - want).norm() / want.norm()).item()
    del got, want
    torch.cuda.empty_cache()
    return err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("attention_bench.json"))
    ap.add_argument("--sweep", action="store_true", help="also time tile/variant/split/page-size variants")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_bench: no GPU visible to torch here; nothing to measure")
        return 0
    import triton

    from rlt.attention.backends.triton_backend import TritonBackend

    t0 = time.time()
    ceil = ceilings()
    backend = TritonBackend()
    rows = []
    rows += bench_decode("decode 64x4096", 64, 4096, ceil, backend)
    rows += bench_decode("decode 1x32768", 1, 32768, ceil, backend)
    # the paged kernel (every prompt row with history takes it) and the fresh 8K prompt's keys read densely
    # through TMA (the default on sm_90+; RLT_DENSE_PREFILL=0 turns it off)
    rows.append(bench_prefill("prefill 8192", 8192, ceil, TritonBackend(dense_prefill=False)))
    rows.append(bench_prefill("prefill 8192 dense (TMA)", 8192, ceil, TritonBackend(dense_prefill=True)))
    rows += flash_rows(ceil)
    rows += sdpa_rows(ceil)
    swept = sweep(ceil) if args.sweep else []
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
        "triton": triton.__version__, "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "method": "median of 3 triton.testing.do_bench medians (rep 60 ms) after 1 discarded warm-up call; "
                  "graph mode: do_bench_cudagraph",
        "shapes": {"heads": HEADS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK, "dtype": "bfloat16",
                   "layout": "last_exited, 4 planes, rows at depth 3, full-depth history"},
        "ceilings": ceil, "cases": rows, "sweep": swept, "seconds": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"{'case':26} {'mode':6} {'median ms':>10} {'floor ms':>9} {'of floor':>9}  target / rel err / config")
    for r in [r for r in rows + swept if "median_ms" in r]:
        tgt = f"{r['target']:.0%} {'ok' if r['meets_target'] else 'MISS'}" if "target" in r else ""
        if "rel_err_vs_reference" in r:
            tgt += f" err {r['rel_err_vs_reference']:.1e}"
        cfg = json.dumps(r["config"]).replace('"', "").replace("DecodeTiles", "D").replace("PrefillTiles", "P") \
            if r.get("config") else ""
        print(f"{r['name'][:26]:26} {r.get('mode', ''):6} {r['median_ms']:10.4f} {r['floor_ms']:9.4f} "
              f"{r['fraction_of_floor']:9.1%}  {tgt} {cfg}")
    for s in rows + swept:
        if "error" in s:
            print("error:", s["name"], s.get("config", ""), s["error"])
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
