"""The graph bookkeeping of rlt-decode's executor on CPU, with the capture itself faked: a "graph"
re-runs what it captured when replayed (reading the same static buffers, as a CUDA graph does),
so the replay paths — the decode step per (row bucket, context bucket) and the device planning of
device-planned steps per row bucket — run here exactly as they are sequenced on a GPU: token-identical
to the base engine, each shape run eagerly once and replayed after, the count limit's fallbacks
recorded. (What only a GPU can check — that the capture records, no host sync inside — is
tests/gpu/test_decode_gpu.py.)"""

from __future__ import annotations

import pytest

from rlt.platform import SamplingParams

from engine_driver import run_arrivals as run
from test_device_exit import ADAPTIVE, adaptive_params, engines
from test_pipeline import prompts, same


class ReplayGraph:
    """Stands in for a captured graph: replaying re-runs the captured function; its outputs land in
    the list the capture returned (what the executor hands on after a replay)."""

    def __init__(self, fn, out: list) -> None:
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        res = self.fn()
        self.out[:] = [] if res is None else list(res)
        self.replays += 1


def fake_record(self, fn):  # StaticDecodeExecutor._record without CUDA: nothing runs at capture
    out: list = []
    return ReplayGraph(fn, out), out


def with_graphs(engine, max_graphs: int = 64):
    ex = engine.ctx.parts.executor
    ex.use_graphs, ex.graphs_off_reason, ex.max_graphs = True, "", max_graphs
    return ex


@pytest.mark.parametrize("device_exit", [False, True], ids=["host-planned", "device-planned"])
def test_replayed_steps_equal_the_base_engine(tiny_checkpoint, monkeypatch, device_exit):
    from rlt.decode.executor import StaticDecodeExecutor

    monkeypatch.setattr(StaticDecodeExecutor, "_record", fake_record)
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, plain, planned = engines(path, max_num_seqs=4)
    engine = planned if device_exit else plain
    ex = with_graphs(engine)
    ps = prompts(6, seed=9)
    params = adaptive_params(max_tokens=14)
    got = run(engine, ps, params, arrive_every=3)
    for a, b in zip(got, run(base, ps, params, arrive_every=3)):
        same(a, b)
    info = engine.describe()["executor"]
    assert info["graphs"] and info["graphs_captured"] > 0
    # every captured shape ran eagerly exactly once (its first step), every later step replayed
    assert info["steps"]["eager_decode_steps"] == info["graphs_captured"]
    assert info["steps"]["graph_replays"] == sum(g.replays for g, _ in ex._graphs.values()) > 0
    if device_exit:
        assert info["device_planning_graphs"] > 0 and not info["device_planning_off_reason"]
        assert sum(g.replays for g in ex._advance_graphs.values()) > 0
        assert info["pipeline"]["device_exit"]["device_planned_steps"] > 0
    else:
        assert info["device_planning_graphs"] == 0


def test_count_limit_falls_back_to_eager_steps(tiny_checkpoint, monkeypatch):
    from rlt.decode.executor import StaticDecodeExecutor

    monkeypatch.setattr(StaticDecodeExecutor, "_record", fake_record)
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    base, _, planned = engines(path, max_num_seqs=4)
    with_graphs(planned, max_graphs=1)
    ps = prompts(4, seed=3)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=ADAPTIVE[0][0])
    for a, b in zip(run(planned, ps, sp), run(base, ps, sp)):
        same(a, b)
    info = planned.describe()["executor"]
    assert info["graphs_captured"] == 1 and info["eager_fallbacks"]["graph count limit (1)"] > 0
    assert info["steps"]["eager_decode_steps"] > 1
