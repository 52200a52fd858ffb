"""``rlt-server generate`` end to end in a subprocess: JSON lines in prompt order, and every bad
input exits non-zero with one clear line on stderr and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.models.ouro_reference import reference_generate


def cli(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "rlt_server.cli", "generate", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_generate_json_lines_in_order_equal_oracle(tiny_checkpoint):
    path = tiny_checkpoint(seed=41)
    r = cli("--model", str(path), "--dtype", "float32", "--temperature", "0", "--max-tokens", "6", "--ignore-eos",
            "--prompt", "Hello world", "--prompt-token-ids", "5,6,7", "--prompt", "The fox", "--kv-layout", "last_exited")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 3
    assert lines[2]["prompt_token_ids"] == [5, 6, 7]  # token-id prompts follow the text prompts
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for line in lines:
        assert set(line) == {"prompt_token_ids", "token_ids", "text", "exit_depths", "finish_reason"}
        assert line["token_ids"] == reference_generate(ref, line["prompt_token_ids"], max_tokens=6)[0]
        assert line["exit_depths"] == [4] * 6 and line["finish_reason"] == "length"


def test_generate_demo_model_by_default(tmp_path):
    r = cli("--prompt", "hi", "--max-tokens", "3", "--seed", "7", env_extra={"RLT_DEMO_DIR": str(tmp_path / "demo")})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) <= 3 and out["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("args,message", [
    (["--model", "/does/not/exist", "--prompt", "x"], "does not exist"),
    (["--device", "tpu", "--prompt", "x"], "invalid choice"),
    (["--device", "npu", "--prompt", "x"], "torch_npu"),
    (["--max-tokens", "-3", "--prompt", "x"], "positive integer"),
    (["--temperature", "-1", "--prompt", "x"], "temperature"),
    (["--top-p", "2", "--prompt", "x"], "top_p"),
    (["--min-p", "-0.5", "--prompt", "x"], "min_p"),
    (["--max-loops", "9", "--prompt", "x"], "max_loops"),
    (["--exit-threshold", "3", "--prompt", "x"], "exit_threshold"),
    (["--prompt-token-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-token-ids", "1,a"], "comma-separated integers"),
    (["--prompt", "x" * 50, "--max-model-len", "8"], "maximum context length"),
    ([], "at least one --prompt"),
    (["--prompt", "x", "--attention-backend", "fa4"], "cannot run here"),
    # values past the engine's int64 / int32 storage (issue 15: an OverflowError traceback)
    (["--prompt", "x", "--top-k", str(2**63)], "top_k"),
    (["--prompt", "x", "--min-tokens", str(2**63), "--max-tokens", "4"], "min_tokens"),
    (["--prompt", "x", "--seed", str(2**64)], "seed"),
    (["--prompt", "x", "--min-loops", str(2**31)], "min_loops"),
    (["--prompt", "a\udc80b"], "lone surrogate"),
])
def test_bad_inputs_one_line_no_traceback(tiny_checkpoint, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_checkpoint(seed=41)), *args]
    r = cli(*args, env_extra={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1, r.stderr
    assert message in err


def test_malformed_checkpoint_one_line(tmp_path, tiny_checkpoint):
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint(seed=41), path)
    (path / "config.json").write_text("{")
    r = cli("--model", str(path), "--prompt", "x")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "not valid JSON" in r.stderr


def _broken(tmp_path, family, breakage):
    from safetensors.torch import load_file, save_file

    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / breakage, family=family, seed=42)
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    if breakage == "missing_key":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    elif breakage == "wrong_shape":
        tensors["transformer.adapter.weight"] = torch.zeros(32, 32)
    elif breakage == "unknown_model_type":
        cfg["model_type"] = "llama"
    elif breakage == "huginn_n_layers":
        cfg["n_layers"] = 8
    elif breakage == "zero_loops":
        cfg["num_loops"] = 0
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("family,breakage,message", [
    ("ouro", "missing_key", "missing keys: model.layers.1.mlp.up_proj.weight (1)"),
    ("huginn_raven", "wrong_shape", "transformer.adapter.weight: (32, 32) != expected (32, 64)"),
    ("nanbeige", "unknown_model_type", "model_type 'llama' is not supported; supported: ouro, huginn_raven, nanbeige"),
    ("huginn_raven", "huginn_n_layers", "n_layers is 8 but n_layers_in_prelude + n_layers_in_recurrent_block + "
                                        "n_layers_in_coda is 1 + 2 + 1 = 4"),
    ("nanbeige", "zero_loops", "config.json field 'num_loops' must be >= 1 for model_type 'nanbeige', got 0"),
])
def test_bad_checkpoints_one_line(tmp_path, family, breakage, message):
    """The bad checkpoints of issue 14 each exit non-zero with one stderr line naming the problem."""
    r = cli("--model", str(_broken(tmp_path, family, breakage)), "--prompt", "x")
    err = r.stderr.strip()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(err.splitlines()) == 1, r.stderr
    assert err.startswith("rlt-server: error: ") and message in err
