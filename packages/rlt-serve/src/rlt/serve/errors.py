"""HTTP errors in the OpenAI shape, and the handlers that map every exception to one.

Body: ``{"error": {"message", "type", "param", "code"}}`` with ``code`` = the HTTP status, as
vLLM answers. Mapping: bad input of any kind (malformed JSON, wrong types, out-of-range values,
rlt's :class:`InvalidRequestError`, whose ``param`` becomes the body's) -> 400 ``BadRequestError``;
a missing or wrong API key -> 401; unknown model or route -> 404; a body that does not arrive in
time -> 408; oversized body -> 413; full queue -> 503 with ``Retry-After``; an engine fault -> 500; a
client that goes away before its body has arrived -> a disconnect (counted, one info line; the 400 written
back reaches no one).
FastAPI's 422 for validation errors is re-mapped to 400. Bad input must never surface as 500:
only a defect or an engine fault does, and its body says no more than an error id
(``err-...``) that the log line with the details (and the traceback) also shows.

Error bodies are written with ASCII escapes, so no text (not even a lone surrogate echoed from a
request) can make the error response itself fail.

This module knows nothing of the engine; it only formats errors.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from rlt.platform.errors import RltError

log = logging.getLogger("rlt.serve")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          408: "RequestTimeoutError", 413: "PayloadTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
          501: "NotImplementedError", 503: "ServiceUnavailableError"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": status}}


class ErrorResponse(JSONResponse):
    """A JSON error response rendered with ASCII escapes (any str is safe to put in it)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def internal_message(error_id: str) -> str:
    """What a 500 says: no exception text (it may name files, data or internals), only the id."""
    return f"internal server error (error id {error_id}); the server log has the details under this id"


class APIError(Exception):
    """An error answered to the client as-is."""

    status: int = 400

    def __init__(self, message: str, param: str | None = None, *, status: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(APIError):
    status = 400


class ModelNotFound(APIError):
    status = 404

    def __init__(self, name: str, served: list[str]) -> None:
        super().__init__(f"The model `{name}` does not exist. This server serves: {', '.join(served)}.", "model")


class Overloaded(APIError):
    status = 503

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, None, headers={"Retry-After": str(retry_after)})


class EngineFault(APIError):
    """The engine failed while running this request (it was aborted; the server stays up). The
    body carries only an error id; the engine's message is logged with it."""

    status = 500

    def __init__(self, detail: str, request_id: str = "") -> None:
        self.error_id = new_error_id()
        log.error("request %s failed in the engine [error id %s]: %s", request_id or "?", self.error_id, detail)
        super().__init__(internal_message(self.error_id))


class EngineDead(APIError):
    status = 503


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")


def param_of(message: str) -> str | None:
    """``"temperature: must be ..."`` -> ``"temperature"`` (rlt's validation messages lead with the field)."""
    m = _FIELD_PREFIX.match(message)
    return m.group(1) if m else None


def from_rlt_error(exc: RltError, rename: dict[str, str] | None = None, reword: tuple[str, ...] = ()) -> BadRequest:
    """400 for one of rlt's errors; ``param`` is the error's own (``InvalidRequestError.param``),
    else read off the message's leading ``field:``; ``rename`` maps engine field names to the
    request's (a chat request has ``messages``, not ``prompt``); the names in ``reword`` are renamed in
    the message too (``max_tokens`` where the client sent ``max_completion_tokens``)."""
    message = str(exc)
    param = getattr(exc, "param", None) or param_of(message)
    if rename and param is not None:
        head, dot, rest = param.partition(".")
        if head in rename:
            param = rename[head] + dot + rest
    for name in reword:
        if rename and name in rename:
            message = re.sub(rf"\b{re.escape(name)}\b", rename[name], message)
    return BadRequest(message, param)


def _shown(value: Any) -> str:
    """A short JSON rendering of a rejected value (never the whole of a huge one)."""
    if isinstance(value, str) and len(value) > 80:
        value = value[:80]
    elif isinstance(value, (list, tuple)) and len(value) > 16:
        value = list(value[:16])
    elif isinstance(value, dict) and len(value) > 16:
        value = dict(list(value.items())[:16])
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError, RecursionError):
        return ""


def _loc_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic adds the union member tried (e.g. "str", "list[int]") after the field; keep the field path
    kept = [p for p in parts if not re.match(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$", p)]
    return ".".join(kept) or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON ({detail})" if detail else "request body is not valid JSON", None
    loc = tuple(first.get("loc", ()))
    param = _loc_param(loc)
    if kind == "missing" and loc in ((), ("body",)):
        return "request body is missing: send a JSON object", None
    if kind in ("model_attributes_type", "dict_type", "model_type") and param is None:
        return "request body must be a JSON object", None
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if param is None:
        return msg, None
    extra = "" if len(errors) == 1 or kind.startswith("value_error") else f" ({len(errors)} errors; first shown)"
    shown = ""
    if kind != "missing" and not kind.startswith("value_error"):
        text = _shown(first.get("input"))
        shown = f", got {text}" if text else ""
    return f"{param}: {msg}{shown}{extra}", param


def _count(request: Request, exc: Exception) -> None:
    """Count a refused request in the app's metrics, if it has any (``app.state.metrics``)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is None:
        return
    if isinstance(exc, ModelNotFound):
        metrics.on_rejected("not_found")
    elif isinstance(exc, Overloaded):
        metrics.on_rejected("overloaded")
    elif isinstance(exc, (BadRequest, RltError, RequestValidationError)):
        metrics.on_rejected("bad_request")
    elif isinstance(exc, StarletteHTTPException) and exc.status_code == 408:
        metrics.on_rejected("timeout")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        _count(request, exc)
        return exc.response()

    @app.exception_handler(RltError)
    async def _rlt_error(request: Request, exc: RltError):
        _count(request, exc)
        return from_rlt_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        _count(request, exc)
        message, param = validation_message(exc)
        return ErrorResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        _count(request, exc)
        status = exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if status == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        elif status == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        if status >= 500:  # never echo internals
            error_id = new_error_id()
            log.error("HTTP %d serving %s %s [error id %s]: %s", status, request.method, request.url.path,
                      error_id, detail)
            detail = internal_message(error_id)
        return ErrorResponse(error_body(status, detail), status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.disconnects.inc()
        log.info("client went away before sending the whole body of %s %s", request.method, request.url.path)
        return ErrorResponse(error_body(400, "the client disconnected before sending the whole request body"),
                             status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        error_id = new_error_id()
        log.exception("unhandled error serving %s %s [error id %s]", request.method, request.url.path, error_id)
        return ErrorResponse(error_body(500, internal_message(error_id)), status_code=500)
