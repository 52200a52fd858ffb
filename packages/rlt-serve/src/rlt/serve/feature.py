"""The ``http`` feature: what rlt-serve registers in the entry-point group ``rlt.features``.

This module is loaded whenever the rlt-server CLI builds its parser (for every subcommand), so it
imports nothing heavy: no FastAPI, no uvicorn. Its options become the server's admission and
limit flags (``--max-queue-len``, ``--max-body-bytes``, ...); installing the feature puts the
OpenAI-compatible router into the builder, from which :mod:`rlt.serve.server` builds the app.
"""

from __future__ import annotations

import attrs

from rlt.platform.features import Feature
from rlt.platform.platforms import Capability


def _at_least(minimum):
    def check(inst, attr, value):
        if value < minimum:
            raise ValueError(f"{attr.metadata.get('flag', attr.name)} must be >= {minimum}, got {value}")
    return check


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
