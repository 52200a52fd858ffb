"""Sweep of the Triton paged-prefill kernel's variants (``PrefillTiles`` switches and tile shapes) on
Ouro-1.4B attention shapes: check each against the torch reference, time it, pick the best.

    python benchmarks/prefill_kernel_sweep.py --out $OUT/prefill_kernel_sweep.json     # H200, ~5 min
    python benchmarks/prefill_kernel_sweep.py --cpu-smoke                               # logic only

Problem (as ``benchmarks/attention_bench.py``'s prefill case): one causal prompt of N tokens, MHA
16 heads x 128, bf16, paged KV with 16-token pages, LAST_EXITED with 4 planes and the row at depth 3
over full-depth history (every key through the depth indirection). FLOPs = 4 * heads * head_dim *
N(N+1)/2. The matmul rate is measured in the same run (8192^3 bf16, ``torch.matmul``); each time
is the median of three ``triton.testing.do_bench`` medians after a discarded warm-up call.

Every variant runs at 8K: rel. error against the torch reference (must be < 1e-2, bf16), time,
TFLOP/s, % of the matmul rate, and what the compiled kernel is (registers, spills, shared memory,
and whether ptxas serialised its wgmma: C7515, read from ``ptxas -v`` on the kernel's PTX when the
Triton wheel's ptxas is present). The six fastest exact variants, the default and the old kernel also run at 2K
and 32K (32K is checked against the default kernel's output: the dense reference needs 64 GiB).
The best is the fastest exact variant at 8K; the table is printed last, with the ``PrefillTiles``
literal to make it the default (``TritonBackend.prefill_tiles``).

``--cpu-smoke`` runs the same code under Triton's interpreter on tiny shapes (timings meaningless):
it proves the script runs before it is spent on a device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--cpu-smoke" in sys.argv:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
for sub in ("packages/rlt-attention/src", "packages/rlt-platform/src"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

import attrs  # noqa: E402
import torch  # noqa: E402

from rlt.attention.backends.triton_backend import PrefillTiles, TritonBackend  # noqa: E402

BEST_FLAGS = dict(heads_fastest=True, one_loop=True, fma_scale=True, dot_acc=True, lazy_rescale=True)


#: every switch off: the kernel as it was before the switches (two key loops)
OLD = dict(heads_fastest=False, one_loop=False, k_natural=False, fma_scale=False, dot_acc=False, lazy_rescale=False)


def variants() -> list[tuple[str, PrefillTiles]]:
    """(name, tiles): the backend's current default, the old kernel, each switch alone on the old
    kernel, combinations, then tile shapes with the combined switches."""
    out = [("default", PrefillTiles()), ("old (no switches)", PrefillTiles(**OLD))]
    for flag in ("heads_fastest", "one_loop", "k_natural", "fma_scale", "dot_acc", "lazy_rescale"):
        out.append((flag, PrefillTiles(**dict(OLD, **{flag: True}))))
    combos = {
        "one+hf": dict(one_loop=True, heads_fastest=True),
        "one+hf+fma+acc": dict(one_loop=True, heads_fastest=True, fma_scale=True, dot_acc=True),
        "one+hf+fma+acc+lazy": BEST_FLAGS,
        "one+hf+fma+acc+lazy+knat": dict(BEST_FLAGS, k_natural=True),
        "hf+fma+acc+lazy (two loops)": dict(heads_fastest=True, fma_scale=True, dot_acc=True, lazy_rescale=True),
    }
    out += [(name, PrefillTiles(**dict(OLD, **flags))) for name, flags in combos.items()]
    for bm, bn, w, s in ((128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3),
                         (64, 128, 4, 2), (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4)):
        out.append((f"all {bm}x{bn} w{w} s{s}", PrefillTiles(bm, bn, w, s, **dict(OLD, **BEST_FLAGS))))
    out.append(("one+hf+fma+acc 128x64 w8 s3",
                PrefillTiles(128, 64, 8, 3, **dict(OLD, one_loop=True, heads_fastest=True, fma_scale=True,
                                                   dot_acc=True))))
    return out


class Capture:
    """Stands in for ``paged_prefill.prefill_kernel`` and keeps the compiled kernel of the last launch."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.last = None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.last = launch(*args, **kwargs)
            return self.last

        return run


def kernel_facts(compiled) -> dict:
    """Registers, spills, shared memory of a compiled kernel, and whether ptxas serialised its wgmma."""
    if compiled is None or not hasattr(compiled, "asm"):
        return {}
    facts = {"regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
             "shared": getattr(getattr(compiled, "metadata", None), "shared", None)}
    import triton

    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    try:
        ptx = compiled.asm["ptx"]
    except (KeyError, TypeError):
        ptx = None
    if ptx and ptxas.exists() and ".target " in ptx:
        arch = ptx.split(".target ")[1].split()[0].rstrip(",")
        try:
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "k.ptx"
                src.write_text(ptx)
                r = subprocess.run([str(ptxas), "-v", "--gpu-name", arch, str(src), "-o", str(Path(tmp) / "k.cubin")],
                                   capture_output=True, text=True, timeout=120)
            facts["wgmma_serialized"] = "C7515" in (r.stdout + r.stderr)
        except (OSError, subprocess.SubprocessError) as exc:
            facts["ptxas_error"] = repr(exc)[:200]
    return facts


class Bench:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.heads, self.head_dim, self.block = (2, 16, 4) if smoke else (16, 128, 16)

    def problem(self, n: int):
        from rlt.attention.synthetic import random_problem

        return random_problem([(n, n, 3)], num_heads=self.heads, num_kv_heads=self.heads, head_dim=self.head_dim,
                              block_size=self.block, num_planes=4, dtype=torch.bfloat16, device=self.device,
                              history="full", spare_blocks=0, seed=n)

    def flops(self, n: int) -> float:
        return 4.0 * self.heads * self.head_dim * n * (n + 1) / 2

    def time_ms(self, fn) -> list[float]:
        fn()
        if self.smoke:
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t) * 1e3)
            return runs
        import triton.testing as tt

        torch.cuda.synchronize()
        return [tt.do_bench(fn, warmup=10, rep=60, return_mode="median") for _ in range(3)]

    def matmul_rate(self) -> float:
        m = 256 if self.smoke else 8192
        a = torch.randn(m, m, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=self.device, dtype=torch.bfloat16)
        rate = 2 * m ** 3 / (statistics.median(self.time_ms(lambda: a @ b)) * 1e-3)
        del a, b
        return rate


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "prefill_kernel_sweep.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (logic only)")
    ap.add_argument("--sizes", default=None, help="main,extra,... prompt lengths (default 8192,2048,32768)")
    ap.add_argument("--top", type=int, default=6, help="variants (besides the default) also run at the other sizes")
    ap.add_argument("--tolerance", type=float, default=1e-2, help="rel. error bound (bf16)")
    ap.add_argument("--limit", type=int, default=None,
                    help="run only the first N variants (the default and the old kernel come first)")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("prefill_kernel_sweep: no GPU visible to torch here (use --cpu-smoke to check the logic)")
        return 0
    if args.cpu_smoke:  # the interpreter fixes of the CPU kernel tests (loading the conftest applies them)
        import importlib.util

        spec = importlib.util.spec_from_file_location("_rlt_attention_conftest",
                                                      ROOT / "tests/rlt-attention/conftest.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    from rlt.attention.backends.torch_ref import TorchReferenceBackend
    from rlt.attention.backends.triton_kernels import paged_prefill

    bench = Bench(args.cpu_smoke)
    sizes = [int(s) for s in (args.sizes or ("48,16,80" if args.cpu_smoke else "8192,2048,32768")).split(",")]
    main_n, extra = sizes[0], sizes[1:]
    cand = variants()[:args.limit]
    if args.cpu_smoke:  # interpreter: small tiles, a few variants
        cand = [(name, attrs.evolve(t, block_m=16, block_n=16)) for name, t in cand[:2] + cand[8:11]]
    t0 = time.time()
    rate = bench.matmul_rate()
    capture = Capture(paged_prefill.prefill_kernel)
    paged_prefill.prefill_kernel = capture
    results: dict[str, dict] = {name: {"name": name, "tiles": repr(t)} for name, t in cand}
    tiles = dict(cand)
    ref = TorchReferenceBackend()

    def run_size(n: int, names: list[str], check_against: str) -> None:
        pb = bench.problem(n)
        fwd = lambda be: be.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)  # noqa: E731
        if check_against == "reference":
            want = fwd(ref).float()
        else:
            want = fwd(TritonBackend(prefill_tiles=tiles["default"])).float()
        for name in names:
            row = results[name]
            try:
                backend = TritonBackend(prefill_tiles=tiles[name])
                capture.last = None
                err = rel_err(fwd(backend), want)
                facts = kernel_facts(capture.last) if n == main_n else {}
                ms = bench.time_ms(lambda: fwd(backend))
                med = statistics.median(ms)
                row[n] = {"ms": med, "times_ms": ms, "tflops": bench.flops(n) / med / 1e9,
                          "of_matmul": bench.flops(n) / (med * 1e-3) / rate, "rel_err": err,
                          "checked_against": check_against, "exact": err < args.tolerance, **facts}
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile/launch is a result
                row[n] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"  {n:6d} {name:32} " + (f"{row[n]['ms']:8.3f} ms {row[n]['of_matmul']:6.1%} err "
                                           f"{row[n]['rel_err']:.1e}" if "ms" in row[n] else row[n]["error"][:120]),
                  flush=True)
        del pb, want
        if not bench.smoke:
            torch.cuda.empty_cache()

    print(f"matmul rate {rate / 1e12:.1f} TFLOP/s; {len(cand)} variants at {main_n}", flush=True)
    run_size(main_n, [name for name, _ in cand], "reference")
    ok = [r for r in results.values() if r.get(main_n, {}).get("exact")]
    ranked = sorted(ok, key=lambda r: r[main_n]["ms"])
    fixed = ["default", "old (no switches)"]
    others = [r["name"] for r in ranked if r["name"] not in fixed][:args.top]
    for n in extra:
        run_size(n, [*fixed, *others], "reference" if n <= 8192 else "default")

    sdpa = None
    if not bench.smoke:
        import torch.nn.functional as F

        q, k, v = (torch.randn(1, bench.heads, main_n, bench.head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        ms = statistics.median(bench.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        sdpa = {"ms": ms, "of_matmul": bench.flops(main_n) / (ms * 1e-3) / rate}
        del q, k, v
    best = ranked[0] if ranked else None
    report = {"device": torch.cuda.get_device_name(0) if not bench.smoke else "cpu (interpreter)",
              "torch": torch.__version__, "matmul_flops_per_s": rate, "sizes": sizes,
              "shape": {"heads": bench.heads, "head_dim": bench.head_dim, "block_size": bench.block,
                        "layout": "last_exited, 4 planes, depth 3, full-depth history", "dtype": "bfloat16"},
              "sdpa_dense_causal": sdpa, "variants": list(results.values()),
              "best": None if best is None else best["name"], "best_tiles": None if best is None else best["tiles"],
              "seconds": time.time() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))

    print(f"\nmatmul {rate / 1e12:.0f} TFLOP/s" + (f"; torch SDPA dense causal {main_n}: {sdpa['ms']:.3f} ms "
                                                 f"({sdpa['of_matmul']:.1%})" if sdpa else ""))
    head = f"{'variant':32} {'ms':>8} {'TFLOP/s':>8} {'%mm':>6} {'err':>8} {'regs':>4} {'spill':>5} {'ser':>3}"
    head += "".join(f" {'ms@' + str(n):>9} {'%mm':>6}" for n in extra)
    print(head)
    for r in sorted(results.values(), key=lambda r: r.get(main_n, {}).get("ms", float("inf"))):
        m = r.get(main_n, {})
        if "ms" not in m:
            print(f"{r['name']:32} {m.get('error', 'not run')[:90]}")
            continue
        line = (f"{r['name']:32} {m['ms']:8.3f} {m['tflops']:8.1f} {m['of_matmul']:6.1%} {m['rel_err']:8.1e} "
                f"{str(m.get('regs', '-')):>4} {str(m.get('spills', '-')):>5} "
                f"{'Y' if m.get('wgmma_serialized') else ('n' if 'wgmma_serialized' in m else '-'):>3}")
        for n in extra:
            e = r.get(n, {})
            line += f" {e['ms']:9.3f} {e['of_matmul']:6.1%}" if "ms" in e else f" {'-':>9} {'-':>6}"
        print(line + ("" if m["exact"] else "  NOT EXACT"))
    if best is None:
        print("no exact variant")
        return 1
    b = best[main_n]
    d = results["default"].get(main_n, {})
    o = results["old (no switches)"].get(main_n, {})
    print(f"\nBEST at {main_n}: {best['name']}: {b['ms']:.3f} ms, {b['of_matmul']:.1%} of the matmul rate "
          f"(target 60%: {'met' if b['of_matmul'] >= 0.60 else 'missed'}); default {d.get('ms', float('nan')):.3f} ms "
          f"({d.get('of_matmul', float('nan')):.1%}); old kernel {o.get('ms', float('nan')):.3f} ms "
          f"({o.get('of_matmul', float('nan')):.1%})")
    print(f"make it the default: TritonBackend(prefill_tiles={best['tiles']})")
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
