"""Compile the decode kernels for sm_90 without a GPU and print their SASS facts as JSON (a helper of
``test_decode_kernels_sass.py``, run in a subprocess without ``TRITON_INTERPRET``: another package's
conftest may have imported the kernels as interpreted functions in the test process).

Uses ``benchmarks/triton_aot_report.py``'s compile (Triton's compiler and the ``cuobjdump`` its wheel ships);
prints ``{}`` where the wheel has none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks/
from benchmarks.triton_aot_report import compile_sass  # noqa: E402
from rlt.attention.backends.triton_kernels import dense_prefill, paged_decode  # noqa: E402
from rlt.platform.models import fused_linear as fl  # noqa: E402

POINTERS = {"X": "*bf16", "W": "*bf16", "PARTS": "*fp32", "CNT": "*i32", "H": "*bf16", "W1": "*bf16", "W2": "*bf16",
            "OUT_H": "*bf16", "OUT_N": "*bf16", "OUT": "*bf16", "COS": "*bf16", "SIN": "*bf16", "K_CACHE": "*bf16",
            "V_CACHE": "*bf16", "SLOTS": "*i64", "eps": "fp32", "sm_scale_log2": "fp32",
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32", "cnt_ptr": "*i32", "bt_ptr": "*i32", "td_ptr": "*i32", "slots_ptr": "*i32",
            "seq_lens_ptr": "*i32", "qdepth_ptr": "*i32", "qsl_ptr": "*i32"}
#: Integers that are multiples of 16 at run time get the JIT's divisibility hint (vectorised loads).
ALIGNED = {"stride_xm", "stride_wn", "stride_ps", "stride_pm", "stride_om", "stride_cs", "stride_h", "stride_oh",
           "stride_on", "N", "I", "stride_qn", "stride_qh", "stride_kb", "stride_ks", "stride_kh"}
TOOL = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"


def sass_of(fn, consts: dict, num_warps: int = 4, num_stages: int = 3, types: dict | None = None) -> dict:
    """``{"ops": SASS instructions in order, "local": spilled bytes}`` of ``fn`` compiled for sm_90."""
    ops, usage, _ = compile_sass(fn, consts, 90, {**POINTERS, **(types or {})}, ALIGNED, num_warps=num_warps,
                                 num_stages=num_stages)
    return {"ops": ops, "local": usage["local"]}


SPLIT_K = dict(K_SPLIT=1408, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, PRECISION="tf32", SPLITS=4,
               HAS_SECOND=True, BLOCK_ROW=2048, FOLD=False, PDL=True)  # Ouro-1.4B down_proj, 4 splits
SILU = dict(K=2048, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, PRECISION="tf32", ACCURATE_EXP=True, PDL=True)
ROPE = dict(K=2048, NUM_Q=16, NUM_KV=16, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, EVEN_K=True,
            PRECISION="tf32", WRITE_KV=True, PDL=True)
PREFETCH = dict(PREFETCH=True, LINE=64, LINES=32)
DENSE = dict(GROUP=1, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, SKIP_SINGLE=True, DOT_PRECISION="tf32")
DECODE = dict(NUM_HEADS=16, GROUP=1, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=32, SPLIT=True,
              LAST_EXITED=True, PRE_RESOLVED=True, DOT_PRECISION="tf32", FOLD=True, BLOCK_S=64, PDL=True)


def main() -> dict:
    out: dict = {}
    if not TOOL.exists():
        return out
    for name, fn, consts in (("split_k", fl._linear_split_k_kernel, SPLIT_K),
                             ("silu_mul", fl._linear_silu_mul_kernel, SILU),
                             ("rope_kv", fl._linear_rope_kv_kernel, ROPE)):
        out[name + "/prefetch"] = sass_of(fn, dict(consts, **PREFETCH), num_stages=4)
        out[name + "/plain"] = sass_of(fn, dict(consts, PREFETCH=False), num_stages=4)
    out["split_k/fold"] = sass_of(fl._linear_split_k_kernel, dict(SPLIT_K, FOLD=True), num_stages=4)
    out["silu_mul/fold"] = sass_of(fl._linear_silu_mul_kernel, dict(SILU, SPLITS=2), num_stages=4)
    out["rope_kv/fold"] = sass_of(fl._linear_rope_kv_kernel, dict(ROPE, SPLITS=4), num_stages=4)
    out["decode/fold"] = sass_of(paged_decode.decode_grouped_kernel, DECODE)
    # the fused projections with X / W through TMA (Tiles.tma) at 64 rows: 64-wide tiles on 8 warps, and 2 K splits
    wide = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, TMA=True, PREFETCH=False)
    for name, fn, consts in (("silu_mul", fl._linear_silu_mul_kernel, SILU), ("rope_kv", fl._linear_rope_kv_kernel, ROPE)):
        out[name + "/tma"] = sass_of(fn, dict(consts, **wide, SPLITS=2), num_warps=8, num_stages=3,
                                     types={"X": "tensordesc<bf16[64,128]>", "W": "tensordesc<bf16[64,128]>"})
    out["split_k/tma"] = sass_of(fl._linear_split_k_kernel, dict(SPLIT_K, TMA=True, PREFETCH=False), num_stages=4,
                                 types={"X": "tensordesc<bf16[16,128]>", "W": "tensordesc<bf16[32,128]>"})
    box = "tensordesc<bf16[128,128]>"  # Ouro's head_dim, the default 128 x 128 prefill tiles
    out["prefill/dense"] = sass_of(dense_prefill.dense_prefill_kernel, DENSE, num_warps=8, num_stages=2,
                                   types={"q_desc": box, "k_desc": box, "v_desc": box})
    # the smallest shape TritonBackend._dense_ready sends it (head_dim 16, a prompt of <= 16 tokens: 16 x 16
    # tiles), bf16 and fp32 ("ieee"); and head_dim 8, which it must not send (tl.dot needs K >= 16 on the GPU)
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        small = f"tensordesc<{dtype}[16,16]>"
        out[f"prefill/dense16-{dtype}"] = sass_of(
            dense_prefill.dense_prefill_kernel, dict(DENSE, HEAD_DIM=16, BLOCK_M=16, BLOCK_N=16, DOT_PRECISION=precision),
            num_warps=4, num_stages=2, types={"q_desc": small, "k_desc": small, "v_desc": small, "out_ptr": f"*{dtype}"})
    tiny = "tensordesc<fp32[16,8]>"
    try:
        sass_of(dense_prefill.dense_prefill_kernel, dict(DENSE, HEAD_DIM=8, BLOCK_M=16, BLOCK_N=16, DOT_PRECISION="ieee"),
                num_warps=4, num_stages=2, types={"q_desc": tiny, "k_desc": tiny, "v_desc": tiny, "out_ptr": "*fp32"})
        out["prefill/dense8-compiles"] = True
    except Exception:  # noqa: BLE001 - Triton's CompilationError (the min-dot-size assertion)
        out["prefill/dense8-compiles"] = False
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
