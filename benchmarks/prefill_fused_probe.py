"""Probe: do the fused projections pay at prompt-sized row counts (issue 10's C=128 end to end)?

A C=128 1K/128 run spends ~40 % of its time in prefill, and the prefill step is 74 % cuBLAS GEMM at the
matmul ceiling plus 17 % elementwise kernels each at its byte floor (H100 lease 11, ``benchmarks/results/
h100-20261206-lease11/README.md``): SwiGLU 6 %, the add + norm pairs 6 %, RoPE + KV store 5 %. Two of those
could ride in a GEMM's epilogue, which cuBLAS does not offer: the gate/up projection + SiLU·mul and the q/k/v
projection + RoPE. ``rlt.platform.models.fused_linear`` has both as Triton kernels built for decode-sized
batches (``linear_silu_mul``, ``linear_rope_kv``: any row count through their grid, served up to 128 rows);
this times them at prompt-sized row counts, with a few large-tile launch shapes through TMA, against what
prefill runs now (cuBLAS + ``silu_mul`` / ``rope_qk_``), and a plain cuBLAS GEMM of the same shape for its
matmul rate. A launch shape that beats the eager pair across row counts would be the case for serving prompt
rows with the fused kernels. Lease 20 (an H100, ``benchmarks/results/h100-20261207-lease20/README.md``): none does —
the fused GEMMs run at 530-575 TFLOP/s against cuBLAS's 750-780, 7-19 % slower than the pair at 2K-32K rows, so
prompt rows stay on cuBLAS.

    RLT_FUSED_ROWS=silu_mul=1048576,rope_kv=1048576 python -m benchmarks.prefill_fused_probe --out probe.json

(the row limits lifted so the kernels take prompt-sized batches; the script sets them if unset). Per case: the
median of ``--reps`` CUDA-event timings after a warm-up; also correctness against the eager pair (max
abs difference, bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("RLT_FUSED_ROWS", "silu_mul=1048576,rope_kv=1048576")

import torch  # noqa: E402

from benchmarks.roofline import timed  # noqa: E402
from rlt.platform.models import fused_linear as fl  # noqa: E402
from rlt.platform.models.fused_ops import rope_qk_, silu_mul  # noqa: E402
from rlt.platform.models.layers import rope_cos_sin, rope_inv_freq  # noqa: E402

#: Launch shapes tried (BM x BN x BK x warps x stages, TMA): the two accumulators of a gate/up tile make a
#: BN-wide tile a 2*BN-wide GEMM tile; q/k/v + RoPE tiles are at most half a head wide (BN <= 64).
SILU_TILES = [fl.Tiles(128, 64, 64, 8, 4, True), fl.Tiles(128, 64, 128, 8, 3, True),
              fl.Tiles(128, 128, 64, 8, 3, True), fl.Tiles(128, 128, 64, 8, 4, True),
              fl.Tiles(64, 128, 64, 4, 4, True), fl.Tiles(256, 64, 64, 8, 3, True)]
ROPE_TILES = [fl.Tiles(128, 64, 64, 8, 4, True), fl.Tiles(128, 64, 128, 8, 3, True),
              fl.Tiles(128, 32, 128, 4, 4, True), fl.Tiles(256, 64, 64, 8, 3, True)]


def _median(fn, device, reps: int) -> float:
    fn()
    torch.cuda.synchronize(device)
    return statistics.median(timed(fn, device, reps))


def run(rows: list[int], hidden: int, inter: int, heads: int, head_dim: int, reps: int) -> list[dict]:
    device = torch.device("cuda")
    dt = torch.bfloat16
    torch.manual_seed(0)
    gate_up = torch.randn(2 * inter, hidden, device=device, dtype=dt) * hidden ** -0.5
    qkv_w = torch.randn(3 * heads * head_dim, hidden, device=device, dtype=dt) * hidden ** -0.5
    out = []
    for m in rows:
        x = torch.randn(m, hidden, device=device, dtype=dt)
        cos, sin = rope_cos_sin(torch.arange(m, device=device) % 1024, rope_inv_freq(head_dim, 1e4, device), dt)
        flops_gu = 2 * m * hidden * 2 * inter
        flops_qkv = 2 * m * hidden * 3 * heads * head_dim
        case = {"rows": m}
        case["gemm_gate_up_us"] = _median(lambda: torch.nn.functional.linear(x, gate_up), device, reps) * 1e6
        case["eager_silu_us"] = _median(lambda: silu_mul(torch.nn.functional.linear(x, gate_up)), device, reps) * 1e6
        ref = silu_mul(torch.nn.functional.linear(x, gate_up)).float()
        case["silu"] = {}
        for t in SILU_TILES:
            key = "x".join(str(int(v)) for v in t)
            try:
                got = fl.linear_silu_mul(x, gate_up, tiles=t, splits=1)
                err = (got.float() - ref).abs().max().item()
                us = _median(lambda: fl.linear_silu_mul(x, gate_up, tiles=t, splits=1), device, reps) * 1e6
                case["silu"][key] = {"us": us, "tflops": flops_gu / us / 1e6, "max_abs_err": err}
            except Exception as e:  # a shape the compiler refuses: recorded, the sweep goes on
                case["silu"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        case["gemm_qkv_us"] = _median(lambda: torch.nn.functional.linear(x, qkv_w), device, reps) * 1e6

        def eager_rope():
            return rope_qk_(torch.nn.functional.linear(x, qkv_w), cos, sin, heads, heads, head_dim)

        case["eager_rope_us"] = _median(eager_rope, device, reps) * 1e6
        ref_q = eager_rope()[0].float()
        case["rope"] = {}
        for t in ROPE_TILES:
            key = "x".join(str(int(v)) for v in t)
            try:
                got = fl.linear_rope_kv(x, qkv_w, cos, sin, heads, heads, head_dim, tiles=t, splits=1)[0]
                err = (got.float() - ref_q).abs().max().item()
                us = _median(lambda: fl.linear_rope_kv(x, qkv_w, cos, sin, heads, heads, head_dim, tiles=t,
                                                       splits=1), device, reps) * 1e6
                case["rope"][key] = {"us": us, "tflops": flops_qkv / us / 1e6, "max_abs_err": err}
            except Exception as e:
                case["rope"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        case["gemm_gate_up_tflops"] = flops_gu / case["gemm_gate_up_us"] / 1e6
        case["gemm_qkv_tflops"] = flops_qkv / case["gemm_qkv_us"] / 1e6
        out.append(case)
        best_s = min((v["us"], k) for k, v in case["silu"].items() if "us" in v)
        best_r = min((v["us"], k) for k, v in case["rope"].items() if "us" in v)
        print(f"rows {m}: gate/up GEMM {case['gemm_gate_up_us']:.0f} us ({case['gemm_gate_up_tflops']:.0f} TFLOP/s), "
              f"+ silu_mul {case['eager_silu_us']:.0f} us; fused best {best_s[0]:.0f} us ({best_s[1]}) | "
              f"qkv GEMM {case['gemm_qkv_us']:.0f} us, + rope {case['eager_rope_us']:.0f} us; fused best "
              f"{best_r[0]:.0f} us ({best_r[1]})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2048,8192,16384,32768")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = run([int(r) for r in a.rows.split(",")], a.hidden, a.inter, a.heads, a.head_dim, a.reps)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": res}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
