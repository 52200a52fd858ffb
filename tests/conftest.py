"""Shared fixtures. Nothing here imports an rlt package at module level, so each package's tests
can run with only that package (and its declared dependencies) installed."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: ``tiny_checkpoint(**kwargs) -> Path`` of a tiny random Ouro checkpoint (cached per kwargs)."""
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    cache: dict[str, object] = {}

    def make(**kwargs):
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp("ckpt")
            cache[key] = write_tiny_checkpoint(path, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """A private copy location for the demo model so tests never touch the user's cache."""
    import os

    path = tmp_path_factory.mktemp("demo") / "demo"
    os.environ["RLT_DEMO_DIR"] = str(path)
    return path
