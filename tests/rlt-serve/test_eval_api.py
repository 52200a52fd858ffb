"""What evaluation clients (lm-eval, the openai client) read: completions' ``echo`` + ``logprobs``
returns the prompt's logprobs as vLLM does, the ``prompt_logprobs`` extension, ``/tokenizer_info``,
``/v1/models/{id}``, ``include_stop_str_in_output``, and SSE lines that survive line splitters."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.features import FeatureStatus
from rlt.serve.app import create_app
from rlt.serve.feature import HttpOptions
from rlt.serve.routes import router
from rlt.serve.serving import sse
from rlt.serve.server import build_state

PROMPT = [5, 17, 40, 99, 123, 7]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint(seed=8)


@pytest.fixture(scope="module")
def client(path):
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, max_num_seqs=4))
    status = FeatureStatus("http", "rlt-serve", True, True, True, "enabled")
    state = build_state(engine, statuses=[status], options=HttpOptions(), served_names=["tiny", "org/alias"])
    with TestClient(create_app(state, [router]), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def offline(path):
    """The engine's own prompt logprobs (top 2) and one greedy token for PROMPT."""
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, max_num_seqs=4))
    engine.add_request("o", PROMPT, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                   prompt_logprobs=2, logprobs=2))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                return o


def _tok(client, ids):
    return [client.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids]


def _check_echo_logprobs(client, lp, offline, top, generated=True):
    """``lp`` lists the prompt's tokens with the engine's prompt logprobs, then (``generated``) its greedy token."""
    strs = _tok(client, PROMPT + list(offline.token_ids if generated else ()))
    assert lp["tokens"] == strs
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    entries = list(offline.prompt_logprobs[1:]) + ([offline.logprobs[0]] if generated else [])
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries], abs=1e-6)
    for got, e in zip(lp["top_logprobs"][1:], entries):
        names = {_tok(client, [t])[0] for t, _ in e.top[:top]} | {_tok(client, [e.token_id])[0]}
        assert set(got) == names
    offsets = [sum(len(s) for s in strs[:i]) for i in range(len(strs))]
    assert lp["text_offset"] == offsets


def test_echo_with_logprobs_scores_every_prompt_token(client, offline):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                             "echo": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == client.post("/detokenize", json={"tokens": PROMPT + list(offline.token_ids)}).json()["prompt"]
    _check_echo_logprobs(client, c["logprobs"], offline, top=1)
    assert "prompt_logprobs" not in c


def test_echo_with_logprobs_streams_the_prompt_first(client, offline):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    merged = {k: sum((c["logprobs"][k] for c in chunks), []) for k in chunks[0]["logprobs"]}
    _check_echo_logprobs(client, merged, offline, top=2)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_zero_max_tokens_scores_the_prompt_and_generates_nothing(client, offline, stream):
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs): the prompt and its logprobs, no
    generated token in the text, the logprobs, the ids or the usage; it ends by length (vLLM's answer)."""
    body = {"prompt": PROMPT, "max_tokens": 0, "temperature": 0, "logprobs": 2, "echo": True,
            "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        chunks = [e["choices"][0] for e in events if e["choices"]]
        usage = events[-1]["usage"]
        lp = {k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in chunks[0]["logprobs"]}
        text = "".join(c["text"] for c in chunks)
        ids = sum((c["token_ids"] or [] for c in chunks), [])
        depths = sum((c["rlt"]["exit_depths"] for c in chunks), [])
        finish = chunks[-1]["finish_reason"]
    else:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c, usage = r.json()["choices"][0], r.json()["usage"]
        lp, text, ids, depths, finish = c["logprobs"], c["text"], c["token_ids"], c["rlt"]["exit_depths"], c["finish_reason"]
    assert text == client.post("/detokenize", json={"tokens": PROMPT}).json()["prompt"]
    _check_echo_logprobs(client, lp, offline, top=2, generated=False)
    assert (ids, depths, finish) == ([], [], "length")
    assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}
    # without logprobs: the prompt's text alone
    plain = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 0, "echo": True}).json()
    assert (plain["choices"][0]["text"], plain["choices"][0]["logprobs"]) == ("hello there", None)


def test_zero_max_tokens_needs_echo_and_no_min_tokens(client):
    for extra, param, words in (({}, "max_tokens", "only with echo"),
                                ({"echo": True, "min_tokens": 1}, "min_tokens", "must not exceed max_tokens (0)"),
                                ({"echo": True, "min_tokens": -1}, "min_tokens", "must be an integer in [0,")):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_extension(client, offline):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                                             "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for j, (got, e) in enumerate(zip(plp[1:], offline.prompt_logprobs[1:]), 1):
        own = got[str(PROMPT[j])]
        assert own["logprob"] == pytest.approx(e.logprob, abs=1e-6) and own["rank"] == e.rank
        assert own["decoded_token"] == _tok(client, [PROMPT[j]])[0]
        assert set(got) == {str(PROMPT[j])} | {str(t) for t, _ in e.top}
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(d) == 1 for d in body["prompt_logprobs"][1:])


@pytest.mark.parametrize("body", [{"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": 21},
                                  {"prompt_logprobs": -1}, {"prompt_logprobs": "2"}])
def test_bad_prompt_logprobs_are_400(client, body):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert "prompt_logprobs" in r.json()["error"]["message"]


def test_include_stop_str_in_output(client):
    base = client.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True}).json()["choices"][0]["text"]
    assert len(base) >= 6
    stop = base[3:5]
    cut = base[:base.find(stop)]
    for stream in (False, True):
        body = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
                "include_stop_str_in_output": True, "stream": stream}
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {") and '"choices":[{' in line)
        else:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
        assert text == cut + stop


def test_model_retrieve(client):
    card = client.get("/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "rlt"
    assert client.get("/v1/models/org/alias").json()["id"] == "org/alias"
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokenizer_info(client, path):
    info = client.get("/tokenizer_info").json()
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert info["eos_token"] == cfg["eos_token"] and info["bos_token"] == cfg["bos_token"]
    assert info["pad_token"] == cfg["pad_token"] and info["chat_template"] == cfg["chat_template"]
    assert info["model_max_length"] == 256 and info["tokenizer_class"] == cfg["tokenizer_class"]
    ids = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1  # what lm-eval's remote tokenizer takes as the eos id


def test_sse_escapes_unicode_line_separators():
    text = "a\u2028b\u2029c\u0085d\n"
    line = sse({"t": text, "é": "é"})
    body = line[len("data: "):-2]
    assert "\u2028" not in line and "\u2029" not in line and "\u0085" not in line
    assert line.endswith("\n\n") and len(line[:-2].splitlines()) == 1 and json.loads(body) == {"t": text, "é": "é"}


def test_logit_bias_and_min_p_reach_the_sampler(client):
    """OpenAI's logit_bias (token ids as strings; +100 forces a token) and vLLM's min_p over HTTP."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    forced = client.post("/v1/completions", json={**body, "logit_bias": {"42": 100}}).json()["choices"][0]
    assert forced["token_ids"] == [42, 42, 42]
    greedy = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    hot = client.post("/v1/completions", json={**body, "temperature": 2.0, "seed": 5, "min_p": 1.0}).json()
    assert hot["choices"][0]["token_ids"] == greedy  # min_p 1 keeps only the argmax
