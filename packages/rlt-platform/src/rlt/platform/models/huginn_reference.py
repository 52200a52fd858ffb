"""The eager reference of Huginn-0125: the test oracle.

Written from models.md §2.4 with the checkpoint's own weight names (``transformer.{group}.{b}...``,
``Wqkv`` split into q/k/v as stored), no paging, whole-sequence recompute for every generated
token; RoPE from :func:`rlt.platform.models.huginn.rope_table` (the checkpoint's ``freqs_cis`` when
stored, as the reference's persistent buffer). A request runs the same number of recurrences ``r``
for every token, so every KV slot of Hugging Face's cache exists (no holes): prelude and coda blocks
attend to their single-depth keys,
core block j at recurrence s to the recurrence-s keys of all earlier positions — recomputing the
whole sequence causally gives exactly that. The initial state of position p is
:func:`rlt.platform.models.huginn.initial_state` of ``(seed, p)`` (zero when ``init_scale = 0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlt.platform.models.huginn import initial_state, rope_table
from rlt.platform.models.layers import apply_rope_pairs, rms_norm
from rlt.platform.models.ouro_reference import eager_attention


class HuginnReference:
    def __init__(self, cfg, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        self.rope = rope_table(cfg, weights)  # the stored freqs_cis when the checkpoint has one
        self.dtype = weights["transformer.wte.weight"].dtype

    def block(self, name: str, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``transformer.{name}`` (a sandwich block) over the whole sequence x ``[S, E]``, causal."""
        cfg, w, p = self.cfg, self.w, f"transformer.{name}."
        eps, e, nh, d = cfg.norm_eps, cfg.n_embd, cfg.n_heads, cfg.head_dim
        s = x.shape[0]
        q, k, v = F.linear(rms_norm(x, w[p + "norm_1.weight"], eps), w[p + "attn.Wqkv.weight"]).split([e, e, e], dim=-1)
        q, k, v = q.reshape(s, nh, d), k.reshape(s, nh, d), v.reshape(s, nh, d)
        if cfg.qk_bias:
            q = q + w[p + "attn.qk_bias"][0, 0]
            k = k + w[p + "attn.qk_bias"][1, 0]
        cos, sin = self.rope[pos, :, 0], self.rope[pos, :, 1]
        q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        attn = eager_attention(q, k, v, pos, pos, d ** -0.5)
        x = rms_norm(F.linear(attn, w[p + "attn.proj.weight"]) + x, w[p + "norm_2.weight"], eps)
        gate, up = F.linear(rms_norm(x, w[p + "norm_3.weight"], eps), w[p + "mlp.fc.weight"]).chunk(2, dim=-1)
        m = F.linear(F.silu(gate) * up, w[p + "mlp.proj.weight"])
        return rms_norm(m + x, w[p + "norm_4.weight"], eps)

    def forward(self, tokens: list[int], num_steps: int, *, seed: int = 0, init_scale: float = 0.0) -> torch.Tensor:
        """float32 logits ``[S, vocab]`` of the whole sequence at ``num_steps`` recurrences."""
        cfg, w = self.cfg, self.w
        pos = torch.arange(len(tokens))
        e = F.embedding(torch.tensor(tokens), w["transformer.wte.weight"]) * cfg.embed_scale
        for b in range(cfg.n_layers_in_prelude):
            e = self.block(f"prelude.{b}", e, pos)
        s = initial_state([seed] * len(tokens), pos.tolist(), [init_scale] * len(tokens), cfg, self.dtype, "cpu")
        for _ in range(num_steps):
            s = F.linear(torch.cat([s, e], dim=-1), w["transformer.adapter.weight"])
            for b in range(cfg.n_layers_in_recurrent_block):
                s = self.block(f"core_block.{b}", s, pos)
        x = rms_norm(s, w["transformer.ln_f.weight"], cfg.norm_eps)
        for b in range(cfg.n_layers_in_coda):
            x = self.block(f"coda.{b}", x, pos)
        head = w["transformer.wte.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
        return F.linear(rms_norm(x, w["transformer.ln_f.weight"], cfg.norm_eps), head).float()


def huginn_reference_generate(ref: HuginnReference, prompt: list[int], *, max_tokens: int, num_steps: int,
                              seed: int = 0, init_scale: float = 0.0,
                              stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy generation by the oracle at ``num_steps`` recurrences per token."""
    tokens, out = list(prompt), []
    while True:
        nxt = int(torch.argmax(ref.forward(tokens, num_steps, seed=seed, init_scale=init_scale)[-1]))
        out.append(nxt)
        if len(out) >= max_tokens or nxt in stop_token_ids:
            return out
        tokens.append(nxt)
