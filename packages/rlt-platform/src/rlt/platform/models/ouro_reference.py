"""The eager reference of Ouro: the test oracle.

Plain tensors, no paging, no fusion, unfused Hugging Face weight names, whole-sequence recompute.
It states the semantics every execution path must reproduce token for token in float32:

* **LAST_EXITED** (default): a query at loop depth ``d`` reads an earlier token's K/V from depth
  ``min(d, e)``, where ``e`` is the loop that token exited at (prompt tokens run every loop). The
  whole sequence is recomputed depth-major for every generated token; with fixed depth this is
  exactly Hugging Face's ``OuroForCausalLM`` forward.
* **SHARED**: one KV version per position, overwritten by each loop, so later tokens read an
  earlier token's last version at every depth. Positions are processed in order, each through all
  its loops (prompt tokens too), which is what keeps it independent of chunking.

Exit rule (per generated token, fp32): after loop t (1-based) λ_t = sigmoid(gate(H_t)),
``remaining *= 1 - λ_t``; exit after the first t with t >= min_loops and 1 - remaining >= τ, and
always at max_loops; τ >= 1 means fixed depth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlt.platform.models.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


def eager_attention(q, k, v, q_pos, k_pos, scale: float) -> torch.Tensor:
    """Eager attention (HF order) of q [S,nh,d] over k/v [C,nkv,d]; causal by positions; GQA by
    repeating each KV head over its group of query heads."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [nh, C, d]
    v = v.repeat_interleave(g, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale
    mask = k_pos[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask[None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(q.shape[0], -1)


class OuroReference:
    def __init__(self, cfg, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.num_loops = getattr(cfg, "default_loops", None) or cfg.num_loops

    # -- one layer, dense ------------------------------------------------------------------------
    def _qkv(self, l: int, h: torch.Tensor, cos, sin):
        cfg, w, p = self.cfg, self.w, f"model.layers.{l}."
        a = rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        s = h.shape[0]
        q = F.linear(a, w[p + "self_attn.q_proj.weight"]).view(s, cfg.num_attention_heads, cfg.head_dim)
        k = F.linear(a, w[p + "self_attn.k_proj.weight"]).view(s, cfg.num_key_value_heads, cfg.head_dim)
        v = F.linear(a, w[p + "self_attn.v_proj.weight"]).view(s, cfg.num_key_value_heads, cfg.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q, k, v, q_pos, k_pos):
        return eager_attention(q, k, v, q_pos, k_pos, self.cfg.head_dim ** -0.5)

    def _finish_layer(self, l: int, h, attn):
        cfg, w, p = self.cfg, self.w, f"model.layers.{l}."
        eps = cfg.rms_norm_eps
        h = h + rms_norm(F.linear(attn, w[p + "self_attn.o_proj.weight"]), w[p + "input_layernorm_2.weight"], eps)
        m = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        m = F.silu(F.linear(m, w[p + "mlp.gate_proj.weight"])) * F.linear(m, w[p + "mlp.up_proj.weight"])
        return h + rms_norm(F.linear(m, w[p + "mlp.down_proj.weight"]), w[p + "post_attention_layernorm_2.weight"], eps)

    def _loop_end(self, h: torch.Tensor) -> torch.Tensor:
        """The shared final norm after every loop (its output is the next loop's input)."""
        return rms_norm(h, self.w["model.norm.weight"], self.cfg.rms_norm_eps)

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.w
        return (hidden.float() @ w["model.early_exit_gate.weight"].float().T + w["model.early_exit_gate.bias"].float()).squeeze(-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.w["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        return F.linear(hidden, head).float()

    # -- LAST_EXITED: whole-sequence recompute, depth-major -------------------------------------
    def forward_last_exited(self, tokens: list[int], exit_depths: list[int], num_loops: int):
        """Hidden state after every loop ``[num_loops, S, H]``.

        ``exit_depths[i]`` is the 0-based loop token i exited at; tokens still running (the last
        one) pass ``num_loops``.
        """
        cfg = self.cfg
        ids = torch.tensor(tokens)
        pos = torch.arange(len(tokens))
        e = torch.tensor(exit_depths)
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        h = F.embedding(ids, self.w["model.embed_tokens.weight"])
        keys: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_hidden_layers)]
        vals: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_hidden_layers)]
        states = []
        for d in range(num_loops):
            src = torch.clamp(e, max=d)  # depth each key is read from
            for l in range(cfg.num_hidden_layers):
                q, k, v = self._qkv(l, h, cos, sin)
                keys[l].append(k)
                vals[l].append(v)
                kd = torch.stack(keys[l])[src, pos]
                vd = torch.stack(vals[l])[src, pos]
                h = self._finish_layer(l, h, self._attend(q, kd, vd, pos, pos))
            h = self._loop_end(h)
            states.append(h)
        return torch.stack(states)

    # -- SHARED: positions in order, each through its loops --------------------------------------
    def run_position_shared(self, cache, token: int, position: int, loops_fn):
        """Run one position through its loops; ``cache`` holds per-layer final K/V lists.

        ``loops_fn(depth, hidden) -> bool`` is asked after every loop whether the token exits.
        Returns (hidden states per executed loop).
        """
        cfg = self.cfg
        pos = torch.tensor([position])
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        h = F.embedding(torch.tensor([token]), self.w["model.embed_tokens.weight"])
        k_pos = torch.arange(position + 1)
        states = []
        d = 0
        while True:
            latest = []
            for l in range(cfg.num_hidden_layers):
                q, k, v = self._qkv(l, h, cos, sin)
                kd = torch.cat([*cache[l][0], k]) if cache[l][0] else k
                vd = torch.cat([*cache[l][1], v]) if cache[l][1] else v
                latest.append((k, v))
                h = self._finish_layer(l, h, self._attend(q, kd, vd, pos, k_pos))
            h = self._loop_end(h)
            states.append(h)
            if loops_fn(d, h):
                break
            d += 1
        for l, (k, v) in enumerate(latest):
            cache[l][0].append(k)
            cache[l][1].append(v)
        return states


class ExitRule:
    """The exit rule of one generated token, stated plainly (fp32 scalars)."""

    def __init__(self, min_loops: int, max_loops: int, threshold: float) -> None:
        self.min_loops, self.max_loops, self.threshold = min_loops, max_loops, threshold
        self.remaining = torch.tensor(1.0, dtype=torch.float32)

    def exits_after(self, loop: int, gate_logit: torch.Tensor) -> bool:
        """``loop`` is 1-based."""
        lam = torch.sigmoid(gate_logit.float().reshape(()))
        self.remaining = self.remaining * (1.0 - lam)
        if loop >= self.max_loops:
            return True
        if self.threshold >= 1.0 or loop < self.min_loops:
            return False
        return bool((1.0 - self.remaining) >= self.threshold)


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
              repetition: float) -> torch.Tensor:
    """vLLM's penalties, token by token (the engine's vectorised form is ``rlt.platform.engine.penalties``):
    each token of the prompt or the output has a positive logit divided by ``repetition``, a negative one
    multiplied; each generated token loses ``frequency`` per occurrence and ``presence`` once."""
    z = logits.float().clone()
    for t in set(prompt) | set(output):
        z[t] = z[t] / repetition if z[t] > 0 else z[t] * repetition
    for t in set(output):
        z[t] = z[t] - frequency * output.count(t) - presence
    return z


def reference_generate(
    ref: OuroReference,
    prompt: list[int],
    *,
    max_tokens: int,
    layout: str = "last_exited",
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_threshold: float = 1.0,
    stop_token_ids: tuple[int, ...] = (),
    gaps: list[float] | None = None,
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0),
) -> tuple[list[int], list[int]]:
    """Greedy generation by the oracle: (generated token ids, their exit depths, 1-based loops).

    ``gaps``, when given, receives each generated token's logit margin over the runner-up: a margin of
    a few fp32 ulps is a tie that any other (equally exact) summation order may break the other way —
    randomised comparisons use it to tell such a tie from a wrong token. ``penalties``: (presence,
    frequency, repetition) applied to each pick's logits (:func:`penalised`)."""
    max_loops = max_loops or ref.num_loops

    def pick(logits: torch.Tensor) -> int:
        if penalties != (0.0, 0.0, 1.0):
            logits = penalised(logits, prompt, out, *penalties)
        if gaps is not None:
            top = torch.topk(logits.double(), 2).values
            gaps.append(float(top[0] - top[1]))
        return int(torch.argmax(logits))

    out: list[int] = []
    depths: list[int] = []
    if layout == "last_exited":
        tokens = list(prompt)
        exits = [max_loops - 1] * len(prompt)
        states = ref.forward_last_exited(tokens, exits, max_loops)
        nxt = pick(ref.logits(states[max_loops - 1, -1]))
        depth = max_loops
        while True:
            out.append(nxt)
            depths.append(depth)
            if len(out) >= max_tokens or nxt in stop_token_ids:
                return out, depths
            tokens.append(nxt)
            states = ref.forward_last_exited(tokens, exits + [max_loops], max_loops)
            rule = ExitRule(min_loops, max_loops, exit_threshold)
            for t in range(1, max_loops + 1):
                if rule.exits_after(t, ref.gate(states[t - 1, -1])):
                    break
            exits.append(t - 1)
            nxt = pick(ref.logits(states[t - 1, -1]))
            depth = t
    if layout != "shared":
        raise ValueError(f"unknown layout {layout!r}")
    cache = [([], []) for _ in range(ref.cfg.num_hidden_layers)]
    last = None
    for i, tok in enumerate(prompt):
        last = ref.run_position_shared(cache, tok, i, lambda d, h: d + 1 >= max_loops)
    nxt = pick(ref.logits(last[-1][0]))
    depth = max_loops
    pos = len(prompt)
    while True:
        out.append(nxt)
        depths.append(depth)
        if len(out) >= max_tokens or nxt in stop_token_ids:
            return out, depths
        rule = ExitRule(min_loops, max_loops, exit_threshold)
        states = ref.run_position_shared(cache, nxt, pos, lambda d, h: rule.exits_after(d + 1, ref.gate(h[0])))
        pos += 1
        nxt = pick(ref.logits(states[-1][0]))
        depth = len(states)
