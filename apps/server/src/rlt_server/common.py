"""Flags shared by every subcommand (engine flags from EngineConfig, feature flags from the installed
features), the composition every subcommand runs, and the one place bad input becomes one line on
stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterable, NoReturn

import attrs

from rlt.platform import config as config_mod
from rlt.platform.config import EngineConfig, positive_int  # noqa: F401 - positive_int: for subcommands
from rlt.platform.composition import CompositionPlan, plan_composition
from rlt.platform.errors import RltError
from rlt.platform.features import (
    KNOWN_FEATURE_PACKAGES,
    Feature,
    add_feature_arguments,
    discover_features,
    feature_statuses,
    options_from_args,
)
from rlt.platform.platforms import PlatformError, detect_platform


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags, generated from :class:`EngineConfig` (one source of defaults)."""
    config_mod.add_engine_arguments(p)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_mod.engine_config_from_args(args)


class _AbsentFeature(argparse.Action):
    """A switch of a known feature whose package is not installed: refuse it, saying what to install."""

    def __init__(self, option_strings, dest, feature: str = "", package: str = "", **kwargs):
        self.feature, self.package = feature, package
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: feature {self.feature} is not installed (pip install {self.package})")


def add_feature_flags(p: argparse.ArgumentParser) -> None:
    """Flags of every installed feature (generated from its options), and refusals for known ones
    that are not installed."""
    features = discover_features()
    add_feature_arguments(p, features)
    installed = {f.name for f in features}
    for name, package in sorted(KNOWN_FEATURE_PACKAGES.items()):
        if name not in installed:
            flag = f"--{name}".replace("_", "-")
            p.add_argument(flag, f"--no-{name}".replace("_", "-"), action=_AbsentFeature, feature=name,
                           package=package, dest=f"absent__{name}")
    p.set_defaults(installed_features=features)


def _given_flags(feature: Feature, args: argparse.Namespace) -> list[str]:
    ns = vars(args)
    flags = []
    if ns.get(f"feature__{feature.name}__enabled"):
        flags.append(f"--{feature.name}".replace("_", "-"))
    if feature.options is not None:
        for field in attrs.fields(feature.options):
            if ns.get(f"feature__{feature.name}__{field.name}") is not None:
                flags.append(field.metadata.get("flag") or f"--{feature.name}-{field.name}".replace("_", "-"))
    return flags


def plan(args: argparse.Namespace, extra_features: Iterable[Feature] = ()) -> CompositionPlan:
    """Detect the platform, refuse flags of unavailable features, install the available ones."""
    config = engine_config(args)
    platform = detect_platform(config.device)
    features = sorted([*getattr(args, "installed_features", ()), *extra_features], key=lambda f: f.name)
    enabled, options = options_from_args(features, args)
    for st, f in zip(feature_statuses(platform, features, enabled), features):
        if not st.available:
            given = _given_flags(f, args)
            if given:
                die(f"{given[0]}: feature {f.name} is installed but not available on this platform ({st.reason})")
    return plan_composition(platform, features, enabled=enabled, options=options, model=config.model)


def die(message: str) -> NoReturn:
    print(f"rlt-server: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_guarded(fn: Callable[[], int]) -> int:
    """Run ``fn``; user-facing errors become one stderr line and exit code 2, never a traceback."""
    try:
        return fn()
    except (RltError, PlatformError, ValueError) as exc:
        die(str(exc))
    except KeyboardInterrupt:
        return 130
