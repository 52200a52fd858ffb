"""Completions and chat completions: from a validated request to engine requests, and from the
engine's outputs to OpenAI responses — one JSON body, or SSE chunks ending with ``data: [DONE]``.

- Requests are checked before any work that grows with them: every text must be valid Unicode,
  a request needing more engine requests (prompts x n) than the server can ever hold is a 400,
  and prompts are bounded by the context length before they are tokenised in full (see
  :mod:`rlt.serve.state`); tokenising runs off the event loop. The engine gets token ids.
- Each prompt x each of ``n`` choices is its own engine request; choice ``i`` samples with
  ``seed + i`` when a seed is given. Choice index = ``prompt_index * n + i`` (vLLM's order).
- Usage is counted from real token ids: each prompt's tokens once, every choice's generated tokens.
- rlt's extension: every choice (and every streamed choice delta) carries
  ``"rlt": {"exit_depths": [...]}``, the loops run for each generated token it reports;
  ``return_token_ids: true`` adds ``token_ids`` (and ``prompt_token_ids``) to each choice.
- Prompt logprobs: completions' ``echo`` with ``logprobs`` returns an entry for every prompt token
  (the first one null) ahead of the generated ones, with ``text_offset`` from the prompt's start, as
  vLLM does; the ``prompt_logprobs`` extension adds vLLM's ``prompt_logprobs`` list (per choice in
  completions, per response in chat). ``echo`` with ``max_tokens: 0`` returns only the prompt (and its
  logprobs), evaluation clients' scoring request: the engine computes one token, which the response
  leaves out (``finish_reason: length``, no completion tokens; vLLM, which accepts the request too,
  counts that token in usage and returns its id and finish reason).
- SSE ``data:`` lines escape U+2028, U+2029 and U+0085 (valid JSON either way, but line-splitting
  clients such as httpx's ``aiter_lines`` would cut a raw one).
- Streaming writes once per wakeup (everything the engine delivered meanwhile, one send); a
  client that fell behind gets one chunk per choice for the outputs it missed, built from the
  latest (cumulative) output, so nothing is lost. The chunk envelope is encoded once per request.
- Streaming holds back the last ``len(longest stop string) - 1`` characters until the request
  ends, so a stop string split across tokens is never partly sent.
- A client that goes away cancels its handler; every unfinished engine request of it is aborted,
  which frees its KV. An engine fault is a 500 (or, once streaming has begun, an in-band
  ``data: {"error": ...}`` event followed by ``data: [DONE]``) whose message is only an error id;
  the engine's own message is logged under that id.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any, AsyncIterator

import attrs

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rlt.platform.errors import RltError
from rlt.platform.outputs import RequestOutput, TokenLogprob
from rlt.platform.sampling_params import SamplingParams
from rlt.serve.async_engine import Generation, Item
from rlt.serve.errors import EngineFault, from_rlt_error
from rlt.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, seed_for_choice
from rlt.serve.state import ServerState

DONE = "data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: characters some line splitters (str.splitlines, httpx) treat as line breaks: sent \u-escaped
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_json(payload)}\n\n"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def echo_entries(prompt_ids: list[int], out: RequestOutput) -> list[TokenLogprob | int]:
    """The prompt's logprob entries for ``echo``: a bare token id first (nothing predicts it). A
    request aborted before its prompt ran (at shutdown) has none: its prompt tokens come back bare
    (null logprobs)."""
    if out.prompt_logprobs is None and out.finish_reason == "abort":
        return list(prompt_ids)
    if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(prompt_ids):
        raise EngineFault("the engine returned no prompt logprobs for a request that asked for them")
    return [prompt_ids[0], *out.prompt_logprobs[1:]]


class ChoiceStream:
    """Turns one choice's cumulative engine outputs into deltas (what was not yet sent)."""

    def __init__(self, index: int, prompt_ids: list[int], prefix: str, hold: int, echo_logprobs: bool = False) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.prefix = prefix
        self.hold = hold
        self.echo_logprobs = echo_logprobs
        self.sent_text = 0
        self.sent_tokens = 0
        self.started = False
        self.text_offset = len(prefix)

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        text = out.text
        limit = len(text) if out.finished or not self.hold else max(self.sent_text, len(text) - self.hold)
        piece = text[self.sent_text:limit]
        self.sent_text = max(self.sent_text, limit)
        start = self.sent_tokens
        self.sent_tokens = len(out.token_ids)
        first = not self.started
        logprobs = list(out.logprobs[start:]) if out.logprobs is not None else None
        if first:
            piece = self.prefix + piece
            self.started = True
            if self.echo_logprobs:
                logprobs = echo_entries(self.prompt_ids, out) + (logprobs or [])
        return {
            "first": first, "text": piece, "token_ids": list(out.token_ids[start:]),
            "exit_depths": list(out.exit_depths[start:]),
            "logprobs": logprobs,
            "finished": out.finished, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
            "completion_tokens": len(out.token_ids),
        }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Format:
    """The shape of one endpoint's responses."""

    object_name: str
    chunk_object: str
    id_prefix: str

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.offsets: dict[int, int] = {}

    def logprobs(self, index: int, lps: list[TokenLogprob] | None, top_n: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def prompt_logprobs(self, entries, top_n: int) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token ``{id: {logprob, rank, decoded_token}}``, first null;
        None where the engine computed none (a request aborted before its prompt ran)."""
        if entries is None:
            return None
        tok = self.state.token_str
        out: list[dict[str, Any] | None] = [None]
        for e in entries[1:]:
            d = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": tok(e.token_id)}}
            for rank, (tid, v) in enumerate(e.top[:top_n], 1):
                d.setdefault(str(tid), {"logprob": _finite(v), "rank": rank, "decoded_token": tok(tid)})
            out.append(d)
        return out

    def attach_prompt_logprobs(self, payload: dict, choice: dict, value: list) -> None:
        choice["prompt_logprobs"] = value

    def choice(self, index: int, text: str, out: RequestOutput, lps, with_ids: bool, prompt_ids) -> dict:
        raise NotImplementedError

    def chunk_choice(self, index: int, d: dict[str, Any], with_ids: bool, prompt_ids) -> dict:
        raise NotImplementedError

    def opening(self, indices: list[int]) -> list[dict]:
        return []


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def logprobs(self, index, lps, top_n):
        if lps is None:
            return None
        tok = self.state.token_str
        offset = self.offsets.get(index, 0)
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:  # a bare int: a token without a logprob (the echoed prompt's first)
            s = tok(lp if isinstance(lp, int) else lp.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if isinstance(lp, int):
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_finite(lp.logprob))
            top = {s: _finite(lp.logprob)}
            for tid, v in lp.top[:top_n]:
                top.setdefault(tok(tid), _finite(v))
            tops.append(top)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _ext(self, c: dict, depths, ids, with_ids, prompt_ids) -> dict:
        c["rlt"] = {"exit_depths": list(depths)}
        if with_ids:
            c["token_ids"] = list(ids)
            if prompt_ids is not None:
                c["prompt_token_ids"] = list(prompt_ids)
        return c

    def choice(self, index, text, out, lps, with_ids, prompt_ids):
        c = {"index": index, "text": text, "logprobs": lps, "finish_reason": out.finish_reason,
             "stop_reason": out.stop_reason}
        return self._ext(c, out.exit_depths, out.token_ids, with_ids, prompt_ids)

    def chunk_choice(self, index, d, with_ids, prompt_ids):
        c = {"index": index, "text": d["text"], "logprobs": d["lp"],
             "finish_reason": d["finish_reason"] if d["finished"] else None,
             "stop_reason": d["stop_reason"] if d["finished"] else None}
        return self._ext(c, d["exit_depths"], d["token_ids"], with_ids, prompt_ids if d["first"] else None)


class ChatFormat(CompletionFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def logprobs(self, index, lps, top_n):
        if lps is None:
            return None
        tok = self.state.token_str
        content = []
        for lp in lps:
            s = tok(lp.token_id)
            content.append({
                "token": s, "logprob": _finite(lp.logprob), "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": tok(t), "logprob": _finite(v), "bytes": list(tok(t).encode("utf-8"))}
                                 for t, v in lp.top[:top_n]],
            })
        return {"content": content}

    def choice(self, index, text, out, lps, with_ids, prompt_ids):
        c = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lps,
             "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        return self._ext(c, out.exit_depths, out.token_ids, with_ids, prompt_ids)

    def attach_prompt_logprobs(self, payload, choice, value):
        if payload.get("prompt_logprobs") is None:  # chat: one prompt, reported per response (vLLM)
            payload["prompt_logprobs"] = value

    def opening(self, indices):
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in indices]

    def chunk_choice(self, index, d, with_ids, prompt_ids):
        c = {"index": index, "delta": {"content": d["text"]} if d["text"] or not d["finished"] else {},
             "logprobs": d["lp"], "finish_reason": d["finish_reason"] if d["finished"] else None,
             "stop_reason": d["stop_reason"] if d["finished"] else None}
        return self._ext(c, d["exit_depths"], d["token_ids"], with_ids, prompt_ids if d["first"] else None)


# -- the shared flow ---------------------------------------------------------------------------------
class _Job:
    """One HTTP generation request, prepared: prompts as token ids, params, the engine requests."""

    def __init__(self, state: ServerState, body: SamplingFields, fmt: _Format, model: str,
                 prompt_ids: list[list[int]], prefixes: list[str], params: SamplingParams, top_n: int) -> None:
        self.state = state
        self.body = body
        self.fmt = fmt
        self.model = model
        self.prompt_ids = prompt_ids
        self.params = params
        self.top_n = top_n
        self.n = body.n
        self.id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        #: set once the whole response (or its in-band error) has been produced
        self.completed = False
        self.created = int(time.time())
        self._chunk_head: str | None = None
        hold = max((len(s) for s in params.stop), default=1) - 1
        echo_logprobs = getattr(body, "echo_logprobs", False)
        self.prompt_only = getattr(body, "prompt_only", False)
        self.choices = {p * self.n + i: ChoiceStream(p * self.n + i, ids, prefixes[p], hold, echo_logprobs)
                        for p, ids in enumerate(prompt_ids) for i in range(self.n)}
        # logprobs' text_offset: after the echoed prefix, or from 0 where the prompt's tokens are listed too
        fmt.offsets = {index: 0 if echo_logprobs else len(cs.prefix) for index, cs in self.choices.items()}

    def view(self, out: RequestOutput) -> RequestOutput:
        """What the client is shown of ``out``: all of it, except for a prompt-only request (completions'
        ``echo`` with ``max_tokens: 0``), whose one computed token is left out — no text, ids, logprobs or
        depths of it, nothing counted as generated — and which ends by length (max_tokens 0 reached)."""
        if not self.prompt_only:
            return out
        ended = out.finished and out.finish_reason != "abort"
        return attrs.evolve(out, token_ids=(), text="", exit_depths=(), new_token_ids=(), new_text="",
                            logprobs=None if out.logprobs is None else (),
                            finish_reason="length" if ended else out.finish_reason,
                            stop_reason=None if ended else out.stop_reason)

    def engine_requests(self) -> list[tuple[int, str, list[int], SamplingParams]]:
        reqs = []
        for p, ids in enumerate(self.prompt_ids):
            for i in range(self.n):
                params = self.params if self.n == 1 else self.params.with_(seed=seed_for_choice(self.params.seed, i))
                reqs.append((p * self.n + i, f"{self.id}-{p}-{i}", ids, params))
        return reqs

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_ids)

    def prompt_of(self, index: int) -> list[int]:
        return self.prompt_ids[index // self.n]

    def envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.fmt.chunk_object if chunk else self.fmt.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def chunk_sse(self, choices: list[dict], usage: dict[str, int] | None = None) -> str:
        """``sse(envelope(choices, chunk=True) [+ usage])``, byte for byte, encoding the envelope once per job."""
        if self._chunk_head is None:
            head = _json(self.envelope([], chunk=True))
            self._chunk_head = "data: " + head[:head.rindex("[]")]
        tail = "}\n\n" if usage is None else f',"usage":{_json(usage)}}}\n\n'
        return self._chunk_head + _json(choices) + tail


async def _start(job: _Job) -> Generation:
    return await job.state.engine.generate(job.engine_requests())


async def _await_or_disconnect(request: Request, coro):
    """Run ``coro``; if the client disconnects first, cancel it and return None (vLLM's with_cancellation)."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nothing to answer
        pass
    return None


async def _collect(job: _Job, gen: Generation) -> JSONResponse:
    finals: dict[int, RequestOutput] = {}
    try:
        async for item in gen:
            if item.error is not None or (item.output is not None and item.output.error):
                raise EngineFault(item.error or item.output.error, item.request_id)
            if item.output is not None and item.output.finished:
                finals[item.index] = job.view(item.output)
    finally:
        gen.abort()
    fmt, body = job.fmt, job.body
    choices = []
    payload = job.envelope(choices, chunk=False)
    for index in sorted(finals):
        out = finals[index]
        cs = job.choices[index]
        lps = list(out.logprobs) if out.logprobs is not None else None
        if cs.echo_logprobs:
            lps = echo_entries(cs.prompt_ids, out) + (lps or [])
        choice = fmt.choice(index, cs.prefix + out.text, out, fmt.logprobs(index, lps, job.top_n),
                            body.return_token_ids, job.prompt_of(index))
        if body.prompt_logprobs is not None:
            fmt.attach_prompt_logprobs(payload, choice, fmt.prompt_logprobs(out.prompt_logprobs, body.prompt_logprobs))
        choices.append(choice)
    payload["usage"] = _usage(job.prompt_tokens, sum(len(o.token_ids) for o in finals.values()))
    return JSONResponse(payload)


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its generation however it ends (finished, disconnect, cancel) —
    even when the client left before the body iterator was first entered."""

    def __init__(self, job: "_Job", gen: Generation) -> None:
        super().__init__(_stream(job, gen), media_type="text/event-stream", headers=_SSE_HEADERS)
        self._job = job
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()
            if not self._job.completed:
                self._job.state.metrics.disconnects.inc()


def _superseded(batch: list[Item]) -> set[int]:
    """Positions in ``batch`` of outputs a later output of the same choice supersedes (outputs are
    cumulative, so a client that fell behind gets one chunk per choice for the steps it missed)."""
    last: dict[int, int] = {}
    for pos, item in enumerate(batch):
        if item.error is None and item.output is not None and not item.output.error:
            last[item.index] = pos
    return {pos for pos, item in enumerate(batch)
            if item.error is None and item.output is not None and not item.output.error and last[item.index] != pos}


async def _stream(job: _Job, gen: Generation) -> AsyncIterator[str]:
    fmt, body = job.fmt, job.body
    generated: dict[int, int] = {}
    # Chat's opening (role) chunks go out with the first engine output, as vLLM sends them: a
    # client that times the first chunk (vllm bench serve) then measures the first token.
    opening = fmt.opening(sorted(job.choices))
    try:
        async for batch in gen.batches():
            parts: list[str] = []  # one write per wakeup, whatever the batch holds
            skip = _superseded(batch) if len(batch) > 1 else ()
            for pos, item in enumerate(batch):
                error = item.error or (item.output.error if item.output is not None else None)
                if error is not None:
                    job.completed = True
                    parts += (sse(EngineFault(error, item.request_id).body()), DONE)
                    yield "".join(parts)
                    return
                for c in opening:
                    parts.append(job.chunk_sse([c], _usage(len(job.prompt_of(c["index"])), 0)
                                               if body.continuous_usage else None))
                opening = []
                if pos in skip:
                    continue
                d = job.choices[item.index].delta(job.view(item.output))
                if not (d["text"] or d["token_ids"] or d["finished"] or d["first"]):
                    continue
                d["lp"] = fmt.logprobs(item.index, d["logprobs"], job.top_n)
                generated[item.index] = d["completion_tokens"]
                choice = fmt.chunk_choice(item.index, d, body.return_token_ids, job.prompt_of(item.index))
                parts.append(job.chunk_sse([choice], _usage(len(job.prompt_of(item.index)), d["completion_tokens"])
                                           if body.continuous_usage else None))
            if parts:
                yield "".join(parts)
        tail = [job.chunk_sse([], _usage(job.prompt_tokens, sum(generated.values())))] if body.include_usage else []
        job.completed = True
        yield "".join(tail) + DONE
    finally:
        gen.abort()


async def _respond(job: _Job, request: Request) -> Response:
    gen = await _start(job)
    if job.body.stream:
        return GenerationStream(job, gen)
    result = await _await_or_disconnect(request, _collect(job, gen))
    if result is None:  # the client went away: its requests were aborted
        gen.abort()
        job.state.metrics.disconnects.inc()
        return Response(status_code=499)
    return result


# -- endpoints -----------------------------------------------------------------------------------------
def _check_fits(state: ServerState, num_prompts: int, n: int) -> None:
    if n > state.engine.capacity:
        state.check_fits(n, "n")
    state.check_fits(num_prompts * n, "prompt")


def check_prompt_count(state: ServerState, data: Any) -> None:
    """The decoded body of a completion request, before it is validated or searched: a batch of
    more prompts than the server can ever hold is refused at once (the message of
    :func:`_check_fits`), not after walking each of its (maybe a million) prompts."""
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(prompt, list) or len(prompt) <= state.engine.capacity or not isinstance(prompt[0], (str, list)):
        return  # not a batch (a single prompt's token ids may be long), or one that may fit
    n = data.get("n", 1)
    valid_n = type(n) is int and 1 <= n <= state.options.max_n
    _check_fits(state, len(prompt), n if valid_n else 1)


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    """``body`` was read by :func:`rlt.serve.bodies.read_body` (so its text is valid Unicode)."""
    body.warn_unknown("/v1/completions")
    model = state.check_model(body.model)
    body.check_supported(state.options.max_n)
    params = body.to_params()
    items, _batch = body.prompts()
    _check_fits(state, len(items), body.n)
    prompt_ids: list[list[int]] = []
    prefixes: list[str] = []
    for p, item in enumerate(items):
        if isinstance(item, str):
            ids = await state.encode(item, body.add_special_tokens, "prompt")
            state.check_prompt_len(len(ids), "prompt")
            text = item
        else:
            state.check_prompt_len(len(item), "prompt")
            state.check_token_ids(item, "prompt")
            ids = item
            text = state.tokenizer.decode(item, skip_special_tokens=False) if body.echo else ""
        prompt_ids.append(ids)
        prefixes.append(text if body.echo else "")
    job = _Job(state, body, CompletionFormat(state), model, prompt_ids, prefixes, params, body.logprobs or 0)
    return await _respond(job, request)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    """``body`` was read by :func:`rlt.serve.bodies.read_body` (so its text is valid Unicode)."""
    body.warn_unknown("/v1/chat/completions")
    model = state.check_model(body.model)
    body.check_supported(state.options.max_n)
    # the engine names its own fields; a chat request has messages, and maybe max_completion_tokens
    rename = {"prompt": "messages"}
    if body.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    try:
        params = body.to_params()
    except RltError as exc:
        raise from_rlt_error(exc, rename, ("max_tokens",)) from None
    _check_fits(state, 1, body.n)
    messages = body.template_messages()
    text = await state.render_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   template_kwargs=body.chat_template_kwargs)
    ids = await state.encode(text, body.add_special_tokens, "messages")
    state.check_prompt_len(len(ids), "messages")
    prefix = ""
    if body.echo and messages[-1].get("role") == "assistant":
        prefix = messages[-1].get("content") or ""
    job = _Job(state, body, ChatFormat(state), model, [ids], [prefix], params, body.top_logprobs or 0)
    try:
        return await _respond(job, request)
    except RltError as exc:
        raise from_rlt_error(exc, rename, ("max_tokens",)) from None

