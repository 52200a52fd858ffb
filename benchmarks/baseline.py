"""Baseline rows: what plain PyTorch gives on the same checkpoint, in the same run.

Two baselines, both eager PyTorch on the same weights, greedy, fixed depth unless a τ is given:

* ``reference`` — the in-repo eager reference path (``rlt.platform.models.ouro_reference``:
  ``reference_generate`` over ``OuroReference``), unchanged: no KV cache at all, every generated
  token recomputes the whole sequence through every loop (what the test oracle does). One
  sequence at a time (C must be 1). It is slow by construction, so it runs few tokens; its
  per-token numbers are ``(T(n) - T(1)) / (n - 1)`` from two timed calls, T(1) being the TTFT.
* ``dense`` — a plain Hugging Face-style decode loop written here: a dense preallocated KV cache
  per (loop, layer) ``[B, kv_heads, max_len, head_dim]`` (Ouro's T·L cache slots), unfused
  projections, ``scaled_dot_product_attention``, the batch prefilled together (all prompts have
  the same length, so no padding), then one eager forward per generated token. No graphs, no
  compile: what a user writing plain PyTorch gets.

Neither touches the engine. Numerics follow ``rlt.platform.models.layers`` (HF rounding order).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.workload import Workload, prompts_for
from rlt.platform.models.layers import rms_norm, rope_cos_sin, rope_inv_freq, rotate_half
from rlt.platform.models.ouro_reference import OuroReference, reference_generate


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def run_reference(ckpt, wl: Workload, device: torch.device, *, reps: int = 3, seed: int = 0) -> dict:
    if wl.concurrency != 1:
        raise ValueError("the reference baseline runs one sequence at a time: use c=1")
    if wl.output_len < 2:
        raise ValueError("the reference baseline needs out >= 2 to separate TTFT from per-token time")
    cfg = ckpt.config
    prompt = prompts_for(wl, cfg.vocab_size, seed, 1)[0]
    _reset_peak(device)
    with torch.device(device), torch.inference_mode():
        ref = OuroReference(cfg, ckpt.weights)

        def timed(n: int) -> tuple[float, list[int]]:
            _sync(device)
            t = time.perf_counter()
            _toks, depths = reference_generate(ref, prompt, max_tokens=n, min_loops=wl.min_loops,
                                               max_loops=wl.max_loops, exit_threshold=wl.exit_threshold)
            _sync(device)
            return time.perf_counter() - t, depths

        timed(2)  # warm-up, discarded
        runs = []
        for _ in range(reps):
            t1, _ = timed(1)
            tn, depths = timed(wl.output_len)
            per_tok = (tn - t1) / (wl.output_len - 1)
            runs.append({
                "wall_s": tn, "ttft_ms": 1e3 * t1, "ms_per_token_step": 1e3 * per_tok,
                "e2e_tok_s": wl.output_len / tn, "decode_tok_s": 1.0 / per_tok if per_tok > 0 else None,
                "mean_exit_depth": statistics.mean(depths[1:]),
            })
    return _summary("reference", "in-repo eager reference (OuroReference, whole-sequence recompute, no KV cache)",
                    wl, runs, _peak(device))


class DenseEagerOuro:
    """Plain PyTorch Ouro with a dense per-(loop, layer) KV cache: the HF-style baseline."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], *, batch: int, max_len: int, device) -> None:
        self.cfg, self.w = cfg, weights
        self.batch, self.max_len = batch, max_len
        dtype = weights["model.embed_tokens.weight"].dtype
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=device)
        self.cache = torch.empty((cfg.total_ut_steps, cfg.num_hidden_layers, 2, batch, cfg.num_key_value_heads,
                                  max_len, cfg.head_dim), dtype=dtype, device=device)
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]

    @staticmethod
    def cache_bytes(cfg, batch: int, max_len: int, elem: int) -> int:
        return (cfg.total_ut_steps * cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * max_len
                * cfg.head_dim * elem)

    def _rope(self, x, cos, sin):  # x [B, S, heads, d]; cos/sin [S, d]
        return x * cos[None, :, None, :] + rotate_half(x) * sin[None, :, None, :]

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids ``[B, S]`` at positions start.. -> last-position logits ``[B, vocab]`` (fp32)."""
        cfg, w = self.cfg, self.w
        b, s = ids.shape
        nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        pos = torch.arange(start, start + s, device=ids.device)
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.lm_head.dtype)
        h = F.embedding(ids, w["model.embed_tokens.weight"])
        end = start + s
        for d in range(cfg.total_ut_steps):
            for l in range(cfg.num_hidden_layers):
                p = f"model.layers.{l}."
                a = rms_norm(h, w[p + "input_layernorm.weight"], eps)
                q = self._rope(F.linear(a, w[p + "self_attn.q_proj.weight"]).view(b, s, nh, hd), cos, sin)
                k = self._rope(F.linear(a, w[p + "self_attn.k_proj.weight"]).view(b, s, nkv, hd), cos, sin)
                v = F.linear(a, w[p + "self_attn.v_proj.weight"]).view(b, s, nkv, hd)
                kc, vc = self.cache[d, l, 0], self.cache[d, l, 1]
                kc[:, :, start:end] = k.transpose(1, 2)
                vc[:, :, start:end] = v.transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), kc[:, :, :end], vc[:, :, :end], is_causal=(s > 1 and start == 0),
                    enable_gqa=nh != nkv)
                o = o.transpose(1, 2).reshape(b, s, nh * hd)
                h = h + rms_norm(F.linear(o, w[p + "self_attn.o_proj.weight"]), w[p + "input_layernorm_2.weight"], eps)
                m = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
                m = F.silu(F.linear(m, w[p + "mlp.gate_proj.weight"])) * F.linear(m, w[p + "mlp.up_proj.weight"])
                h = h + rms_norm(F.linear(m, w[p + "mlp.down_proj.weight"]), w[p + "post_attention_layernorm_2.weight"], eps)
            h = rms_norm(h, w["model.norm.weight"], eps)
        return F.linear(h[:, -1], self.lm_head).float()


def run_dense(ckpt, wl: Workload, device: torch.device, *, reps: int = 3, seed: int = 0) -> dict:
    if wl.adaptive:
        raise ValueError("the dense baseline runs fixed depth only (tau=1.0)")
    cfg = ckpt.config
    elem = ckpt.weights["model.embed_tokens.weight"].element_size()
    batch = wl.concurrency
    max_len = wl.prompt_len + wl.output_len
    note = None
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        per_row = DenseEagerOuro.cache_bytes(cfg, 1, max_len, elem)
        fit = int((0.85 * free - (8 << 30)) // per_row)
        if fit < batch:
            note = f"memory: dense KV for C={batch} needs {per_row * batch / 2**30:.1f} GiB; ran C={max(fit, 1)}"
            batch = max(fit, 1)
    ids = torch.tensor(prompts_for(wl, cfg.vocab_size, seed, batch), device=device)
    _reset_peak(device)
    runs = []
    with torch.inference_mode():
        model = DenseEagerOuro(cfg, ckpt.weights, batch=batch, max_len=max_len, device=device)

        def once(out_len: int) -> dict:
            _sync(device)
            t0 = time.perf_counter()
            nxt = model.forward(ids, 0).argmax(-1, keepdim=True)
            _sync(device)
            t1 = time.perf_counter()
            for i in range(out_len - 1):
                nxt = model.forward(nxt, wl.prompt_len + i).argmax(-1, keepdim=True)
            _sync(device)
            t2 = time.perf_counter()
            dec = t2 - t1
            n_dec = out_len - 1
            return {
                "wall_s": t2 - t0, "ttft_ms": 1e3 * (t1 - t0),
                "ms_per_token_step": 1e3 * dec / n_dec if n_dec else None,
                "e2e_tok_s": batch * out_len / (t2 - t0),
                "decode_tok_s": batch * n_dec / dec if n_dec and dec > 0 else None,
                "mean_exit_depth": float(cfg.total_ut_steps),
            }

        once(min(2, wl.output_len))  # warm-up, discarded
        for _ in range(reps):
            runs.append(once(wl.output_len))
        del model
    out = _summary("dense", "plain PyTorch: dense per-(loop, layer) KV cache, SDPA, eager, no graphs",
                   wl, runs, _peak(device), batch=batch)
    if note:
        out["notes"].append(note)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _summary(kind: str, description: str, wl: Workload, runs: list[dict], peak, batch: int | None = None) -> dict:
    keys = ("wall_s", "ttft_ms", "ms_per_token_step", "e2e_tok_s", "decode_tok_s", "mean_exit_depth")
    med = {k: statistics.median([r[k] for r in runs if r.get(k) is not None]) if any(r.get(k) is not None for r in runs)
           else None for k in keys}
    return {"kind": kind, "description": description,
            "workload": {"name": f"baseline-{kind}-c{batch or wl.concurrency}-in{wl.prompt_len}-out{wl.output_len}",
                         "concurrency": batch or wl.concurrency, "prompt_len": wl.prompt_len,
                         "output_len": wl.output_len, "requests": batch or wl.concurrency,
                         "exit_threshold": wl.exit_threshold},
            "median": med, "reps": runs, "reps_run": len(runs), "peak_memory_bytes": peak, "notes": []}
