"""The feature contract and its composition.

A feature package registers :class:`Feature` values in the entry-point group ``rlt.features``
(the entry point loads either a Feature or a zero-argument callable returning a list of them).
A feature declares its name, the platform capabilities it requires, its options (an attrs class:
the CLI flags are generated from its fields) and how it installs itself into the engine being
built: ``install(builder, options)`` with a
:class:`rlt.platform.engine.assembly.FeatureInstaller` (wrap or replace components, observe
steps, contribute HTTP routes). ``docs/features.md`` shows a complete feature package.

``rlt.platform`` never imports a feature package: it discovers what is installed, drops what the
platform cannot run (recording why), and installs the rest in a stable order (by name).
:mod:`rlt.platform.composition` puts it together for ``serve``, ``generate`` and ``LLM`` alike.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
from typing import Any, Callable, Iterable

import attrs

from rlt.platform.platforms import Capability, Platform

log = logging.getLogger("rlt.features")
ENTRY_POINT_GROUP = "rlt.features"


@attrs.frozen
class Feature:
    name: str
    package: str
    description: str
    requires: frozenset[Capability] = attrs.field(default=frozenset(), converter=frozenset)
    #: attrs class of options (each field becomes ``--<feature>-<field>`` unless it has metadata "flag").
    options: type | None = None
    #: install(builder, options) applies the feature (builder: an assembly FeatureInstaller).
    install: Callable[[Any, Any], None] | None = None
    enabled_by_default: bool = True
    #: its components were verified with models whose prelude and coda run attention (Huginn); for
    #: such a model every other feature is off by default (the table says why), and one asked for
    #: explicitly that wraps or replaces a component is refused at composition, naming its flag
    boundary_attention: bool = False
    #: non-empty: the feature is registered but cannot run on any platform yet (it is listed as not
    #: available with this reason, and its flags are refused with it)
    unavailable: str = ""

    def missing(self, platform: Platform) -> frozenset[Capability]:
        return frozenset(c for c in self.requires if not platform.has(c))


@attrs.frozen
class FeatureStatus:
    name: str
    package: str
    installed: bool
    available: bool
    enabled: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def discover_features(entry_points: Iterable | None = None) -> list[Feature]:
    """Load every installed feature. A feature that fails to load is logged and skipped."""
    eps = entry_points if entry_points is not None else importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    found: list[Feature] = []
    for ep in eps:
        try:
            obj = ep.load()
            items = obj() if callable(obj) and not isinstance(obj, Feature) else obj
            items = [items] if isinstance(items, Feature) else list(items)
        except Exception:  # noqa: BLE001 - a broken plugin must not take the server down
            log.exception("feature entry point %s failed to load", getattr(ep, "name", ep))
            continue
        found.extend(items)
    return sorted(found, key=lambda f: f.name)


def feature_statuses(platform: Platform, features: Iterable[Feature], enabled: dict[str, bool],
                     boundary_model: str | None = None) -> list[FeatureStatus]:
    """Each feature's row of the feature table. ``boundary_model``: the ``model_type`` of a model
    with attention outside its loop (Huginn); features not verified with it are off by default
    there (asked for explicitly, the assembly refuses them with the reason)."""
    rows = []
    for f in features:
        missing = f.missing(platform)
        if f.unavailable:
            rows.append(FeatureStatus(f.name, f.package, True, False, False, f.unavailable))
            continue
        if missing:
            rows.append(FeatureStatus(f.name, f.package, True, False, False,
                                      f"{platform.name} lacks {', '.join(sorted(c.value for c in missing))}"))
            continue
        if boundary_model and not f.boundary_attention and f.name not in enabled:
            rows.append(FeatureStatus(f.name, f.package, True, True, False,
                                      f"off for {boundary_model}: not verified with prelude/coda attention"))
            continue
        on = enabled.get(f.name, f.enabled_by_default)
        rows.append(FeatureStatus(f.name, f.package, True, True, on, "enabled" if on else "disabled by option"))
    return rows


# -- options <-> CLI --------------------------------------------------------------------------
def _flag(feature: Feature, field: attrs.Attribute) -> str:
    return field.metadata.get("flag") or f"--{feature.name}-{field.name}".replace("_", "-")


_SCALARS = {int: int, "int": int, "int | None": int, float: float, "float": float, "float | None": float,
            str: str, "str": str, "str | None": str}


def add_attrs_argument(group, flag: str, field: attrs.Attribute, dest: str, default: Any = None) -> None:
    """One flag for one attrs field: type, choices, help and metavar from the field and its metadata
    (``help``, ``choices``, ``type``: a parser callable). ``default`` None leaves unset flags out."""
    kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": field.metadata.get("help", "")}
    if field.type in (bool, "bool", "bool | None"):  # None: the feature decides (--x / --no-x override it)
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["metavar"] = field.name.upper()
        parse = field.metadata.get("type") or _SCALARS.get(field.type)
        if parse is not None:
            kwargs["type"] = parse
    if "choices" in field.metadata:
        kwargs["choices"] = field.metadata["choices"]
        kwargs.pop("metavar", None)
    group.add_argument(flag, **kwargs)


def add_feature_arguments(parser: argparse.ArgumentParser, features: Iterable[Feature]) -> None:
    """Add each available feature's switch and option flags to ``parser``."""
    for f in features:
        group = parser.add_argument_group(f"{f.name} ({f.package})", f.description)
        dest = f"feature__{f.name}__enabled"
        group.add_argument(f"--{f.name}".replace("_", "-"), dest=dest, action=argparse.BooleanOptionalAction,
                           default=None, help=f"enable {f.name} (default: {'on' if f.enabled_by_default else 'off'})")
        if f.options is None:
            continue
        for field in attrs.fields(f.options):
            add_attrs_argument(group, _flag(f, field), field, f"feature__{f.name}__{field.name}")


def options_from_args(features: Iterable[Feature], args: argparse.Namespace) -> tuple[dict[str, bool], dict[str, Any]]:
    enabled: dict[str, bool] = {}
    options: dict[str, Any] = {}
    ns = vars(args)
    for f in features:
        flag = ns.get(f"feature__{f.name}__enabled")
        if flag is not None:
            enabled[f.name] = flag
        if f.options is not None:
            given = {fl.name: ns[f"feature__{f.name}__{fl.name}"] for fl in attrs.fields(f.options)
                     if ns.get(f"feature__{f.name}__{fl.name}") is not None}
            options[f.name] = f.options(**given)
            if given and f.name not in enabled:
                enabled[f.name] = True
    return enabled, options


def compose(assembly, features: Iterable[Feature], enabled: dict[str, bool],
            options: dict[str, Any], boundary_model: str | None = None) -> list[FeatureStatus]:
    """Install every available, enabled feature into ``assembly`` (by name order); return the table."""
    features = list(features)
    statuses = feature_statuses(assembly.platform, features, enabled, boundary_model)
    by_name = {f.name: f for f in features}
    for st in statuses:
        f = by_name[st.name]
        if not st.enabled:
            continue
        opts = options.get(f.name) or (f.options() if f.options is not None else None)
        assembly.feature_options[f.name] = opts
        if f.boundary_attention:
            assembly.boundary_attention_ok.add(f.name)
        if f.install is not None:
            f.install(assembly.for_feature(f.name), opts)
    # An options class may say how it is set (``summary() -> str``): shown in the feature table.
    out = []
    for st in statuses:
        summary = getattr(assembly.feature_options.get(st.name), "summary", None) if st.enabled else None
        out.append(attrs.evolve(st, reason=f"enabled: {summary()}") if callable(summary) else st)
    return out


def absent_feature_message(flag: str, statuses: Iterable[FeatureStatus], known: dict[str, str]) -> str | None:
    """Why a flag of a known-but-absent feature is unknown here (``known``: flag prefix -> feature)."""
    for prefix, name in known.items():
        if flag.startswith(prefix):
            for st in statuses:
                if st.name == name and not st.available:
                    return f"{flag}: feature {name} is installed but not available on this platform ({st.reason})"
            return f"{flag}: feature {name} is not installed (pip install {name_to_package(name)})"
    return None


def name_to_package(name: str) -> str:
    return KNOWN_FEATURE_PACKAGES.get(name, "the package that provides it")


#: Features rlt ships, by name -> distribution, so an absent one can be named in errors.
KNOWN_FEATURE_PACKAGES = {
    "chunked_prefill": "rlt-prefill", "packed_prefill": "rlt-prefill", "prefill_uva": "rlt-prefill",
    "static_buffers": "rlt-decode", "graphs": "rlt-decode",
    "prefix_cache": "rlt-kvcache", "preemption": "rlt-kvcache",
    "self_spec": "rlt-spec", "async_self_spec": "rlt-spec", "http": "rlt-serve",
}
