"""The features' composition, options, feature table, public-only imports, and request errors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kv_helpers import GREEDY, kv_engine, metrics, prompts
from rlt.kvcache.feature import FEATURES
from rlt.kvcache.manager import KVCacheManager
from rlt.kvcache.options import PreemptionOptions, PrefixCacheOptions
from rlt.kvcache.scheduler import KVCacheScheduler
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.composition import build_engine, format_feature_table
from rlt.platform.errors import ConfigError, InvalidRequestError

SRC = Path(__file__).resolve().parents[2] / "packages" / "rlt-kvcache" / "src" / "rlt" / "kvcache"


@pytest.mark.parametrize("enabled", [("preemption",), ("prefix_cache",), ("preemption", "prefix_cache")])
def test_one_kv_manager_and_scheduler_for_either_or_both(tiny_checkpoint, enabled):
    path = tiny_checkpoint(seed=1)
    engine = build_engine(EngineConfig(model=str(path), dtype="float32"), features=FEATURES,
                          enabled={n: n in enabled for n in ("preemption", "prefix_cache")})
    parts = engine.ctx.parts
    assert isinstance(parts.kv_manager, KVCacheManager) and isinstance(parts.scheduler, KVCacheScheduler)
    assert parts.kv_manager.incremental == ("preemption" in enabled)
    assert (parts.kv_manager.index is not None) == ("prefix_cache" in enabled)
    comp = engine.describe()["components"]
    assert comp["kv_manager"] == [enabled[0]] and comp["scheduler"] == [enabled[0]]
    table = "\n".join(format_feature_table(engine.features))
    if "preemption" in enabled:
        assert "enabled: policy=priority, mode=auto" in table
    names = {m.name for m in engine.stats().feature_metrics}
    assert ("kv_preemptions" in names) == ("preemption" in enabled)
    assert ("prefix_cache_hit_rate" in names) == ("prefix_cache" in enabled)


def test_disabled_by_default(tiny_checkpoint):
    engine = build_engine(EngineConfig(model=str(tiny_checkpoint(seed=1)), dtype="float32"), features=FEATURES)
    assert engine.describe()["components"]["kv_manager"] == ["base"]


@pytest.mark.parametrize("kwargs,flag", [
    (dict(policy="lifo"), "--preemption-policy"), (dict(mode="teleport"), "--preemption-mode"),
    (dict(watermark=1.0), "--preemption-watermark"), (dict(watermark=-0.1), "--preemption-watermark"),
    (dict(recompute_max_tokens=-1), "--preemption-recompute-max-tokens"),
])
def test_bad_options_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        PreemptionOptions(**kwargs)


def test_cli_flags_are_generated(tiny_checkpoint):
    import argparse

    from rlt.platform.features import add_feature_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_feature_arguments(parser, FEATURES)
    args = parser.parse_args(["--preemption-mode", "swap", "--preemption-policy", "fcfs", "--prefix-cache"])
    enabled, options = options_from_args(FEATURES, args)
    assert enabled == {"preemption": True, "prefix_cache": True}
    assert options["preemption"] == PreemptionOptions(mode="swap", policy="fcfs")
    assert options["prefix_cache"] == PrefixCacheOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "nope"])


def test_too_large_request_is_rejected_and_others_continue(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    engine = kv_engine(path, preemption=PreemptionOptions(), num_kv_blocks=24, max_num_seqs=4)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("big", prompts(1, seed=1, lo=12, hi=12)[0], SamplingParams(max_tokens=20))
    assert err.value.param == "max_tokens"
    engine.add_request("ok", prompts(1, seed=2)[0], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_free_kv_blocks == 24


def test_abort_of_a_swapped_out_request_frees_everything(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    engine = kv_engine(path, preemption=PreemptionOptions(mode="swap"), num_kv_blocks=32, max_num_seqs=5)
    for i, p in enumerate(prompts(5, seed=1)):
        engine.add_request(f"r{i}", p, GREEDY)
    aborted = None
    while engine.has_unfinished_requests():
        engine.step()
        running = set(engine.running_request_ids())
        if aborted is None and metrics(engine)["kv_preemptions"] > 0:
            waiting = [f"r{i}" for i in range(5) if f"r{i}" not in running]
            out = engine.abort_request(waiting[0])
            if out is not None:
                aborted = waiting[0]
                assert out.finished and out.finish_reason == "abort"
    assert aborted is not None
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0


def test_package_imports_only_public_rlt_names():
    for path in SRC.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlt."):
                assert node.module.split(".")[1] in ("platform", "attention", "kvcache"), (path.name, node.module)
                if not node.module.startswith("rlt.kvcache"):
                    assert not any(p.startswith("_") for p in node.module.split(".")), (path.name, node.module)
                    assert not any(a.name.startswith("_") for a in node.names), (path.name, node.module)
