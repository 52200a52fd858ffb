"""Chunk-size invariance: fp32 greedy output of chunked and wavefront chunked prefill is
token-identical to the oracle (whole-sequence fp32 reference) for chunk sizes 1, 3, 16, 128, 512
and whole, mixed with decoding requests, GQA and MHA; plus the scheduling invariants (budget,
wavefront overlap, in-flight bound) that make the speed and smoothness claims possible."""

from __future__ import annotations

import pytest

from prefill_helpers import GREEDY, RowLog, chunked_engine, oracle, prompts, run
from rlt.platform import SamplingParams
from rlt.platform.errors import ConfigError, InvalidRequestError

# (chunk size, budget, prompt lengths): prompts several chunks long, budgets a little above the
# chunk so decode rows of other requests shrink chunks too. 0: whole prompt (full prefill).
CASES = [(1, 4, (9, 5, 13)), (3, 8, (17, 4, 26)), (16, 40, (70, 9, 41)), (128, 140, (300, 20, 150)),
         (512, 530, (700, 33, 520)), (0, None, (700, 33, 520))]


# Whole-prompt prefill has one chunk, so it has no wavefront variant.
INVARIANCE = [pytest.param(c, b, ls, wf, id=f"chunk{c or 'whole'}-{'wavefront' if wf else 'sequential'}")
              for c, b, ls in CASES for wf in ((False, True) if c else (False,))]


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("chunk,budget,lengths,wavefront", INVARIANCE)
def test_chunk_size_invariance(tiny_checkpoint, chunk, budget, lengths, wavefront, kv_heads):
    path = tiny_checkpoint(seed=21, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    ps = prompts(lengths, seed=chunk + kv_heads)
    log = RowLog()
    engine = chunked_engine(path, chunk_size=chunk, wavefront=wavefront, budget=budget)
    engine.add_observer(log)
    outs = run(engine, ps, GREEDY, arrive_every=2)  # later prompts arrive while earlier ones decode
    for p, o, (want, depths) in zip(ps, outs, oracle(path, ps, GREEDY)):
        assert list(o.token_ids) == want, f"prompt of {len(p)} tokens"
        assert list(o.exit_depths) == depths
    # The test exercised what it claims: chunks of the size asked for, mixed with decode rows.
    if chunk:
        lens = [length for step in log.steps for (_, _, length, _) in step if length > 1 or chunk == 1]
        assert max(lens) == chunk
        assert all(sum(length for (_, _, length, _) in st) <= budget for st in log.steps)
    mixed = [st for st in log.steps if len({rid for rid, *_ in st}) > 1]
    assert mixed, "no step mixed requests"


def test_adaptive_exit_decode_rows_with_chunked_prompts(tiny_checkpoint):
    """Decode rows exit early (adaptive) while later prompts are chunked: still the oracle's tokens."""
    path = tiny_checkpoint(seed=7, gate_bias=0.0, max_position_embeddings=512)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    ps = prompts((40, 7, 33, 12), seed=3)
    outs = run(chunked_engine(path, chunk_size=5, wavefront=True, budget=9), ps, sp, arrive_every=3)
    for o, (want, depths) in zip(outs, oracle(path, ps, sp)):
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)
    assert any(d < 4 for o in outs for d in o.exit_depths[1:]), "no early exit: the test proves nothing"


def test_shared_layout_chunked_matches_its_oracle(tiny_checkpoint):
    path = tiny_checkpoint(seed=5)
    ps = prompts((9, 4, 6), seed=5)
    outs = run(chunked_engine(path, chunk_size=3, budget=4, layout="shared"), ps, GREEDY, arrive_every=2)
    for o, (want, depths) in zip(outs, oracle(path, ps, GREEDY, layout="shared")):
        assert (list(o.token_ids), list(o.exit_depths)) == (want, depths)


def test_wavefront_overlaps_chunks_at_several_depths(tiny_checkpoint):
    """One step holds several chunks of one request at different depths (and other requests' rows)."""
    path = tiny_checkpoint(seed=21)
    log = RowLog()
    engine = chunked_engine(path, chunk_size=4, wavefront=True, budget=64)
    engine.add_observer(log)
    run(engine, prompts((40, 3), seed=1), GREEDY)
    own = [[(s, d) for rid, s, _, d in st if rid == "r0" and s < 40] for st in log.steps]
    deepest = max(len(x) for x in own)
    assert deepest == 4, own  # 4 loops: chunks c..c+3 at depths 3..0 in one step
    assert any(len({d for _, d in x}) == 4 for x in own)
    # the sequential policy never has two chunks of one request in flight
    log2 = RowLog()
    engine = chunked_engine(path, chunk_size=4, wavefront=False, budget=64)
    engine.add_observer(log2)
    run(engine, prompts((40, 3), seed=1), GREEDY)
    assert all(sum(1 for rid, *_ in st if rid == "r0") <= 1 for st in log2.steps)
    assert len(log.steps) < len(log2.steps)


def test_inflight_tokens_bounded(tiny_checkpoint):
    path = tiny_checkpoint(seed=21)
    log = RowLog()
    engine = chunked_engine(path, chunk_size=4, wavefront=True, budget=64, max_inflight_tokens=8)
    engine.add_observer(log)
    ps = prompts((40, 30), seed=2)
    outs = run(engine, ps, GREEDY)
    assert all(sum(length for rid, s, length, d in st if length > 1) <= 8 for st in log.steps)
    assert any(sum(1 for rid, *_ in st if rid == "r0") == 2 for st in log.steps)
    for o, (want, _) in zip(outs, oracle(path, ps, GREEDY)):
        assert list(o.token_ids) == want


def test_decode_rows_run_in_every_step_of_a_long_prefill(tiny_checkpoint):
    """A long prompt arriving while others decode never stalls them: every step has their rows."""
    path = tiny_checkpoint(seed=21, max_position_embeddings=1024)
    log = RowLog()
    engine = chunked_engine(path, chunk_size=32, budget=40)
    engine.add_observer(log)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts((5, 6, 7), seed=4)):
        engine.add_request(f"d{i}", p, sp)
    for _ in range(3):
        engine.step()
    engine.add_request("long", prompts((300,), seed=9)[0], GREEDY)
    finished = set()
    while "long" not in finished:
        finished |= {o.request_id for o in engine.step() if o.finished}
    prefill_steps = [st for st in log.steps if any(rid == "long" for rid, *_ in st)]
    assert len(prefill_steps) >= 300 // 32 * 4
    assert all({"d0", "d1", "d2"} <= {rid for rid, *_ in st} for st in prefill_steps)
    assert all(sum(length for *_, length, _ in st) <= 40 for st in log.steps)


def test_prompt_longer_than_budget_is_served(tiny_checkpoint):
    path = tiny_checkpoint(seed=21, max_position_embeddings=1024)
    ps = prompts((300,), seed=6)
    outs = run(chunked_engine(path, chunk_size=32, budget=32), ps, GREEDY)
    assert list(outs[0].token_ids) == oracle(path, ps, GREEDY)[0][0]


def test_without_rlt_prefill_the_error_says_install_it(tiny_checkpoint):
    from rlt.platform import EngineConfig, LLMEngine

    path = tiny_checkpoint(seed=21)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_batched_tokens=16))
    with pytest.raises(InvalidRequestError, match="install rlt-prefill") as err:
        engine.add_request("r", prompts((20,))[0], GREEDY)
    assert err.value.param == "prompt"


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_size=65, budget=64), "--prefill-chunk-size 65 must be between 1 and"),
    (dict(chunk_size=8, budget=64, max_inflight_tokens=4), "--chunked-prefill-max-inflight-tokens 4"),
    (dict(chunk_size=8, budget=64, wavefront=True, layout="shared"), "SHARED semantics forbid cross-chunk"),
])
def test_bad_settings_name_the_flag(tiny_checkpoint, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        chunked_engine(tiny_checkpoint(seed=21), **kwargs)


def test_negative_chunk_size_option_is_refused():
    from rlt.prefill.features import ChunkedPrefillOptions

    with pytest.raises(ValueError, match="--prefill-chunk-size must be an integer >= 0"):
        ChunkedPrefillOptions(chunk_size=-1)


def test_abort_mid_prefill_frees_everything_and_others_continue(tiny_checkpoint):
    path = tiny_checkpoint(seed=21, max_position_embeddings=512)
    engine = chunked_engine(path, chunk_size=8, wavefront=True, budget=24)
    ps = prompts((200, 9), seed=8)
    engine.add_request("long", ps[0], GREEDY)
    engine.add_request("short", ps[1], GREEDY)
    for _ in range(6):
        engine.step()
    free_before = engine.stats().num_free_kv_blocks
    engine.abort_request("long")
    assert engine.stats().num_free_kv_blocks > free_before
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert list(outs["short"].token_ids) == oracle(path, ps[1:], GREEDY)[0][0]
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
