"""Request bodies: prompt shapes, strict types, unsupported fields, and the translation to
SamplingParams (ranges are SamplingParams' job; the protocol must pass values through unchanged)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlt.platform.errors import InvalidRequestError
from rlt.platform.sampling_params import SamplingParams
from rlt.serve.errors import BadRequest
from rlt.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    check_prompt_shape,
    prompt_items,
    seed_for_choice,
)


@pytest.mark.parametrize("value, want", [
    ("hi", (["hi"], False)),
    (["a", "b"], (["a", "b"], True)),
    ([1, 2, 3], ([[1, 2, 3]], False)),
    ([[1], [2, 3]], ([[1], [2, 3]], True)),
])
def test_prompt_shapes(value, want):
    check_prompt_shape(value)
    assert prompt_items(value) == want


@pytest.mark.parametrize("value, words", [
    ([], "must not be empty"),
    ([1, "a"], "not a mixture"),
    ([[1], []], "token-id list 1 is empty"),
    ([[1, "x"]], "token-id list 0 must hold integers"),
    ([True, False], "not a mixture"),  # booleans are not token ids
    (5, "must be a string"),
    ({"a": 1}, "must be a string"),
])
def test_bad_prompt_shapes(value, words):
    with pytest.raises(ValueError, match=words):
        check_prompt_shape(value)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": value})


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", 5.0), ("max_tokens", True), ("temperature", "0.5"),
    ("n", 1.5), ("stream", "yes"), ("stop", 3), ("stop_token_ids", ["a"]), ("seed", "1"),
    ("stream_options", {"include_usage": "yes"}), ("logprobs", True), ("min_loops", 2.0),
])
def test_wrong_types_are_rejected_not_coerced(field, value):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert info.value.errors()[0]["loc"][0] == field


def test_null_means_the_default_where_the_openai_api_allows_null():
    """n, stream, echo and (chat) logprobs are nullable in the OpenAI API, as vLLM reads them."""
    nulls = {"n": None, "stream": None, "echo": None, "logprobs": None}
    r = CompletionRequest.model_validate({"prompt": "x", **nulls})
    assert (r.n, r.stream, r.echo, r.logprobs) == (1, False, False, None) and not r.model_extra
    c = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **nulls})
    assert (c.n, c.stream, c.echo, c.logprobs) == (1, False, False, False)
    for field in ("ignore_eos", "min_tokens", "priority"):  # the rest stay strict
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", field: None})


def test_ints_are_accepted_for_floats_and_unknown_fields_are_kept_aside():
    r = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_p": 1, "frobnicate": True})
    assert r.temperature == 1.0 and r.model_extra == {"frobnicate": True}


def test_completion_defaults_follow_vllm():
    r = CompletionRequest.model_validate({"prompt": "x"})
    r.check_supported(max_n=4)
    p = r.to_params()
    assert p == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)


def test_all_sampling_fields_reach_sampling_params():
    r = CompletionRequest.model_validate({
        "prompt": "x", "max_tokens": 7, "min_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.05, "seed": 11, "stop": "END", "stop_token_ids": [3, 4], "ignore_eos": True, "priority": -2,
        "logprobs": 3, "min_loops": 2, "max_loops": 3, "exit_threshold": 0.8, "skip_special_tokens": False,
    })
    r.check_supported(max_n=4)
    assert r.to_params() == SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.05, seed=11, stop=("END",),
        stop_token_ids=(3, 4), ignore_eos=True, priority=-2, logprobs=3, min_loops=2, max_loops=3,
        exit_threshold=0.8, skip_special_tokens=False)


def test_top_k_minus_one_means_off():
    assert CompletionRequest.model_validate({"prompt": "x", "top_k": -1}).to_params().top_k == 0


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("min_p", 1.5),
    ("seed", 2**64), ("exit_threshold", 1.5), ("min_loops", 0), ("top_k", -2),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
])
def test_out_of_range_values_raise_invalid_request(field, value):
    r = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(InvalidRequestError, match=f"^{field}: "):
        r.check_supported(max_n=4)
        r.to_params()


@pytest.mark.parametrize("body, param", [
    ({"best_of": 3}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"suffix": "tail"}, "suffix"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 0}, "n"),
    ({"n": 5}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": 21}, "logprobs"),
])
def test_unsupported_or_invalid_fields_name_the_field(body, param):
    r = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(BadRequest) as info:
        r.check_supported(max_n=4)
    assert info.value.param == param and info.value.status == 400


def test_logit_bias_keys_are_token_ids():
    r = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"5": 1, "17": -250.5}})
    assert r.to_params().logit_bias == ((5, 1.0), (17, -100.0))  # clamped, as vLLM
    for key in ("abc", "-3", "1.5", " 4", "9" * 40, "٣"):
        with pytest.raises(InvalidRequestError, match="^logit_bias: keys must be token ids") as info:
            CompletionRequest.model_validate({"prompt": "x", "logit_bias": {key: 1.0}}).to_params()
        assert info.value.param == "logit_bias"


def test_neutral_values_of_unsupported_fields_are_fine():
    r = CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "logit_bias": {},
                                          "response_format": {"type": "text"}})
    r.check_supported(max_n=4)


def test_penalties_reach_the_engine_parameters():
    r = CompletionRequest.model_validate({"prompt": "x", "frequency_penalty": 0.5, "presence_penalty": -1,
                                          "repetition_penalty": 1.2})
    r.check_supported(max_n=4)
    p = r.to_params()
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -1, 1.2) and p.penalized
    off = CompletionRequest.model_validate({"prompt": "x", "frequency_penalty": None, "presence_penalty": 0,
                                            "repetition_penalty": 1}).to_params()
    assert not off.penalized


def test_seed_per_choice():
    assert [seed_for_choice(10, i) for i in range(3)] == [10, 11, 12]
    assert seed_for_choice(None, 2) is None
    assert seed_for_choice(2**64 - 1, 1) == 0  # stays in the 64-bit range


def test_chat_fields():
    r = ChatCompletionRequest.model_validate({
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 9, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
        "chat_template_kwargs": {"enable_thinking": True},
    })
    r.check_supported(max_n=4)
    assert r.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    p = r.to_params()
    assert p.max_tokens == 9 and p.logprobs == 2  # max_completion_tokens wins over max_tokens
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).to_params().max_tokens is None


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_chat_fields(body, param):
    body = {"messages": [{"role": "user", "content": "x"}], **body}
    r = ChatCompletionRequest.model_validate(body)
    with pytest.raises(BadRequest) as info:
        r.check_supported(max_n=4)
    assert info.value.param == param


@pytest.mark.parametrize("body", [{"max_tokens": -5}, {"max_tokens": 0}, {"max_tokens": -5, "max_completion_tokens": 5},
                                  {"max_tokens": 0, "max_completion_tokens": 5}])
def test_an_invalid_max_tokens_is_named_whichever_limit_is_used(body):
    r = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    with pytest.raises((BadRequest, InvalidRequestError)) as info:
        r.check_supported(max_n=4)
        r.to_params()
    assert info.value.param == "max_tokens" and str(info.value).startswith("max_tokens: must be an integer in [1, ")


def test_image_content_parts_are_refused():
    r = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(BadRequest, match="text only"):
        r.template_messages()


def test_tokenize_needs_exactly_one_input():
    with pytest.raises(BadRequest):
        TokenizeRequest.model_validate({}).check()
    with pytest.raises(BadRequest):
        TokenizeRequest.model_validate({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).check()
    TokenizeRequest.model_validate({"prompt": "a"}).check()
