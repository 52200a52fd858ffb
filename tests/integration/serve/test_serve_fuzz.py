"""Property-based: generated JSON bodies, every field of completions, chat and /tokenize with values
drawn across types and extreme ranges (64-bit edges, NaN and infinities, lone surrogates, nested
junk), thrown at a real server over HTTP. Every response must be a 2xx (a stream ending with
``[DONE]`` and no in-band error) or a 4xx in the OpenAI error shape: never a 5xx, never a hang.
Afterwards the engine is idle and healthy and has counted no fault.

Runs derandomized (the same examples every run); ``RLT_FUZZ_EXAMPLES`` sets how many per endpoint,
``RLT_FUZZ_RANDOM=1`` draws new ones.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlt.serve.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

from test_serve_hardening import assert_recovers, idle, stats

EXAMPLES = int(os.environ.get("RLT_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("RLT_FUZZ_RANDOM"),
                database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=True)
VOCAB = 320  # the tiny checkpoint's

INTS = [0, 1, -1, 2, 7, 63, 64, 255, 256, 319, 320, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1,
        2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, -(10**30)]
FLOATS = [0.0, -0.0, 1e-7, 0.5, 1.0, 1.5, -1.0, 1e-300, 5e-324, 3.4028234663852886e38, 3.5e38, 1e308,
          math.inf, -math.inf, math.nan]
STRINGS = ["", "x", "hi there", "\ud800", "a\udfffb", "\x00", "<|im_end|>", "<|im_start|>user", "word " * 80,
           "é😀", "{{ raise_exception('x') }}", "user", "assistant", "tiny", "text"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(INTS), st.floats(),
                    st.sampled_from(FLOATS), st.text(max_size=12), st.sampled_from(STRINGS))
junk = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                    max_leaves=10)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
text = st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["x", "hi there", "é😀", "<|im_end|>"]))
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"])},
    optional={"content": st.one_of(text, st.lists(part, min_size=1, max_size=3))})
extreme = st.one_of(st.sampled_from(INTS), st.sampled_from(FLOATS), st.sampled_from(STRINGS), st.none(),
                    st.booleans(), junk)

#: values that are valid (or nearly), so that requests get past the first check and run; a field
#: not listed is sent at its default
GOOD = {
    "prompt": st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids,
                        st.lists(token_ids, min_size=1, max_size=3)),
    "messages": st.lists(message, min_size=1, max_size=4),
    "model": st.sampled_from(["tiny", None]),
    "n": st.integers(1, 3),
    "max_tokens": st.one_of(st.integers(0, 8), st.none()),  # 0: prompt-only with echo, else a 400
    "max_completion_tokens": st.one_of(st.integers(1, 8), st.none()),
    "min_tokens": st.integers(0, 4), "top_k": st.integers(-1, 50), "seed": st.integers(-(2**63), 2**64 - 1),
    "priority": st.integers(-10, 10), "top_logprobs": st.integers(0, 5),
    "min_loops": st.integers(1, 4), "max_loops": st.one_of(st.none(), st.integers(1, 4)),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1.0), "min_p": st.floats(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-200, 200), max_size=4),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.05, 3),
    "exit_threshold": st.one_of(st.none(), st.floats(0, 1)),
    "stop": st.one_of(st.none(), text, st.lists(text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "stream": st.booleans(), "echo": st.booleans(), "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})),
    "chat_template_kwargs": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        "enable_thinking": st.booleans()})),
    "tokens": token_ids,
}
#: per endpoint, where a field's type differs
GOOD_FOR = {
    CompletionRequest: {"logprobs": st.one_of(st.none(), st.integers(0, 5))},
    ChatCompletionRequest: {"logprobs": st.booleans()},
    TokenizeRequest: {"prompt": text, "messages": st.lists(message, min_size=1, max_size=3)},
}


def bodies(model, required: tuple[str, ...]):
    fields = sorted(model.model_fields)
    good = {**GOOD, **GOOD_FOR.get(model, {})}

    def good_value(f):
        if f in good:
            return good[f]
        default = model.model_fields[f].default
        return st.just(default)

    @st.composite
    def body(draw):
        out = {f: draw(good_value(f)) for f in required}
        for f in draw(st.lists(st.sampled_from(fields), max_size=6, unique=True)):
            out[f] = draw(good_value(f))
        # then 0-2 fields (any, or one the server does not know) take extreme or junk values
        for f in draw(st.lists(st.sampled_from([*fields, "unknown_field"]), max_size=2, unique=True)):
            out[f] = draw(extreme)
        if out.get("stream") is not True:
            out.pop("stream_options", None) if draw(st.booleans()) else None
        return out

    return st.one_of(body(), body(), body(), body(), body(), body(), body(), junk)  # sometimes not an object


@pytest.fixture(scope="module")
def fuzz_server(launch_server, tiny_model):
    return launch_server("--model", str(tiny_model), "--served-model-name", "tiny", "--dtype", "float32",
                         "--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "64", "--max-n", "8",
                         "--log-level", "error")


@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as c:
        yield c


#: (path, status) -> how many responses the generated bodies got
OUTCOMES: dict[tuple[str, int], int] = {}


def check_response(http: httpx.Client, path: str, body) -> None:
    content = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals, as Python's json reads them
    headers = {"content-type": "application/json"}
    streaming = isinstance(body, dict) and body.get("stream") is True
    with http.stream("POST", path, content=content, headers=headers) as r:
        raw = r.read()  # a hang is a timeout here
    OUTCOMES[path, r.status_code] = OUTCOMES.get((path, r.status_code), 0) + 1
    assert r.status_code < 500, (r.status_code, raw[:500], body)
    if r.status_code >= 400:
        err = json.loads(raw)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["code"] == r.status_code and isinstance(err["error"]["message"], str)
        return
    assert 200 <= r.status_code < 300
    if streaming and path != "/tokenize":
        events = [line for line in raw.decode().splitlines() if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        for e in events[:-1]:
            assert e.startswith("data: ") and "error" not in json.loads(e[len("data: "):]), e
    else:
        json.loads(raw)


@FUZZ
@given(body=bodies(CompletionRequest, ("prompt",)))
def test_completions_never_5xx(http, body):
    check_response(http, "/v1/completions", body)


@FUZZ
@given(body=bodies(ChatCompletionRequest, ("messages",)))
def test_chat_never_5xx(http, body):
    check_response(http, "/v1/chat/completions", body)


@FUZZ
@given(body=bodies(TokenizeRequest, ()))
def test_tokenize_never_5xx(http, body):
    check_response(http, "/tokenize", body)


RAW = [
    b"[" * 100_000,  # nesting deeper than the JSON parser's recursion limit
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # more digits than Python reads as an int
    b'{"prompt": "\xff\xfe"}',  # not UTF-8
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "top_p": 1e400}',
    b'{"prompt": "x"} trailing',
    b'{"prompt": "x", "prompt": 5}',
    b"null", b"\x00\x01", b'"just a string"',
]


@pytest.mark.parametrize("content", RAW, ids=range(len(RAW)))
def test_raw_bodies_never_5xx(http, content):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = http.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, r.status_code, r.text[:300])
        if r.status_code >= 400:  # (/tokenize ignores sampling fields, so it may answer 200)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        elif path != "/tokenize":
            raise AssertionError((path, r.status_code, r.text[:300]))


def test_idle_and_healthy_after_the_fuzzing(fuzz_server, http):
    # runs last in this module (pytest keeps file order within a worker; with xdist it may share a
    # worker with only some of the tests above, which is still a check)
    assert http.get("/health").status_code == 200
    assert idle(fuzz_server.url), stats(fuzz_server.url)
    st_ = stats(fuzz_server.url)
    assert st_["num_faults"] == 0 and st_["alive"] and st_["stall_reason"] is None
    assert_recovers(fuzz_server.url)
    print("fuzz outcomes:", dict(sorted(OUTCOMES.items())))
    for path in {p for p, _ in OUTCOMES}:  # the bodies reach generation too, not only the first check
        if sum(n for (p, _), n in OUTCOMES.items() if p == path) >= 50:
            assert OUTCOMES.get((path, 200), 0) >= 3, OUTCOMES
