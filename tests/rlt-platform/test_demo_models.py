"""The demo model of every family builds locally, loads and generates (``--model demo-...``)."""

from __future__ import annotations

import pytest
import torch

from huginn_driver import HuginnDriver
from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.checkpoint.demo import DEMO_NAMES, demo_model_dir, resolve_model


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_engine_serves_the_demo(demo_dir, family):
    eng = LLMEngine(EngineConfig(model=None if family == "ouro" else DEMO_NAMES[family], dtype="float32"))
    assert eng.ctx.model_type == family and type(eng.model).__module__.endswith(family)
    eng.add_request("r", "Hello world", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    out = None
    while eng.has_unfinished_requests():
        out = next((o for o in eng.step() if o.finished), out)
    assert len(out.token_ids) == 4


def test_huginn_demo_loads_and_runs_its_stages(demo_dir):
    path = resolve_model(DEMO_NAMES["huginn_raven"])
    assert path == str(demo_model_dir("huginn_raven")) and path.startswith(str(demo_dir.parent))
    ck = load_checkpoint(path, dtype=torch.float32)
    model = ck.family.build_runtime(ck.config, ck.weights)
    out = HuginnDriver(model, max_steps=4, max_seqs=1).run([(0, "r", [5, 6, 7], dict(num_steps=4, max_tokens=3))])
    assert len(out["r"]) == 3
    # The demo serves through the engine too, with the same tokens as the stage-level driver.
    eng = LLMEngine(EngineConfig(model=DEMO_NAMES["huginn_raven"], dtype="float32", init_state_scale=0.0))
    assert eng.ctx.model_type == "huginn_raven"
    eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, max_loops=4))
    done = None
    while eng.has_unfinished_requests():
        done = next((o for o in eng.step() if o.finished), done)
    assert list(done.token_ids) == list(out["r"])


def test_a_directory_wins_over_a_demo_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEMO_NAMES["nanbeige"]).mkdir()
    assert resolve_model(DEMO_NAMES["nanbeige"]) == DEMO_NAMES["nanbeige"]
