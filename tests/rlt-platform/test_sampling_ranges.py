"""Every numeric field of SamplingParams is checked against the column the engine stores it in:
the largest accepted value can be written into the slot table, one past it is a 400-style
InvalidRequestError whose ``param`` names the field (issue 15: top_k >= 2**63 used to pass and
then raise OverflowError inside admission)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlt.platform import InvalidRequestError, SamplingParams
from rlt.platform.engine.slots import SlotTable
from rlt.platform.sampling_params import (FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN, MAX_STOP_STRINGS,
                                          MAX_STOP_TOKEN_IDS)

# (field, largest or smallest accepted value, the first value past it)
EDGES = [
    ("top_k", INT64_MAX, INT64_MAX + 1),
    ("top_k", -1, -2),
    ("min_tokens", INT64_MAX, INT64_MAX + 1),
    ("max_tokens", INT64_MAX, INT64_MAX + 1),
    ("seed", 2**64 - 1, 2**64),
    ("seed", INT64_MIN, INT64_MIN - 1),
    ("min_loops", INT32_MAX, INT32_MAX + 1),
    ("priority", INT64_MAX, INT64_MAX + 1),
    ("priority", INT64_MIN, INT64_MIN - 1),
    ("temperature", FLOAT32_MAX, 3.5e38),
    ("temperature", 0.0, -1e-300),
    ("logprobs", 20, 21),
]


def _params(field, value):
    kw = {field: value}
    if field == "min_tokens":
        kw["max_tokens"] = None
    return SamplingParams(**kw)


@pytest.mark.parametrize("field, ok, bad", EDGES, ids=[f"{e[0]}={e[2]}" for e in EDGES])
def test_edges(field, ok, bad):
    p = _params(field, ok)
    table = SlotTable(2)
    req = SimpleNamespace(params=p, min_loops=min(p.min_loops, INT32_MAX), max_loops=p.max_loops or p.min_loops,
                          exit_threshold=1.0, stop_token_ids=frozenset(p.stop_token_ids),
                          seed=p.seed if p.seed is not None else 0)
    with np.errstate(over="raise"):
        table.assign(1, req)  # never OverflowError
    with pytest.raises(InvalidRequestError) as e:
        _params(field, bad)
    assert e.value.param == field and str(e.value).startswith(f"{field}: ")


def test_loops_and_stops():
    assert SamplingParams(min_loops=2, max_loops=INT32_MAX).max_loops == INT32_MAX
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_loops=INT32_MAX + 1)
    assert e.value.param == "max_loops"
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), stop=["x"] * MAX_STOP_STRINGS)
    for kw, field in ((dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
                      (dict(stop_token_ids=[2**63]), "stop_token_ids"),
                      (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == field


@pytest.mark.parametrize("field", ["temperature", "top_p", "exit_threshold"])
def test_non_finite_floats(field):
    for v in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**{field: v})
        assert e.value.param == field


# -- the tokenizer: lone surrogates, the characters-per-token bound, the GIL --------------------------
def _tokenizer(tiny_checkpoint):
    from rlt.platform.checkpoint.tokenizer import RltTokenizer

    return RltTokenizer.from_dir(tiny_checkpoint(seed=1))


def test_lone_surrogate_is_an_invalid_request(tiny_checkpoint):
    tok = _tokenizer(tiny_checkpoint)
    with pytest.raises(InvalidRequestError) as e:
        tok.encode("ab\ud800c")
    assert e.value.param == "prompt" and "U+D800" in str(e.value) and "character 2" in str(e.value)


def test_chars_per_token_bound_holds(tiny_checkpoint):
    import random

    tok = _tokenizer(tiny_checkpoint)
    k = tok.max_chars_per_token
    assert k is not None and k >= 1
    rng = random.Random(0)
    alphabet = "ab c\n\t  é😀<|im_end|>" + "".join(chr(i) for i in range(32, 127))
    for n in (1, 10, 100, 2000):
        for _ in range(20):
            text = "".join(rng.choice(alphabet) for _ in range(n))
            assert len(text) <= k * len(tok.encode(text))
    text = " " * 5000 + "<|im_end|>" * 300
    assert len(text) <= k * len(tok.encode(text, True))


def test_no_bound_when_a_normalizer_may_shorten_text(tiny_checkpoint, tmp_path):
    import json
    import shutil

    from rlt.platform.checkpoint.tokenizer import RltTokenizer

    path = tmp_path / "nfc"
    shutil.copytree(tiny_checkpoint(seed=1), path)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    assert RltTokenizer.from_dir(path).max_chars_per_token is None


def test_encode_releases_the_gil(tiny_checkpoint):
    import threading
    import time

    tok = _tokenizer(tiny_checkpoint)
    text = "hello world " * 200_000
    ticks = []
    done = threading.Event()

    def encode():
        tok.encode(text)
        done.set()

    t = threading.Thread(target=encode)
    t0 = time.perf_counter()
    t.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    t.join()
    took = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    if took > 0.1:  # long enough to tell: the main thread kept running while it encoded
        assert len(ticks) > 10 and max(gaps, default=0) < took * 0.8, (took, max(gaps, default=0))
