"""The persistent loop kernel's plan, shared by its CUDA launch and its torch emulation.

``loop_kernel.cu`` runs one Ouro loop step of one decode row in one launch; this module owns the layout
it reads — the GEMV weights of every layer packed into 16 KB stages (:func:`pack`, ``ROWS`` weight rows x
``CK`` columns, gate/up tiles pairing 8 gate rows with the same 8 up rows), the norm weights ``[L, 4, H]``
— the phase table that numbers a layer's tiles and deals them over the CTAs, the attention items' context
splits, and :func:`emulate`: the kernel's plan step for step in torch (fp32 arithmetic; bf16 at the
kernel's rounding points unless ``rounding=False``). The emulation is the kernel's CPU stand-in (the
"fake device" of tests: the same math, tile by tile) and the statement of what the CUDA code computes.
"""

from __future__ import annotations

import math

import attrs
import torch

#: a stage: ROWS weight rows x CK columns of bf16 (16 KB); the kernel's consumer warps
ROWS, CK = 16, 512
STAGE_ELEMS = ROWS * CK
MAX_K = 6144
MAX_H = 2048  # the widest hidden size (its prologues hold a thread's elements in registers)
#: consumer warps a CTA (lease 21, an H100: 1.661 ms a loop step at 8 against 1.816 at 4; persistent.cuh's default)
CONSUMER_WARPS = 8
CONSUMERS = 32 * CONSUMER_WARPS
THREADS = 32 + CONSUMERS
#: stages the producer prefetches into L2 ahead of its ring (0: none; not yet measured, so off)
L2_AHEAD = 0
#: V rows of an attention key block loaded with its K rows (0: after the softmax; not yet measured, so 0)
V_EARLY = 0
HEAD_DIM = 128
#: the loop kernel's phase stamps a layer (its `times`)
STAMPS = 16
#: a layer's norm weights in the kernel's order (Ouro's sandwich norms)
NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
#: the GEMV phases of a layer
QKV, O, GU, DOWN = range(4)


def pack_matrix(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> stages [N/ROWS tiles][K/CK chunks][ROWS][CK], flat."""
    n, k = w.shape
    return w.reshape(n // ROWS, ROWS, k // CK, CK).permute(0, 2, 1, 3).reshape(-1)


def check_model(model) -> None:
    """The shapes the kernel serves (a clear error otherwise)."""
    layers = getattr(model, "layers", None)
    if not layers or any(n not in getattr(layers[0], "norms", {}) for n in NORMS):
        raise ValueError(f"loop kernel: {type(model).__name__} is not an Ouro sandwich-norm stack")
    cfg = model.cfg
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    why = []
    if d != HEAD_DIM:
        why.append(f"head_dim {d} != {HEAD_DIM}")
    if nq * d != h:
        why.append(f"heads x head_dim {nq * d} != hidden {h}")
    if h % CK or i % CK or h > MAX_H or i > MAX_K:
        why.append(f"hidden {h} / intermediate {i} must be multiples of {CK}, at most {MAX_H} / {MAX_K}")
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
    gets each layer's intermediates (a dict of vectors: qkv, o, o_out, h after attention, act, down)."""
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
            trace.append(dict(qkv=qkv, o=o, o_out=o_out, h=h, act=act, down=down))
    h = r(h + rms(down, norms[len(model.layers) - 1, 3]))
    return rms(h, final)


def fp32_loop_step(family, cfg, weights: dict[str, torch.Tensor], hidden: torch.Tensor, kv, backend, meta):
    """``OuroModel.recurrent`` of the same rows in fp32 — the bf16 weights and cache widened, cos / sin computed
    in fp32 — on a copy of the cache: the arithmetic the bf16 paths (the kernel-per-op one, the loop kernel,
    its emulation) are measured against. ``hidden``: ``[R, H]``."""
    model = family.build_runtime(cfg, {n: t.float() for n, t in weights.items()})
    kv32 = attrs.evolve(kv, k=kv.k.float(), v=kv.v.float(),
                        token_depth=None if kv.token_depth is None else kv.token_depth.clone())
    meta32 = backend.prepare(kv32, attrs.evolve(meta, resolved_slots=None))
    return model.recurrent(hidden.float(), model.rotary(meta.positions), kv32, backend, meta32)
