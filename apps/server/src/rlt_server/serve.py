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
from typing import Any, Sequence

from rlt.platform.checkpoint.demo import DEMO_NAME
from rlt.platform.composition import CompositionPlan, format_feature_table
from rlt.platform.features import Feature
from rlt_server.common import add_engine_arguments, add_feature_flags, die, engine_config, plan

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
    g.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                   help="run a short synthetic workload before listening so kernels compile before real "
                        "traffic (auto: on unless the device is the CPU)")
    add_feature_flags(p)
    p.set_defaults(run=run)


def _require_http(p: CompositionPlan) -> None:
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
    lines += format_feature_table(info["features"])
    ex = eng.get("executor") or {}
    if ex.get("graphs_captured"):
        lines.append(f"graphs:    {ex['graphs_captured_at_startup']} decode graphs captured at startup in "
                     f"{ex['startup_capture_seconds']:.2f} s, {ex['graph_memory_mib']:.1f} MiB graph memory")
    elif ex.get("static_buffers"):
        lines.append(f"graphs:    off ({ex.get('graphs_off_reason') or 'none captured'})")
    lines.append(f"listening: http://{srv['host']}:{srv['port']}  (OpenAI API under /v1; GET /v1/engine shows this)")
    return "\n".join(lines)


# -- run ---------------------------------------------------------------------------------------------
def _warm_up(engine, mode: str) -> str:
    """Warm the engine up before it listens (rlt.platform.engine.warmup says why); the banner line."""
    if mode == "off" or (mode == "auto" and engine.platform.device_type == "cpu"):
        return "off" if mode == "off" else "off (auto: the CPU compiles nothing at first use)"
    return engine.warm_up().summary()


def run(args: argparse.Namespace, extra_features: Sequence[Feature] = ()) -> int:
    server = _import_serve()
    p = plan(args, extra_features)
    _require_http(p)
    config = engine_config(args)
    engine = p.build_engine(config)
    warmup = _warm_up(engine, args.warmup)
    aliases = []
    if args.served_model_name:
        names = args.served_model_name
    elif config.model:
        names = [server.checkpoint_name(config.model)]
        aliases = [config.model]  # accepted, never shown: it may be a filesystem path
    else:
        names = [DEMO_NAME]
    options = p.assembly.feature_options[HTTP_FEATURE]
    state = server.build_state(engine, statuses=p.table, options=options, served_names=names,
                               host=args.host, port=args.port, aliases=aliases)
    print(describe(state.info, state.model_path), flush=True)
    print(f"warm-up:   {warmup}", flush=True)
    return server.serve(state, p.assembly.http_routers, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=args.access_log)


if __name__ == "__main__":  # pragma: no cover - use the rlt-server entry point
    from rlt_server.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
