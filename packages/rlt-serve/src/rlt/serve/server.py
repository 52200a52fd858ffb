"""Run the HTTP server over a built engine: state, app, uvicorn, graceful shutdown.

Shutdown on SIGINT or SIGTERM (uvicorn's handlers): stop accepting connections and refuse new
requests (503), let in-flight requests run for up to ``--shutdown-timeout`` seconds, then abort
what is still running — each client gets a normal end with ``finish_reason: "abort"`` — and the
lifespan stops the engine thread, which aborts anything left and frees its KV. A SIGTERM-initiated shutdown that completed exits 0;
SIGINT exits 130: uvicorn re-raises it after shutdown (KeyboardInterrupt through the CLI), and
:func:`serve` returns 130 itself when that re-raise was absorbed on the way out (asyncio's runner
may turn a late SIGINT into a cancellation), so the exit code never depends on that race.

Must not: parse command lines (the app does) or import feature packages.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable

import uvicorn

from rlt.platform.checkpoint.tokenizer import RltTokenizer
from rlt.platform.engine.engine import LLMEngine
from rlt.serve.app import create_app
from rlt.serve.async_engine import AsyncEngine
from rlt.serve.feature import API_KEY_ENV, HttpOptions
from rlt.serve.info import checkpoint_name, engine_info
from rlt.serve.metrics import ServerMetrics
from rlt.serve.state import ServerState

log = logging.getLogger("rlt.serve")
#: seconds after the grace period before uvicorn cancels handlers that still have not finished
_BACKSTOP_S = 5


def resolve_api_key(options: HttpOptions, environ=os.environ) -> str | None:
    """``--api-key``, else ``$RLT_API_KEY`` (an empty variable is no key), else None."""
    if options.api_key is not None:
        return options.api_key
    key = environ.get(API_KEY_ENV, "").strip()
    return key or None


def build_state(engine: LLMEngine, *, statuses: Iterable, options: HttpOptions, served_names: list[str],
                host: str = "127.0.0.1", port: int = 8000, aliases: Iterable[str] = ()) -> ServerState:
    """``aliases``: further model names requests may use that are never listed (such as the
    ``--model`` path, accepted for clients that send it but not shown)."""
    if not served_names:
        raise ValueError("give at least one served model name")
    capacity = engine.config.max_num_seqs + options.max_queue_len
    metrics = ServerMetrics(served_names[0], engine.num_loops)
    front = AsyncEngine(engine, capacity=capacity, retry_after=options.retry_after, metrics=metrics,
                        watchdog_timeout=options.watchdog_timeout)
    metrics.bind_in_flight(lambda: front.in_flight)
    api_key = resolve_api_key(options)
    server = {"host": host, "port": port, "max_queue_len": options.max_queue_len, "capacity": capacity,
              "max_body_bytes": options.max_body_bytes, "max_n": options.max_n,
              "retry_after": options.retry_after, "shutdown_timeout": options.shutdown_timeout,
              "body_read_timeout": options.body_read_timeout, "watchdog_timeout": options.watchdog_timeout,
              "api_key_required": api_key is not None,
              "public_health_metrics": options.public_health_metrics or api_key is None,
              "api_docs": options.api_docs}
    info = engine_info(engine, statuses=statuses, served_names=served_names, server=server)
    return ServerState(
        engine=front, tokenizer=RltTokenizer.from_dir(engine.model_dir), served_names=list(served_names),
        model_root=checkpoint_name(engine.model_dir), max_model_len=engine.max_model_len,
        vocab_size=engine.model.shape.vocab_size, options=options, metrics=metrics, info=info,
        model_path=str(engine.model_dir), api_key=api_key,
        aliases=[a for a in aliases if a and a not in served_names],
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the front end when shutdown begins: new requests get 503, and
    what is still running after the grace period is aborted, so every client gets a proper end
    (``finish_reason: "abort"``) instead of a cut connection. uvicorn's own cancellation, a few
    seconds later, is only a backstop."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        #: the shutdown signals received, in order (uvicorn keeps its own list private)
        self.signals: list[int] = []

    def handle_exit(self, sig, frame) -> None:
        self.signals.append(sig)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self._state.engine.begin_shutdown(self._state.options.shutdown_timeout)
        await super().shutdown(sockets)


def serve(state: ServerState, routers: Iterable[Any], *, host: str, port: int, log_level: str = "info",
          access_log: bool = False, on_config: Callable[[uvicorn.Config], None] | None = None) -> int:
    """Serve until a shutdown signal; returns the process exit code."""
    app = create_app(state, routers)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=state.options.shutdown_timeout + _BACKSTOP_S, lifespan="on",
                            timeout_keep_alive=5)
    if on_config is not None:
        on_config(config)
    server = GracefulServer(config, state)
    # uvicorn re-raises the signal that stopped it once it has shut down; for SIGTERM that is a
    # completed graceful shutdown, which should exit 0 rather than die by the default handler.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    if not server.started:
        log.error("the server did not start (see the messages above)")
        return 1
    return 130 if signal.SIGINT in server.signals else 0
