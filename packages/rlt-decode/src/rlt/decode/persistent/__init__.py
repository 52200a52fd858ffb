"""The persistent loop: one loop step of a one-row decode batch as ONE kernel launch (``persistent_loop``).

At C=1 a loop step of the kernel-per-op graph is ~190 kernels (eight a layer), each streaming its
weights at ~4 TB/s and paying a few microseconds at its boundary (``docs/decode.md``). ``loop_kernel.cu``
runs the whole step — every layer's q/k/v, RoPE, paged per-depth KV store and attention, o_proj, the
sandwich norms and residual adds, gate/up + SiLU * up, down_proj, and the end-of-loop norm — in one
launch of one CTA per SM: a producer lane per CTA streams the CTA's weight stages into a shared-memory
ring ahead of the consumers, across the grid barriers between phases (``plan`` owns the layout and the
plan; ``cuda`` compiles and launches it).

- :class:`PersistentLoop` — what the static decode executor calls instead of ``model.recurrent`` for a
  one-row bucket: resolves the row's key slots (the attention backend's pre-resolved ones when it made
  them) and runs the kernel, inside the captured graph.
- :func:`build_persistent_loop` — the loop for an engine's model and cache, or ``ValueError`` with the
  reason it cannot run there (not an Ouro model of the served shapes, not bf16, not an NVIDIA GPU of
  compute capability 9.0+, no NVRTC / nvcc).
- :class:`EmulatedLoop` — the same plan in torch (:func:`rlt.decode.persistent.plan.emulate`): the CPU
  stand-in tests run the executor with, and in fp32 the statement that the plan is the loop step.

Tests: the plan against the oracle and the engine with it (CPU), the CUDA source on a CPU simulator
(``tests/rlt-decode/cuda_sim``), and on a GPU ``tests/gpu/test_persistent_loop_gpu.py``. Off by default
(``--persistent-loop``): correct on the GPU but measured slower than the kernel-per-op graph (lease 21;
``docs/decode.md``, "The persistent loop").
"""

from __future__ import annotations

import torch

from rlt.attention.gather import key_slots
from rlt.decode.persistent.plan import CONSUMER_WARPS, HEAD_DIM, L2_AHEAD, LoopWeights, check_model, emulate, pack


class EmulatedLoop:
    """The kernel's plan in torch (tests' CPU stand-in): fp32 arithmetic, bf16 rounding points for a bf16 model."""

    kind = "emulated"

    def __init__(self, model, lw: LoopWeights, ctas: int = 8) -> None:
        self.model, self.lw, self.ctas = model, lw, ctas

    def __call__(self, hidden, out, cos, sin, k_cache, v_cache, slots, write_slot, seq_len) -> None:
        L, nkv = k_cache.shape[0], k_cache.shape[-2]
        res = emulate(self.model, self.lw, hidden, cos, sin, k_cache.view(L, -1, nkv, HEAD_DIM),
                      v_cache.view(L, -1, nkv, HEAD_DIM), slots, int(write_slot[0]), int(seq_len[0]), self.ctas,
                      rounding=hidden.dtype != torch.float32)
        out.copy_(res.to(out.dtype))


class PersistentLoop:
    """``model.recurrent`` for one decode row, as one launch of ``impl`` (:class:`~rlt.decode.persistent.cuda.
    CudaLoop` or :class:`EmulatedLoop`)."""

    def __init__(self, kv, impl) -> None:
        self.kv, self.impl = kv, impl

    def __call__(self, x: torch.Tensor, rope, meta) -> torch.Tensor:
        """The loop step of the one row of ``meta`` (``x``: ``[1, H]``), its K/V stored at the row's slot."""
        if x.shape[0] != 1:
            raise ValueError(f"the persistent loop runs one row, got {x.shape[0]}")
        cos, sin = rope
        slots = meta.resolved_slots if meta.resolved_slots is not None else key_slots(self.kv, meta, meta.max_seq_len)
        out = torch.empty_like(x)
        self.impl(x[0], out[0], cos[0].contiguous(), sin[0].contiguous(), self.kv.k, self.kv.v,
                  slots[0].to(torch.int32).contiguous(), meta.slot_mapping[:1].to(torch.int64),
                  meta.seq_lens[:1].to(torch.int32))
        return out

    def describe(self) -> dict:
        lw = self.impl.lw
        return {"rows": 1, "kernel": self.impl.kind, "ctas": self.impl.ctas,
                "packed_weight_mib": round(lw.packed.numel() * lw.packed.element_size() / 2**20, 1)}


def build_persistent_loop(model, kv, device: torch.device, stages: int = 12,
                          consumer_warps: int = CONSUMER_WARPS, l2_ahead: int = L2_AHEAD) -> PersistentLoop:
    """The persistent loop for this model and cache on ``device``; ``ValueError`` says why it cannot run."""
    check_model(model)
    if model.layers[0].qkv.dtype != torch.bfloat16 or kv.k.dtype != torch.bfloat16:
        raise ValueError(f"the loop kernel runs bf16 weights and KV (model {model.layers[0].qkv.dtype}, "
                         f"KV {kv.k.dtype})")
    if device.type != "cuda" or torch.version.hip is not None:
        rocm = ", ROCm" if torch.version.hip else ""
        raise ValueError(f"the loop kernel needs an NVIDIA GPU (device {device}{rocm})")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"the loop kernel needs compute capability 9.0+ (bulk copies, mbarriers); this GPU is "
                         f"{major}.{minor}")
    from rlt.decode.persistent.cuda import CudaLoop

    try:
        impl = CudaLoop(model, pack(model), stages=stages, consumer_warps=consumer_warps, l2_ahead=l2_ahead)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"the loop kernel did not build: {exc}"[:400]) from None
    return PersistentLoop(kv, impl)
