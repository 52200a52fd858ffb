"""``rlt-server serve`` composition: the startup report and GET /v1/engine agree, features are
composed by platform capability (a fake torch_npu gives the NPU platform, which declares only
HTTP serving), flags of absent or unavailable features are refused with the reason, and the
clear one-line failures: no torch_npu for --device npu, no rlt-serve installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import httpx
import pytest

from rlt.platform.features import KNOWN_FEATURE_PACKAGES, Feature, discover_features
from rlt.platform.config import EngineConfig
from rlt.platform.platforms import Capability
from rlt_server import common, serve
from rlt_server.cli import build_parser
from rlt_server.common import run_guarded

# Runs the CLI as if rlt-serve were not installed: its modules cannot be imported and its entry
# point is not registered.
WITHOUT_RLT_SERVE = r'''
import importlib.metadata as md
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name == "rlt.serve" or name.startswith("rlt.serve."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
_entry_points = md.entry_points

def entry_points(**kw):
    eps = _entry_points(**kw)
    if kw.get("group") == "rlt.features":
        return md.EntryPoints(e for e in eps if not e.value.startswith("rlt.serve"))
    return eps

md.entry_points = entry_points
from rlt_server.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _cli(*args, code=None):
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "rlt_server.cli", *args]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_startup_report_and_v1_engine_agree(tiny_server, tiny_model):
    out = tiny_server.stdout
    assert "platform:  cpu" in out and "attention: torch (auto: first of torch on cpu)" in out
    table = out[out.index("features:"):].splitlines()
    assert table[1].split()[:5] == ["feature", "package", "installed", "available", "enabled"]
    assert any(line.split()[:5] == ["http", "rlt-serve", "yes", "yes", "yes"] for line in table)
    info = httpx.get(f"{tiny_server.url}/v1/engine", timeout=10).json()
    assert info["platform"]["name"] == "cpu" and "http_serving" in info["platform"]["capabilities"]
    assert info["attention"] == {"name": "torch", "reason": "auto: first of torch on cpu", "skipped": []}
    rows = {f["name"]: f for f in info["features"]}
    assert rows["http"] == {"name": "http", "package": "rlt-serve", "installed": True, "available": True,
                            "enabled": True, "reason": "enabled"}
    for name, row in rows.items():  # every row of the printed table is in the JSON, and back
        assert any(line.split()[:2] == [name, row["package"]] for line in table)
        if not row["installed"]:
            assert row["reason"] == f"not installed (pip install {KNOWN_FEATURE_PACKAGES[name]})"
    # the model is named; its path is only in the startup log, never in a response
    assert info["model"]["name"] == tiny_model.name and info["model"]["served_model_names"] == ["tiny"]
    assert f"model:     {tiny_model} served as tiny" in out and str(tiny_model) not in json.dumps(info)
    assert info["engine"]["num_kv_blocks"] == 4096 and info["engine"]["max_num_seqs"] == 64
    assert info["server"]["capacity"] == 64 + 256 and info["server"]["max_body_bytes"] == 65536
    assert "warm-up:   off (auto: the CPU compiles nothing at first use)" in out


def test_warmup_modes(tiny_model):
    """--warmup on runs the synthetic workload (and leaves the engine idle); off and CPU auto do not."""
    from rlt.platform import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", max_num_seqs=4, max_model_len=128))
    assert serve._warm_up(engine, "off") == "off"
    assert serve._warm_up(engine, "auto").startswith("off (auto")
    line = serve._warm_up(engine, "on")
    # alone: one prompt per query tile (16, 31, 64, 119 tokens), then 4 arrivals, then a burst of 4
    assert line.startswith("12 requests, ") and " steps in " in line and not engine.has_unfinished_requests()
    assert engine.stats().num_steps > 9
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--warmup", "maybe"])


def _fake_features(calls):
    graphs = Feature("fake_graphs", "fake-decode", "needs graph capture",
                     requires=frozenset({Capability.GRAPH_CAPTURE}), install=lambda b, o: calls.append("fake_graphs"))
    portable = Feature("fake_portable", "fake-kv", "needs nothing optional",
                       install=lambda b, o: calls.append("fake_portable"))
    return [graphs, portable]


@pytest.fixture
def fake_npu(monkeypatch):
    npu = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda: None, device_count=lambda: 1)
    module = types.ModuleType("torch_npu")
    module.npu = npu
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def test_fake_npu_composes_only_what_the_npu_platform_declares(fake_npu, monkeypatch, capsys):
    calls: list[str] = []
    real = discover_features()
    monkeypatch.setattr(common, "discover_features", lambda: [*real, *_fake_features(calls)])
    p = serve.plan(build_parser().parse_args(["serve", "--device", "npu"]))
    assert p.platform.name == "npu" and p.platform.capabilities == frozenset({Capability.HTTP_SERVING})
    rows = {s.name: s for s in p.table}
    assert rows["http"].available and rows["http"].enabled
    assert not rows["fake_graphs"].available and not rows["fake_graphs"].enabled
    assert rows["fake_graphs"].reason == "npu lacks graph_capture"
    assert calls == ["fake_portable"]  # the unavailable feature was never installed
    assert p.assembly.http_routers and "http" in p.assembly.feature_options
    # a flag of the unavailable feature is refused with the reason
    with pytest.raises(SystemExit) as exc:
        serve.plan(build_parser().parse_args(["serve", "--device", "npu", "--fake-graphs"]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rlt-server: error: --fake-graphs: feature fake_graphs is installed but not available on "
                   "this platform (npu lacks graph_capture)")
    # CPU does not declare graph capture either; the portable feature is composed everywhere
    calls.clear()
    p = serve.plan(build_parser().parse_args(["serve", "--device", "cpu"]))
    assert {s.name: s.available for s in p.table}["fake_graphs"] is False and calls == ["fake_portable"]


def test_absent_feature_switch_names_the_package(capsys):
    installed = {f.name for f in discover_features()}
    absent = sorted(n for n in KNOWN_FEATURE_PACKAGES if n not in installed)
    if not absent:
        pytest.skip("every known feature package is installed here")
    name = absent[0]
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", flag])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"rlt-server: error: {flag}: feature {name} is not installed (pip install {KNOWN_FEATURE_PACKAGES[name]})")


def test_serve_refuses_to_run_without_http(capsys):
    with pytest.raises(SystemExit) as exc:
        serve.run(build_parser().parse_args(["serve", "--device", "cpu", "--no-http"]))
    assert exc.value.code == 2 and "drop --no-http" in capsys.readouterr().err


def test_http_options_are_validated(capsys):
    args = build_parser().parse_args(["serve", "--device", "cpu", "--max-queue-len", "-1"])
    with pytest.raises(SystemExit):
        run_guarded(lambda: serve.run(args))
    assert "--max-queue-len must be >= 0" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_device_npu_without_torch_npu_is_one_line(tiny_model):
    r = _cli("serve", "--model", str(tiny_model), "--device", "npu")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlt-server: error: --device npu needs torch_npu"), r.stderr


def test_without_rlt_serve_serve_fails_in_one_line_and_generate_works(tiny_model):
    r = _cli("serve", "--model", str(tiny_model), code=WITHOUT_RLT_SERVE)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "needs the rlt-serve package: pip install rlt-serve" in lines[0]
    r = _cli("generate", "--model", str(tiny_model), "--prompt", "hi", "--max-tokens", "2", code=WITHOUT_RLT_SERVE)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 2
    r = _cli("serve", "--help", code=WITHOUT_RLT_SERVE)
    assert r.returncode == 0 and "--max-queue-len" not in r.stdout  # the http feature's flags are absent


def test_docs_startup_example_shows_the_real_defaults():
    """docs/serving.md's example startup output uses the defaults (issue 15: it showed 64, 320 and
    a 65536-byte body limit), and its flag table lists every flag of the http feature."""
    from pathlib import Path

    import attrs

    from rlt.serve.feature import HttpOptions

    docs = (Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text()
    args = build_parser().parse_args(["serve"])
    opts = HttpOptions()
    capacity = EngineConfig().max_num_seqs + opts.max_queue_len
    assert f"max_num_seqs {EngineConfig().max_num_seqs}, " in docs
    assert (f"admission: at most {capacity} requests in flight (max_num_seqs + max_queue_len {opts.max_queue_len}); "
            f"body limit {opts.max_body_bytes} bytes") in docs
    srv = {"api_key_required": False, "api_docs": opts.api_docs, "body_read_timeout": opts.body_read_timeout,
           "watchdog_timeout": opts.watchdog_timeout}
    assert f"security:  {serve._security(srv)}" in docs
    for field in attrs.fields(HttpOptions):
        assert f"`{field.metadata['flag']}" in docs, field.metadata["flag"]
