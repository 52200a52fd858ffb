"""Roofline floors for looped-model serving workloads, and the two ceilings they are divided by.

Ceilings are *measured in the same run* (``measure_ceilings``): a large device-to-device copy
(bytes read + bytes written over time) and a large matrix product in the model dtype (2·M·N·K
over time), each the median of several timed repetitions after warm-up, on random data.

Cost model (per token and loop unless said otherwise; b = bytes per element):

* weights: every loop reads the whole layer stack once per engine step, whatever the batch:
  ``L · (H·(nh+2·nkv)·d + nh·d·H + 3·H·I) · b``; a token's coda reads the LM head ``V·H·b`` once
  per step that samples;
* KV: a token at depth q reads one plane of every earlier position (LAST_EXITED reads
  ``min(q, exit depth)``, still one plane), ``2·L·nkv·d·b`` per position and loop, and writes its
  own K/V once per loop;
* activations: each matmul's input read once and output written once (what a fully fused
  layer must still move): ``L · (12·H + 3·I)``-ish elements per token and loop, exactly
  ``L · (H + (nh+2nkv)d + 2·nh·d + H + H + 2I + I + H + 2·nkv·d + H)``;
* layers outside the loop (Huginn's prelude + coda, ``boundary_layers``): weights read once per
  step, one KV plane, once per token; Huginn's injection adapter counts as loop weights;
* FLOPs: ``2 · params_per_loop`` per token and loop, plus attention ``4 · ctx · nh · d · L`` per
  token and loop (QK and PV; causal prefill counts ``ctx`` as the query's own position), plus
  ``2·V·H`` per sampled token.

A floor is ``max(bytes / copy_bw, flops / matmul_rate)``: no implementation can beat it on this
device; measured time over floor is the gap. This module does not run the engine.
"""

from __future__ import annotations

import statistics
import time

import attrs
import torch


@attrs.frozen
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    copy_bytes: int
    matmul_n: int
    dtype: str

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def timed(fn, device: torch.device, reps: int) -> list[float]:
    """Seconds per call of ``fn``, ``reps`` times (CUDA events on a GPU, the wall clock elsewhere)."""
    times = []
    if device.type == "cuda":
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Measured copy bandwidth and matmul rate (median of 10 after 3 warm-ups, random data)."""
    big = device.type == "cuda"
    nbytes = (4 << 30) if big else (64 << 20)
    n = 8192 if big else 1024
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    copy_t = statistics.median(timed(lambda: dst.copy_(src), device, 10))
    del src, dst
    mm_dtype = dtype if big else torch.float32
    a = torch.randn(n, n, dtype=mm_dtype, device=device)
    b = torch.randn(n, n, dtype=mm_dtype, device=device)
    for _ in range(3):
        torch.mm(a, b)
    mm_t = statistics.median(timed(lambda: torch.mm(a, b), device, 10))
    del a, b
    if big:
        torch.cuda.empty_cache()
    return Ceilings(copy_bytes_per_s=2 * nbytes / copy_t, matmul_flops_per_s=2 * n**3 / mm_t,
                    copy_bytes=nbytes, matmul_n=n, dtype=str(mm_dtype).removeprefix("torch."))


@attrs.frozen
class ModelCost:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_loops: int
    elem_bytes: int
    #: layers outside the loop, run once per token with one KV plane (Huginn's prelude + coda)
    boundary_layers: int = 0
    #: loop weights outside the layers (Huginn's injection adapter)
    extra_params_per_loop: int = 0

    @classmethod
    def from_config(cls, cfg, elem_bytes: int) -> "ModelCost":
        """From a :class:`benchmarks.bench_model.BenchShape` (or any config with its field names)."""
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.total_ut_steps, elem_bytes,
                   getattr(cfg, "boundary_layers", 0), getattr(cfg, "extra_params_per_loop", 0))

    @property
    def params_per_layer(self) -> int:
        h, i, d = self.hidden, self.intermediate, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + 3 * h * i

    @property
    def params_per_loop(self) -> int:
        return self.num_layers * self.params_per_layer + self.extra_params_per_loop

    @property
    def boundary_params(self) -> int:
        return self.boundary_layers * self.params_per_layer

    def boundary_cost(self, tokens: int, ctx: float) -> "Cost":
        """The once-per-token layers for ``tokens`` tokens at context ``ctx`` (weights read once)."""
        if not self.boundary_layers:
            return Cost(0.0, 0.0)
        kv = 2 * self.boundary_layers * self.num_kv_heads * self.head_dim * self.elem_bytes
        per_tok = self.activation_bytes_per_token_loop * self.boundary_layers / self.num_layers
        flops = tokens * (2.0 * self.boundary_params
                          + 4.0 * ctx * self.num_heads * self.head_dim * self.boundary_layers)
        return Cost(self.boundary_params * self.elem_bytes + tokens * ((ctx + 1) * kv + per_tok), flops)

    @property
    def weight_bytes_per_loop(self) -> int:
        return self.params_per_loop * self.elem_bytes

    @property
    def lm_head_bytes(self) -> int:
        return self.vocab * self.hidden * self.elem_bytes

    @property
    def kv_bytes_per_position_plane(self) -> int:
        """K and V of one position in one depth plane, all layers (196,608 B for Ouro-1.4B bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def activation_bytes_per_token_loop(self) -> int:
        h, i, d = self.hidden, self.intermediate, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        per_layer = (h + qkv) + (qkv + self.num_heads * d) + (self.num_heads * d + h) + (h + 2 * i) + (i + h)
        return self.num_layers * per_layer * self.elem_bytes

    def attention_flops_per_token_loop(self, ctx: float) -> float:
        return 4.0 * ctx * self.num_heads * self.head_dim * self.num_layers


@attrs.frozen
class Cost:
    bytes: float
    flops: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes + other.bytes, self.flops + other.flops)

    def scale(self, k: float) -> "Cost":
        return Cost(self.bytes * k, self.flops * k)

    def floor_s(self, c: Ceilings) -> float:
        return max(self.bytes / c.copy_bytes_per_s, self.flops / c.matmul_flops_per_s)

    def bound(self, c: Ceilings) -> str:
        return "bandwidth" if self.bytes / c.copy_bytes_per_s >= self.flops / c.matmul_flops_per_s else "compute"


def decode_step_cost(m: ModelCost, batch: int, ctx: float, loops: float) -> Cost:
    """Every one of ``batch`` rows advances one token (``loops`` loops each) at context ``ctx``."""
    per_loop_bytes = (m.weight_bytes_per_loop
                      + batch * (ctx * m.kv_bytes_per_position_plane
                                 + m.activation_bytes_per_token_loop
                                 + m.kv_bytes_per_position_plane))  # its own K/V write
    flops_per_loop = batch * (2.0 * m.params_per_loop + m.attention_flops_per_token_loop(ctx))
    return Cost(loops * per_loop_bytes + m.lm_head_bytes,
                loops * flops_per_loop + batch * 2.0 * m.vocab * m.hidden) + m.boundary_cost(batch, ctx)


def prefill_cost(m: ModelCost, prompt: int, batch: int = 1) -> Cost:
    """``batch`` prompts of ``prompt`` tokens prefilled together through every loop (weights read
    once per loop for the whole batch), then one sampled token each."""
    loops = m.num_loops
    per_loop_bytes = (m.weight_bytes_per_loop
                      + batch * prompt * (m.activation_bytes_per_token_loop + 2 * m.kv_bytes_per_position_plane))
    mean_ctx = (prompt + 1) / 2.0  # causal: query i sees i + 1 keys
    flops = batch * loops * prompt * (2.0 * m.params_per_loop + m.attention_flops_per_token_loop(mean_ctx))
    return (Cost(loops * per_loop_bytes + m.lm_head_bytes, flops + batch * 2.0 * m.vocab * m.hidden)
            + m.boundary_cost(batch * prompt, mean_ctx))


@attrs.frozen
class WorkloadFloor:
    e2e_s: float
    prefill_s: float  # one prompt (the TTFT floor at C=1)
    decode_step_s: float  # one token for every one of C rows (the TPOT floor)
    decode_tok_s: float  # C / decode_step_s
    e2e_tok_s: float
    decode_bound: str
    prefill_bound: str
    decode_step_bytes: float
    decode_step_flops: float

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def workload_floor(m: ModelCost, c: Ceilings, *, concurrency: int, prompt_len: int, output_len: int,
                   num_requests: int, loops: float) -> WorkloadFloor:
    """Floors of a closed-loop workload (every request prompt_len in, output_len out).

    The requests run in ``num_requests / C`` waves of C: each wave prefills its C prompts together
    and then takes ``output_len - 1`` decode steps at batch C (at the mean decode context). The
    end-to-end floor overlaps everything ideally: ``max(Σbytes/bw, ΣFLOPs/rate)`` over all of it.
    """
    pre = prefill_cost(m, prompt_len)
    waves = num_requests / concurrency
    mean_ctx = prompt_len + max(output_len - 1, 0) / 2.0
    step = decode_step_cost(m, concurrency, mean_ctx, loops)
    total = (prefill_cost(m, prompt_len, concurrency).scale(waves)
             + step.scale(waves * max(output_len - 1, 0)))
    e2e = total.floor_s(c)
    step_s = step.floor_s(c)
    out_tokens = num_requests * output_len
    return WorkloadFloor(
        e2e_s=e2e, prefill_s=pre.floor_s(c), decode_step_s=step_s,
        decode_tok_s=concurrency / step_s if step_s else float("nan"),
        e2e_tok_s=out_tokens / e2e if e2e else float("nan"),
        decode_bound=step.bound(c), prefill_bound=pre.bound(c),
        decode_step_bytes=step.bytes, decode_step_flops=step.flops,
    )
