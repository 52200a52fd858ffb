"""rlt-spec (synchronous and overlapped self-speculation) composed with rlt-decode's static
buffers and token-level pipeline (graphs where the platform has them) and rlt-prefill's chunked
prefill, at their defaults: fp32 greedy output token-identical to the oracle.

Requests arrive while others decode, so lagged plain decode steps (tokens still on the device)
alternate with speculative steps. Draft and chain rows are one-token rows: their steps run from
rlt-decode's static buffers (synchronously: the pipeline drains what is in flight before their
results are read), with their states at their own state-table entries; verification rows
(multi-token) run in eager steps. Adaptive K on random weights (a high ``min_gain``) drops requests
to plain decoding (their steps lagged) and probes with rounds whose first row starts while the
request's last token is still in flight (embedded from the device token buffer).
"""

from __future__ import annotations

import random

import pytest

from compose_helpers import run_with_arrivals

from rlt.decode.feature import FEATURES as DECODE
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features as spec_features
from rlt.spec.stats import SpecStats


def _engine(path, overlap: bool):
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=40, max_num_seqs=6)
    feats = spec_features() + DECODE + PREFILL
    return build_engine(cfg, features=feats, enabled={"self_spec": True, "async_self_spec": overlap},
                        options={"self_spec": SpecOptions(probe_interval=3, min_gain=0.5),
                                 "chunked_prefill": ChunkedPrefillOptions(chunk_size=8)})


def _fixed_k_engine(path, overlap: bool, decode: bool, **cfg):
    """self_spec with every request's own K (no adaptive K); rlt-decode's features at their
    defaults (``decode``) or all off."""
    enabled = {"self_spec": True, "async_self_spec": overlap}
    if not decode:
        enabled.update({f.name: False for f in DECODE})
    return build_engine(EngineConfig(model=str(path), dtype="float32", block_size=4, **cfg),
                        features=spec_features() + DECODE, enabled=enabled,
                        options={"self_spec": SpecOptions(adaptive=False)})


def _items(seed):
    rng = random.Random(seed)
    specs = [None, {"num_tokens": 3, "draft_loops": 1}, {"num_tokens": 8, "draft_loops": 2}, None,
             {"num_tokens": 2, "draft_loops": 3}, {"num_tokens": 5, "draft_loops": 2}, {"num_tokens": 1}]
    return [([rng.randrange(3, 320) for _ in range(rng.randint(2, 20))],
             SamplingParams(max_tokens=rng.randint(10, 24), temperature=0.0, ignore_eos=True, speculation=s))
            for s in specs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("scale", [1.0, 0.03], ids=["random", "controlled"])
def test_speculation_with_decode_pipeline_is_exact(tiny_checkpoint, tmp_path, overlap, scale):
    path = scale_loop_updates(tiny_checkpoint(seed=5), tmp_path / "ck", scale)
    engine = _engine(path, overlap)
    comps = engine.assembly.describe()
    assert comps["executor"] == ["self_spec", "static_buffers"] and comps["step_loop"] == ["pipeline"]
    stats = SpecStats()
    engine.add_observer(stats)
    in_flight = _InFlightSpecRows()
    engine.add_observer(in_flight)
    items = _items(3)
    outs = run_with_arrivals(engine, items, 4)  # arrivals while others decode
    ck = load_checkpoint(path, dtype=__import__("torch").float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for i, (prompt, sp) in enumerate(items):
        want, depths = reference_generate(ref, prompt, max_tokens=sp.max_tokens)
        out = outs[i]
        assert out.error is None
        assert list(out.token_ids) == want, (i, sp.speculation)
        assert list(out.exit_depths) == depths
    described = engine.ctx.parts.executor.describe()
    pipe = described["pipeline"]
    assert stats.rounds > 0 and pipe["lagged_steps"] > 0  # both kinds of steps ran
    assert described["steps"].get("with_feature_rows", 0) > 0  # speculative rows in static steps
    if not overlap:  # verification rows: eager steps
        assert pipe["synchronous_steps"].get("not a decode-only step", 0) > 0
    if scale == 1.0:  # requests fell back to plain (lagged) decoding and probed with tokens in flight
        assert in_flight.count > 0


class _InFlightSpecRows:
    """Counts speculative rows that embedded their request's last token from the device."""

    count = 0

    def on_step(self, batch, result) -> None:
        if type(batch).__name__ == "DecodeBatch":
            self.count += sum(bool(f) and type(r).__name__ != "Row" for r, f in zip(batch.rows, batch.from_device))


PAIRS = [(k, d) for k in range(1, 9) for d in range(1, 4)]  # K x d for D = 4


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_every_k_and_d_through_static_buffers_is_exact(tiny_checkpoint, tmp_path, overlap):
    """Every K in 1..8 and d in 1..3, mixed with plain requests, on a controlled-acceptance
    checkpoint (drafts mostly accepted, chains several rows deep): token-identical to the oracle.
    Every step without a prompt row is a static decode step: chain rows of one request at several
    depths, or a round's verification rows at consecutive positions, each at its own state-table
    entry."""
    path = scale_loop_updates(tiny_checkpoint(seed=1), tmp_path / "ck", 0.03)
    engine = _fixed_k_engine(path, overlap, True, max_num_seqs=8)
    stats = SpecStats()
    engine.add_observer(stats)
    kinds = {"prompt": 0, "verify": 0}
    engine.add_observer(type("Kinds", (), {"on_step": lambda self, b, r: (
        kinds.__setitem__("prompt", kinds["prompt"] + any(row.in_prompt for row in b.rows)),
        kinds.__setitem__("verify", kinds["verify"] + any(type(row).__name__ == "VerifyRow" for row in b.rows)))})())
    rng = random.Random(7)
    items = []
    for i, (k, d) in enumerate(PAIRS):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 11))]
        items.append((f"r{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                      speculation={"num_tokens": k, "draft_loops": d})))
        if i % 3 == 2:
            items.append((f"p{i}", prompt[::-1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)))
    for rid, prompt, sp in items:
        engine.add_request(rid, prompt, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    ck = load_checkpoint(path, dtype=__import__("torch").float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for rid, prompt, sp in items:
        want, depths = reference_generate(ref, prompt, max_tokens=sp.max_tokens)
        assert outs[rid].error is None
        assert list(outs[rid].token_ids) == want, (rid, sp.speculation)
        assert list(outs[rid].exit_depths) == depths
    assert stats.rounds > 0 and stats.acceptance > 0.5
    steps = engine.ctx.parts.executor.describe()["steps"]
    assert steps.get("with_feature_rows", 0) > 0
    assert steps.get("eager_other_steps", 0) == kinds["prompt"]
    assert (kinds["verify"] > 0) == (not overlap)
    # chains are read back lagged (the pipeline is on by default); rounds at once
    assert (steps.get("lagged_with_feature_rows", 0) > 0) == overlap


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_seeded_sampling_through_static_buffers_equals_the_eager_path(tiny_checkpoint, tmp_path, overlap):
    """Random rows (temperature > 0, seeded): the draft distributions kept by ring position, the
    rejection tests and corrections give the same tokens whether the steps run from rlt-decode's
    static buffers or eagerly (the noise is keyed by seed and generation step, not by the path)."""
    path = scale_loop_updates(tiny_checkpoint(seed=2), tmp_path / "ck", 0.1)
    rng = random.Random(11)
    items = [([rng.randrange(3, 300) for _ in range(rng.randint(2, 9))],
              SamplingParams(max_tokens=14, temperature=t, top_k=k, seed=100 + i, ignore_eos=True,
                             speculation={"num_tokens": 1 + i % 4, "draft_loops": 1 + i % 3}))
             for i, (t, k) in enumerate([(0.8, 0), (1.0, 20), (0.5, 0), (1.3, 5), (0.9, 0), (0.0, 0)])]
    got = {}
    for decode in (False, True):
        engine = _fixed_k_engine(path, overlap, decode, max_num_seqs=4)
        outs = run_with_arrivals(engine, items, 3)
        assert all(o.error is None for o in outs)
        got[decode] = [list(o.token_ids) for o in outs]
        if decode:
            assert engine.ctx.parts.executor.describe()["steps"].get("with_feature_rows", 0) > 0
    assert got[True] == got[False]


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_abort_mid_round_frees_everything_and_leaves_the_others_exact(tiny_checkpoint, tmp_path, overlap, decode):
    """Aborting a speculating request while its round or chain rows are in flight: it finishes at
    once, nothing more is reported for it, its slot is reused by a new speculating request, every
    other request stays token-identical to the oracle, and all KV comes back."""
    path = scale_loop_updates(tiny_checkpoint(seed=4), tmp_path / "ck", 0.03)
    engine = _fixed_k_engine(path, overlap, decode, max_num_seqs=3)
    sched = engine.ctx.parts.scheduler
    rng = random.Random(5)
    items = [([rng.randrange(3, 300) for _ in range(rng.randint(3, 9))],
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                             speculation={"num_tokens": 3 + i, "draft_loops": 1 + i % 2})) for i in range(4)]
    for i, (p, sp) in enumerate(items[:3]):
        engine.add_request(f"r{i}", p, sp)
    outs = {}
    target = None
    while target is None:  # until r0 has speculative rows several steps deep
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        target = next((r for r in (sched.chains if overlap else sched.rounds) if r.request_id == "r0"
                       and r.num_produced >= 2), None)
    aborted = engine.abort_request("r0")
    assert aborted.finished and aborted.finish_reason == "abort" and len(aborted.token_ids) < 16
    engine.add_request("r3", *items[3])  # takes r0's slot and ring entries
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert "r0" not in outs
    ck = load_checkpoint(path, dtype=__import__("torch").float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for i in (1, 2, 3):
        want, _ = reference_generate(ref, items[i][0], max_tokens=16)
        assert outs[f"r{i}"].error is None and list(outs[f"r{i}"].token_ids) == want, i
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
