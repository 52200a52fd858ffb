"""Issue 15's pieces in-process: the watchdog, the API key check, the body read timeout, the search
for lone surrogates, bounded tokenising (the prefix probe for a tokenizer with no per-token bound),
``param`` taken from rlt's errors, and big bodies (read off the event loop, cheap limits first)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from functools import partial

import pytest
from starlette.testclient import TestClient

from rlt.platform import EngineConfig, InvalidRequestError, LLMEngine
from rlt.platform.features import FeatureStatus
from rlt.serve.app import create_app
from rlt.serve.async_engine import Watchdog
from rlt.serve.auth import ApiKeyAuth
from rlt.serve.bodies import THREAD_MIN_BYTES, parse_body
from rlt.serve.errors import BadRequest, from_rlt_error
from rlt.serve.feature import HttpOptions
from rlt.serve.limits import BodySizeLimit
from rlt.serve.protocol import ChatCompletionRequest, CompletionRequest
from rlt.serve.routes import router
from rlt.serve.server import build_state, resolve_api_key
from rlt.serve.state import PROBE_CHARS_PER_TOKEN, find_lone_surrogate


# -- watchdog ------------------------------------------------------------------------------------
def test_watchdog_trips_only_when_busy_without_steps():
    w = Watchdog(5.0)
    w.observe(10, busy=False, now=0.0)
    assert w.stalled_for(100.0) is None  # idle is never stalled
    w.observe(10, busy=True, now=1.0)
    assert w.stalled_for(4.0) is None
    assert w.stalled_for(5.5) == pytest.approx(5.5)  # busy since the last idle observation (0.0)
    w.observe(11, busy=True, now=6.0)  # a step ran
    assert w.stalled_for(10.0) is None and w.stalled_for(11.5) == pytest.approx(5.5)
    w.observe(11, busy=False, now=12.0)
    assert w.stalled_for(30.0) is None
    assert Watchdog(0).stalled_for(1e9) is None  # 0: off


# -- ASGI middleware ------------------------------------------------------------------------------
async def _echo_body(scope, receive, send):
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _call(app, headers=(), chunks=((b"{}", False),), path="/v1/completions", gap=0.0):
    sent = []

    async def main():
        queue = list(chunks)

        async def receive():
            if not queue:
                await asyncio.sleep(3600)
            body, more = queue.pop(0)
            if gap:
                await asyncio.sleep(gap)
            return {"type": "http.request", "body": body, "more_body": more}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
        try:
            await app(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - what the app's exception handlers would see
            return exc
        return None

    exc = asyncio.run(main())
    return exc, sent


def test_api_key_middleware():
    app = ApiKeyAuth(_echo_body, "k3y", open_paths=("/health",))
    for headers in ((), [(b"authorization", b"Bearer wrong")], [(b"authorization", b"k3y")],
                    [(b"authorization", b"Basic k3y")], [(b"authorization", b"Bearer k3y2")]):
        _, sent = _call(app, headers)
        assert sent[0]["status"] == 401 and (b"www-authenticate", b"Bearer") in sent[0]["headers"]
        body = json.loads(sent[1]["body"])
        assert body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401
    for value in (b"Bearer k3y", b"bearer k3y", b"Bearer  k3y "):
        _, sent = _call(app, [(b"authorization", value)])
        assert sent[0]["status"] == 200, value
    _, sent = _call(app, (), path="/health")
    assert sent[0]["status"] == 200


def test_api_key_from_flag_then_environment():
    assert resolve_api_key(HttpOptions(api_key="flag"), {"RLT_API_KEY": "env"}) == "flag"
    assert resolve_api_key(HttpOptions(), {"RLT_API_KEY": "env"}) == "env"
    assert resolve_api_key(HttpOptions(), {"RLT_API_KEY": "  "}) is None
    assert resolve_api_key(HttpOptions(), {}) is None
    assert "flag" not in repr(HttpOptions(api_key="flag"))
    with pytest.raises(ValueError, match="--api-key"):
        HttpOptions(api_key="")


def test_body_read_timeout():
    app = BodySizeLimit(_echo_body, max_bytes=10_000, read_timeout=0.3)
    exc, _ = _call(app, chunks=[(b"{", True)])  # then nothing more ever arrives
    assert exc is not None and exc.status_code == 408 and "--body-read-timeout" in exc.detail
    t0 = time.monotonic()
    exc, _ = _call(app, chunks=[(b"x", True)] * 50, gap=0.05)  # a trickle: each chunk in time, the whole not
    assert exc.status_code == 408 and time.monotonic() - t0 < 1.0
    exc, sent = _call(app, chunks=[(b"ab", True), (b"cd", False)], gap=0.05)
    assert exc is None and sent[1]["body"] == b"abcd"
    exc, sent = _call(BodySizeLimit(_echo_body, max_bytes=10_000, read_timeout=0), chunks=[(b"x", False)], gap=0.5)
    assert exc is None  # 0: no limit


# -- text ----------------------------------------------------------------------------------------
def test_find_lone_surrogate_names_the_field():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "fine"}, {"role": "user", "content": [{"type": "text",
                                                                                       "text": "x\udc00"}]}]})
    assert find_lone_surrogate(body) == ("messages.1.content.0.text", 1, "\udc00")
    assert find_lone_surrogate({"prompt": ["a", "b\ud800"]}) == ("prompt.1", 1, "\ud800")
    assert find_lone_surrogate({"a": {"b\ud800": 1}}) == ("a", 1, "\ud800")
    assert find_lone_surrogate({"prompt": list(range(100_000)), "x": "é😀"}) is None


def test_param_comes_from_the_error_and_is_renamed_for_chat():
    assert from_rlt_error(InvalidRequestError("prompt has 300 tokens", param="prompt")).param == "prompt"
    assert from_rlt_error(InvalidRequestError("top_k: bad")).param == "top_k"  # read off the message
    assert from_rlt_error(InvalidRequestError("no field here")).param is None
    chat = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    assert from_rlt_error(InvalidRequestError("x", param="prompt"), chat).param == "messages"
    assert from_rlt_error(InvalidRequestError("x", param="max_tokens"), chat).param == "max_completion_tokens"
    assert from_rlt_error(InvalidRequestError("x", param="max_loops"), chat).param == "max_loops"
    # the message names the client's field too where the route asks for it (chat's max_completion_tokens)
    err = from_rlt_error(InvalidRequestError("prompt has 9 tokens and max_tokens is 99; lower max_tokens to at most 8 "
                                             "(not max_tokens_x)", param="max_tokens"), chat, ("max_tokens",))
    assert err.param == "max_completion_tokens" and err.message == (
        "prompt has 9 tokens and max_completion_tokens is 99; lower max_completion_tokens to at most 8 (not max_tokens_x)")
    assert from_rlt_error(InvalidRequestError("max_tokens: bad"), {"prompt": "messages"}, ("max_tokens",)).message == \
        "max_tokens: bad"  # not renamed: the client sent max_tokens


# -- bounded tokenising ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def state(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=5)), dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=2, max_model_len=64))
    status = FeatureStatus("http", "rlt-serve", True, True, True, "enabled")
    return build_state(engine, statuses=[status], options=HttpOptions(), served_names=["tiny"])


class _Counting:
    """Wraps the tokenizer: counts characters tokenised; optionally claims no per-token bound."""

    def __init__(self, inner, bound) -> None:
        self.inner, self.bound, self.chars = inner, bound, 0

    @property
    def max_chars_per_token(self):
        return self.bound

    def encode(self, text, add_special_tokens=False):
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("bound", ["vocab", None])
def test_a_long_prompt_is_refused_after_bounded_work(state, bound):
    inner = state.tokenizer
    tok = _Counting(inner, inner.max_chars_per_token if bound == "vocab" else None)
    state.tokenizer = tok
    try:
        with pytest.raises(BadRequest) as e:
            asyncio.run(state.encode("hello world " * 200_000, True, "prompt"))
        assert e.value.param == "prompt" and "maximum context length of 64 tokens" in e.value.message
        if bound == "vocab":
            assert tok.chars == 0  # refused by length alone
        else:
            assert tok.chars <= PROBE_CHARS_PER_TOKEN * 64  # one probe, not the 2.4 M characters
        # few tokens for many characters (the vocab's longest token, repeated): probed, then tokenised whole
        piece = max((inner.decode([i], skip_special_tokens=False) for i in range(inner.vocab_size)), key=len)
        dense = piece * (PROBE_CHARS_PER_TOKEN * 64 // len(piece) + 1)
        assert len(dense) > PROBE_CHARS_PER_TOKEN * 64 and len(inner.encode(dense, False)) < 64
        ids = asyncio.run(state.encode(dense, False, "prompt"))
        assert ids == inner.encode(dense, False)
        assert asyncio.run(state.encode("short", False, "prompt")) == inner.encode("short", False)
    finally:
        state.tokenizer = inner


def test_never_fits_is_a_400(state):
    cap = state.engine.capacity
    state.check_fits(cap, "n")
    with pytest.raises(BadRequest) as e:
        state.check_fits(cap + 1, "n")
    assert e.value.status == 400 and e.value.param == "n" and "can never be admitted" in e.value.message


def test_docs_switch(state):
    assert create_app(state, [router]).openapi_url is None
    state.options = HttpOptions(api_docs=True)
    try:
        with TestClient(create_app(state, [router])) as c:
            assert c.get("/openapi.json").status_code == 200 and c.get("/docs").status_code == 200
    finally:
        state.options = HttpOptions()


# -- big bodies ------------------------------------------------------------------------------------
def _many_prompts(count: int) -> bytes:
    return json.dumps({"prompt": [[1]] * count, "max_tokens": 2}).encode()


def test_a_big_body_is_parsed_off_the_event_loop(state, monkeypatch):
    """While a big body is being decoded, /health is answered: the decoding (held here until
    /health has answered, or a deadlock guard ran out) runs in a worker thread, not on the loop."""
    import httpx

    big = _many_prompts(300_000)
    assert len(big) > THREAD_MIN_BYTES
    real_loads = json.loads
    decoding, health_answered = threading.Event(), threading.Event()

    def held_loads(s, *args, **kwargs):
        if len(s) >= len(big):
            decoding.set()
            health_answered.wait(10)  # the guard: on the loop this would hold /health for 10 s
        return real_loads(s, *args, **kwargs)

    monkeypatch.setattr(json, "loads", held_loads)
    app = create_app(state, [router])
    order = []

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://rlt", timeout=60) as c:
                async def post_big():
                    r = await c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
                    order.append("big")
                    return r

                task = asyncio.ensure_future(post_big())
                assert await asyncio.to_thread(decoding.wait, 10)
                health = await c.get("/health")
                order.append("health")
                health_answered.set()
                return health, await task

    health, r = asyncio.run(main())
    assert order == ["health", "big"]
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # the big body gets the answer it always got
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert err["message"].startswith("prompt: this request needs 300000 generations (prompts x n) but this server "
                                     f"runs at most {state.engine.capacity} at once")


def test_a_batch_that_can_never_fit_is_refused_before_its_prompts_are_walked(state, monkeypatch):
    import rlt.serve.bodies as bodies
    import rlt.serve.protocol as protocol
    from rlt.serve.serving import check_prompt_count

    walked = []
    monkeypatch.setattr(protocol, "check_prompt_shape", lambda v: walked.append("shape"))
    monkeypatch.setattr(bodies, "check_text", lambda v: walked.append("text"))
    cap = state.engine.capacity
    for n, want in ((1, cap + 1), (2, 2 * (cap + 1)), ("2", cap + 1)):  # an invalid n counts as 1 here
        body = json.dumps({"prompt": [[1]] * (cap + 1), "n": n}).encode()
        with pytest.raises(BadRequest) as e:
            parse_body(body, "application/json", CompletionRequest, partial(check_prompt_count, state))
        assert e.value.param == "prompt" and f"needs {want} generations" in e.value.message
    assert walked == []
    # a batch that fits, and one long prompt of token ids, go on to be validated and searched
    for prompt in ([[1]] * cap, [1] * (cap + 1)):
        body = json.dumps({"prompt": prompt}).encode()
        parse_body(body, "application/json", CompletionRequest, partial(check_prompt_count, state))
    assert walked == ["shape", "text"] * 2


def test_fields_the_server_ignores_are_not_searched():
    junk = [[1, "a\ud800"]] * 1000
    assert find_lone_surrogate(CompletionRequest.model_validate({"prompt": "x", "junk": junk})) is None
    assert find_lone_surrogate(CompletionRequest.model_validate(
        {"prompt": "x", "stream": True, "stream_options": {"junk": "\ud800"}})) is None
    # a message's further fields go to the chat template: they are searched
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "junk": "\ud800"}]})
    assert find_lone_surrogate(chat) == ("messages.0.junk", 0, "\ud800")
    assert find_lone_surrogate(CompletionRequest.model_validate({"prompt": "x", "stop": ["\ud800"]}))[0] == "stop.0"


# -- errors name their field ------------------------------------------------------------------------
def _error(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_engine_and_template_errors_name_their_field(tiny_checkpoint):
    # 8 KV blocks of 16 tokens x 4 depth planes: a request can hold at most 32 positions
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=5)), dtype="float32", num_kv_blocks=8,
                                    block_size=16, max_num_seqs=2, max_model_len=256))
    assert engine.num_loops == 4
    status = FeatureStatus("http", "rlt-serve", True, True, True, "enabled")
    st = build_state(engine, statuses=[status], options=HttpOptions(), served_names=["tiny"])
    with TestClient(create_app(st, [router])) as c:
        # the prompt alone is too big for the pool, whatever max_tokens: the prompt is named
        e = _error(c.post("/v1/completions", json={"prompt": [7] * 40, "max_tokens": 2}))
        assert e["param"] == "prompt" and "prompt alone" in e["message"] and "the pool has 8" in e["message"]
        long_chat = [{"role": "user", "content": " ".join(["hello"] * 10)}]
        e = _error(c.post("/v1/chat/completions", json={"messages": long_chat, "max_completion_tokens": 2}))
        assert e["param"] == "messages" and "prompt alone" in e["message"]
        # the prompt fits, prompt + max_tokens does not: max_tokens (max_completion_tokens in chat) is named
        e = _error(c.post("/v1/completions", json={"prompt": [7] * 20, "max_tokens": 20}))
        assert e["param"] == "max_tokens" and "lower max_tokens" in e["message"]
        short_chat = [{"role": "user", "content": "hi"}]
        e = _error(c.post("/v1/chat/completions", json={"messages": short_chat, "max_completion_tokens": 60}))
        assert e["param"] == "max_completion_tokens"
        # the engine's loop-bound message leads with its field, as the others do
        e = _error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "min_loops": 5}))
        assert e["param"] == "min_loops" and e["message"] == "min_loops: 5 exceeds the 4 loops requests run"
        # the chat template's own raise_exception (an InvalidRequestError) is about the messages
        tok = st.tokenizer
        template = tok.chat_template
        tok.chat_template, tok._template = "{{ raise_exception('roles must alternate') }}", None
        try:
            for path in ("/v1/chat/completions", "/tokenize"):
                e = _error(c.post(path, json={"messages": short_chat}))
                assert e["param"] == "messages" and "roles must alternate" in e["message"], path
        finally:
            tok.chat_template, tok._template = template, None
        assert c.post("/v1/chat/completions", json={"messages": short_chat, "max_tokens": 1}).status_code == 200
