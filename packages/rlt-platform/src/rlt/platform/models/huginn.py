"""Huginn-0125 ("raven", ``model_type = huginn_raven``): config, weights, runtime stages.

Architecture (models.md §2.4)::

    e = wte[ids] * embed_scale;  e = prelude_blocks(e)            # e: the injection
    s = initial_state()                                           # per token, see below
    repeat r times:  s = core_blocks(adapter(concat[s, e]))       # no norm inside the recurrence
    x = ln_f(s);  x = coda_blocks(x);  logits = head(ln_f(x))     # tied head, fp32 logits

A sandwich block normalises *after* each residual add: ``x = n2(x + attn(n1(x)))``,
``x = n4(x + mlp(n3(x)))``; ``Wqkv`` is stored fused (rows q, k, v), ``mlp.fc`` fused (gate, up);
an additive per-head q/k bias precedes the interleaved-pair RoPE, which runs in float32 (θ =
``rope_base``); MHA. ``r`` is per request (default ``mean_recurrence``); there is no exit gate.

Initial state (``like-init``): per token, a truncated normal N(0, σ²) clipped at ±3σ with σ =
``init_values.std * init_scale``, times ``embed_scale``; ``init_scale = 0`` gives the zero state.
HF draws it from the global RNG, so its output depends on the batch; here
:func:`initial_state` draws token ``p`` of a request from a generator seeded by ``(seed, p)``, so a
request's state depends only on its own seed (and never on chunking, batch or arrival order).

Checkpoints hold fp32 weights (cast to the serving dtype at load), may carry ``lm_head.weight``
(tied: ignored, the embedding is the head) and ``freqs_cis`` (the RoPE table: used as stored, in
float32, exactly as the reference uses its persistent buffer; computed in float32 when absent — see
:func:`rope_table`), and ship ``.py`` files that rlt never runs. The embedding scale is
``sqrt(n_embd)`` whatever ``init_values["embed_scale"]`` says (the reference's ``emb_scale``); the
initial state's σ is ``init_values["std"]``.

Executor contract (what an engine must do to serve Huginn; the stages below are the whole model;
:class:`rlt.platform.engine.boundary.BoundaryExecutor` implements it)
--------------------------------------------------------------------------------------------------
Two KV caches, both addressed through the usual :class:`AttentionMetadata`:

* **core** cache: ``shape.num_layers`` (= core blocks) layers, one plane per recurrence up to the
  engine's maximum recurrence count (LAST_EXITED; plane d = recurrence d);
* **boundary** cache: ``shape.num_boundary_layers`` (= prelude + coda blocks) layers with ONE
  plane (layout SHARED, no version map): prelude block j is layer ``j``, coda block j is layer
  ``n_prelude + j``. Its metadata has every row at depth 0 and one page table per row.

Per request: its recurrence count ``r`` (1..max), its init seed and ``init_scale``. Per slot
(as the executor keeps ``hidden`` today, and for multi-token chunks per chunk): the injection
``e [tokens, E]`` (written once by ``prelude``, read by every recurrence of those tokens) and the
recurrent state ``s [tokens, E]``.

Per token (prompt chunk or decoded token), in order:

1. ``rope = model.rotary(positions)`` (float32 cos/sin ``[N, head_dim/2]``, shared by all stages);
2. ``e = model.prelude(token_ids, rope, boundary_kv, attention, boundary_meta)`` — embeds and runs
   the prelude blocks, writing their KV at the tokens' positions (boundary layers 0..n_prelude-1);
3. ``s = model.initial_state(seeds, positions, init_scales)`` (seeds/scales per token);
4. for d in 0..r-1: stamp depth d (LAST_EXITED) and ``s = model.recurrent(s, rope, core_kv,
   attention, core_meta_at_depth_d, injection=e)`` — rows at different depths (and requests with
   different r) may share one call, exactly as for Ouro; ``exit_logit`` is ``-inf`` (no gate), so
   a row exits when it reaches its own r (``max_loops``);
5. on exit: ``logits = model.coda(s, rope, boundary_kv, attention, boundary_meta,
   sample_rows=last)`` — runs ``ln_f`` and the coda blocks over EVERY token of the row (their
   coda KV is read by later tokens; boundary layers n_prelude..), then ``ln_f`` and the head
   only on the rows given in ``sample_rows`` (indices into the tokens), float32 ``[len, vocab]``.

Tokens of one request reach the coda in position order (a token is decoded only after the previous
one's coda), so every coda query finds the coda KV of all earlier positions.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from rlt.attention import AttentionBackend, AttentionMetadata, KVCache
from rlt.platform.errors import CheckpointError
from rlt.platform.models.base import LoopedModel, ModelFamily, ModelShape, no_exit_gate
from rlt.platform.models.fused_ops import silu_mul
from rlt.platform.models.layers import apply_rope_pairs, rms_norm, rope_inv_freq, rope_pair_cos_sin
from rlt.platform.models.stack import ConfigReader

GROUPS = ("prelude", "core_block", "coda")
BLOCK_NORMS = ("norm_1", "norm_2", "norm_3", "norm_4")
_MASK64 = (1 << 64) - 1


def _aliased(r: ConfigReader, name: str, alias: str) -> int:
    """A RavenConfig field that its ``attribute_map`` also reads under a Llama name (``hidden_size`` ->
    ``n_embd``, ``num_attention_heads`` -> ``n_heads``, ``num_hidden_layers`` -> ``n_layers``)."""
    values = {k: int(r.raw[k]) for k in (name, alias) if r.raw.get(k) is not None}
    if not values:
        r.need(name)
    if len(set(values.values())) > 1:
        raise CheckpointError(f"config.json gives {name} = {values[name]} but its alias {alias} = {values[alias]}; "
                              "they must agree")
    return next(iter(values.values()))


@attrs.frozen
class HuginnConfig:
    vocab_size: int  # the embedding / head rows (padded_vocab_size)
    n_embd: int
    n_heads: int
    head_dim: int
    intermediate_size: int
    n_layers_in_prelude: int
    n_layers_in_recurrent_block: int
    n_layers_in_coda: int
    block_size: int
    rope_base: float
    norm_eps: float
    qk_bias: bool
    tie_embeddings: bool
    mean_recurrence: int
    init_std: float
    embed_scale: float
    torch_dtype: str | None
    eos_token_id: Any = None
    bos_token_id: Any = None

    # Names the engine reads on every family.
    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def max_position_embeddings(self) -> int:
        return self.block_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "HuginnConfig":
        r = ConfigReader(raw, "huginn_raven")
        e = _aliased(r, "n_embd", "hidden_size")
        heads = _aliased(r, "n_heads", "num_attention_heads")
        prelude, core, coda = (int(r.need(f"n_layers_in_{g}")) for g in ("prelude", "recurrent_block", "coda"))
        n_layers = _aliased(r, "n_layers", "num_hidden_layers")
        if n_layers != prelude + core + coda:
            raise CheckpointError(f"n_layers is {n_layers} but n_layers_in_prelude + n_layers_in_recurrent_block + "
                                  f"n_layers_in_coda is {prelude} + {core} + {coda} = {prelude + core + coda}; "
                                  "fix config.json so they agree")
        r.positive("n_layers_in_recurrent_block", core)
        if e % heads:
            raise CheckpointError(f"n_embd ({e}) must be a multiple of n_heads ({heads})")
        head_dim = e // heads
        if int(r.get("head_dim", head_dim)) != head_dim or head_dim % 2:
            raise CheckpointError(f"head_dim must be n_embd / n_heads = {e} / {heads} and even, got {r.get('head_dim')}")
        if int(r.get("num_key_value_heads", heads)) != heads:
            raise CheckpointError("Huginn's fused Wqkv is multi-head attention: num_key_value_heads must equal n_heads")
        expected = {"injection_type": "linear", "norm_class_name": "RMSNorm_llama", "block_class_name": "SandwichBlock",
                    "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU"}
        for key, want in expected.items():
            if r.get(key, want) != want:
                raise CheckpointError(f"{key} {raw[key]!r} is not supported for Huginn (only {want!r}, as released)")
        r.refuse("Huginn", ("bias",), "a Linear bias")
        if float(r.get("test_time_noise", 0)):
            raise CheckpointError("test_time_noise is not supported for Huginn (the release serves with noise 0)")
        init_values = r.get("init_values", {})
        if not isinstance(init_values, dict):
            raise CheckpointError(f"init_values must be an object (with 'std' and 'embed_scale'), got {init_values!r}")
        mean_recurrence = r.positive("mean_recurrence", int(r.get("mean_recurrence", 32)))
        # RavenConfig derives init_values from its n_embd argument (5280 when only the hidden_size alias is
        # given); a stored init_values replaces that.
        default_std = math.sqrt(2 / (5 * int(r.get("n_embd", 5280))))
        return cls(
            vocab_size=int(r.get("padded_vocab_size", r.need("vocab_size"))),
            n_embd=e,
            n_heads=heads,
            head_dim=head_dim,
            intermediate_size=int(r.need("intermediate_size")),
            n_layers_in_prelude=prelude,
            n_layers_in_recurrent_block=core,
            n_layers_in_coda=coda,
            block_size=int(r.get("block_size", 4096)),
            rope_base=float(r.get("rope_base", 50000)),
            norm_eps=float(r.get("norm_eps", 1e-6)),
            qk_bias=bool(r.get("qk_bias", True)),
            tie_embeddings=bool(r.get("tie_embeddings", True)),
            mean_recurrence=mean_recurrence,
            init_std=float(init_values.get("std", default_std)),
            # The reference scales by sqrt(n_embd) (its emb_scale property), never by a stored
            # init_values["embed_scale"]: a config copied from the release keeps 72.66 whatever n_embd is.
            embed_scale=math.sqrt(e),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_id=raw.get("eos_token_id"),
            bos_token_id=raw.get("bos_token_id"),
        )

    def blocks(self) -> list[tuple[str, int]]:
        """(group, index) of every block in execution order: prelude, core, coda."""
        sizes = (self.n_layers_in_prelude, self.n_layers_in_recurrent_block, self.n_layers_in_coda)
        return [(g, b) for g, n in zip(GROUPS, sizes) for b in range(n)]


def huginn_expected_weights(cfg: HuginnConfig) -> dict[str, tuple[int, ...]]:
    e, i = cfg.n_embd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (cfg.vocab_size, e),
        "transformer.adapter.weight": (e, 2 * e),
        "transformer.ln_f.weight": (e,),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, e)
    for g, b in cfg.blocks():
        p = f"transformer.{g}.{b}."
        shapes.update({p + n + ".weight": (e,) for n in BLOCK_NORMS})
        shapes.update({p + "attn.Wqkv.weight": (3 * e, e), p + "attn.proj.weight": (e, e),
                       p + "mlp.fc.weight": (2 * i, e), p + "mlp.proj.weight": (e, i)})
        if cfg.qk_bias:
            shapes[p + "attn.qk_bias"] = (2, 1, cfg.n_heads, cfg.head_dim)
    return shapes


def huginn_optional_weights(cfg: HuginnConfig) -> dict[str, tuple[int, ...]]:
    """A tied head (accepted, never read) and the stored RoPE table (read when present, models.md §2.3)."""
    out = {"freqs_cis": (1, cfg.block_size, 1, cfg.head_dim // 2, 2)}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.n_embd)
    return out


def rope_table(cfg: HuginnConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 RoPE table ``[block_size, head_dim / 2, 2]`` (cos, sin) of a checkpoint.

    The reference registers ``freqs_cis`` as a *persistent* buffer, so when a checkpoint stores one it
    is that table the reference rotates with (a table saved in bf16, or computed on another device,
    is used as stored); without one it is computed as the reference computes it: float32 angles
    ``p * rope_base^(-2i/d)`` for every position below ``block_size``, on the CPU.
    """
    stored = weights.get("freqs_cis")
    if stored is not None:
        return stored.reshape(cfg.block_size, cfg.head_dim // 2, 2).float()
    cos, sin = rope_pair_cos_sin(torch.arange(cfg.block_size), rope_inv_freq(cfg.head_dim, cfg.rope_base))
    return torch.stack((cos, sin), dim=-1)


def initial_state(seeds: list[int], positions: list[int], scales: list[float], cfg: HuginnConfig,
                  dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The start state ``[N, E]`` of each token: TruncNormal(0, σ², ±3σ) · embed_scale, σ = std · scale.

    Token i is drawn on the CPU, in float32, from a generator seeded by ``(seeds[i], positions[i])``:
    the same request token gets the same state in any batch. ``scale == 0`` gives zeros.
    """
    out = torch.zeros(len(seeds), cfg.n_embd, dtype=torch.float32)
    gen = torch.Generator()
    for row, (seed, pos, scale) in enumerate(zip(seeds, positions, scales)):
        std = cfg.init_std * float(scale)
        if std > 0:
            gen.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(pos) * 0xBF58476D1CE4E5B9 + 1) & _MASK64)
            torch.nn.init.trunc_normal_(out[row], mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    return (out * cfg.embed_scale).to(device=device, dtype=dtype)


@attrs.frozen(eq=False)
class _Block:
    qkv: torch.Tensor
    q_bias: torch.Tensor | None  # [heads, d]
    k_bias: torch.Tensor | None
    proj: torch.Tensor
    fc: torch.Tensor
    down: torch.Tensor
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class HuginnModel(LoopedModel):
    """Runtime Huginn: the stages of the executor contract in the module docstring."""

    has_exit_gate = False
    boundary_attention = True
    per_request_depth = True
    has_initial_state = True

    def __init__(self, cfg: HuginnConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.shape = ModelShape(
            num_layers=cfg.n_layers_in_recurrent_block,
            num_kv_heads=cfg.n_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.n_embd,
            vocab_size=cfg.vocab_size,
            num_loops=cfg.mean_recurrence,
            max_position_embeddings=cfg.block_size,
            num_boundary_layers=cfg.n_layers_in_prelude + cfg.n_layers_in_coda,
        )
        w = weights
        self.wte = w["transformer.wte.weight"]
        self.anchor = self.wte
        self.head = self.wte if cfg.tie_embeddings else w["lm_head.weight"]
        self.adapter = w["transformer.adapter.weight"]
        self.ln_f = w["transformer.ln_f.weight"]
        blocks: dict[str, list[_Block]] = {g: [] for g in GROUPS}
        for g, b in cfg.blocks():
            p = f"transformer.{g}.{b}."
            bias = w.get(p + "attn.qk_bias")
            blocks[g].append(_Block(
                qkv=w[p + "attn.Wqkv.weight"], proj=w[p + "attn.proj.weight"], fc=w[p + "mlp.fc.weight"],
                down=w[p + "mlp.proj.weight"], norms=tuple(w[p + n + ".weight"] for n in BLOCK_NORMS),
                q_bias=None if bias is None else bias[0, 0], k_bias=None if bias is None else bias[1, 0],
            ))
        self.prelude_blocks, self.core_blocks, self.coda_blocks = (blocks[g] for g in GROUPS)
        table = rope_table(cfg, weights).to(self.wte.device)
        #: float32 cos / sin ``[block_size, head_dim / 2]`` (:func:`rope_table`)
        self.rope_cos, self.rope_sin = table[..., 0].contiguous(), table[..., 1].contiguous()
        self.scale = cfg.head_dim ** -0.5

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)

    def _block(self, blk: _Block, layer: int, x: torch.Tensor, rope, kv: KVCache, attention: AttentionBackend,
               meta: AttentionMetadata) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.norm_eps
        n1, n2, n3, n4 = blk.norms
        n = x.shape[0]
        q, k, v = F.linear(rms_norm(x, n1, eps), blk.qkv).view(n, 3, cfg.n_heads, cfg.head_dim).unbind(1)
        if blk.q_bias is not None:
            q, k = q + blk.q_bias, k + blk.k_bias
        cos, sin = rope
        q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        attention.write_kv(kv, layer, k, v.contiguous(), meta)
        o = attention.forward(q.contiguous(), kv, layer, meta, self.scale)
        x = rms_norm(x + F.linear(o, blk.proj), n2, eps)
        return rms_norm(x + F.linear(silu_mul(F.linear(rms_norm(x, n3, eps), blk.fc)), blk.down), n4, eps)

    # -- stages ----------------------------------------------------------------------------------
    def prelude(self, token_ids: torch.Tensor, rope=None, kv: KVCache | None = None,
                attention: AttentionBackend | None = None, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The injection ``[N, E]``: scaled embedding through the prelude blocks (boundary KV)."""
        if kv is None:
            raise TypeError("Huginn's prelude runs attention: pass rope, the boundary KV cache, attention and meta")
        x = F.embedding(token_ids, self.wte) * self.cfg.embed_scale
        for j, blk in enumerate(self.prelude_blocks):
            x = self._block(blk, j, x, rope, kv, attention, meta)
        return x

    def initial_state(self, seeds: list[int], positions: list[int], scales: list[float]) -> torch.Tensor:
        return initial_state(seeds, positions, scales, self.cfg, self.dtype, self.device)

    def recurrent(self, hidden, rope, kv: KVCache, attention: AttentionBackend, meta: AttentionMetadata,
                  injection: torch.Tensor | None = None) -> torch.Tensor:
        """One recurrence: ``core_blocks(adapter(concat[hidden, injection]))`` on the core KV."""
        if injection is None:
            raise TypeError("Huginn's recurrent stage needs the rows' injection (the prelude output)")
        x = F.linear(torch.cat([hidden, injection], dim=-1), self.adapter)
        for j, blk in enumerate(self.core_blocks):
            x = self._block(blk, j, x, rope, kv, attention, meta)
        return x

    def exit_logit(self, hidden: torch.Tensor) -> torch.Tensor:
        """No gate (fixed per-request depth)."""
        return no_exit_gate(hidden)

    def coda(self, hidden: torch.Tensor, rope=None, kv: KVCache | None = None,
             attention: AttentionBackend | None = None, meta: AttentionMetadata | None = None,
             sample_rows: torch.Tensor | None = None) -> torch.Tensor:
        """ln_f, coda blocks over every token (boundary KV), then ln_f + tied head on ``sample_rows``."""
        if kv is None:
            raise TypeError("Huginn's coda runs attention: pass rope, the boundary KV cache, attention and meta")
        eps, base = self.cfg.norm_eps, self.cfg.n_layers_in_prelude
        x = rms_norm(hidden, self.ln_f, eps)
        for j, blk in enumerate(self.coda_blocks):
            x = self._block(blk, base + j, x, rope, kv, attention, meta)
        if sample_rows is not None:
            x = x.index_select(0, sample_rows)
        return F.linear(rms_norm(x, self.ln_f, eps), self.head).float()


def _build_reference(cfg: HuginnConfig, weights: dict[str, torch.Tensor]):
    from rlt.platform.models.huginn_reference import HuginnReference

    return HuginnReference(cfg, weights)


HUGINN = ModelFamily(
    model_type="huginn_raven",
    parse_config=HuginnConfig.from_dict,
    expected_weights=huginn_expected_weights,
    build_runtime=HuginnModel,
    build_reference=_build_reference,
    default_stop_token_ids=(65505, 65508),  # <|end_text|>, <|end_turn|> (models.md §2.6)
    stop_tokens=("<|end_text|>", "<|end_turn|>"),
    optional_weights=huginn_optional_weights,
    optional_read=("freqs_cis",),
)
