"""The eager reference of Nanbeige: the test oracle.

Plain tensors, unfused Llama weight names, no paging, whole-sequence recompute. It shares the
loop drivers and KV semantics of :mod:`rlt.platform.models.ouro_reference` (LAST_EXITED: a query at
depth d reads loop-d keys; SHARED: each position's last version) and states only what differs
(models.md §3.3): the plain pre-norm layer ``h += Attn(RMS_in(h)); h += MLP(RMS_post(h))``, the
final norm after every loop unless ``skip_loop_final_norm`` (then once, before the head), and no
gate (fixed depth; ``gate`` returns -inf, so the exit rule never fires before max_loops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlt.platform.models.layers import rms_norm
from rlt.platform.models.ouro_reference import OuroReference


class NanbeigeReference(OuroReference):
    def _finish_layer(self, l: int, h, attn):
        cfg, w, p = self.cfg, self.w, f"model.layers.{l}."
        h = h + F.linear(attn, w[p + "self_attn.o_proj.weight"])
        m = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        m = F.silu(F.linear(m, w[p + "mlp.gate_proj.weight"])) * F.linear(m, w[p + "mlp.up_proj.weight"])
        return h + F.linear(m, w[p + "mlp.down_proj.weight"])

    def _loop_end(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.cfg.skip_loop_final_norm else super()._loop_end(h)

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.full(hidden.shape[:-1], float("-inf"))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cfg.skip_loop_final_norm:
            hidden = super()._loop_end(hidden)
        return super().logits(hidden)
