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
