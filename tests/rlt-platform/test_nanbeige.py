"""Nanbeige end to end: fp32 greedy output of the engine is token-identical to its eager reference.

Batch sizes, mixed prompt lengths, arrivals mid-decode, both KV layouts, 1-3 loops, both values of
``skip_loop_final_norm``, q dim != hidden, GQA/MQA; plus its config checks, stop ids and template.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import check_against_reference, drain, random_prompts, reference_for, run_engine
from rlt.platform import CheckpointError, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from rlt.platform.checkpoint import RltTokenizer, load_checkpoint
from rlt.platform.checkpoint.tiny import write_tiny_checkpoint
from rlt.platform.models.ouro_reference import reference_generate

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def nanbeige(tiny_checkpoint, **kw):
    return tiny_checkpoint(family="nanbeige", **kw)


@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_batches_and_layouts_match_reference(tiny_checkpoint, batch, layout):
    path = nanbeige(tiny_checkpoint, seed=1)
    check_against_reference(path, random_prompts(batch, 320, seed=batch), GREEDY, layout=layout)


def test_arrivals_while_decoding(tiny_checkpoint):
    path = nanbeige(tiny_checkpoint, seed=2)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = check_against_reference(path, random_prompts(6, 320, seed=3), sp, arrive_every=3)
    assert all(len(o.token_ids) == 8 and set(o.exit_depths) == {2} for o in outs)


@pytest.mark.parametrize("changes", [
    {"num_loops": 1}, {"num_loops": 3}, {"skip_loop_final_norm": True},
    {"hidden_size": 64, "head_dim": 16},  # q dim == hidden
    {"num_key_value_heads": 1}, {"num_key_value_heads": 4}, {"rope_theta": 7e7},
])
def test_config_variants_match_reference(tiny_checkpoint, changes):
    path = nanbeige(tiny_checkpoint, seed=4, **changes)
    check_against_reference(path, random_prompts(3, 320, seed=5), GREEDY)


def test_skip_loop_final_norm_changes_the_output(tiny_checkpoint):
    """The flag must reach both the engine and the reference (else the variant test proves nothing)."""
    prompts = random_prompts(3, 320, seed=6)
    a = run_engine(LLMEngine(EngineConfig(model=str(nanbeige(tiny_checkpoint, seed=4)), dtype="float32")), prompts, GREEDY)
    b = run_engine(LLMEngine(EngineConfig(model=str(nanbeige(tiny_checkpoint, seed=4, skip_loop_final_norm=True)),
                                          dtype="float32")), prompts, GREEDY)
    assert [o.token_ids for o in a] != [o.token_ids for o in b]


def test_reference_loops_have_their_own_kv(tiny_checkpoint):
    """Loop 2 attends to loop-2 keys: the reference's depth-matched KV differs from reading loop-1 keys."""
    ref = reference_for(nanbeige(tiny_checkpoint, seed=7))
    tokens = random_prompts(1, 320, seed=7, lo=8, hi=8)[0]
    depth_matched = ref.forward_last_exited(tokens, [1] * len(tokens), 2)[1]
    loop1_keys = ref.forward_last_exited(tokens, [0] * (len(tokens) - 1) + [1], 2)[1]
    assert not torch.allclose(depth_matched[-1], loop1_keys[-1])


def test_mixed_loop_bounds_in_one_batch(tiny_checkpoint):
    path = nanbeige(tiny_checkpoint, seed=8, num_loops=3)
    prompts = random_prompts(3, 320, seed=8)
    params = [GREEDY, GREEDY.with_(max_loops=1), GREEDY.with_(max_loops=2)]
    outs = run_engine(LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4)), prompts, params)
    ref = reference_for(path)
    for p, sp, o in zip(prompts, params, outs):
        want, depths = reference_generate(ref, p, max_tokens=6, max_loops=sp.max_loops)
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)


def test_adaptive_exit_is_refused_without_a_gate(tiny_checkpoint):
    eng = LLMEngine(EngineConfig(model=str(nanbeige(tiny_checkpoint, seed=1)), dtype="float32"))
    with pytest.raises(InvalidRequestError, match="no exit gate") as err:
        eng.add_request("r", [5, 6], GREEDY.with_(exit_threshold=0.5))
    assert err.value.param == "exit_threshold"
    eng.add_request("ok", [5, 6], GREEDY.with_(exit_threshold=1.0))


def test_stop_ids_template_and_eos(tiny_checkpoint):
    path = nanbeige(tiny_checkpoint, seed=1)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    assert eng.eos_token_ids == {2}  # config.json eos_token_id (166101 on the release)
    tok = RltTokenizer.from_dir(path)
    msgs = [{"role": "user", "content": "hi"}]
    base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs) == base
    assert tok.apply_chat_template(msgs, enable_thinking=False) == base + "<think>\n\n</think>\n\n"



def test_generation_stops_on_the_config_eos(tmp_path):
    """eos_token_id of config.json is a stop id: declare the first greedy token as eos and it stops there."""
    path = write_tiny_checkpoint(tmp_path / "eos", family="nanbeige", seed=9)
    prompt = random_prompts(1, 320, seed=9)[0]
    first = reference_generate(reference_for(path), prompt, max_tokens=1)[0][0]
    _rewrite(path, eos_token_id=[2, first])
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    assert eng.eos_token_ids == {2, first}
    eng.add_request("s", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    out = next(o for o in drain(eng).values())
    assert list(out.token_ids) == [first] and out.finish_reason == "stop"


def _rewrite(path, **changes):
    cfg = path / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **changes}))


@pytest.mark.parametrize("changes,message", [
    ({"num_loops": 0}, "'num_loops' must be >= 1"),
    ({"loop_loss_weights": [0.5, 1.0]}, "loop_loss_weights is non-empty"),
    ({"enable_hyper_connection": True}, "enable_hyper_connection is set"),
    ({"loop_share_kv": True}, "loop_share_kv is set"),
    ({"attention_bias": True}, "attention_bias is set"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' is not supported for Nanbeige"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_bad_configs_exit_with_one_clear_line(tmp_path, changes, message):
    path = write_tiny_checkpoint(tmp_path / "n", family="nanbeige", seed=1)
    _rewrite(path, **changes)
    with pytest.raises(CheckpointError, match=message) as err:
        LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    assert "\n" not in str(err.value)


def test_bad_weights_are_named(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "w", family="nanbeige", seed=1)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.post_attention_layernorm.weight"]
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, dtype=torch.float32)
    msg = str(err.value)
    assert "missing keys: model.layers.0.post_attention_layernorm.weight" in msg
    assert "model.layers.1.self_attn.k_proj.weight: (64, 32) != expected (32, 32)" in msg
