"""Compile the Triton attention kernels ahead of time for a GPU target, without a GPU, and report
registers, spills (local memory), shared memory and the instructions that matter.

    python benchmarks/triton_aot_report.py [--arch 90] [--out report.json]

Uses Triton's own compiler and the ``cuobjdump`` its wheel ships. Integer arguments that are
multiples of 16 at run time (pointers, the K/V/query/output strides of Ouro's shapes) carry the same
divisibility hint the JIT would give them; without it the loads are not vectorised. Reports, per
variant: ``REG``, ``STACK``/``LOCAL`` (spills), the count of ``HGMMA`` (wgmma), ``HMMA`` (mma.sync),
``LDGSTS`` (cp.async, i.e. software-pipelined loads), 128-bit global loads, and the dynamic shared
memory with whether it fits the 227 KiB a program may use.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/rlt-attention/src"))

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32", "cnt_ptr": "*i32", "bt_ptr": "*i32", "td_ptr": "*i32", "seq_lens_ptr": "*i32", "qdepth_ptr": "*i32",
            "qsl_ptr": "*i32", "slots_ptr": "*i32", "sm_scale_log2": "fp32"}
DIV16 = set(POINTERS) - {"sm_scale_log2"} | {"stride_qn", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
                                              "stride_on"}
OPS = ("HGMMA", "HMMA", "LDGSTS", "LDG.E.128", "LDL", "STL")


def compile_sass(fn, consts: dict, arch: int = 90, types: dict | None = None, aligned: set | None = None,
                 **opts) -> tuple[list[str], dict, object]:
    """``fn`` compiled for ``arch`` without a GPU: (SASS instructions in order, resource usage — regs, stack,
    shared, local —, the compiled kernel; no instructions and no usage where the wheel ships no ``cuobjdump``).
    Arguments typed by ``types`` (default: the attention kernels' pointers), integers otherwise; those in
    ``aligned`` (and every pointer) get the JIT's divisibility-by-16 hint, as run-time multiples of 16 would;
    constexprs left out take their defaults, as at a launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts)
    for p in fn.params:
        if p.is_constexpr and p.name not in consts and p.default is not inspect.Parameter.empty:
            consts[p.name] = p.default
    types = types if types is not None else POINTERS
    aligned = aligned if aligned is not None else DIV16
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n in aligned or sig[n].startswith("*"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=opts)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not tool.exists():  # compiled (the compiler's errors raised above), but no SASS to read
        return [], {}, kernel
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True).stdout
    ops = [line.split(";")[0].split("*/")[-1].strip() for line in sass.splitlines()
           if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    res = dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups()))) if m else {"usage": usage[-300:]}
    return [o for o in ops if o], res, kernel


def compile_one(fn, consts: dict, arch: int, **opts) -> dict:
    consts = dict(consts)
    dtype = consts.pop("_dtype", "bf16")
    types = {**POINTERS, **{n: "*" + dtype for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}}
    ops, res, kernel = compile_sass(fn, consts, arch, types, **opts)
    res.update({op: sum(op in o for o in ops) for op in OPS})
    res["dynamic_shared"] = kernel.metadata.shared
    res["fits_227KiB"] = kernel.metadata.shared <= 227 * 1024
    return res


def variants():
    from rlt.attention.backends.triton_kernels import paged_decode as D, paged_prefill as P, paging

    for pre in (False, True):
        dec = dict(NUM_HEADS=16, GROUP=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64, SPLIT=False,
                   LAST_EXITED=True, PRE_RESOLVED=pre)
        for bn, w in ((32, 4), (64, 2), (64, 4)):
            yield D.decode_kernel, dict(dec, BLOCK_N=bn), dict(num_warps=w, num_stages=2)
        grp = dict(dec, BLOCK_G=16, DOT_PRECISION="tf32")
        yield D.decode_grouped_kernel, grp, dict(num_warps=4, num_stages=2)
        yield D.decode_grouped_kernel, dict(grp, BLOCK_N=32, SPLIT=True), dict(num_warps=4, num_stages=3)
        yield D.decode_grouped_kernel, dict(grp, BLOCK_N=32, SPLIT=True, FOLD=True, BLOCK_S=64), \
            dict(num_warps=4, num_stages=3)
        yield D.decode_grouped_kernel, dict(grp, GROUP=4), dict(num_warps=4, num_stages=3)
        pre_c = dict(GROUP=1, GROUP_PAD=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_Q=128, BLOCK_M=128,
                     BLOCK_N=64, LAST_EXITED=True, SKIP_SINGLE=False, PRE_RESOLVED=pre, DOT_PRECISION="tf32")
        for bm, bn, w, s in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 32, 8, 4), (64, 64, 4, 3),
                             (16, 64, 4, 3)]:
            yield P.prefill_kernel, dict(pre_c, BLOCK_Q=bm, BLOCK_M=bm, BLOCK_N=bn), dict(num_warps=w, num_stages=s)
    fp32 = dict(GROUP=1, GROUP_PAD=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_Q=128, BLOCK_M=128, BLOCK_N=64,
                LAST_EXITED=True, SKIP_SINGLE=False, PRE_RESOLVED=True, DOT_PRECISION="ieee", _dtype="fp32")
    yield P.prefill_kernel, fp32, dict(num_warps=8, num_stages=3)
    yield P.prefill_kernel, dict(fp32, BLOCK_N=128), dict(num_warps=8, num_stages=3)
    yield D.merge_splits_kernel, dict(NUM_HEADS=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64), dict(num_warps=4)
    yield paging.resolve_slots_kernel, dict(BLOCK_SIZE=16, LAST_EXITED=True, BLOCK=1024), dict(num_warps=4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for fn, consts, opts in variants():
        tiles = {k: v for k, v in consts.items()
                 if k.startswith("BLOCK") or k in ("SPLIT", "FOLD", "GROUP", "PRE_RESOLVED", "_dtype")}
        res = compile_one(fn, consts, args.arch, **opts)
        rows.append({"kernel": fn.__name__, "constexprs": tiles, "options": opts, **res})
        print(f"{fn.__name__:22} {json.dumps(tiles)} {json.dumps(opts)} "
              + " ".join(f"{k}={res[k]}" for k in ("regs", "stack", "local", *OPS, "dynamic_shared", "fits_227KiB")
                         if k in res))
    if args.out:
        args.out.write_text(json.dumps({"arch": args.arch, "variants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
