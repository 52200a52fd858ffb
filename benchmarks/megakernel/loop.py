"""Probe: one whole Ouro loop step at one row in ONE persistent kernel (``loop_kernel.cu``).

Issue 10's C=1 target (300 tok/s on the H200: ~0.80 ms a loop step) is out of reach of the
eight-kernels-a-layer design (1.31 ms a loop step, ``docs/decode.md``); ``probe.py`` measured the
persistent design on the weight stream alone (1.08 ms against 1.40 on an H100, 1.20 with the KV bytes
of an attention stand-in). This probe is the same design with nothing stood in for: norms, RoPE, the
paged per-depth KV store and attention, the exit-free loop of ``OuroModel.recurrent`` at one decode row,
with the kernel-per-op path's rounding points. On a GPU it

- checks the kernel against ``OuroModel.recurrent`` (Triton backend, bf16) and both against an fp32
  copy of the model (the oracle's arithmetic): the loop output's relative error, and the K/V rows each
  stores at the token's slot;
- times one loop step both ways, back to back: ``recurrent`` replayed in a CUDA graph (what rlt-decode's
  graph runs per loop at C=1, less the exit gate) against the kernel (a counter reset + one launch).

    python -m benchmarks.megakernel.loop --out "$OUT/loop.json"

:func:`emulate` runs the kernel's bookkeeping in torch — packed stages read tile by tile as the CTAs
deal them, the attention items' context splits and their merge, the residual buffers, every rounding
point (or none, in fp32) — so CPU tests (``tests/rlt-decode/test_megakernel_loop.py``) check the kernel's
plan against ``OuroModel.recurrent`` at tiny shapes, and a device call spends its time on what only a
GPU checks. Not an engine path: rlt-decode runs the kernel-per-op graph; this measures the alternative.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
from pathlib import Path

import attrs
import torch

from benchmarks.megakernel import probe
from benchmarks.megakernel.probe import CK, CONSUMERS, MAX_K, ROWS, STAGE_ELEMS, pack_matrix

SOURCE = Path(__file__).with_name("loop_kernel.cu")
HEAD_DIM = 128
CONSUMER_WARPS = CONSUMERS // 32
THREADS = 32 + CONSUMERS
NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
QKV, O, GU, DOWN = range(4)


def check_model(model) -> None:
    """The shapes the kernel serves (a clear error otherwise)."""
    cfg = model.cfg
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    why = []
    if d != HEAD_DIM:
        why.append(f"head_dim {d} != {HEAD_DIM}")
    if nq * d != h:
        why.append(f"heads x head_dim {nq * d} != hidden {h}")
    if h % CK or i % CK or max(h, i) > MAX_K:
        why.append(f"hidden {h} / intermediate {i} must be multiples of {CK}, at most {MAX_K}")
    if nq % nkv:
        why.append(f"{nq} q heads over {nkv} kv heads")
    if why:
        raise ValueError("loop kernel: " + "; ".join(why))


def phases(model) -> list[dict]:
    """The GEMV phases of a layer (q/k/v, o_proj, gate/up, down_proj): input width, tiles, chunks per
    tile, first stage and first tile in the layer's numbering (``loop_kernel.cu``'s ``phase_table``)."""
    cfg = model.cfg
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    out, stage, tile = [], 0, 0
    for k, tiles in ((h, qkv_rows // ROWS), (h, h // ROWS), (h, 2 * i // ROWS), (i, h // ROWS)):
        out.append(dict(k=k, tiles=tiles, chunks=k // CK, stage0=stage, tile0=tile))
        stage += tiles * (k // CK)
        tile += tiles
    return out


@attrs.frozen(eq=False)
class LoopWeights:
    """A model's loop weights in the kernel's layout: GEMV stages (all layers) and norms ``[L, 4, H]``."""

    packed: torch.Tensor  # int16 view of bf16 stages
    norms: torch.Tensor  # bf16 [L, 4, H] in NORMS order
    final_norm: torch.Tensor  # bf16 [H]
    per_layer: int  # stages per layer


def pack(model) -> LoopWeights:
    check_model(model)
    parts, norms = [], []
    for layer in model.layers:
        inter = layer.gate_up.shape[0] // 2
        g, u = layer.gate_up[:inter], layer.gate_up[inter:]
        half, k = ROWS // 2, g.shape[1]
        gu = torch.cat([g.reshape(inter // half, half, k), u.reshape(inter // half, half, k)], 1).reshape(2 * inter, k)
        parts += [pack_matrix(layer.qkv), pack_matrix(layer.o), pack_matrix(gu), pack_matrix(layer.down)]
        norms.append(torch.stack([layer.norms[n] for n in NORMS]))
    table = phases(model)
    per_layer = table[-1]["stage0"] + table[-1]["tiles"] * table[-1]["chunks"]
    packed = torch.cat(parts)
    assert packed.numel() == per_layer * STAGE_ELEMS * len(model.layers)
    return LoopWeights(packed.view(torch.int16) if packed.dtype == torch.bfloat16 else packed,
                       torch.stack(norms).contiguous(), model.norm.contiguous(), per_layer)


def splits_for(num_heads: int, ctas: int) -> int:
    """Context splits per q head: as many attention items as CTAs allow (at least one per head)."""
    return max(1, ctas // num_heads)


def _first_tile(tile0: int, cta: int, ctas: int) -> int:
    return (cta - tile0) % ctas


def emulate(model, lw: LoopWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slots: torch.Tensor, write_slot: int, seq_len: int, ctas: int,
            rounding: bool = True, trace: list | None = None) -> torch.Tensor:
    """The kernel's plan in torch (fp32 arithmetic; ``rounding``: bf16 at the kernel's rounding points).

    ``k_cache`` / ``v_cache``: ``[layers, slots, nkv, d]`` views (the new token's K/V are stored there, as
    the kernel does); ``slots``: the row's depth-resolved flat key slots. Returns the loop output ``[H]``.
    Every tile of every phase is computed exactly once from the packed stages (asserted). ``trace``: a list that
    gets each layer's intermediates (a dict of vectors: qkv, o, o_out, act, down)."""
    cfg = model.cfg
    H, D, nq, nkv, eps = cfg.hidden_size, HEAD_DIM, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    r = (lambda t: t.to(torch.bfloat16).float()) if rounding else (lambda t: t)
    table = phases(model)
    w = lw.packed.view(torch.bfloat16).float().reshape(-1, ROWS, CK) if lw.packed.dtype == torch.int16 else \
        lw.packed.float().reshape(-1, ROWS, CK)
    norms, final = lw.norms.float(), lw.final_norm.float()
    cos, sin = cos.float().reshape(-1), sin.float().reshape(-1)

    def gemv(layer: int, p: int, xin: torch.Tensor) -> torch.Tensor:
        ph = table[p]
        out = torch.zeros(ph["tiles"] * ROWS)
        written = torch.zeros(ph["tiles"], dtype=torch.int64)
        for cta in range(ctas):
            for t in range(_first_tile(ph["tile0"], cta, ctas), ph["tiles"], ctas):
                first = layer * lw.per_layer + ph["stage0"] + t * ph["chunks"]
                out[t * ROWS:(t + 1) * ROWS] = torch.einsum("crk,ck->r", w[first:first + ph["chunks"]],
                                                            xin[:ph["k"]].reshape(ph["chunks"], CK))
                written[t] += 1
        assert bool((written == 1).all()), f"phase {p}: tiles written {written.tolist()}"
        return r(out)

    def rms(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return r(wt * r(x * torch.rsqrt((x * x).mean() + eps)))

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = D // 2
        x1, x2 = x[:half], x[half:]
        return torch.cat([r(r(x1 * cos[:half]) + r(-x2 * sin[:half])), r(r(x2 * cos[half:]) + r(x1 * sin[half:]))])

    S, group, ctx = splits_for(nq, ctas), nq // nkv, seq_len - 1
    scale_log2 = D ** -0.5 * math.log2(math.e)
    h = hidden.float().clone()
    a = rms(h, norms[0, 0])
    down = None
    for layer in range(len(model.layers)):
        if layer:
            h = r(h + rms(down, norms[layer - 1, 3]))
            a = rms(h, norms[layer, 0])
        qkv = gemv(layer, QKV, a)
        o = torch.zeros(H)
        for head in range(nq):  # the attention items of this head: (m, l, acc) per split, then merged
            kvh = head // group
            q = rope(qkv[head * D:(head + 1) * D]) * scale_log2
            knew = rope(qkv[(nq + kvh) * D:(nq + kvh + 1) * D])
            vnew = qkv[(nq + nkv + kvh) * D:(nq + nkv + kvh + 1) * D]
            if head % group == 0 and write_slot >= 0:
                k_cache[layer, write_slot, kvh] = knew.to(k_cache.dtype)
                v_cache[layer, write_slot, kvh] = vnew.to(v_cache.dtype)
            per = -(-ctx // S)
            parts = []
            for split in range(S):
                p0 = min(ctx, split * per)
                p1 = min(ctx, p0 + per)
                keys = k_cache[layer, slots[p0:p1].long(), kvh].float()
                vals = v_cache[layer, slots[p0:p1].long(), kvh].float()
                if split == S - 1:
                    keys, vals = torch.cat([keys, knew[None]]), torch.cat([vals, vnew[None]])
                if keys.shape[0] == 0:
                    parts.append((torch.tensor(-1.0e30), torch.tensor(0.0), torch.zeros(D)))
                    continue
                s = keys @ q
                m = s.max()
                p = torch.exp2(s - m)
                parts.append((m, p.sum(), p @ vals))
            m = torch.stack([pt[0] for pt in parts]).max()
            sc = [torch.exp2(pt[0] - m) for pt in parts]
            l = sum(c * pt[1] for c, pt in zip(sc, parts))
            o[head * D:(head + 1) * D] = r(sum(c * pt[2] for c, pt in zip(sc, parts)) / l)
        o_out = gemv(layer, O, o)
        h = r(h + rms(o_out, norms[layer, 1]))
        m_in = rms(h, norms[layer, 2])
        gu = gemv(layer, GU, m_in).reshape(-1, 2, ROWS // 2)  # per tile: 8 gate rows, then the 8 up rows
        g, u = gu[:, 0].reshape(-1), gu[:, 1].reshape(-1)
        act = r(r(g / (1 + torch.exp(-g))) * u)
        down = gemv(layer, DOWN, act)
        if trace is not None:
            trace.append(dict(qkv=qkv, o=o, o_out=o_out, act=act, down=down))
    h = r(h + rms(down, norms[-1, 3]))
    return rms(h, final)


class LoopArgs(ctypes.Structure):
    """``loop_kernel.cu``'s ``LoopArgs``, field for field."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("w", "norms", "final_norm", "hidden_in", "out", "cos", "sin", "k_cache",
                                               "v_cache")] + [("layer_stride", ctypes.c_longlong)] + \
               [(n, ctypes.c_void_p) for n in ("slots", "write_slot", "seq_len", "qkv", "part", "o_out", "hres", "act",
                                               "down", "counter")] + \
               [(n, ctypes.c_int) for n in ("hidden", "inter", "layers", "nq", "nkv", "splits")] + \
               [("eps", ctypes.c_float), ("scale_log2", ctypes.c_float)]


def shared_bytes(stages: int) -> int:
    return stages * STAGE_ELEMS * 2 + (MAX_K + ROWS + CONSUMER_WARPS) * 4 + stages * 16


class LoopKernel:
    """The compiled kernel with its scratch buffers, for one model and one KV cache (CUDA)."""

    def __init__(self, model, lw: LoopWeights, ctas: int, stages: int = 12, nvrtc: str = "") -> None:
        cfg = model.cfg
        self.model, self.lw, self.ctas = model, lw, ctas
        self.kernel = probe.Kernel(probe.build({"NSTAGES": stages}, nvrtc, source=SOURCE), shared_bytes(stages),
                                   name="ouro_loop")
        dev = lw.packed.device
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.splits = splits_for(nq, ctas)
        f = lambda n: torch.zeros(n, device=dev)
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.bufs = dict(qkv=f((nq + 2 * nkv) * HEAD_DIM), part=f(nq * self.splits * (HEAD_DIM + 2)), o_out=f(H),
                         hres=f(2 * H), act=f(I), down=f(H), counter=torch.zeros(1, dtype=torch.int32, device=dev))

    def __call__(self, hidden, out, cos, sin, k_cache, v_cache, slots, write_slot, seq_len) -> None:
        """One loop step: ``hidden`` / ``out`` ``[H]`` bf16; cos / sin ``[HEAD_DIM]``; the caches ``[L, blocks,
        block_size, nkv, d]``; ``slots`` int32 resolved key slots; ``write_slot`` int64 ``[1]``; ``seq_len``
        int32 ``[1]`` (device tensors, so a graph can replay the launch)."""
        cfg, b = self.model.cfg, self.bufs
        assert k_cache.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16 and slots.dtype == torch.int32
        b["counter"].zero_()
        p = lambda t: ctypes.c_void_p(t.data_ptr())
        args = LoopArgs(p(self.lw.packed), p(self.lw.norms), p(self.lw.final_norm), p(hidden), p(out), p(cos), p(sin),
                        p(k_cache), p(v_cache), k_cache.stride(0), p(slots), p(write_slot), p(seq_len), p(b["qkv"]),
                        p(b["part"]), p(b["o_out"]), p(b["hres"]), p(b["act"]), p(b["down"]), p(b["counter"]),
                        cfg.hidden_size, cfg.intermediate_size, len(self.model.layers), cfg.num_attention_heads,
                        cfg.num_key_value_heads, self.splits, cfg.rms_norm_eps, HEAD_DIM ** -0.5 * math.log2(math.e))
        self.kernel.launch(self.ctas, THREADS, [args])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> None:
    from benchmarks.bench_model import NAMED_CONFIGS, random_weights
    from rlt.attention import AttentionMetadata, KVCache, KVLayout
    from rlt.attention.backends.triton_backend import TritonBackend
    from rlt.platform.checkpoint.tiny import tiny_config
    from rlt.platform.models import MODEL_FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ouro-1.4b")
    ap.add_argument("--context", type=int, default=1024, help="context length including the new token")
    ap.add_argument("--stages", default="12,10")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--nvrtc", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    family, fields = NAMED_CONFIGS[a.model]
    cfg = MODEL_FAMILIES[family].parse_config(tiny_config(family, **fields))
    weights = random_weights(family, cfg, seed=0, gate_bias=0.0, dtype=torch.bfloat16, device=dev)
    model = MODEL_FAMILIES[family].build_runtime(cfg, weights)
    L, nkv, D, bs, planes, depth = cfg.num_hidden_layers, cfg.num_key_value_heads, HEAD_DIM, 16, 4, 1
    pages = -(-a.context // bs)
    kv = KVCache.allocate(num_layers=L, num_blocks=pages * planes, block_size=bs, num_kv_heads=nkv, head_dim=D,
                          num_planes=planes, layout=KVLayout.LAST_EXITED, dtype=torch.bfloat16, device=dev)
    kv.k.normal_()
    kv.v.normal_()
    kv.token_depth.fill_(planes - 1)
    bt = torch.randperm(pages * planes, device=dev).to(torch.int32).view(1, planes, pages)
    pos = a.context - 1
    slot = (bt[0, depth, pos // bs].long() * bs + pos % bs).view(1)
    seq = torch.full((1,), a.context, device=dev, dtype=torch.int32)
    qd = torch.full((1,), depth, device=dev, dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 1], device=dev, dtype=torch.int32), seq_lens=seq,
                             query_depth=qd, block_tables=bt, slot_mapping=slot,
                             plane0_slot_mapping=(bt[0, 0, pos // bs].long() * bs + pos % bs).view(1),
                             token_query_depth=qd, positions=torch.tensor([pos], device=dev), max_query_len=1,
                             max_seq_len=a.context, layout=KVLayout.LAST_EXITED)
    backend = TritonBackend()
    meta = backend.prepare(kv, meta)
    slots = meta.resolved_slots[0, :a.context].to(torch.int32).contiguous()
    cos, sin = model.rotary(meta.positions)
    gen = torch.Generator(device=dev).manual_seed(1)
    hidden = model.layers[0].norms["input_layernorm"].new_empty(cfg.hidden_size)
    hidden.copy_(torch.randn(cfg.hidden_size, device=dev, generator=gen))
    lw = pack(model)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms, "model": a.model,
              "context": a.context, "weight_bytes": lw.packed.numel() * 2,
              "kv_bytes": L * a.context * 2 * nkv * D * 2, "variants": {}}

    # the kernel-per-op loop step (rlt's bf16 path at one row) and its fp32 counterpart (the oracle's arithmetic)
    k0, v0 = kv.k.clone(), kv.v.clone()
    ref = model.recurrent(hidden[None], (cos, sin), kv, backend, meta)[0]
    ref_k, ref_v = kv.k.view(L, -1, nkv, D)[:, slot].clone(), kv.v.view(L, -1, nkv, D)[:, slot].clone()
    model32 = MODEL_FAMILIES[family].build_runtime(cfg, {k: t.float() for k, t in weights.items()})
    kv32 = KVCache.allocate(num_layers=L, num_blocks=pages * planes, block_size=bs, num_kv_heads=nkv, head_dim=D,
                            num_planes=planes, layout=KVLayout.LAST_EXITED, dtype=torch.float32, device=dev)
    kv32.k.copy_(k0)
    kv32.v.copy_(v0)
    kv32.token_depth.copy_(kv.token_depth)
    meta32 = backend.prepare(kv32, attrs.evolve(meta, resolved_slots=None))
    oracle = model32.recurrent(hidden[None].float(), model32.rotary(meta.positions), kv32, backend, meta32)[0]
    del model32, kv32
    result["kernel_per_op_rel_err_vs_fp32"] = _rel(ref, oracle)
    print(f"kernel-per-op bf16 loop vs fp32: rel err {result['kernel_per_op_rel_err_vs_fp32']:.2e}", flush=True)

    static_h = hidden[None].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model.recurrent(static_h, (cos, sin), kv, backend, meta)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.recurrent(static_h, (cos, sin), kv, backend, meta)
    ms = probe.med3(graph.replay, a.reps)
    result["variants"]["kernel_per_op_graph"] = {"ms": ms}
    print(f"kernel-per-op loop step, one graph: {statistics.median(ms):.3f} ms", flush=True)

    out = torch.empty_like(hidden)
    wslot = slot.clone()
    for n in (int(x) for x in a.stages.split(",")):
        name = f"persistent_s{n}"
        try:
            kern = LoopKernel(model, lw, sms, stages=n, nvrtc=a.nvrtc)
        except RuntimeError as exc:
            result["variants"][name] = {"error": str(exc)[-3000:]}
            print(f"{name}: {exc}", flush=True)
            continue
        kv.k.copy_(k0)
        kv.v.copy_(v0)
        run = lambda: kern(hidden, out, cos[0], sin[0], kv.k, kv.v, slots, wslot, seq)
        run()
        torch.cuda.synchronize()
        got_k, got_v = kv.k.view(L, -1, nkv, D)[:, slot], kv.v.view(L, -1, nkv, D)[:, slot]
        entry = {"rel_err_vs_kernel_per_op": _rel(out, ref), "rel_err_vs_fp32": _rel(out, oracle),
                 "kv_rel_err_vs_kernel_per_op": max(_rel(got_k, ref_k), _rel(got_v, ref_v)),
                 "regs": kern.kernel.regs, "shared_bytes": kern.kernel.smem, "ctas": sms, "splits": kern.splits}
        print(f"{name}: out rel err {entry['rel_err_vs_kernel_per_op']:.2e} vs kernel-per-op, "
              f"{entry['rel_err_vs_fp32']:.2e} vs fp32; KV {entry['kv_rel_err_vs_kernel_per_op']:.2e}; "
              f"{kern.kernel.regs} regs", flush=True)
        entry["ms"] = probe.med3(run, a.reps)
        print(f"{name}: {statistics.median(entry['ms']):.3f} ms a loop step", flush=True)
        result["variants"][name] = entry
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
