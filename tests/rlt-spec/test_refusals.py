"""Bad combinations fail with a clear error naming the setting, at request or at startup; a
refused request never disturbs the others; the feature table says what is not available."""

from __future__ import annotations

import pytest

from rlt.platform import SamplingParams
from rlt.platform.errors import ConfigError, InvalidRequestError
from rlt.spec.feature import SpecOptions
from rlt.spec.stats import SpecStats
from spec_helpers import drain, spec_engine


def _sp(**spec):
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, speculation=spec or None)


@pytest.mark.parametrize("params, field, words", [
    (SamplingParams(max_tokens=4, exit_threshold=0.5, speculation={"num_tokens": 2}), "speculation", "adaptive exit"),
    (_sp(num_tokens=2, draft_loops=4), "speculation.draft_loops", "below the request's depth"),
    (SamplingParams(max_tokens=4, max_loops=2, speculation={"num_tokens": 2, "draft_loops": 2}),
     "speculation.draft_loops", "below the request's depth"),
    (_sp(num_tokens=9), "speculation.num_tokens", "--self-spec-max-num-tokens"),
    (_sp(num_tokens=2).with_(repetition_penalty=1.3), "speculation", "penalties"),
    (_sp(num_tokens=2).with_(presence_penalty=-0.5), "speculation", "penalties"),
])
def test_request_refusals_name_the_setting(spec_checkpoints, params, field, words):
    engine = spec_engine(spec_checkpoints[0])
    engine.add_request("ok", [5, 6, 7], _sp(num_tokens=3, draft_loops=2))
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", [5, 6, 7], params)
    assert err.value.param == field and words in str(err.value)
    outs = drain(engine, [])
    assert list(outs) == ["ok"] and len(outs["ok"].token_ids) == 6 and outs["ok"].error is None


def test_k_beyond_the_step_budget(spec_checkpoints):
    engine = spec_engine(spec_checkpoints[0], max_num_batched_tokens=8)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens") as err:
        engine.add_request("bad", [5, 6], SamplingParams(speculation={"num_tokens": 8}))
    assert err.value.param == "speculation.num_tokens"


def test_speculation_without_the_feature_is_refused(spec_checkpoints):
    engine = spec_engine(spec_checkpoints[0], spec=False)
    with pytest.raises(InvalidRequestError, match="self_spec") as err:
        engine.add_request("r", [5, 6], _sp(num_tokens=2))
    assert err.value.param == "speculation"


@pytest.mark.parametrize("value, field", [({"num_tokens": -1}, "speculation.num_tokens"),
                                          ({"num_tokens": 2, "draft_loops": 0}, "speculation.draft_loops"),
                                          ({"draft_loops": 1}, "speculation.num_tokens"),
                                          ({"num_tokens": 1, "k": 2}, "speculation")])
def test_malformed_speculation(value, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(speculation=value)
    assert err.value.param == field


@pytest.mark.parametrize("cfg, options, words", [
    ({"kv_layout": "shared"}, SpecOptions(), "--kv-layout shared"),
    ({}, SpecOptions(draft_loops=4), "--self-spec-draft-loops"),
    ({"exit_threshold": 0.5}, SpecOptions(num_tokens=2), "adaptive exit"),
])
def test_startup_refusals(spec_checkpoints, cfg, options, words):
    with pytest.raises(ConfigError, match=words):
        spec_engine(spec_checkpoints[0], options=options, **cfg)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="--self-spec-num-tokens"):
        SpecOptions(num_tokens=9)
    with pytest.raises(ConfigError, match="--self-spec-initial-acceptance"):
        SpecOptions(initial_acceptance=2.0)
    with pytest.raises(ConfigError, match="--self-spec-step-cost"):
        SpecOptions(step_cost=0.0)
    with pytest.raises(ConfigError, match="--self-spec-max-running"):
        SpecOptions(max_running=-1)
    for width in (0, 17):
        with pytest.raises(ConfigError, match="--self-spec-width"):
            SpecOptions(width=width)
    assert SpecOptions(width=16).width == 16


def test_feature_table(spec_checkpoints):
    engine = spec_engine(spec_checkpoints[0])
    table = {f.name: f for f in engine.features}
    assert table["self_spec"].enabled and table["self_spec"].available
    assert "overlapped ones lagged" in table["self_spec"].reason
    assert table["async_self_spec"].available and not table["async_self_spec"].enabled
    assert engine.assembly.describe()["executor"] == ["self_spec"]
    table = {f.name: f for f in spec_engine(spec_checkpoints[0], overlap=True).features}
    assert table["async_self_spec"].enabled


def test_step_cost_default_follows_the_composition():
    """Unset, a speculative step costs GRAPH_STEP_COST plain steps where rlt-decode's graphs are on
    (plain steps pipelined, speculative ones host-synchronous), 1 otherwise; a given value always wins."""
    from rlt.spec.adaptive import best_k
    from rlt.spec.feature import GRAPH_STEP_COST

    assert SpecOptions().resolved_step_cost({"self_spec", "static_buffers"}) == 1.0
    assert SpecOptions().resolved_step_cost({"self_spec", "graphs"}) == GRAPH_STEP_COST
    assert SpecOptions(step_cost=2.0).resolved_step_cost({"graphs"}) == 2.0
    from rlt.spec.feature import LAGGED_STEP_COST

    assert SpecOptions().resolved_step_cost({"self_spec", "async_self_spec", "static_buffers", "graphs",
                                             "pipeline"}) == LAGGED_STEP_COST
    # with preemption the pipeline drains before every plan: chains are read at once, like rounds
    assert SpecOptions().resolved_step_cost({"self_spec", "async_self_spec", "static_buffers", "graphs", "pipeline",
                                             "preemption"}) == GRAPH_STEP_COST
    assert SpecOptions().resolved_step_cost({"self_spec", "async_self_spec", "graphs"}) == GRAPH_STEP_COST
    # chain_lag 0: the pipeline completes every chain step before the next (host-synchronous, like rounds)
    assert SpecOptions(chain_lag=0).resolved_step_cost({"self_spec", "async_self_spec", "static_buffers", "graphs",
                                                        "pipeline"}) == GRAPH_STEP_COST
    # at the graph default overlapped d = 1 pays at high acceptance and not at low (Ouro's 4 loops)
    assert best_k(0.95, 8, 1, 4, 0.05, overlap=True, step_cost=GRAPH_STEP_COST) > 0
    assert best_k(0.2, 8, 1, 4, 0.05, overlap=True, step_cost=GRAPH_STEP_COST) == 0
    # at the cost eager speculative steps had (12 plain steps) no K pays even at full acceptance
    assert best_k(1.0, 8, 1, 4, 0.05, overlap=True, step_cost=12.0) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_penalised_requests_decode_plainly_under_the_default_k(spec_checkpoints, overlap):
    """With an engine default K, a penalised request (which gives no speculation) decodes without it —
    equal to the oracle's penalised greedy generation — while its neighbours speculate."""
    from rlt.platform.models.ouro_reference import reference_generate
    from spec_helpers import reference

    path = spec_checkpoints[1]
    engine = spec_engine(path, options=SpecOptions(num_tokens=4, adaptive=False), overlap=overlap)
    s = (0.5, 1.0, 1.5)
    pen = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=s[0], frequency_penalty=s[1],
                         repetition_penalty=s[2])
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    stats = SpecStats()
    engine.add_observer(stats)
    alone = drain(engine, [("p", [5, 6, 7, 5], pen)])
    assert stats.drafted == 0  # the penalised request never drafted
    outs = drain(engine, [("p", [5, 6, 7, 5], pen), ("q", [9, 8, 7], plain)])
    assert stats.drafted > 0  # its neighbour did
    ref = reference(path)
    want = reference_generate(ref, [5, 6, 7, 5], max_tokens=10, penalties=s)[0]
    assert list(alone["p"].token_ids) == want and list(outs["p"].token_ids) == want
    assert want != reference_generate(ref, [5, 6, 7, 5], max_tokens=10)[0]  # the penalties matter here
    assert list(outs["q"].token_ids) == reference_generate(ref, [9, 8, 7], max_tokens=10)[0]
