"""Probe: how fast can ONE persistent kernel stream a decode loop's weights at C=1?

Issue 10's C=1 target (300 tok/s on the H200: ~0.80 ms per loop step) is out of reach of the
eight-kernels-a-layer design (1.31 ms per loop step, `docs/decode.md`): each kernel streams at
~4 TB/s but pays a few microseconds at every boundary, and what Triton can express inside one kernel
(ticket folds, L2 prefetch before the PDL wait) measured slower. `gemv_chain.cu` is the other
architecture, reduced to its weight stream: the 24 layers x 4 GEMVs of one Ouro-1.4B loop at one
row (q/k/v, o_proj + residual, gate/up + SiLU*mul, down_proj + residual; no attention, norms or
RoPE) in one persistent launch — a producer lane per SM streams pre-packed 16 KB weight stages with
bulk copies into a shared-memory ring and runs ahead across the grid barriers between phases, so
the memory stream never stops while the consumers wait. This measures that stream against

- the same chain as cuBLAS GEMVs + elementwise kernels in one CUDA graph (the kernel-per-op design),
- the device's read rate (a large reduction over the packed weights),
- the ablation ``NO_RUNAHEAD`` (the producer waits for each phase's barrier: what the run-ahead buys), and
  two timing-only ablations whose outputs are wrong by construction: ``NO_GRID_SYNC`` (no barriers) and
  ``NO_COMPUTE`` with it (the bulk-copy stream alone),
- and with the attention stand-in (``--kv-tiles``: a layer's KV bytes at 1K context streamed like weights
  after q/k/v, plus a barrier): the probe's estimate of a whole persistent loop step at C=1.

It checks the kernel's output against an fp32 torch reference of the same chain (relative error).

    python -m benchmarks.megakernel.probe --out "$OUT/megakernel.json"

The kernel is compiled at run time with NVRTC (the ``libnvrtc`` PyTorch's CUDA wheels ship, or
``--nvrtc PATH``) or ``nvcc`` when NVRTC is not found, for ``sm_90a``, and launched through the CUDA
driver API (ctypes) on PyTorch's current stream. Timings: per variant, the median of three medians of
``--reps`` launches after a warm-up (CUDA events; each launch also zeroes the barrier counter and copies
the input vector: two tiny kernels inside the timed span).

``emulate`` runs the kernel's tile / stage bookkeeping in torch on CPU (tests/rlt-decode/
test_megakernel_probe.py checks it against the reference at small shapes), so a device call spends
its time on the parts only a GPU can check: the bulk copies, the mbarriers and the grid barrier.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import torch

from benchmarks.roofline import timed
from rlt.decode.persistent import cuda
from rlt.decode.persistent.plan import CK, MAX_K, ROWS, STAGE_ELEMS, THREADS, pack_matrix

SOURCE = Path(__file__).with_name("gemv_chain.cu")


# -- the packed layout (must match gemv_chain.cu) ----------------------------------------------
QKV, KV, O_PROJ, GATE_UP, DOWN = range(5)
#: a layer's KV bytes at 1K context (Ouro-1.4B: 1,024 tokens x K and V x 2,048 x bf16 = 8 MiB) in 16 KB stages
KV_TILES_1K = 1024 * 2 * 2048 * 2 // (STAGE_ELEMS * 2)


def phases(hidden: int, inter: int, kv_tiles: int = 0) -> list[dict]:
    """The five phases of a layer (q/k/v, the attention stand-in, o_proj, gate/up, down_proj): input
    width ``k``, tiles, chunks per tile, first stage and first tile (in the layer's numbering)."""
    out, stage, tile = [], 0, 0
    for k, tiles in ((hidden, 3 * hidden // ROWS), (CK, kv_tiles), (hidden, hidden // ROWS),
                     (hidden, 2 * inter // ROWS), (inter, hidden // ROWS)):
        out.append(dict(k=k, tiles=tiles, chunks=k // CK, stage0=stage, tile0=tile))
        stage += tiles * (k // CK)
        tile += tiles
    return out


def layer_stages(hidden: int, inter: int, kv_tiles: int = 0) -> int:
    last = phases(hidden, inter, kv_tiles)[-1]
    return last["stage0"] + last["tiles"] * last["chunks"]


def check_shape(hidden: int, inter: int) -> None:
    if hidden % CK or inter % CK or hidden % ROWS or inter % (ROWS // 2) or inter > MAX_K or hidden > MAX_K:
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of {CK} and at most {MAX_K}")


def pack_layer(wqkv, wo, wg, wu, wd, kv: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's weights in the kernel's order; gate/up tiles: 8 gate rows, then the same 8 up rows;
    ``kv``: the attention stand-in's bytes, ``[kv_tiles * ROWS, CK]``."""
    inter, k = wg.shape
    half = ROWS // 2
    gu = torch.cat([wg.reshape(inter // half, half, k), wu.reshape(inter // half, half, k)], 1).reshape(2 * inter, k)
    parts = [pack_matrix(wqkv)] + ([pack_matrix(kv)] if kv is not None else []) + [pack_matrix(wo), pack_matrix(gu),
                                                                                   pack_matrix(wd)]
    return torch.cat(parts)


def chain(x: torch.Tensor, layers: list) -> torch.Tensor:
    """The chain, op by op in ``x``'s dtype (the weights cast to it): in fp32 the probe's reference; in bf16,
    captured in a CUDA graph, the kernel-per-op design it is timed against (cuBLAS GEMVs + elementwise)."""
    hidden = x.shape[0]
    for ws in layers:
        wqkv, wo, wg, wu, wd = (w.to(x.dtype) for w in ws)
        qkv = wqkv @ x
        x1 = wo @ qkv[:hidden] + x
        x = wd @ (torch.nn.functional.silu(wg @ x1) * (wu @ x1)) + x1
    return x


def reference(x: torch.Tensor, layers: list) -> torch.Tensor:
    """The chain in fp32 (weights as stored, bf16, widened)."""
    return chain(x.float(), layers)


def random_layer(hidden: int, inter: int, device, generator=None) -> list[torch.Tensor]:
    """One layer's random bf16 weights, scaled so that 24 layers without norms stay finite: SiLU*mul makes
    the residual's variance grow quadratically, so o_proj is halved and down_proj scaled by 0.02."""
    return [(torch.randn(n, k, device=device, generator=generator) * (scale * k ** -0.5)).to(torch.bfloat16)
            for (n, k), scale in zip(((3 * hidden, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
                                      (hidden, inter)), (1.0, 0.5, 1.0, 1.0, 0.02))]


def first_tile(tile0: int, cta: int, ctas: int) -> int:
    return (cta - tile0) % ctas


def emulate(packed: torch.Tensor, x: torch.Tensor, hidden: int, inter: int, num_layers: int, ctas: int,
            kv_tiles: int = 0) -> torch.Tensor:
    """The kernel's bookkeeping in torch (fp32): per CTA, its tiles of each phase read from the packed
    stages exactly where the producer would fetch them, with the consumers' epilogues. Every output
    row must be written exactly once per phase (asserted)."""
    table = phases(hidden, inter, kv_tiles)
    per_layer = layer_stages(hidden, inter, kv_tiles)
    w = packed.float().reshape(-1, ROWS, CK)  # [stages, ROWS, CK]
    x = x.float().clone()
    qkv, x1, act, att = torch.zeros(3 * hidden), torch.zeros(hidden), torch.zeros(inter), torch.zeros(kv_tiles * ROWS)
    for layer in range(num_layers):
        for p, ph in enumerate(table):
            vin = (x, qkv, qkv, x1, act)[p][: ph["k"]].clone()
            written = torch.zeros(ph["tiles"], dtype=torch.int64)
            for cta in range(ctas):
                for t in range(first_tile(ph["tile0"], cta, ctas), ph["tiles"], ctas):
                    first = layer * per_layer + ph["stage0"] + t * ph["chunks"]
                    stages = w[first: first + ph["chunks"]]  # [chunks, ROWS, CK]
                    v = torch.einsum("crk,ck->r", stages, vin.reshape(ph["chunks"], CK))
                    rows = t * ROWS + torch.arange(ROWS)
                    if p == QKV:
                        qkv[rows] = v
                    elif p == KV:
                        att[rows] = v
                    elif p == O_PROJ:
                        x1[rows] = v + x[rows]
                    elif p == DOWN:
                        x[rows] = v + x1[rows]
                    else:
                        g, u = v[: ROWS // 2], v[ROWS // 2:]
                        act[t * (ROWS // 2) + torch.arange(ROWS // 2)] = torch.nn.functional.silu(g) * u
                    written[t] += 1
            assert bool((written == 1).all()), f"phase {p}: tiles written {written.tolist()}"
    return x


def shared_bytes(stages: int) -> int:
    return stages * STAGE_ELEMS * 2 + MAX_K * 4 + ROWS * 4 + stages * 16 + 8


# -- compile and launch (rlt.decode.persistent.cuda) ---------------------------------------------------
def build(defines: dict[str, int], nvrtc: str = "") -> bytes:
    return cuda.build(SOURCE, defines, nvrtc)


class Kernel(cuda.Kernel):
    """``gemv_chain``."""

    def __init__(self, cubin: bytes, smem: int) -> None:
        super().__init__(cubin, smem, "gemv_chain")

    def __call__(self, ctas: int, packed, x, qkv, x1, act, att, counter, hidden: int, inter: int, kv_tiles: int,
                 layers: int) -> None:
        args = [ctypes.c_void_p(t.data_ptr()) for t in (packed, x, qkv, x1, act, att, counter)]
        args += [ctypes.c_int(hidden), ctypes.c_int(inter), ctypes.c_int(kv_tiles), ctypes.c_int(layers)]
        self.launch(ctas, THREADS, args)


def med3(fn, reps: int) -> list[float]:
    """Three medians (ms) of ``reps`` timed calls each, after one discarded warm-up call."""
    fn()
    torch.cuda.synchronize()
    return [statistics.median(timed(fn, torch.device("cuda"), reps)) * 1e3 for _ in range(3)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)  # Ouro-1.4B
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--stages", default="12,8", help="ring depths to time (16 KB stages)")
    p.add_argument("--kv-tiles", type=int, default=KV_TILES_1K,
                   help="the attention stand-in's 16 KB stages per layer (default: 1K context's KV; 0: none)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--nvrtc", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    check_shape(a.hidden, a.inter)
    H, I, L = a.hidden, a.inter, a.layers
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers, packed, packed_kv = [], [], []
    for _ in range(L):
        ws = random_layer(H, I, dev)
        layers.append(ws)
        packed.append(pack_layer(*ws))
        kv = torch.randn(a.kv_tiles * ROWS, CK, device=dev, dtype=torch.bfloat16) * CK ** -0.5
        packed_kv.append(pack_layer(*ws, kv=kv))
    packed = torch.cat(packed).view(torch.int16)
    packed_kv = torch.cat(packed_kv).view(torch.int16)
    weight_bytes = packed.numel() * 2
    x0 = torch.randn(H, device=dev)
    ref = reference(x0, layers)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms, "hidden": H,
              "inter": I, "layers": L, "weight_bytes": weight_bytes, "kv_tiles": a.kv_tiles,
              "kv_bytes": packed_kv.numel() * 2 - weight_bytes, "variants": {}}

    # the device's read rate over the same bytes (a reduction: ~no writes)
    flat = packed.view(torch.float16)
    rd = med3(lambda: flat.sum(dtype=torch.float32), a.reps)
    result["read_tbps"] = weight_bytes / statistics.median(rd) / 1e9
    print(f"read rate (sum over the packed weights): {result['read_tbps']:.2f} TB/s", flush=True)

    # the kernel-per-op chain in one CUDA graph (cuBLAS GEMVs at one row + elementwise kernels)
    static = x0.to(torch.bfloat16)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(static, layers)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = chain(static, layers)
    ms = med3(graph.replay, a.reps)
    err = ((out_graph.float() - ref).abs().max() / ref.abs().max()).item()
    result["variants"]["cublas_graph"] = {"ms": ms, "tbps": weight_bytes / statistics.median(ms) / 1e9, "rel_err": err}
    print(f"cuBLAS + elementwise, one graph: {statistics.median(ms):.3f} ms "
          f"({result['variants']['cublas_graph']['tbps']:.2f} TB/s), rel err {err:.2e} (bf16 activations)", flush=True)

    bufs = dict(x=torch.empty(H, device=dev), qkv=torch.empty(3 * H, device=dev), x1=torch.empty(H, device=dev),
                act=torch.empty(I, device=dev), att=torch.empty(max(1, a.kv_tiles) * ROWS, device=dev),
                counter=torch.zeros(1, dtype=torch.int32, device=dev))
    stages = [int(n) for n in a.stages.split(",")]
    # (name, compile-time defines, with the attention stand-in); CTAs per SM = MIN_BLOCKS
    variants = [(f"persistent_s{n}", {"NSTAGES": n}, False) for n in stages]
    variants.append((f"no_runahead_s{stages[0]}", {"NSTAGES": stages[0], "NO_RUNAHEAD": 1}, False))
    variants.append((f"backoff_s{stages[0]}", {"NSTAGES": stages[0], "BACKOFF_NS": 256}, False))
    variants.append(("two_per_sm_s5", {"NSTAGES": 5, "MIN_BLOCKS": 2}, False))
    # timing ablations (their outputs are wrong by construction): without the grid barriers, and without
    # the consumers' arithmetic as well (the bulk-copy stream alone)
    variants.append((f"ablation_no_grid_sync_s{stages[0]}", {"NSTAGES": stages[0], "NO_GRID_SYNC": 1}, False))
    variants.append((f"ablation_stream_only_s{stages[0]}", {"NSTAGES": stages[0], "NO_GRID_SYNC": 1, "NO_COMPUTE": 1},
                     False))
    if a.kv_tiles:
        variants.append((f"persistent_s{stages[0]}_kv", {"NSTAGES": stages[0]}, True))
    kernels: dict[tuple, Kernel] = {}
    for name, defines, with_kv in variants:
        key = tuple(sorted(defines.items()))
        try:
            if key not in kernels:
                kernels[key] = Kernel(build(defines, a.nvrtc), shared_bytes(defines["NSTAGES"]))
        except RuntimeError as exc:
            result["variants"][name] = {"error": str(exc)[-2000:]}
            print(f"{name}: {exc}", flush=True)
            continue
        kern = kernels[key]
        ctas = sms * defines.get("MIN_BLOCKS", 1)
        weights, kv_tiles = (packed_kv, a.kv_tiles) if with_kv else (packed, 0)
        def run():
            bufs["counter"].zero_()
            bufs["x"].copy_(x0)
            kern(ctas, weights, bufs["x"], bufs["qkv"], bufs["x1"], bufs["act"], bufs["att"], bufs["counter"],
                 H, I, kv_tiles, L)
        run()
        torch.cuda.synchronize()
        err = ((bufs["x"] - ref).abs().max() / ref.abs().max()).item()
        ms = med3(run, a.reps)
        nbytes = weights.numel() * 2
        tb = nbytes / statistics.median(ms) / 1e9
        result["variants"][name] = {"ms": ms, "tbps": tb, "bytes": nbytes, "rel_err": err, "regs": kern.regs,
                                    "shared_bytes": kern.smem, "ctas": ctas, "barriers": L * (5 if with_kv else 4)}
        print(f"{name}: {statistics.median(ms):.3f} ms ({tb:.2f} TB/s over {nbytes / 1e9:.2f} GB), rel err {err:.2e}, "
              f"{kern.regs} regs", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
