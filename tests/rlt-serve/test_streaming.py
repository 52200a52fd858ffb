"""Streaming deltas: what each SSE chunk carries, built from the engine's cumulative outputs."""

from __future__ import annotations

import json

from rlt.platform.outputs import RequestMetrics, RequestOutput
from rlt.serve.serving import DONE, ChoiceStream, sse

_M = RequestMetrics(0.0, 0.0, 0.0, None)


def _out(text, ids, finished=False, reason=None, stop=None):
    return RequestOutput("r", (1, 2), tuple(ids), text, tuple(4 for _ in ids), finished, reason, stop, None,
                         (), "", _M)


def test_deltas_concatenate_to_the_final_text_and_carry_new_tokens_only():
    cs = ChoiceStream(0, [1, 2], prefix="", hold=0)
    d1 = cs.delta(_out("Hel", [7]))
    d2 = cs.delta(_out("Hello", [7, 8]))
    d3 = cs.delta(_out("Hello!", [7, 8, 9], True, "length"))
    assert [d["text"] for d in (d1, d2, d3)] == ["Hel", "lo", "!"]
    assert [d["token_ids"] for d in (d1, d2, d3)] == [[7], [8], [9]]
    assert [d["exit_depths"] for d in (d1, d2, d3)] == [[4], [4], [4]]
    assert d1["first"] and not d2["first"] and d3["finished"] and d3["finish_reason"] == "length"


def test_stop_string_split_across_tokens_is_never_partly_sent():
    # stop="END": the engine's text may end in "EN" before the stop string completes and the
    # text is cut back; the stream must hold back len("END") - 1 characters until the end.
    cs = ChoiceStream(0, [1], prefix="", hold=2)
    sent = [cs.delta(_out("abcE", [1]))["text"], cs.delta(_out("abcEN", [1, 2]))["text"]]
    sent.append(cs.delta(_out("abc", [1, 2, 3], True, "stop", "END"))["text"])
    assert "".join(sent) == "abc" and "E" not in "".join(sent)


def test_echo_prefix_goes_into_the_first_delta():
    cs = ChoiceStream(0, [1], prefix="Q: ", hold=0)
    assert cs.delta(_out("A", [5]))["text"] == "Q: A"
    assert cs.delta(_out("AB", [5, 6]))["text"] == "B"


def test_sse_framing():
    line = sse({"a": "é"})
    assert line == 'data: {"a":"é"}\n\n' and json.loads(line[len("data: "):]) == {"a": "é"}
    assert DONE == "data: [DONE]\n\n"


# -- delivery in batches (issue 10): one SSE write per wakeup, superseded outputs coalesced ------
import asyncio  # noqa: E402

from rlt.platform.sampling_params import SamplingParams  # noqa: E402
from rlt.serve.async_engine import Item  # noqa: E402
from rlt.serve.protocol import CompletionRequest  # noqa: E402
from rlt.serve.serving import CompletionFormat, _Job, _stream, _superseded  # noqa: E402


class _Batches:
    """A Generation stand-in that delivers prepared batches."""

    def __init__(self, batches):
        self._batches = batches
        self.aborted = False

    async def batches(self):
        for b in self._batches:
            yield b

    def abort(self):
        self.aborted = True


def _job(n=1, **body):
    req = CompletionRequest(model="m\u2028", prompt="p", stream=True, n=n, **body)
    return _Job(None, req, CompletionFormat(None), "m\u2028", [[1, 2]], [""], SamplingParams(max_tokens=8), 0)


def _item(index, out=None, error=None):
    return Item(index, f"r{index}", out, 0.0, error)


def _events(chunks):
    text = "".join(chunks)
    assert text.endswith(DONE)
    return [json.loads(e[len("data: "):]) for e in text[:-len(DONE)].split("\n\n") if e]


def _run(job, batches):
    gen = _Batches(batches)

    async def main():
        return [c async for c in _stream(job, gen)]

    chunks = asyncio.run(main())
    assert gen.aborted
    return chunks


def test_chunk_envelope_is_encoded_like_sse_of_the_envelope():
    job = _job()
    choice = {"index": 0, "text": "a\u2029b\u0085", "logprobs": None}
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert job.chunk_sse([choice]) == sse(job.envelope([choice], chunk=True))
    assert job.chunk_sse([choice], usage) == sse({**job.envelope([choice], chunk=True), "usage": usage})
    assert "\u2028" not in job.chunk_sse([]) and "\u2029" not in job.chunk_sse([choice])


def test_superseded_outputs_are_the_earlier_outputs_of_each_choice():
    a1, a2, b1 = _item(0, _out("a", [1])), _item(0, _out("ab", [1, 2])), _item(1, _out("x", [3]))
    failed = _item(0, error="boom")
    assert _superseded([a1, b1, a2]) == {0}
    assert _superseded([a1, failed]) == set()  # an error supersedes nothing
    assert _superseded([b1]) == set()


def test_a_client_behind_gets_one_chunk_per_choice_per_wakeup_and_loses_nothing():
    job = _job(n=2, stream_options={"include_usage": True})
    steps = [[_item(0, _out("He", [7])), _item(1, _out("Yo", [9])), _item(0, _out("Hell", [7, 8])),
              _item(1, _out("Yo!", [9, 10]))],
             [_item(0, _out("Hello", [7, 8, 11], True, "length")), _item(1, _out("Yo!!", [9, 10, 12], True, "length"))]]
    chunks = _run(job, steps)
    assert len(chunks) == 3  # one write per batch, then usage + [DONE]
    events = _events(chunks)
    texts = {0: "", 1: ""}
    depths = {0: [], 1: []}
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        depths[c["index"]] += c["rlt"]["exit_depths"]
    assert texts == {0: "Hello", 1: "Yo!!"} and depths == {0: [4, 4, 4], 1: [4, 4, 4]}
    assert [len(e["choices"]) for e in events] == [1, 1, 1, 1, 0]  # 2 coalesced + 2 final + usage
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_an_error_in_a_batch_sends_what_came_before_it_then_the_error_and_done():
    job = _job()
    chunks = _run(job, [[_item(0, _out("Hi", [7])), _item(0, error="engine fault: x")]])
    events = _events(chunks)
    assert len(chunks) == 1 and events[0]["choices"][0]["text"] == "Hi"
    assert "error" in events[1] and job.completed
