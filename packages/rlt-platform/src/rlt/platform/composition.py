"""Composition: the installed features, filtered by platform, installed into one engine.

One path for every front end — the offline ``LLM`` API, ``rlt-server generate`` and
``rlt-server serve`` — so each gets the same features and the same feature table (installed /
available on this platform / enabled, and why; features rlt knows of that are not installed are
listed with the package that provides them).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

from rlt.platform.config import EngineConfig
from rlt.platform.engine.assembly import EngineAssembly
from rlt.platform.features import (
    KNOWN_FEATURE_PACKAGES,
    Feature,
    FeatureStatus,
    compose,
    discover_features,
)
from rlt.platform.platforms import Platform, detect_platform


@attrs.frozen(eq=False)
class CompositionPlan:
    platform: Platform
    assembly: EngineAssembly
    #: every installed feature, then every known feature that is not installed
    table: tuple[FeatureStatus, ...]

    def build_engine(self, config: EngineConfig):
        engine = self.assembly.build_engine(config)
        engine.features = self.table
        return engine


def boundary_model_type(model: str | None) -> str | None:
    """The ``model_type`` of the checkpoint ``model`` if its model runs attention outside its loop
    (Huginn's prelude and coda), else None. An unreadable checkpoint gives None here: the engine
    build reports it with its own error."""
    from rlt.platform.checkpoint.demo import resolve_model
    from rlt.platform.checkpoint.loader import read_config
    from rlt.platform.errors import RltError

    try:
        _, _, family, _ = read_config(resolve_model(model))
    except (RltError, OSError, ValueError):
        return None
    return family.model_type if getattr(family.build_runtime, "boundary_attention", False) else None


def plan_composition(platform: Platform, features: Iterable[Feature] | None = None, *,
                     enabled: Mapping[str, bool] | None = None, options: Mapping[str, Any] | None = None,
                     extra_features: Iterable[Feature] = (), model: str | None = None) -> CompositionPlan:
    """Install the available, enabled features into a fresh assembly for ``platform``.

    ``features`` defaults to what is installed (entry points); ``enabled`` overrides each
    feature's default switch; ``options`` holds option values by feature name. ``model`` (the
    checkpoint to serve, when known): features not verified with its kind of model are off by
    default for it, with the reason in the table (:func:`boundary_model_type`).
    """
    found = list(discover_features() if features is None else features)
    found = sorted([*found, *extra_features], key=lambda f: f.name)
    assembly = EngineAssembly(platform)
    statuses = compose(assembly, found, dict(enabled or {}), dict(options or {}),
                       boundary_model_type(model) if model is not None else None)
    installed = {f.name for f in found}
    absent = [FeatureStatus(name, package, False, False, False, f"not installed (pip install {package})")
              for name, package in sorted(KNOWN_FEATURE_PACKAGES.items()) if name not in installed]
    return CompositionPlan(platform, assembly, tuple(statuses) + tuple(absent))


def build_engine(config: EngineConfig, *, platform: Platform | None = None, features: Iterable[Feature] | None = None,
                 enabled: Mapping[str, bool] | None = None, options: Mapping[str, Any] | None = None,
                 extra_features: Iterable[Feature] = ()):
    """The engine with the installed features composed for the platform (``engine.features``)."""
    platform = platform or detect_platform(config.device)
    plan = plan_composition(platform, features, enabled=enabled, options=options, extra_features=extra_features,
                            model=config.model)
    return plan.build_engine(config)


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def format_feature_table(rows: Iterable[FeatureStatus | Mapping[str, Any]]) -> list[str]:
    """The feature table as aligned text lines (the same at every startup)."""
    data = [r.as_dict() if isinstance(r, FeatureStatus) else dict(r) for r in rows]
    table = [("feature", "package", "installed", "available", "enabled", "why")]
    table += [(f["name"], f["package"], _yes(f["installed"]), _yes(f["available"]) if f["installed"] else "-",
               _yes(f["enabled"]), f["reason"]) for f in data]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in table]
