"""fp32 greedy output of the engine against the model math of ``transformers`` itself, on tiny checkpoints
written by rlt's writer in the Hugging Face layout.

No release of transformers ships Ouro, Huginn-0125 or Nanbeige (checked up to 5.25: their code is
``trust_remote_code`` only, and this suite never runs or downloads checkpoint code). What transformers
does ship is the Llama decoder, and both whole-stack families are built from it:

* **Nanbeige**: the checkpoint loads *unchanged* into ``LlamaForCausalLM`` (same weight names); the
  public ``NanbeigeModel.forward`` then runs the stack ``num_loops`` times with ``model.norm`` after
  every loop (once after the last with ``skip_loop_final_norm``), each loop on its own KV slots.
* **Ouro**: ``LlamaAttention`` / ``LlamaMLP`` / ``LlamaRMSNorm`` wired as the public
  ``OuroDecoderLayer`` (norm after each sublayer, then the residual add), the shared final norm
  after every loop, and ``OuroForCausalLM.forward``'s default read-out: loop ``early_exit_step``
  when the config sets one (every loop still computed), else the loop whose exit CDF (cumsum of the
  gate's pdf, the last loop taking the remaining mass) first reaches ``early_exit_threshold`` (1.0).

RoPE, GQA head mapping, eager attention and RMSNorm rounding are transformers' own, so a
convention error in rlt (rotation layout, θ, KV head order, norm order, eps) shows up as different
tokens. Huginn has no counterpart in transformers (interleaved-pair RoPE, sandwich blocks that
normalise after the add, the injection adapter): it is checked against rlt's eager reference only.

Runs in the ``lm-eval`` hatch environment (which installs transformers; written against transformers 5,
checked with 5.25); nothing is fetched.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama as llama  # noqa: E402

from rlt.platform import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from rlt.platform.checkpoint import load_checkpoint  # noqa: E402
from rlt.platform.checkpoint.tiny import write_tiny_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 41], [7, 8], [100, 3, 250, 12, 12, 60, 61, 19, 4, 300, 77], [11, 22, 33, 44, 55]]
NEW_TOKENS = 8


def _llama_config(cfg) -> LlamaConfig:
    c = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                    num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                    rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                    attention_bias=False, mlp_bias=False, hidden_act="silu",
                    tie_word_embeddings=cfg.tie_word_embeddings)
    c._attn_implementation = "eager"
    return c


def _out(x):
    return x[0] if isinstance(x, tuple) else x


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]


class _OuroLayer(nn.Module):
    """OuroDecoderLayer from Llama parts: h += n2(attn(n1(h))); h += n4(mlp(n3(h)))."""

    def __init__(self, config: LlamaConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = llama.LlamaAttention(config, idx)
        self.mlp = llama.LlamaMLP(config)
        for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            setattr(self, name, llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, h, pe, mask):
        a = _out(self.self_attn(self.input_layernorm(h), position_embeddings=pe, attention_mask=mask))
        h = h + self.input_layernorm_2(a)
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class _Ouro(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        config = _llama_config(cfg)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(_OuroLayer(config, i) for i in range(cfg.num_hidden_layers))
        self.model.norm = llama.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.model.early_exit_gate = nn.Linear(cfg.hidden_size, 1)
        self.model.rotary_emb = llama.LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loops, self.threshold, self.exit_at = cfg.total_ut_steps, cfg.early_exit_threshold, cfg.early_exit_step

    def last_logits(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Logits of the last position and the loop OuroForCausalLM's default forward reads them from."""
        x = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        h = self.model.embed_tokens(x)
        pe, mask = self.model.rotary_emb(h, pos), _causal(len(ids))
        states, gates = [], []
        for _ in range(self.loops):
            for layer in self.model.layers:
                h = layer(h, pe, mask)
            h = self.model.norm(h)
            states.append(h)
            gates.append(self.model.early_exit_gate(h))
        if self.exit_at is not None and 0 <= self.exit_at < self.loops:  # config.early_exit_step wins
            return self.lm_head(states[self.exit_at][0, -1]), self.exit_at
        pdf, remaining = [], torch.ones_like(gates[0].squeeze(-1))
        for i, g in enumerate(gates):
            lam = torch.sigmoid(g.squeeze(-1))
            pdf.append(lam * remaining if i < len(gates) - 1 else remaining)
            remaining = remaining * (1.0 - lam)
        reached = torch.cumsum(torch.stack(pdf, dim=2), dim=2) >= self.threshold
        step = int(torch.argmax(reached.float(), dim=2)[0, -1]) if bool(reached[0, -1].any()) else self.loops - 1
        return self.lm_head(states[step][0, -1]), step


def _nanbeige_logits(model: LlamaForCausalLM, cfg, ids: list[int]) -> torch.Tensor:
    """NanbeigeModel.forward over LlamaForCausalLM's modules: the stack num_loops times."""
    m = model.model
    pos = torch.arange(len(ids))[None]
    h = m.embed_tokens(torch.tensor([ids]))
    pe, mask = m.rotary_emb(h, pos), _causal(len(ids))
    for _ in range(cfg.num_loops):
        for layer in m.layers:
            h = _out(layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe))
        if not cfg.skip_loop_final_norm:
            h = m.norm(h)
    if cfg.skip_loop_final_norm:
        h = m.norm(h)
    return model.lm_head(h[0, -1])


def _greedy(next_logits, prompt: list[int]) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(NEW_TOKENS):
        tok = int(torch.argmax(next_logits(ids).float()))
        out.append(tok)
        ids.append(tok)
    return out


def _engine_greedy(path) -> list[list[int]]:
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4))
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: list(o.token_ids) for o in eng.step() if o.finished})
    return [outs[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("overrides", [
    {},  # GQA 4/2, head_dim 8
    {"num_key_value_heads": 1, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "total_ut_steps": 3},
    {"num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": True},  # q dim 64 != hidden 32
    {"early_exit_step": 1},  # HF computes all four loops and reads loop 1
])
@torch.inference_mode()
def test_ouro_equals_transformers_llama_parts(tmp_path, overrides):
    path = write_tiny_checkpoint(tmp_path / "ouro", family="ouro", seed=21, **overrides)
    ck = load_checkpoint(path, dtype=torch.float32)
    model = _Ouro(ck.config).eval()
    weights = dict(ck.weights)
    if ck.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=False)
    missing = {k for k, _ in model.named_parameters()} - set(weights)
    assert not missing, missing
    steps = []

    def logits(ids):
        out, step = model.last_logits(ids)
        steps.append(step)
        return out

    want = [_greedy(logits, p) for p in PROMPTS]
    # these gates never saturate, so HF's default read-out is the last loop rlt runs (or early_exit_step)
    assert set(steps) == {ck.config.default_loops - 1}
    assert _engine_greedy(path) == want


@pytest.mark.parametrize("overrides", [
    {},  # GQA 4/2, head_dim 16: q dim 64 != hidden 32, two loops
    {"skip_loop_final_norm": True, "num_loops": 3, "rope_theta": 7e7},
    {"num_key_value_heads": 1, "rms_norm_eps": 1e-6, "num_loops": 1},
])
@torch.inference_mode()
def test_nanbeige_equals_transformers_llama(tmp_path, overrides):
    path = write_tiny_checkpoint(tmp_path / "nanbeige", family="nanbeige", seed=22, **overrides)
    ck = load_checkpoint(path, dtype=torch.float32)
    model = LlamaForCausalLM(_llama_config(ck.config)).eval()
    model.load_state_dict(ck.weights, strict=True)  # a Nanbeige checkpoint has exactly Llama's weight names
    want = [_greedy(lambda ids: _nanbeige_logits(model, ck.config, ids), p) for p in PROMPTS]
    assert _engine_greedy(path) == want
