"""Load a Hugging Face checkpoint directory.

Reads ``config.json`` (``model_type`` picks the family; ``dtype`` or ``torch_dtype`` accepted;
``auto_map`` ignored — rlt never runs checkpoint code), then ``model.safetensors`` or the shards
listed in ``model.safetensors.index.json`` (and ``generation_config.json`` for its stop ids), with a strict key and shape check whose error names the
missing and unexpected keys (a family may declare optional weights, such as a tied head or a stored
RoPE table: shape-checked when present, then dropped unless the family reads them — those it reads
stay float32). Weights are cast to the requested dtype (float32 / bfloat16 / float16) on the target
device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open

from rlt.platform.errors import CheckpointError
from rlt.platform.models import MODEL_FAMILIES, ModelFamily

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Non-persistent buffers some exports still carry; skipped rather than rejected.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@attrs.frozen(eq=False)
class LoadedCheckpoint:
    path: Path
    family: ModelFamily
    config: Any
    raw_config: dict
    weights: dict[str, torch.Tensor]
    #: ``generation_config.json`` ({} when absent): its ``eos_token_id`` ends generation in HF ``generate``
    generation_config: dict = attrs.field(factory=dict)


def read_generation_config(root: Path) -> dict:
    """``generation_config.json`` of a checkpoint directory, or {} when it has none."""
    path = root / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def read_config(path: str | Path) -> tuple[Path, dict, ModelFamily, Any]:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} not found: a checkpoint directory needs config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise CheckpointError(
            f"{cfg_path}: model_type {model_type!r} is not supported; supported: {', '.join(MODEL_FAMILIES)}"
        )
    family = MODEL_FAMILIES[model_type]
    try:
        config = family.parse_config(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    return root, raw, family, config


def _weight_files(root: Path) -> list[Path]:
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is malformed: {exc}") from None
        files = sorted({root / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that do not exist: {', '.join(missing)}")
        return files
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {root}")


def resolve_dtype(name: str | None, config_dtype: str | None) -> torch.dtype:
    choice = name if name not in (None, "auto") else (config_dtype or "float32")
    if choice not in DTYPES:
        raise CheckpointError(f"dtype {choice!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[choice]


def load_checkpoint(path: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> LoadedCheckpoint:
    root, raw, family, config = read_config(path)
    expected = family.expected_weights(config)
    optional = family.optional_weights(config)
    weights: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    bad_shape: list[str] = []
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    want = expected.get(key, optional.get(key))
                    if want is None:
                        unexpected.append(key)
                        continue
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != want:
                        bad_shape.append(f"{key}: {shape} != expected {want}")
                        continue
                    if key in expected:
                        weights[key] = f.get_tensor(key).to(device=device, dtype=dtype)
                    elif key in family.optional_read:
                        weights[key] = f.get_tensor(key).to(device=device, dtype=torch.float32)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise CheckpointError(f"cannot read {file}: {exc}") from None
    missing = sorted(set(expected) - set(weights) - {k.split(":")[0] for k in bad_shape})
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} ({len(missing)})")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(sorted(unexpected)[:8])}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
        if bad_shape:
            parts.append("wrong shapes: " + "; ".join(bad_shape[:4]))
        raise CheckpointError(f"checkpoint {root} does not match its config.json: " + " | ".join(parts))
    return LoadedCheckpoint(root, family, config, raw, weights, read_generation_config(root))
