"""``rlt-server serve``: the OpenAI-compatible HTTP server, composed from what is installed.

Flags: the engine flags shared with ``generate``, the server's own (``--host`` default 127.0.0.1,
``--port``, ``--served-model-name``, logging), and the flags of every installed feature, generated
from its options (rlt-serve's ``http`` feature contributes ``--max-queue-len``,
``--max-body-bytes``, ``--max-n``, ``--retry-after``, ``--shutdown-timeout``). A flag of a
feature that is installed but not available on the detected platform is refused at start with
the reason; a switch of a known feature that is not installed is refused naming the package.

At start it prints the platform, the attention backend and why it was chosen, and the feature
table (installed / available on this platform / enabled) — the same data ``GET /v1/engine``
serves. Nothing here imports rlt-serve at module level: without it ``serve`` fails with one line
telling what to install, and ``generate`` keeps working.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Iterable, Sequence

import attrs

from rlt.platform.checkpoint.demo import DEMO_NAME
from rlt.platform.features import (
    KNOWN_FEATURE_PACKAGES,
    EngineBuilder,
    Feature,
    FeatureStatus,
    add_feature_arguments,
    compose,
    discover_features,
    feature_statuses,
    options_from_args,
)
from rlt.platform.platforms import Platform, detect_platform
from rlt_server.common import add_engine_arguments, die, engine_config

INSTALL_HINT = ("rlt-server serve needs the rlt-serve package: pip install rlt-serve "
                "(or pip install 'rlt-server[serve]'; with hatch: hatch run server:serve). "
                "rlt-server generate works without it")
HTTP_FEATURE = "http"


def port_number(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {v}")
    return v


class _AbsentFeature(argparse.Action):
    """A switch of a known feature whose package is not installed: refuse it, saying what to install."""

    def __init__(self, option_strings, dest, feature: str = "", package: str = "", **kwargs):
        self.feature, self.package = feature, package
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: feature {self.feature} is not installed (pip install {self.package})")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs rlt-serve)",
                       description="Serve a looped model over an OpenAI-compatible HTTP API.")
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=port_number, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: the --model directory's name)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    features = discover_features()
    add_feature_arguments(p, features)
    installed = {f.name for f in features}
    for name, package in sorted(KNOWN_FEATURE_PACKAGES.items()):
        if name not in installed:
            flag = f"--{name}".replace("_", "-")
            p.add_argument(flag, f"--no-{name}".replace("_", "-"), action=_AbsentFeature, feature=name,
                           package=package, dest=f"absent__{name}")
    p.set_defaults(run=run, serve_features=features)


# -- composition ------------------------------------------------------------------------------------
@attrs.frozen
class Plan:
    platform: Platform
    builder: EngineBuilder
    #: every installed feature, then every known feature that is not installed
    table: tuple[FeatureStatus, ...]


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


def plan(args: argparse.Namespace, extra_features: Iterable[Feature] = ()) -> Plan:
    """Detect the platform, refuse flags of unavailable features, install the available ones."""
    platform = detect_platform(args.device)
    features = sorted([*getattr(args, "serve_features", ()), *extra_features], key=lambda f: f.name)
    enabled, options = options_from_args(features, args)
    for st, f in zip(feature_statuses(platform, features, enabled), features):
        if not st.available:
            given = _given_flags(f, args)
            if given:
                die(f"{given[0]}: feature {f.name} is installed but not available on this platform ({st.reason})")
    builder = EngineBuilder(platform)
    statuses = compose(builder, features, enabled, options)
    installed = {f.name for f in features}
    absent = [FeatureStatus(name, package, False, False, False, f"not installed (pip install {package})")
              for name, package in sorted(KNOWN_FEATURE_PACKAGES.items()) if name not in installed]
    return Plan(platform, builder, tuple(statuses) + tuple(absent))


def _require_http(p: Plan) -> None:
    st = next((s for s in p.table if s.name == HTTP_FEATURE), None)
    if st is None or not st.installed:
        die("rlt-serve is importable but its feature entry point (rlt.features: http) is not registered; "
            "reinstall it: pip install rlt-serve")
    if not st.available:
        die(f"HTTP serving is not available on this platform: {st.reason}")
    if not st.enabled:
        die("serve needs the http feature; drop --no-http")


def _import_serve():
    try:
        return importlib.import_module("rlt.serve.server")
    except ModuleNotFoundError as exc:
        if exc.name in ("rlt.serve", "rlt.serve.server"):
            die(INSTALL_HINT)
        die(f"rlt-serve is installed but its dependency {exc.name!r} is missing: pip install rlt-serve")


# -- startup text ------------------------------------------------------------------------------------
def _yes(v: bool) -> str:
    return "yes" if v else "no"


def _security(srv: dict[str, Any]) -> str:
    if srv.get("api_key_required"):
        ops = "open" if srv.get("public_health_metrics") else "behind the key too"
        key = f"API key required (/health and /metrics {ops})"
    else:
        key = "no API key (--api-key or $RLT_API_KEY sets one)"
    return (f"{key}; API docs {'on' if srv.get('api_docs') else 'off'}; "
            f"body read timeout {srv.get('body_read_timeout', 0):g} s; watchdog {srv.get('watchdog_timeout', 0):g} s")


def describe(info: dict[str, Any], model_path: str | None = None) -> str:
    plat, att, model, eng, srv = info["platform"], info["attention"], info["model"], info["engine"], info["server"]
    lines = [
        f"platform:  {plat['name']} (torch device {plat['device_type']}"
        f"{', arch ' + plat['arch'] if plat.get('arch') else ''}); capabilities: {', '.join(plat['capabilities']) or 'none'}",
        f"attention: {att['name']} ({att['reason']})",
    ]
    lines += [f"           skipped {s['name']}: {s['reason']}" for s in att.get("skipped", ())]
    lines += [
        f"model:     {model_path or model['name']} served as {', '.join(model['served_model_names'])} "
        f"({model['dtype']}, max_model_len {model['max_model_len']}, {model['num_loops']} loops)",
        f"engine:    {eng['num_kv_blocks']} KV blocks x {eng['block_size']} tokens ({eng['kv_layout']}), "
        f"max_num_seqs {eng['max_num_seqs']}, max_num_batched_tokens {eng['max_num_batched_tokens']}",
        f"admission: at most {srv['capacity']} requests in flight (max_num_seqs + max_queue_len {srv['max_queue_len']}); "
        f"body limit {srv['max_body_bytes']} bytes",
        f"security:  {_security(srv)}",
        "features:",
    ]
    rows = [("feature", "package", "installed", "available", "enabled", "why")]
    rows += [(f["name"], f["package"], _yes(f["installed"]), _yes(f["available"]) if f["installed"] else "-",
              _yes(f["enabled"]), f["reason"]) for f in info["features"]]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    lines.append(f"listening: http://{srv['host']}:{srv['port']}  (OpenAI API under /v1; GET /v1/engine shows this)")
    return "\n".join(lines)


# -- run ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, extra_features: Sequence[Feature] = ()) -> int:
    server = _import_serve()
    p = plan(args, extra_features)
    _require_http(p)
    engine = p.builder.build_engine(engine_config(args))
    aliases = []
    if args.served_model_name:
        names = args.served_model_name
    elif args.model:
        names = [server.checkpoint_name(args.model)]
        aliases = [args.model]  # accepted, never shown: it may be a filesystem path
    else:
        names = [DEMO_NAME]
    options = p.builder.engine_options[HTTP_FEATURE]
    state = server.build_state(engine, statuses=p.table, options=options, served_names=names,
                               host=args.host, port=args.port, aliases=aliases)
    print(describe(state.info, state.model_path), flush=True)
    return server.serve(state, p.builder.http_routers, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=args.access_log)


if __name__ == "__main__":  # pragma: no cover - use the rlt-server entry point
    from rlt_server.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
