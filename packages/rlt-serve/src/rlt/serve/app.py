"""The FastAPI application: routers, error handlers, the body-size limit, and a lifespan that
starts the engine thread on startup and stops it (aborting what is left) on shutdown.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Iterable

from fastapi import APIRouter, FastAPI

from rlt.serve.errors import install_error_handlers
from rlt.serve.limits import BodySizeLimit
from rlt.serve.state import ServerState


def create_app(state: ServerState, routers: Iterable[APIRouter]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()

    app = FastAPI(title="rlt", description="OpenAI-compatible serving of looped language models",
                  version=str(state.info.get("versions", {}).get("rlt-serve") or "0"), lifespan=lifespan)
    app.state.rlt = state
    app.state.metrics = state.metrics
    install_error_handlers(app)
    seen = set()
    for r in routers:
        if id(r) not in seen:
            app.include_router(r)
            seen.add(id(r))
    app.add_middleware(BodySizeLimit, max_bytes=state.options.max_body_bytes, on_reject=state.metrics.on_rejected)
    return app
