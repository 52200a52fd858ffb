"""Probe: one whole Ouro loop step at one row in ONE persistent kernel (``rlt.decode.persistent``).

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

``rlt.decode.persistent.plan.emulate`` runs the kernel's bookkeeping in torch — packed stages read tile by
tile as the CTAs deal them, the attention items' context splits and their merge, the residual buffers,
every rounding point (or none, in fp32) — so CPU tests (``tests/rlt-decode/test_persistent_loop.py``)
check the kernel's plan against ``OuroModel.recurrent`` at tiny shapes, and a device call spends its time
on what only a GPU checks. The engine runs the same kernel for one-row decode steps with
``--persistent-loop``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.megakernel import probe
from rlt.decode.persistent.cuda import CudaLoop
from rlt.decode.persistent.plan import HEAD_DIM, STAMPS, fp32_loop_step, pack

#: the stretches between loop_kernel.cu's phase stamps, a layer
SEGMENTS = ("qkv_prologue", "qkv_gemv", "qkv_barrier", "attention", "attention_barrier", "o_prologue", "o_gemv",
            "o_barrier", "gu_prologue", "gu_gemv", "gu_barrier", "down_prologue", "down_gemv", "down_barrier")

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def diagnose(model, kern, hidden, cos, sin, kv, slots, wslot, seq, backend, meta) -> dict:
    """Layer 0 alone through the kernel (``kern.layers = 1``), each phase's scratch output against the eager op
    fed the kernel's own input of that phase — so a wrong phase shows as the one large error, not as the
    drift it causes downstream. Returns the relative error per phase (K/V: the stored row of layer 0)."""
    import torch.nn.functional as F

    from rlt.platform.models.fused_ops import rope_qk_, silu_mul
    from rlt.platform.models.layers import rms_norm

    cfg, L0, b = model.cfg, model.layers[0], kern.bufs
    nq, nkv, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    n, eps = L0.norms, cfg.rms_norm_eps
    k0, v0 = kv.k.clone(), kv.v.clone()
    out = torch.empty_like(hidden)
    kern.layers = 1
    try:
        kern(hidden, out, cos, sin, kv.k, kv.v, slots, wslot, seq)
        torch.cuda.synchronize()
    finally:
        kern.layers = len(model.layers)
    bf = lambda t: t.to(hidden.dtype)  # a scratch vector (fp32 holding the model dtype's values) as the model's dtype
    a = rms_norm(hidden[None], n["input_layernorm"], eps)
    errs = {"qkv": _rel(b["qkv"], F.linear(a, L0.qkv)[0])}
    got_k, got_v = kv.k[0].view(-1, nkv, HEAD_DIM)[wslot], kv.v[0].view(-1, nkv, HEAD_DIM)[wslot]
    kv.k.copy_(k0)
    kv.v.copy_(v0)
    q, k, v, stored = rope_qk_(bf(b["qkv"])[None].clone(), cos[None], sin[None], nq, nkv, HEAD_DIM,
                               kv_store=(kv.k[0], kv.v[0], wslot))
    if not stored:
        backend.write_kv(kv, 0, k, v, meta)
    errs["kv_row"] = max(_rel(got_k, kv.k[0].view(-1, nkv, HEAD_DIM)[wslot]),
                         _rel(got_v, kv.v[0].view(-1, nkv, HEAD_DIM)[wslot]))
    o = backend.forward(q, kv, 0, meta, model.scale)
    errs["o_proj"] = _rel(b["o_out"], F.linear(o, L0.o)[0])  # (the merged attention is in o_proj's input)
    h1 = bf(hidden[None].float() + rms_norm(bf(b["o_out"])[None], n["input_layernorm_2"], eps).float())
    errs["residual"] = _rel(b["hres"][H:], h1[0])
    m = rms_norm(bf(b["hres"][H:])[None], n["post_attention_layernorm"], eps)
    errs["gate_up_silu"] = _rel(b["act"], silu_mul(F.linear(m, L0.gate_up))[0])
    errs["down"] = _rel(b["down"], F.linear(bf(b["act"])[None], L0.down)[0])
    h2 = bf(b["hres"][H:][None].float() + rms_norm(bf(b["down"])[None], n["post_attention_layernorm_2"], eps).float())
    errs["out"] = _rel(out, rms_norm(h2, model.norm, eps)[0])
    kv.k.copy_(k0)
    kv.v.copy_(v0)
    return errs


def breakdown(kern, run) -> dict:
    """One launch with the kernel's phase stamps: per stretch of a layer (SEGMENTS), microseconds averaged over the
    CTAs and layers, and the slowest CTA's (its layer average); a barrier's stretch is that CTA's wait there (the
    spread of the CTAs' arrivals plus the barrier itself). Clock cycles to ns by each CTA's launch-long ratio."""
    L, ctas = kern.layers, kern.ctas
    times = torch.zeros(ctas * (L * STAMPS + 4), dtype=torch.int64, device=kern.lw.packed.device)
    kern.times = times
    try:
        run()
        torch.cuda.synchronize()
    finally:
        kern.times = None
    st = times[:ctas * L * STAMPS].view(ctas, L, STAMPS)[..., :len(SEGMENTS) + 1].double()
    ends = times[ctas * L * STAMPS:].view(ctas, 4).double()
    ns_per_clock = (ends[:, 2] - ends[:, 0]) / (ends[:, 3] - ends[:, 1])
    seg = st.diff(dim=-1) * ns_per_clock[:, None, None] / 1e3  # [ctas, L, segments] us
    mean, worst = seg.mean((0, 1)), seg.mean(1).max(0).values
    return {"us_per_layer": {n: [round(mean[i].item(), 2), round(worst[i].item(), 2)] for i, n in enumerate(SEGMENTS)},
            "layer_us": round(seg.sum(-1).mean().item(), 2),
            "launch_us": round((ends[:, 2] - ends[:, 0]).median().item() / 1e3, 1),
            "ghz": round(1 / ns_per_clock.median().item(), 3)}


def main() -> None:
    from benchmarks.bench_model import NAMED_CONFIGS, random_weights
    from rlt.attention.backends.triton_backend import TritonBackend
    from rlt.attention.synthetic import random_problem
    from rlt.platform.checkpoint.tiny import tiny_config
    from rlt.platform.models import MODEL_FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ouro-1.4b")
    ap.add_argument("--context", type=int, default=1024, help="context length including the new token")
    ap.add_argument("--stages", default="12")
    ap.add_argument("--warps", default="8", help="consumer warps a CTA")
    ap.add_argument("--l2-ahead", default="0,8,16", help="stages the producer prefetches into L2 beyond its ring")
    ap.add_argument("--v-early", default="0,16", help="V rows of a key block loaded with its K rows")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--nvrtc", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    family, fields = NAMED_CONFIGS[a.model]
    cfg = MODEL_FAMILIES[family].parse_config(tiny_config(family, **fields))
    weights = random_weights(family, cfg, seed=0, gate_bias=0.0, dtype=torch.bfloat16, device=dev)
    model = MODEL_FAMILIES[family].build_runtime(cfg, weights)
    L, nkv, D = cfg.num_hidden_layers, cfg.num_key_value_heads, HEAD_DIM
    # one row at depth 1 over a fixed-depth history (every earlier token in the deepest plane)
    prob = random_problem([(a.context, 1, 1)], num_heads=cfg.num_attention_heads, num_kv_heads=nkv, head_dim=D,
                          block_size=16, num_planes=4, dtype=torch.bfloat16, device=dev, num_layers=L, history="full")
    kv, backend = prob.kv, TritonBackend()
    meta = backend.prepare(kv, prob.meta)
    slot, seq = meta.slot_mapping, meta.seq_lens
    slots = meta.resolved_slots[0, :a.context].to(torch.int32).contiguous()
    cos, sin = model.rotary(meta.positions)
    hidden = torch.randn(cfg.hidden_size, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    hidden = hidden.to(torch.bfloat16)
    lw = pack(model)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms, "model": a.model,
              "context": a.context, "weight_bytes": lw.packed.numel() * 2,
              "kv_bytes": L * a.context * 2 * nkv * D * 2, "variants": {}}

    # the kernel-per-op loop step (rlt's bf16 path at one row) and its fp32 counterpart (the oracle's arithmetic)
    k0, v0 = kv.k.clone(), kv.v.clone()
    ref = model.recurrent(hidden[None], (cos, sin), kv, backend, meta)[0]
    ref_k, ref_v = kv.k.view(L, -1, nkv, D)[:, slot].clone(), kv.v.view(L, -1, nkv, D)[:, slot].clone()
    oracle = fp32_loop_step(MODEL_FAMILIES[family], cfg, weights, hidden[None], kv, backend, meta)[0]
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
    for n, w, ahead, ve in ((int(x), int(y), int(z), int(e)) for x in a.stages.split(",") for y in a.warps.split(",")
                            for z in a.l2_ahead.split(",") for e in a.v_early.split(",")):
        name = f"persistent_s{n}_w{w}_vearly{ve}_l2ahead{ahead}"
        try:
            kern = CudaLoop(model, lw, stages=n, ctas=sms, nvrtc=a.nvrtc, consumer_warps=w, l2_ahead=ahead,
                            v_early=ve)
        except RuntimeError as exc:
            result["variants"][name] = {"error": str(exc)[-3000:]}
            print(f"{name}: {exc}", flush=True)
            continue
        kv.k.copy_(k0)
        kv.v.copy_(v0)
        run = lambda: kern(hidden, out, cos[0], sin[0], kv.k, kv.v, slots, slot, seq)
        run()
        torch.cuda.synchronize()
        got_k, got_v = kv.k.view(L, -1, nkv, D)[:, slot], kv.v.view(L, -1, nkv, D)[:, slot]
        entry = {"rel_err_vs_kernel_per_op": _rel(out, ref), "rel_err_vs_fp32": _rel(out, oracle),
                 "kv_rel_err_vs_kernel_per_op": max(_rel(got_k, ref_k), _rel(got_v, ref_v)),
                 "regs": kern.kernel.regs, "shared_bytes": kern.kernel.smem, "ctas": sms, "splits": kern.splits}
        print(f"{name}: out rel err {entry['rel_err_vs_kernel_per_op']:.2e} vs kernel-per-op, "
              f"{entry['rel_err_vs_fp32']:.2e} vs fp32; KV {entry['kv_rel_err_vs_kernel_per_op']:.2e}; "
              f"{kern.kernel.regs} regs", flush=True)
        entry["layer0_phase_rel_err"] = diagnose(model, kern, hidden, cos[0], sin[0], kv, slots, slot, seq, backend,
                                                 meta)
        print(f"{name}: layer 0 phase by phase (each against the eager op on the kernel's own input): "
              + ", ".join(f"{k} {v:.1e}" for k, v in entry["layer0_phase_rel_err"].items()), flush=True)
        entry["ms"] = probe.med3(run, a.reps)
        print(f"{name}: {statistics.median(entry['ms']):.3f} ms a loop step", flush=True)
        entry["phases"] = breakdown(kern, run)
        ph = entry["phases"]
        print(f"{name}: a layer {ph['layer_us']} us ({ph['launch_us']} us a launch, {ph['ghz']} GHz); per stretch "
              "(mean / slowest CTA): " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in ph["us_per_layer"].items()),
              flush=True)
        result["variants"][name] = entry
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
