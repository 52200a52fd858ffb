"""Every bad input gets a clear error and loses nothing: other requests finish normally."""

from __future__ import annotations

import pytest

from rlt.platform import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from rlt.platform.errors import ConfigError

from engine_helpers import drain, engine_with_faults

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _config(tiny_checkpoint) -> EngineConfig:
    return EngineConfig(model=str(tiny_checkpoint(seed=21)), dtype="float32", block_size=4, max_model_len=64)


@pytest.fixture
def engine(tiny_checkpoint):
    return LLMEngine(_config(tiny_checkpoint))


_drain = drain


BAD_REQUESTS = [
    ([], GREEDY, "prompt is empty"),
    ([1, 2, 9999], GREEDY, "outside the vocabulary"),
    ([1, -1], GREEDY, "outside the vocabulary"),
    ([1, None, 2], GREEDY, "token id None is outside the vocabulary"),  # once slipped through (None was "no offender")
    ([1, True], GREEDY, "token id True"),
    ([1, 2.0], GREEDY, "token id 2.0"),
    (list(range(3, 70)), GREEDY, "maximum context length"),
    ([1, 2, 3], SamplingParams(max_tokens=62, temperature=0.0), "maximum context length"),
    ([1, 2], SamplingParams(max_loops=9), "exceeds the engine's 4 loops"),
    ([1, 2], SamplingParams(min_loops=4, max_loops=None).with_(min_loops=4), None),  # valid: 4 <= 4
    ([1, 2], SamplingParams(stop_token_ids=[5000]), "stop_token_ids"),
    # max_tokens unset: min_tokens is checked against what the context leaves (64 - 3)
    ([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=62), r"min_tokens \(62\) exceeds the 61 tokens this request can generate"),
    ([1, 2], SamplingParams(min_loops=5), "min_loops: 5 exceeds the 4 loops requests run"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_REQUESTS)
def test_bad_request_rejected_and_others_unaffected(engine, prompt, params, message):
    engine.add_request("good", [5, 6, 7], GREEDY)
    engine.step()  # the good request is mid-flight when the bad one arrives
    if message is None:
        engine.add_request("also-good", prompt, params)
    else:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("bad", prompt, params)
    done = _drain(engine)
    assert done["good"].finish_reason == "length" and len(done["good"].token_ids) == 5
    assert "bad" not in done


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"min_loops": 0}, "min_loops"),
    ({"min_loops": 3, "max_loops": 2}, "max_loops"), ({"exit_threshold": 1.5}, "exit_threshold"),
    ({"seed": 2**70}, "seed"), ({"stop": [""]}, "stop"), ({"logprobs": 99}, "logprobs"), ({"priority": 1.5}, "priority"),
    ({"max_tokens": True}, "max_tokens"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id(engine):
    engine.add_request("x", [4, 5], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", [4, 5], GREEDY)
    assert _drain(engine)["x"].finish_reason == "length"


def test_abort_frees_kv_and_others_finish(engine):
    engine.add_request("a", [4, 5, 6], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [7, 8], GREEDY)
    engine.step()
    busy = engine.stats().num_free_kv_blocks
    out = engine.abort_request("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.stats().num_free_kv_blocks > busy
    done = _drain(engine)
    assert done["b"].finish_reason == "length" and "a" not in done
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    assert engine.abort_request("a") is None  # aborting twice is harmless


def test_admission_never_overcommits_kv(tiny_checkpoint):
    path = tiny_checkpoint(seed=22)
    # 4 planes x 3 pages of 4 = 12 blocks per request (prompt 4 + 8 new - 1 = 11 positions)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=30))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [3, 4, 5, 6], sp)
    engine.step()
    st = engine.stats()
    assert st.num_running == 2 and st.num_waiting == 2  # 2 x 12 <= 30 < 3 x 12
    assert "KV blocks" in st.blocked_reason
    done = _drain(engine)
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    assert all(len(o.token_ids) == 8 for o in done.values())


def test_request_larger_than_pool_is_rejected_with_reason(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=22)), dtype="float32", block_size=4, num_kv_blocks=8))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        engine.add_request("big", [3, 4, 5, 6], SamplingParams(max_tokens=8))
    engine.add_request("small", [3], SamplingParams(max_tokens=2, max_loops=2, temperature=0.0))
    assert _drain(engine)["small"].finish_reason in ("length", "stop")


def test_engine_fault_aborts_step_requests_and_engine_stays_up(tiny_checkpoint):
    engine, faults = engine_with_faults(_config(tiny_checkpoint))
    engine.add_request("victim", [4, 5], GREEDY)
    faults.armed = True
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"] and "injected device fault" in outs[0].error
    assert engine.stats().num_faults == 1 and engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    faults.armed = False
    engine.add_request("after", [4, 5], GREEDY)
    assert _drain(engine)["after"].finish_reason == "length"


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 0}, "block_size"), ({"max_num_seqs": -1}, "max_num_seqs"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"fixed_depth": True, "exit_threshold": 0.5}, "fixed_depth"),
])
def test_engine_config_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_max_model_len_beyond_model_is_rejected(tiny_checkpoint):
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=21)), dtype="float32", max_model_len=10**6))


def test_priority_orders_admission(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=21)), dtype="float32", max_num_seqs=1))
    engine.add_request("low", [3, 4], SamplingParams(max_tokens=2, temperature=0.0, priority=5, ignore_eos=True))
    engine.add_request("high", [3, 4], SamplingParams(max_tokens=2, temperature=0.0, priority=-1, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_fixed_depth_engine_rejects_adaptive_requests(tiny_checkpoint):
    eng = LLMEngine(EngineConfig(model=str(tiny_checkpoint(seed=21)), dtype="float32", block_size=4,
                                 max_model_len=64, fixed_depth=True))
    eng.add_request("good", [5, 6, 7], GREEDY)
    eng.step()
    with pytest.raises(InvalidRequestError, match="fixed depth"):
        eng.add_request("bad", [5, 6], GREEDY.with_(exit_threshold=0.5))
    eng.add_request("full-depth", [5, 6], GREEDY.with_(exit_threshold=1.0))
    done = _drain(eng)
    assert set(done) == {"good", "full-depth"}
    assert all(d == 4 for o in done.values() for d in o.exit_depths)


def test_a_component_missing_protocol_members_fails_composition(tiny_checkpoint):
    from rlt.platform.engine.assembly import CompositionError, EngineAssembly
    from rlt.platform.platforms import detect_platform

    class NoRelease:
        exit_latency = 0

        def execute(self, batch):
            raise AssertionError("never runs")

    assembly = EngineAssembly(detect_platform("cpu"))
    assembly.replace("executor", lambda ctx: NoRelease(), by="half_done")
    with pytest.raises(CompositionError, match="executor from 'half_done' .*lacks release"):
        assembly.build_engine(_config(tiny_checkpoint))
