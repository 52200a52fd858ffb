"""A feature package built and installed as a real distribution (``tests/integration/feature_probe``),
found through its ``rlt.features`` entry point and composed by ``LLM``, ``rlt-server generate`` and
``rlt-server serve`` alike; it changes what the engine does only through the public interfaces.

Also here: two features replacing one component fail at composition naming both; an unavailable
feature is absent with its reason; and no test or benchmark patches the engine to observe it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = REPO / "tests" / "integration" / "feature_probe"
#: the modules a feature package may import from rlt (the documented public surface)
PUBLIC = {"rlt.platform", "rlt.platform.engine.interfaces", "rlt.platform.features", "rlt.platform.platforms",
          "rlt.platform.errors", "rlt.platform.config", "rlt.platform.sampling_params", "rlt.platform.outputs",
          "rlt.attention"}


@pytest.fixture(scope="module")
def probe_site(tmp_path_factory):
    """``pip install --no-deps --target`` of the probe package: a real distribution with its entry point."""
    site = tmp_path_factory.mktemp("probe-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(PROBE)], check=True, capture_output=True, text=True)
    assert list(site.glob("rlt_probe-*.dist-info/entry_points.txt"))
    return site


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONUNBUFFERED": "1"}


def _python(site: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True, text=True, timeout=300)


def test_probe_imports_only_public_modules():
    tree = ast.parse((PROBE / "rlt_probe" / "__init__.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlt"):
            imported.add(node.module)
            assert not any(a.name.startswith("_") for a in node.names), node.module
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names if a.name.startswith("rlt"))
    assert imported and imported <= PUBLIC, imported - PUBLIC
    deps = re.search(r"dependencies = \[(.*?)\]", (PROBE / "pyproject.toml").read_text()).group(1)
    assert sorted(re.findall(r'"([^"]+)"', deps)) == ["rlt-attention", "rlt-platform"]


def test_llm_composes_the_installed_feature(probe_site, tiny_model, tmp_path):
    log = tmp_path / "steps.log"
    code = f"""
import json
from rlt.platform import LLM, SamplingParams, InvalidRequestError
from rlt_probe import ProbeOptions
greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
base = LLM({str(tiny_model)!r}, dtype="float32", num_kv_blocks=256)
probed = LLM({str(tiny_model)!r}, dtype="float32", num_kv_blocks=256,
             features={{"probe": ProbeOptions(chunk=3, veto_top_k=7, log={str(log)!r}),
                        "static_buffers": False}})  # every step through the probe's wrappers
prompt = list(range(5, 16))
a, b = base.generate([prompt], greedy)[0], probed.generate([prompt], greedy)[0]
try:
    probed.generate([prompt], SamplingParams(max_tokens=2, top_k=7))
    vetoed = None
except InvalidRequestError as exc:
    vetoed = str(exc)
table = {{s.name: s.enabled for s in probed.engine.features}}
print(json.dumps({{"same": list(a.token_ids) == list(b.token_ids), "vetoed": vetoed, "table": table,
                   "base_table": {{s.name: s.enabled for s in base.engine.features}}}}))
"""
    r = _python(probe_site, code)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["same"]  # chunked prompt (3 tokens a chunk) gives the same fp32 greedy tokens
    assert out["vetoed"] == "top_k 7 is vetoed by rlt-probe"
    assert out["table"]["probe"] is True and out["base_table"]["probe"] is False  # off by default
    steps = [list(map(int, line.split())) for line in log.read_text().splitlines()]
    # 11 prompt tokens in chunks of 3 -> 4 chunks x 4 loops, then 2 more tokens x 4 loops
    assert len(steps) == 4 * 4 + 2 * 4
    assert max(s[4] for s in steps) == 3  # no row longer than the forced chunk
    assert steps[-1][0] == len(steps) and steps[-1][2] == 1 and steps[-1][3] == 3  # steps, allocations, samples


def test_generate_composes_the_installed_feature(probe_site, tiny_model, tmp_path):
    log = tmp_path / "gen.log"
    argv = [sys.executable, "-m", "rlt_server.cli", "generate", "--model", str(tiny_model), "--dtype", "float32",
            "--num-kv-blocks", "256", "--prompt-token-ids", "5,6,7,8,9", "--max-tokens", "2", "--temperature", "0",
            "--probe-chunk", "2", "--probe-log", str(log)]
    r = subprocess.run(argv, env=_env(probe_site), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 2
    assert max(int(line.split()[4]) for line in log.read_text().splitlines()) == 2
    r = subprocess.run([*argv[:-4], "--probe-veto-top-k", "3", "--top-k", "3"], env=_env(probe_site),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "rlt-server: error: top_k 3 is vetoed by rlt-probe"


def test_serve_composes_the_installed_feature(probe_site, tiny_model, launch_server, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env(probe_site)["PYTHONPATH"])
    server = launch_server("--model", str(tiny_model), "--dtype", "float32", "--num-kv-blocks", "256",
                           "--probe-veto-top-k", "5", "--log-level", "warning")
    info = httpx.get(f"{server.url}/v1/engine").json()
    rows = {f["name"]: f for f in info["features"]}
    assert rows["probe"]["enabled"] and rows["probe"]["installed"] and not rows["probe_rival_a"]["enabled"]
    assert info["engine"]["components"]["executor"][:2] == ["base", "probe"]  # other features may wrap it too
    assert "features:" in server.stdout and "probe" in server.stdout
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 5})
    assert r.status_code == 400 and r.json()["error"]["message"] == "top_k 5 is vetoed by rlt-probe"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_two_features_replacing_one_component_fail_naming_both(probe_site, tiny_model):
    argv = [sys.executable, "-m", "rlt_server.cli", "generate", "--model", str(tiny_model), "--dtype", "float32",
            "--num-kv-blocks", "64", "--prompt", "hi", "--probe-rival-a", "--probe-rival-b"]
    r = subprocess.run(argv, env=_env(probe_site), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip() == ("rlt-server: error: features 'probe_rival_a' and 'probe_rival_b' both replace the "
                                "engine's executor; disable one of them (--no-probe-rival-a or --no-probe-rival-b)")


def test_no_test_or_benchmark_patches_the_engine_to_observe_it():
    """Observation goes through step observers and assembly wrappers; nothing replaces engine
    methods or module functions."""
    patterns = [r"\.execute\s*=", r"engine\.step\s*=", r"setattr\(\s*engine", r"setattr\(\s*executor",
                r"setattr\(\s*(engine|executor)_mod", r"monkeypatch\.setattr\(\s*engine",
                r"\.(scheduler|executor|pool|table)\.\w+\s*=", r"\bengine\.(scheduler|executor|pool|table)\b"]
    offenders = []
    for root in ("tests", "benchmarks"):
        for path in (REPO / root).rglob("*.py"):
            if path.name == Path(__file__).name:
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(REPO)}: {p}" for p in patterns if re.search(p, text)]
    assert offenders == []
