"""The static description of a running server: platform, attention backend and why, the feature
table (installed / available / enabled), model and engine configuration, server limits.

The CLI prints it at startup and ``GET /v1/engine`` serves it (plus live stats), so the two can
never disagree. It names the model (``model.name``: the checkpoint directory's name) but holds no
filesystem path: the startup log adds the path, responses never carry one. Plain data in, plain
dict out: no I/O, no engine calls after construction.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any, Iterable

from rlt.platform.engine.engine import LLMEngine
from rlt.platform.platforms import Platform


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def platform_info(platform: Platform) -> dict[str, Any]:
    return {"name": platform.name, "device_type": platform.device_type, "arch": platform.arch,
            "capabilities": sorted(c.value for c in platform.capabilities)}


def checkpoint_name(model_dir) -> str:
    """The name of a checkpoint (its directory's name), for responses that must not hold its path."""
    path = Path(str(model_dir))
    return path.name or path.resolve().name or "model"


def _status_dict(st) -> dict[str, Any]:
    return dict(st) if isinstance(st, dict) else st.as_dict()


def engine_info(engine: LLMEngine, *, statuses: Iterable, served_names: list[str],
                server: dict[str, Any]) -> dict[str, Any]:
    sel = engine.selection
    cfg = engine.config
    return {
        "platform": platform_info(engine.platform),
        "attention": {"name": sel.name, "reason": sel.reason,
                      "skipped": [{"name": n, "reason": why} for n, why in sel.skipped]},
        "features": [_status_dict(st) for st in statuses],
        "model": {
            "name": checkpoint_name(engine.model_dir), "served_model_names": list(served_names),
            "dtype": str(engine.dtype).removeprefix("torch."), "max_model_len": engine.max_model_len,
            "num_loops": engine.num_loops, "vocab_size": engine.model.shape.vocab_size,
        },
        "engine": {
            "kv_layout": cfg.kv_layout.value, "block_size": cfg.block_size,
            "num_kv_blocks": engine.stats().num_kv_blocks, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "default_exit_threshold": float(engine.default_threshold), "fixed_depth": cfg.fixed_depth,
            **engine.describe(),
        },
        "server": dict(server),
        "versions": {d: _version(d) for d in ("rlt-platform", "rlt-attention", "rlt-serve", "rlt-server")},
    }
