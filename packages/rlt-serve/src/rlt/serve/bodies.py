"""Reading a route's JSON body: parsed and validated as FastAPI would, off the event loop when big.

FastAPI parses and validates a body parameter on the event loop; for a body of megabytes (the
limit is ``--max-body-bytes``) that holds every other request, ``/health`` and every stream for
seconds. The POST routes read their bodies with :func:`read_body` instead: the same steps and the
same errors (``RequestValidationError`` for what is not JSON, not an object or of the wrong
shape; 400 for a lone surrogate in a field the server uses), but a body of ``THREAD_MIN_BYTES``
or more is decoded, pre-checked, validated and searched in a worker thread, so the loop keeps
getting time slices (the GIL still applies: the worker is preempted between Python bytecodes,
not inside one C call such as ``json.loads``). ``precheck`` sees the decoded JSON before it is
validated: cheap count limits go there, ahead of every walk of the whole body.
"""

from __future__ import annotations

import email.message
import json
from typing import Any, Callable, TypeVar

import anyio.to_thread
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from rlt.serve.state import check_text

M = TypeVar("M", bound=BaseModel)

#: bodies at least this long are parsed in a worker thread (smaller ones cost less than the hop)
THREAD_MIN_BYTES = 64 * 1024


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule (strict content type): only ``application/json`` or ``application/*+json``."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def parse_body(raw: bytes, content_type: str | None, model: type[M],
               precheck: Callable[[Any], None] | None = None) -> M:
    """``raw`` -> a validated ``model``, raising what FastAPI raises for a body parameter, then
    400 for a lone surrogate in a field the server uses (:func:`check_text`)."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                       "input": None}])
    body: Any = raw
    if _is_json(content_type):
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from None
        except (ValueError, RecursionError) as e:  # not UTF-8, an int of too many digits, nesting too deep: as FastAPI
            raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
        if precheck is not None:
            precheck(body)
    try:
        value = model.model_validate(body, from_attributes=True)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=body) from None
    check_text(value)
    return value


async def read_body(request: Request, model: type[M], precheck: Callable[[Any], None] | None = None) -> M:
    raw = await request.body()
    content_type = request.headers.get("content-type")
    if len(raw) < THREAD_MIN_BYTES:
        return parse_body(raw, content_type, model, precheck)
    return await anyio.to_thread.run_sync(parse_body, raw, content_type, model, precheck)


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as the route's JSON body (the route reads it itself)."""
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
