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
                          exit_threshold=1.0, stop_token_ids=frozenset(p.stop_token_ids), chunk_start=0,
                          chunk_len=1, depth=0, in_prompt=True, chunk_samples=True)
    with np.errstate(over="raise"):
        table.assign(1, req, p.seed if p.seed is not None else 0)  # never OverflowError
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
