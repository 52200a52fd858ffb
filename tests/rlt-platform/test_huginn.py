"""Huginn-0125: the runtime stages (driven over paged KV by a test-only executor) are token-identical
in fp32 greedy to the eager reference, across recurrence counts 1/4/32, mixed per-request counts in
one batch, batch sizes, mixed lengths and arrivals mid-decode; plus the seeded initial state, the
RoPE layout, the checkpoint variants, bad checkpoints, the template and stop ids. The engine serving
Huginn is tested in test_huginn_engine.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import random_prompts
from huginn_driver import HuginnDriver
from rlt.platform import CheckpointError
from rlt.platform.checkpoint import RltTokenizer, load_checkpoint
from rlt.platform.checkpoint.tiny import write_tiny_checkpoint
from rlt.platform.models import MODEL_FAMILIES
from rlt.platform.models.huginn import initial_state
from rlt.platform.models.huginn_reference import huginn_reference_generate
from rlt.platform.models.layers import apply_rope_pairs, rope_inv_freq, rope_pair_cos_sin

VOCAB = 320


def _load(path, dtype=torch.float32):
    ck = load_checkpoint(path, dtype=dtype)
    return ck, ck.family.build_runtime(ck.config, ck.weights), ck.family.build_reference(ck.config, ck.weights)


def _check(path, requests, *, max_steps=32, max_tokens=5):
    """requests: (arrival step, prompt, num_steps, seed, init_scale); driver == reference for each."""
    _, model, ref = _load(path)
    driver = HuginnDriver(model, max_steps=max_steps, max_seqs=len(requests))
    arrivals = [(t, f"r{i}", p, dict(num_steps=r, seed=s, init_scale=sc, max_tokens=max_tokens))
                for i, (t, p, r, s, sc) in enumerate(requests)]
    got = driver.run(arrivals)
    for i, (_, p, r, s, sc) in enumerate(requests):
        want = huginn_reference_generate(ref, p, max_tokens=max_tokens, num_steps=r, seed=s, init_scale=sc)
        assert got[f"r{i}"] == want, f"request {i}: prompt {p}, {r} recurrences"
    return got


@pytest.mark.parametrize("num_steps", [1, 4, 32])
def test_recurrence_counts_match_reference(tiny_checkpoint, num_steps):
    path = tiny_checkpoint(family="huginn_raven", seed=1)
    prompts = random_prompts(3, VOCAB, seed=num_steps, lo=2, hi=9)
    _check(path, [(0, p, num_steps, 0, 0.0) for p in prompts], max_tokens=4 if num_steps == 32 else 6)


@pytest.mark.parametrize("batch", [1, 5])
def test_batch_sizes_and_arrivals_mid_decode(tiny_checkpoint, batch):
    path = tiny_checkpoint(family="huginn_raven", seed=2)
    prompts = random_prompts(batch, VOCAB, seed=10 + batch)
    _check(path, [(3 * i, p, 3, 0, 0.0) for i, p in enumerate(prompts)], max_steps=4)


def test_mixed_recurrence_counts_in_one_batch(tiny_checkpoint):
    """Rows at different depths share each recurrent call; requests with r = 1, 2, 5, 7 and 3."""
    path = tiny_checkpoint(family="huginn_raven", seed=3)
    prompts = random_prompts(5, VOCAB, seed=3)
    got = _check(path, [(0, prompts[0], 1, 0, 0.0), (0, prompts[1], 2, 0, 0.0), (0, prompts[2], 5, 0, 0.0),
                        (1, prompts[3], 7, 0, 0.0), (4, prompts[4], 3, 0, 0.0)], max_steps=8)
    # the recurrence count must matter here, or the test proves nothing about per-request depth
    _, model, ref = _load(path)
    assert any(huginn_reference_generate(ref, p, max_tokens=5, num_steps=r) != got[f"r{i}"]
               for i, (p, r) in enumerate(zip(prompts, [7, 5, 1, 2, 2])))


def test_seeded_random_state_is_per_request(tiny_checkpoint):
    """init_scale 1: a request's output depends on its seed only, not on its batch or arrival."""
    path = tiny_checkpoint(family="huginn_raven", seed=4)
    prompts = random_prompts(3, VOCAB, seed=4)
    together = _check(path, [(0, p, 2, 100 + i, 1.0) for i, p in enumerate(prompts)], max_steps=2)
    alone = _check(path, [(0, prompts[1], 2, 101, 1.0)], max_steps=2)
    assert alone["r0"] == together["r1"]
    _, _, ref = _load(path)
    outs = {tuple(huginn_reference_generate(ref, prompts[1], max_tokens=5, num_steps=2, seed=s, init_scale=sc))
            for s, sc in ((101, 1.0), (7, 1.0), (0, 0.0))}
    assert len(outs) > 1  # the state actually changes the output at 2 recurrences


def test_initial_state():
    cfg = MODEL_FAMILIES["huginn_raven"].parse_config(
        write_tiny_config_dict(n_embd=32, init_values={"std": 0.1, "embed_scale": 2.0}))
    # the reference's emb_scale is sqrt(n_embd), never init_values["embed_scale"]; sigma is init_values["std"]
    assert cfg.embed_scale == math.sqrt(32) and cfg.init_std == 0.1
    s = math.sqrt(32)
    zero = initial_state([5, 5], [0, 1], [0.0, 0.0], cfg, torch.float32, "cpu")
    assert torch.equal(zero, torch.zeros(2, 32))
    a = initial_state([5, 5, 6], [0, 1, 0], [1.0, 1.0, 1.0], cfg, torch.float32, "cpu")
    b = initial_state([6, 5], [0, 1], [1.0, 1.0], cfg, torch.float32, "cpu")
    assert torch.equal(a[2], b[0]) and torch.equal(a[1], b[1])  # (seed, position) decides, not the batch
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    big = initial_state([1] * 64, list(range(64)), [1.0] * 64, cfg, torch.float32, "cpu")
    assert float(big.abs().max()) <= 3 * 0.1 * s + 1e-5  # clipped at 3 sigma, times embed_scale
    assert 0.7 * 0.1 * s < float(big.std()) < 0.1 * s  # truncation shrinks the std a little (0.88 sigma)
    half = initial_state([1], [3], [0.5], cfg, torch.float64, "cpu")
    assert half.dtype == torch.float64 and float(half.abs().max()) <= 3 * 0.05 * s + 1e-5


def write_tiny_config_dict(**changes):
    from rlt.platform.checkpoint.tiny import tiny_config

    return tiny_config("huginn_raven", **changes)


def test_interleaved_rope_is_a_complex_rotation():
    """Pair (2i, 2i+1) is the complex number x_2i + i x_2i+1, multiplied by e^{i p θ_i} (HF's definition)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64).float()
    pos = torch.tensor([0, 1, 7, 100, 4095])
    inv = rope_inv_freq(8, 50000.0)
    cos, sin = rope_pair_cos_sin(pos, inv)
    got = apply_rope_pairs(x.to(torch.bfloat16), cos, sin)
    assert got.dtype == torch.bfloat16
    z = torch.view_as_complex(x.to(torch.bfloat16).float().unflatten(-1, (-1, 2)).contiguous())
    rot = torch.polar(torch.ones(5, 4), pos[:, None].float() * inv[None, :])[:, None, :]
    want = torch.view_as_real(z * rot).flatten(-2).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert cos.dtype == torch.float32 and torch.equal(apply_rope_pairs(x, cos[:1], sin[:1])[:1], x[:1])


def test_stored_head_is_ignored_and_stored_rope_table_is_used(tmp_path):
    plain = write_tiny_checkpoint(tmp_path / "plain", family="huginn_raven", seed=5)
    extras = write_tiny_checkpoint(tmp_path / "extras", family="huginn_raven", seed=5, store_extras=True, shards=2)
    keys = set(json.loads((extras / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"lm_head.weight", "freqs_cis"} <= keys and (extras / "raven_modeling_minimal.py").is_file()
    ck_plain, _, _ = _load(plain)
    ck_extra, _, _ = _load(extras, torch.bfloat16)
    assert ck_extra.weights.keys() == ck_plain.weights.keys() | {"freqs_cis"}  # the tied head is dropped
    assert ck_extra.weights["freqs_cis"].dtype == torch.float32  # the table stays float32 in any dtype
    prompt = random_prompts(1, VOCAB, seed=5)[0]
    outs = []
    for path in (plain, extras):
        _, model, _ = _load(path)
        d = HuginnDriver(model, max_steps=3, max_seqs=1)
        outs.append(d.run([(0, "r", prompt, dict(num_steps=3, max_tokens=4))])["r"])
    assert outs[0] == outs[1]  # the stored table is the computed one, bit for bit


def test_stored_rope_table_wins_over_rope_base(tmp_path):
    """The reference's freqs_cis is a persistent buffer: a stored table is what it rotates with, whatever
    rope_base says. Store the table of base 100 under a config of base 10000: the output is that of base 100."""
    base100 = write_tiny_checkpoint(tmp_path / "b100", family="huginn_raven", seed=7, rope_base=100)
    stored = write_tiny_checkpoint(tmp_path / "stored", family="huginn_raven", seed=7, rope_base=100,
                                   store_extras=True)
    _rewrite(stored, rope_base=10000)
    base10k = write_tiny_checkpoint(tmp_path / "b10k", family="huginn_raven", seed=7, rope_base=10000)
    prompts = random_prompts(2, VOCAB, seed=7, lo=12, hi=16)
    runs = {}
    for name, path in (("b100", base100), ("stored", stored), ("b10k", base10k)):
        runs[name] = _check(path, [(0, p, 2, 0, 0.0) for p in prompts], max_tokens=6)  # runtime == reference
    assert runs["stored"] == runs["b100"] and runs["stored"] != runs["b10k"]


def test_config_spellings_of_the_reference(tmp_path):
    """RavenConfig's attribute_map reads hidden_size / num_attention_heads / num_hidden_layers as n_embd /
    n_heads / n_layers; its emb_scale is sqrt(n_embd), so a stale init_values["embed_scale"] (a config copied
    from the release keeps 72.66) changes nothing. Same tokens as the plain checkpoint, runtime == reference."""
    plain = write_tiny_checkpoint(tmp_path / "plain", family="huginn_raven", seed=12)
    variant = write_tiny_checkpoint(tmp_path / "variant", family="huginn_raven", seed=12)
    raw = json.loads((variant / "config.json").read_text())
    aliases = (("n_embd", "hidden_size"), ("n_heads", "num_attention_heads"), ("n_layers", "num_hidden_layers"))
    for name, alias in aliases:
        raw[alias] = raw.pop(name)
    raw["init_values"] = {**raw["init_values"], "embed_scale": 72.6636084983398}
    (variant / "config.json").write_text(json.dumps(raw))
    prompts = random_prompts(2, VOCAB, seed=12)
    want = _check(plain, [(0, p, 3, 0, 0.0) for p in prompts])
    assert _check(variant, [(0, p, 3, 0, 0.0) for p in prompts]) == want
    _rewrite(variant, n_heads=8)  # both spellings, disagreeing
    with pytest.raises(CheckpointError, match="gives n_heads = 8 but its alias num_attention_heads = 4"):
        load_checkpoint(variant, dtype=torch.float32)


def test_fp32_checkpoint_serves_in_low_precision(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "lp", family="huginn_raven", seed=6)
    prompt = random_prompts(1, VOCAB, seed=6)[0]
    for dtype in (torch.bfloat16, torch.float16):
        ck, model, _ = _load(path, dtype)
        assert all(t.dtype == dtype for t in ck.weights.values()) and model.dtype == dtype
        assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
        out = HuginnDriver(model, max_steps=2, max_seqs=1).run([(0, "r", prompt, dict(num_steps=2, max_tokens=3))])
        assert len(out["r"]) == 3 and all(0 <= t < VOCAB for t in out["r"])


def _rewrite(path, **changes):
    cfg = path / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **changes}))


@pytest.mark.parametrize("changes,message", [
    ({"n_layers": 8}, r"n_layers is 8 but n_layers_in_prelude \+ n_layers_in_recurrent_block \+ n_layers_in_coda "
                      r"is 1 \+ 2 \+ 1 = 4"),
    ({"n_layers_in_recurrent_block": 0, "n_layers": 2}, "'n_layers_in_recurrent_block' must be >= 1"),
    ({"mean_recurrence": 0}, "'mean_recurrence' must be >= 1"),
    ({"n_heads": 5}, r"n_embd \(32\) must be a multiple of n_heads \(5\)"),
    ({"num_key_value_heads": 2}, "num_key_value_heads must equal n_heads"),
    ({"injection_type": "add"}, "injection_type 'add' is not supported"),
    ({"bias": True}, "bias is set"),
    ({"init_values": 0.02}, "init_values must be an object"),
    ({"model_type": "huginn"}, "model_type 'huginn' is not supported; supported: ouro, huginn_raven, nanbeige"),
])
def test_bad_configs_exit_with_one_clear_line(tmp_path, changes, message):
    path = write_tiny_checkpoint(tmp_path / "h", family="huginn_raven", seed=1)
    _rewrite(path, **changes)
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(path, dtype=torch.float32)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("breakage,message", [
    ("missing", "missing keys: transformer.core_block.1.attn.qk_bias"),
    ("shape", r"transformer.adapter.weight: \(32, 32\) != expected \(32, 64\)"),
    ("freqs", r"freqs_cis: \(1, 8, 1, 4, 2\) != expected \(1, 64, 1, 4, 2\)"),
    ("extra", "unexpected keys: transformer.coda.1.norm_1.weight"),
])
def test_bad_weights_are_named(tmp_path, breakage, message):
    path = write_tiny_checkpoint(tmp_path / "w", family="huginn_raven", seed=1)
    tensors = load_file(str(path / "model.safetensors"))
    if breakage == "missing":
        del tensors["transformer.core_block.1.attn.qk_bias"]
    elif breakage == "shape":
        tensors["transformer.adapter.weight"] = torch.zeros(32, 32)
    elif breakage == "freqs":
        tensors["freqs_cis"] = torch.zeros(1, 8, 1, 4, 2)
    else:
        tensors["transformer.coda.1.norm_1.weight"] = torch.ones(32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, dtype=torch.float32)


def test_template_and_stop_ids(tiny_checkpoint):
    path = tiny_checkpoint(family="huginn_raven", seed=1)
    tok = RltTokenizer.from_dir(path)
    msgs = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello\n"}, {"role": "user", "content": "again"}]
    body = ("<|begin_text|><|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
            "<|begin_header|>user<|end_header|>\n\nhi<|end_turn|><|begin_header|>Huginn<|end_header|>\n\nhello<|end_turn|>"
            "<|begin_header|>user<|end_header|>\n\nagain<|end_turn|>")
    assert tok.apply_chat_template(msgs) == body + "<|begin_header|>Huginn<|end_header|>\n\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == body + "<|end_text|>"
    ids = tok.encode(body)
    assert ids[:2] == [0, 2] and ids.count(4) == 4  # specials are single tokens: bos, begin_header, end_turn
    ck = load_checkpoint(path, dtype=torch.float32)
    assert ck.family.stop_token_ids(ck.config, tok) == (1, 4)  # <|end_text|>, <|end_turn|>

    class NoSpecials:
        def token_to_id(self, token):
            return None

    assert ck.family.stop_token_ids(ck.config, NoSpecials()) == (65505, 65508)  # the release's ids


def test_shape_sizes_the_two_caches(tiny_checkpoint):
    _, model, _ = _load(tiny_checkpoint(family="huginn_raven", seed=1))
    s = model.shape
    assert (s.num_layers, s.num_boundary_layers, s.num_loops, s.hidden_size) == (2, 2, 3, 32)
    assert model.boundary_attention and not model.has_exit_gate
    assert math.isinf(float(model.exit_logit(torch.zeros(2, 32))[0]))
