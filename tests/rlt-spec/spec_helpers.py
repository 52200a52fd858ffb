"""Helpers of the rlt-spec tests: engines with self_spec, the oracle, draining requests."""

from __future__ import annotations

import torch

from rlt.platform import EngineConfig
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.spec.feature import SpecOptions


def spec_engine(path, *, spec=True, options=None, overlap=False, decode=False, **cfg):
    """An engine with self_spec (``overlap``: and async_self_spec); ``decode``: rlt-decode's
    features at their defaults where installed (off otherwise: this package's CI has only the platform)."""
    cfg = {"dtype": "float32", "block_size": 4, **cfg}
    enabled = {"self_spec": spec, "async_self_spec": overlap and spec}
    if not decode:
        enabled.update(static_buffers=False, pipeline=False)
    return build_engine(EngineConfig(model=str(path), **cfg), enabled=enabled,
                        options={"self_spec": options or SpecOptions(adaptive=False)} if spec else {})


def reference(path):
    ck = load_checkpoint(path, dtype=torch.float32)
    return ck.family.build_reference(ck.config, ck.weights)


def drain(engine, requests):
    """Add ``requests`` [(id, prompt, params)] and step until all finish; outputs by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs
