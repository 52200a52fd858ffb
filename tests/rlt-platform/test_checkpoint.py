"""Loading Hugging Face checkpoint directories: layouts, dtypes, strict keys, tokenizer, template."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlt.platform import CheckpointError, EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import RltTokenizer, load_checkpoint
from rlt.platform.checkpoint.tiny import write_tiny_checkpoint


def _greedy(path, **kw):
    eng = LLMEngine(EngineConfig(model=str(path), block_size=4, **kw))
    eng.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                return o.token_ids


def test_sharded_equals_single(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "single", seed=3)
    sharded = write_tiny_checkpoint(tmp_path / "sharded", seed=3, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert _greedy(single, dtype="float32") == _greedy(sharded, dtype="float32")


def test_dtype_field_spellings_and_auto_map_ignored(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=4)
    b = write_tiny_checkpoint(tmp_path / "b", seed=4, dtype_key="dtype")
    raw = json.loads((b / "config.json").read_text())
    assert "dtype" in raw and "torch_dtype" not in raw and "auto_map" in raw
    assert _greedy(a) == _greedy(b)  # dtype "auto" resolves to float32 from either field


def test_demo_model_has_no_auto_map(tmp_path, monkeypatch):
    from rlt.platform.checkpoint.demo import demo_model_dir

    monkeypatch.setenv("RLT_DEMO_DIR", str(tmp_path / "demo"))
    raw = json.loads((demo_model_dir() / "config.json").read_text())
    assert "auto_map" not in raw and raw["model_type"] == "ouro"


@pytest.mark.parametrize("dtype,torch_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtypes(tiny_checkpoint, dtype, torch_dtype):
    ck = load_checkpoint(tiny_checkpoint(seed=5), dtype=torch_dtype)
    assert all(t.dtype == torch_dtype for t in ck.weights.values())
    assert len(_greedy(tiny_checkpoint(seed=5), dtype=dtype)) == 5


def test_strict_keys_name_missing_and_unexpected(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "c", seed=6)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)  # tolerated
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, dtype=torch.float32)
    msg = str(err.value)
    assert "missing keys: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected keys: model.layers.0.self_attn.q_proj.bias" in msg
    assert "inv_freq" not in msg


def test_wrong_shape_is_reported(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "s", seed=6)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.norm.weight: \(7,\) != expected \(32,\)"):
        load_checkpoint(path, dtype=torch.float32)


@pytest.mark.parametrize("breakage,message", [
    ("no_dir", "does not exist"), ("no_config", "config.json not found"), ("bad_json", "not valid JSON"),
    ("wrong_type", "model_type 'llama' is not supported"), ("no_weights", "no model.safetensors"),
    ("missing_field", "missing required field 'hidden_size'"), ("corrupt", "cannot read"),
    ("missing_shard", "shards that do not exist"), ("no_tokenizer", "tokenizer.json"),
])
def test_malformed_checkpoints(tmp_path, breakage, message):
    path = write_tiny_checkpoint(tmp_path / "m", seed=7, shards=2 if breakage == "missing_shard" else 1)
    cfg = path / "config.json"
    if breakage == "no_dir":
        path = tmp_path / "nope"
    elif breakage == "no_config":
        cfg.unlink()
    elif breakage == "bad_json":
        cfg.write_text("{not json")
    elif breakage == "wrong_type":
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_type": "llama"}))
    elif breakage == "no_weights":
        (path / "model.safetensors").unlink()
    elif breakage == "missing_field":
        raw = json.loads(cfg.read_text())
        del raw["hidden_size"]
        cfg.write_text(json.dumps(raw))
    elif breakage == "corrupt":
        (path / "model.safetensors").write_bytes(b"\x00" * 64)
    elif breakage == "missing_shard":
        next(path.glob("model-00002-*.safetensors")).unlink()
    elif breakage == "no_tokenizer":
        (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(path), dtype="float32"))


def test_chat_template_chatml_and_thinking(tmp_path):
    plain = RltTokenizer.from_dir(write_tiny_checkpoint(tmp_path / "p", seed=1))
    think = RltTokenizer.from_dir(write_tiny_checkpoint(tmp_path / "t", seed=1, thinking=True))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert plain.apply_chat_template(msgs) == want
    assert plain.apply_chat_template(msgs, enable_thinking=True) == want  # base template never thinks
    assert think.apply_chat_template(msgs, enable_thinking=True) == want + "<think>\n"
    assert think.apply_chat_template(msgs, enable_thinking=False) == want
    assert think.apply_chat_template(msgs) == want  # None == False
    ids = plain.encode(want)
    assert ids[0] == 1 and 2 in ids  # <|im_start|>=1, <|im_end|>=2 as single tokens
    assert plain.decode(ids, skip_special_tokens=False) == want


def test_ouro_chat_stop_tokens(tiny_checkpoint):
    eng = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=1)), dtype="float32"))
    assert eng.eos_token_ids == {0, 2}


def test_generation_config_eos_is_a_stop_id(tmp_path):
    """HF generate stops on generation_config.json's eos_token_id: declare the first greedy token there."""
    from rlt.platform.models.ouro_reference import reference_generate

    path = write_tiny_checkpoint(tmp_path / "gen", seed=13)
    ck = load_checkpoint(path, dtype=torch.float32)
    first = reference_generate(ck.family.build_reference(ck.config, ck.weights), [5, 6, 7], max_tokens=1)[0][0]
    assert first not in (0, 2)  # not already a stop id of the family
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, 0]}))
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    assert eng.eos_token_ids == {0, 2, first}
    eng.add_request("g", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    while eng.has_unfinished_requests():
        outs = [o for o in eng.step() if o.finished]
    assert list(outs[0].token_ids) == [first] and outs[0].finish_reason == "stop"
    (path / "generation_config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="generation_config.json must hold a JSON object"):
        load_checkpoint(path, dtype=torch.float32)


def test_early_exit_step_is_that_many_loops(tmp_path):
    """OuroForCausalLM reads loop ``early_exit_step`` (config) for the head while computing all loops; loops
    past k never feed loops <= k, so it is k + 1 loops: the same tokens as total_ut_steps = k + 1."""
    forced = write_tiny_checkpoint(tmp_path / "forced", seed=15, early_exit_step=1)
    short = write_tiny_checkpoint(tmp_path / "short", seed=15, total_ut_steps=2)
    full = write_tiny_checkpoint(tmp_path / "full", seed=15)
    assert LLMEngine(EngineConfig(model=str(forced), dtype="float32")).num_loops == 2
    assert _greedy(forced, dtype="float32") == _greedy(short, dtype="float32") != _greedy(full, dtype="float32")
    # out of range: OuroForCausalLM ignores it
    out_of_range = write_tiny_checkpoint(tmp_path / "oor", seed=15, early_exit_step=4)
    assert _greedy(out_of_range, dtype="float32") == _greedy(full, dtype="float32")


def test_tied_embeddings_with_and_without_stored_head(tmp_path):
    from rlt.platform.models.ouro_reference import reference_generate

    path = write_tiny_checkpoint(tmp_path / "tied", seed=8, tie_word_embeddings=True)
    ck = load_checkpoint(path, dtype=torch.float32)
    assert "lm_head.weight" not in ck.weights
    ref = ck.family.build_reference(ck.config, ck.weights)
    want = reference_generate(ref, [5, 6, 7, 8], max_tokens=5)[0]
    assert list(_greedy(path, dtype="float32")) == want
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # some exports store it
    save_file(tensors, str(path / "model.safetensors"))
    assert list(_greedy(path, dtype="float32")) == want


def test_checkpoint_threshold_is_not_a_serving_default(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "thr", seed=9, early_exit_threshold=0.3)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    assert eng.default_threshold == 1.0


_DROP = object()  # _rewrite_config(path, key=_DROP) deletes the key


def _rewrite_config(path, **changes):
    cfg = path / "config.json"
    raw = json.loads(cfg.read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        del raw[key]
    cfg.write_text(json.dumps(raw))


def test_transformers5_rope_parameters(tmp_path):
    """transformers 5 writes RoPE as ``rope_parameters``; the result must equal the old spelling."""
    old = write_tiny_checkpoint(tmp_path / "old", seed=10)
    new = write_tiny_checkpoint(tmp_path / "new", seed=10)
    theta = json.loads((old / "config.json").read_text())["rope_theta"]
    _rewrite_config(new, rope_theta=_DROP, rope_scaling=_DROP,
                    rope_parameters={"rope_type": "default", "rope_theta": theta})
    assert load_checkpoint(new, dtype=torch.float32).config.rope_theta == theta
    assert _greedy(old, dtype="float32") == _greedy(new, dtype="float32")
    _rewrite_config(new, rope_parameters={"rope_type": "default", "rope_theta": 10.0})
    assert load_checkpoint(new, dtype=torch.float32).config.rope_theta == 10.0


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "RoPE type 'linear'"),
    ({"rope_scaling": "fast"}, "rope_scaling must be an object or null"),
    ({"use_sliding_window": True, "max_window_layers": 1}, "sliding-window attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
])
def test_unsupported_config_variants_are_refused(tmp_path, changes, message):
    path = write_tiny_checkpoint(tmp_path / "v", seed=11)
    _rewrite_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, dtype=torch.float32)


def test_chat_template_environment_is_hugging_faces(tmp_path):
    """tojson as HF overrides it (no HTML escaping, keys in order, indent), strftime_now, the special tokens."""
    path = write_tiny_checkpoint(tmp_path / "tpl", seed=14)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ("{{ messages[0]['content'] | tojson }}|{{ messages[0] | tojson(indent=1) }}|"
                            "{{ strftime_now('%Y') | length }}|{{ pad_token }}|{{ tools is none }}")
    cfg_path.write_text(json.dumps(cfg))
    tok = RltTokenizer.from_dir(path)
    msg = {"role": "user", "content": "<a & b> é"}
    text = tok.apply_chat_template([msg], add_generation_prompt=False)
    assert text == '"<a & b> é"|' + json.dumps(msg, ensure_ascii=False, indent=1) + "|4|<|endoftext|>|True"
