"""The HTTP routes (one FastAPI router, installed by the ``http`` feature).

OpenAI-compatible: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``. vLLM's ``GET /tokenizer_info`` (special tokens, maximum length, chat
template: what lm-eval's ``tokenizer_backend=remote`` reads). Operations: ``GET /health`` (200
while the engine thread runs and is not stalled, 503 otherwise; the body names the attention
backend and why it was chosen, or why it is unhealthy), ``GET /metrics`` (Prometheus), ``GET /version``,
``POST /tokenize``, ``POST /detokenize``, and rlt's ``GET /v1/engine`` (platform, attention
backend, feature table, engine configuration and live stats — what the server printed at
startup). No response holds a filesystem path: the model is named, its directory is only in the
startup log. The handlers only unpack and delegate; the logic is in :mod:`rlt.serve.serving`. The
POST routes read their JSON bodies through :func:`rlt.serve.bodies.read_body` (off the event loop
when big; documented through ``openapi_extra``).
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from rlt.serve.bodies import body_doc, read_body
from rlt.serve.info import _version
from rlt.serve.metrics import CONTENT_TYPE_LATEST
from rlt.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from rlt.serve.serving import check_prompt_count, create_chat_completion, create_completion
from rlt.serve.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.rlt


@router.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
async def completions(request: Request) -> Response:
    s = _state(request)
    body = await read_body(request, CompletionRequest, partial(check_prompt_count, s))
    return await create_completion(s, body, request)


@router.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    s = _state(request)
    return await create_chat_completion(s, await read_body(request, ChatCompletionRequest), request)


def _card(s: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": s.created, "owned_by": "rlt", "root": s.model_root,
            "parent": None, "max_model_len": s.max_model_len, "permission": []}


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    s = _state(request)
    return JSONResponse({"object": "list", "data": [_card(s, name) for name in s.served_names]})


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> JSONResponse:
    s = _state(request)
    return JSONResponse(_card(s, s.check_model(model_id)))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    s = _state(request)
    return JSONResponse({**s.tokenizer.describe(), "model_max_length": s.max_model_len, "name_or_path": s.model_name})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    s = _state(request)
    attention = s.info.get("attention", {})
    if not s.engine.alive:
        return JSONResponse({"status": "unhealthy", "reason": s.engine.dead_reason}, status_code=503)
    stalled = s.engine.stall_reason
    if stalled is not None:
        return JSONResponse({"status": "unhealthy", "reason": stalled}, status_code=503)
    return JSONResponse({"status": "ok", "attention_backend": attention.get("name"),
                         "attention_reason": attention.get("reason")})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": _version("rlt-serve"), "rlt_platform": _version("rlt-platform"),
                         "rlt_attention": _version("rlt-attention")})


@router.get("/v1/engine")
async def engine_info(request: Request) -> JSONResponse:
    s = _state(request)
    st = s.engine.stats()
    live = {
        "alive": s.engine.alive, "dead_reason": s.engine.dead_reason, "stall_reason": s.engine.stall_reason,
        "num_running": st.num_running, "num_waiting": st.num_waiting, "kv_usage": st.kv_usage,
        "num_kv_blocks": st.num_kv_blocks, "num_free_kv_blocks": st.num_free_kv_blocks,
        "num_steps": st.num_steps, "num_faults": st.num_faults + s.engine.thread_faults,
        "in_flight": s.engine.in_flight, "capacity": s.engine.capacity,
    }
    info = s.info
    now = await s.engine.describe()
    if now is not None:  # the executor's counters as of now (the startup snapshot otherwise)
        info = {**info, "engine": {**info["engine"], **now}}
    return JSONResponse({**info, "stats": {**live, "engine_description_live": now is not None}})


@router.post("/tokenize", openapi_extra=body_doc(TokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    s = _state(request)
    body = await read_body(request, TokenizeRequest)
    body.warn_unknown("/tokenize")
    s.check_model(body.model)
    body.check()
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await s.encode(body.prompt, special, "prompt")
    else:
        messages = [m.for_template(i) for i, m in enumerate(body.messages or [])]
        text = await s.render_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   template_kwargs=body.chat_template_kwargs)
        ids = await s.encode(text, bool(body.add_special_tokens), "messages")
    out = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [s.token_str(t) for t in ids]
    return JSONResponse(out)


@router.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    s = _state(request)
    body = await read_body(request, DetokenizeRequest)
    body.warn_unknown("/detokenize")
    s.check_model(body.model)
    s.check_token_ids(body.tokens, "tokens")
    return JSONResponse({"prompt": await s.decode(body.tokens, skip_special_tokens=False)})
