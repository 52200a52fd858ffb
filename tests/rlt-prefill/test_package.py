"""rlt-prefill is a feature package by the contract of docs/features.md: it depends only on
rlt-platform and rlt-attention, imports only their public names, and registers its features."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "packages" / "rlt-prefill"


def test_depends_only_on_platform_and_attention():
    deps = re.search(r"dependencies = \[(.*?)\]", (PKG / "pyproject.toml").read_text()).group(1)
    assert sorted(re.findall(r'"([^"]+)"', deps)) == ["rlt-attention", "rlt-platform"]


def test_imports_only_public_names_of_rlt():
    for path in (PKG / "src" / "rlt" / "prefill").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlt"):
                assert node.module.split(".")[1] in ("platform", "attention", "prefill"), (path.name, node.module)
                assert not any(part.startswith("_") for part in node.module.split(".")), (path.name, node.module)
                assert not any(a.name.startswith("_") for a in node.names), (path.name, node.module)
    assert not (PKG / "src" / "rlt" / "__init__.py").exists()  # PEP 420 namespace


def test_entry_point_registers_the_three_features():
    eps = [ep for ep in importlib.metadata.entry_points(group="rlt.features") if ep.value.startswith("rlt.prefill")]
    assert len(eps) == 1
    names = {f.name for f in eps[0].load()}
    assert names == {"chunked_prefill", "packed_prefill", "prefill_uva"}
    from rlt.platform.features import KNOWN_FEATURE_PACKAGES

    assert all(KNOWN_FEATURE_PACKAGES[n] == "rlt-prefill" for n in names)


def test_cli_flags_are_generated_from_the_options():
    import argparse

    from rlt.platform.features import add_feature_arguments, options_from_args
    from rlt.prefill.features import FEATURES

    parser = argparse.ArgumentParser()
    add_feature_arguments(parser, FEATURES)
    args = parser.parse_args(["--prefill-chunk-size", "64", "--chunked-prefill-wavefront",
                              "--chunked-prefill-max-inflight-tokens", "256", "--no-packed-prefill",
                              "--chunked-prefill-decode-step-ratio", "1.75",
                              "--chunked-prefill-step-overhead-tokens", "1500",
                              "--chunked-prefill-attention-tokens", "8000"])
    enabled, options = options_from_args(FEATURES, args)
    assert enabled == {"chunked_prefill": True, "packed_prefill": False}
    o = options["chunked_prefill"]
    assert (o.chunk_size, o.wavefront, o.max_inflight_tokens) == (64, True, 256)
    assert (o.decode_step_ratio, o.step_overhead_tokens, o.attention_tokens) == (1.75, 1500, 8000)
    d = options_from_args(FEATURES, parser.parse_args([]))[1]["chunked_prefill"]
    assert (d.decode_step_ratio, d.step_overhead_tokens, d.attention_tokens) == (0, 2048, 0)  # the cap is opt-in
