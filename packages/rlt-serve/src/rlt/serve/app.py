"""The FastAPI application: routers, error handlers, the API key check, the body limits (size and
read time), and a lifespan that starts the engine thread on startup and stops it (aborting what is
left) on shutdown. ``/docs``, ``/redoc`` and ``/openapi.json`` exist only with ``--api-docs``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Iterable

from fastapi import APIRouter, FastAPI

from rlt.serve.auth import ApiKeyAuth
from rlt.serve.errors import install_error_handlers
from rlt.serve.limits import BodySizeLimit
from rlt.serve.state import ServerState

#: routes that stay open with an API key unless --no-public-health-metrics
PUBLIC_OPS = ("/health", "/metrics")


def create_app(state: ServerState, routers: Iterable[APIRouter]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()

    opts = state.options
    docs = opts.api_docs
    app = FastAPI(title="rlt", description="OpenAI-compatible serving of looped language models",
                  version=str(state.info.get("versions", {}).get("rlt-serve") or "0"), lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.rlt = state
    app.state.metrics = state.metrics
    install_error_handlers(app)
    seen = set()
    for r in routers:
        if id(r) not in seen:
            app.include_router(r)
            seen.add(id(r))
    app.add_middleware(BodySizeLimit, max_bytes=opts.max_body_bytes, on_reject=state.metrics.on_rejected,
                       read_timeout=opts.body_read_timeout)
    if state.api_key is not None:  # outermost: nothing is read for a request without the key
        app.add_middleware(ApiKeyAuth, api_key=state.api_key,
                           open_paths=PUBLIC_OPS if opts.public_health_metrics else (),
                           on_reject=state.metrics.on_rejected)
    return app
