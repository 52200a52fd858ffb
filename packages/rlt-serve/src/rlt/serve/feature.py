"""The ``http`` feature: what rlt-serve registers in the entry-point group ``rlt.features``.

This module is loaded whenever the rlt-server CLI builds its parser (for every subcommand), so it
imports nothing heavy: no FastAPI, no uvicorn. Its options become the server's admission, limit
and security flags (``--max-queue-len``, ``--max-body-bytes``, ``--api-key``, ...); installing the
feature puts the OpenAI-compatible router into the builder, from which :mod:`rlt.serve.server`
builds the app.
"""

from __future__ import annotations

import attrs

from rlt.platform.features import Feature
from rlt.platform.platforms import Capability


def _at_least(minimum):
    def check(inst, attr, value):
        if not value >= minimum:  # (NaN too: it compares false with everything)
            raise ValueError(f"{attr.metadata.get('flag', attr.name)} must be >= {minimum}, got {value}")
    return check


def _key(inst, attr, value):
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{attr.metadata['flag']} must be a non-empty string")


#: the environment variable that gives the API key when --api-key is not given
API_KEY_ENV = "RLT_API_KEY"


@attrs.frozen
class HttpOptions:
    max_queue_len: int = attrs.field(default=256, validator=_at_least(0), metadata={
        "flag": "--max-queue-len",
        "help": "requests (each of n counts) held beyond --max-num-seqs before new ones get 503 (default 256)"})
    max_body_bytes: int = attrs.field(default=8 * 2**20, validator=_at_least(1024), metadata={
        "flag": "--max-body-bytes", "help": "largest accepted request body; larger gets 413 (default 8 MiB)"})
    max_n: int = attrs.field(default=64, validator=_at_least(1), metadata={
        "flag": "--max-n", "help": "largest n (choices per prompt) a request may ask for (default 64)"})
    retry_after: int = attrs.field(default=1, validator=_at_least(0), metadata={
        "flag": "--retry-after", "help": "seconds sent in Retry-After with a 503 when the queue is full (default 1)"})
    shutdown_timeout: float = attrs.field(default=10.0, validator=_at_least(0.0), metadata={
        "flag": "--shutdown-timeout",
        "help": "seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted (default 10)"})
    api_key: str | None = attrs.field(default=None, validator=_key, repr=False, metadata={
        "flag": "--api-key",
        "help": f"require 'Authorization: Bearer KEY' on every route (401 otherwise); default: ${API_KEY_ENV}, "
                "else no key"})
    public_health_metrics: bool = attrs.field(default=True, metadata={
        "flag": "--public-health-metrics",
        "help": "with an API key, leave GET /health and GET /metrics open (default: open; "
                "--no-public-health-metrics puts them behind the key too)"})
    api_docs: bool = attrs.field(default=False, metadata={
        "flag": "--api-docs", "help": "serve /docs, /redoc and /openapi.json (default: off)"})
    body_read_timeout: float = attrs.field(default=30.0, validator=_at_least(0.0), metadata={
        "flag": "--body-read-timeout",
        "help": "seconds a request body may take to arrive in full before the request gets 408 "
                "(default 30; 0: no limit)"})
    watchdog_timeout: float = attrs.field(default=60.0, validator=_at_least(0.0), metadata={
        "flag": "--watchdog-timeout",
        "help": "GET /health answers 503 once requests have waited this many seconds with no engine step "
                "(default 60; 0: off)"})


def install(builder, options: HttpOptions) -> None:
    """``builder``: the engine assembly as this feature sees it; its options reach the server
    through ``builder.feature_options["http"]`` (the composition records them)."""
    from rlt.serve.routes import router  # FastAPI is imported only when the feature is installed

    builder.http_routers.append(router)
    builder.notes.append("http: OpenAI-compatible API (rlt-serve)")


FEATURES = [
    Feature(
        name="http",
        package="rlt-serve",
        description="OpenAI-compatible HTTP serving: completions, chat, streaming, metrics",
        requires=frozenset({Capability.HTTP_SERVING}),
        options=HttpOptions,
        install=install,
    )
]
