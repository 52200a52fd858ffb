"""rlt-decode's device-planned steps (``--pipeline-device-exit``) composed with the other feature
packages: fp32 greedy output token-identical to the oracle, and no request starved by a run of
device-planned steps.

- With rlt-spec's overlapped speculation, a speculating request whose verdicts are in flight has
  no row in a step, so a step of the adaptive-exit requests' plain rows is open; the run must end
  at once ("a running request is not in the run"), or the speculating request would wait until a
  request finished.
- With rlt-prefill's chunked / wavefront prefill under the decode-smoothness cap, a long prompt
  arrives while adaptive requests decode: its first token comes when the host-planned pipeline
  produces it, give or take the steps in flight.
- With rlt-kvcache's preemption (incremental KV allocation; the loop drains before every plan) the
  feature is off, with that reason, and the engine serves adaptive requests exactly.
"""

from __future__ import annotations

import pytest
import torch

from rlt.decode.feature import FEATURES as DECODE, PipelineOptions
from rlt.kvcache.feature import FEATURES as KVCACHE
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.prefill.features import FEATURES as PREFILL, ChunkedPrefillOptions
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features as spec_features

from compose_helpers import run_with_arrivals

ADA = dict(temperature=0.0, ignore_eos=True, exit_threshold=0.6)


def _oracle(path):
    ck = load_checkpoint(path, dtype=torch.float32)
    return ck.family.build_reference(ck.config, ck.weights)


def _assert_oracle(ref, items, outs):
    for (prompt, sp), out in zip(items, outs):
        tau = 1.0 if sp.exit_threshold is None else sp.exit_threshold
        tokens, depths = reference_generate(ref, prompt, max_tokens=sp.max_tokens, exit_threshold=tau,
                                            min_loops=sp.min_loops, max_loops=sp.max_loops)
        assert list(out.token_ids) == tokens and list(out.exit_depths) == depths


def test_with_overlapped_speculation(tiny_checkpoint, tmp_path):
    path = scale_loop_updates(tiny_checkpoint(seed=8, gate_bias=0.5), tmp_path / "ck", 0.05)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=4)

    def engine(device_exit):  # chains read back two steps late, as the pipeline: runs meet verdicts due
        return build_engine(config, features=spec_features() + DECODE,
                            enabled={"self_spec": True, "async_self_spec": True},
                            options={"self_spec": SpecOptions(adaptive=False, chain_lag=2),
                                     "pipeline": PipelineOptions(depth=2, device_exit=device_exit)})

    items = [([5, 9, 13, 200, 31], SamplingParams(max_tokens=30, **ADA)),
             ([77, 3, 150], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                           speculation={"num_tokens": 3, "draft_loops": 2})),
             ([44, 8, 19, 250], SamplingParams(max_tokens=30, min_loops=2, **ADA)),
             ([61, 62, 63], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                           speculation={"num_tokens": 2, "draft_loops": 1}))]
    planned = engine(True)
    got = run_with_arrivals(planned, items, 1)
    assert [o.token_ids for o in got] == [o.token_ids for o in run_with_arrivals(engine(False), items, 1)]
    _assert_oracle(_oracle(path), items, got)
    info = planned.describe()["executor"]["pipeline"]["device_exit"]
    assert info["open_steps"] > 0 and info["ends"].get("a running request is not in the run", 0) > 0


@pytest.mark.parametrize("wavefront", [False, True], ids=["chunked", "wavefront"])
def test_with_chunked_prefill(tiny_checkpoint, wavefront):
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)

    def engine(device_exit):
        options = {"chunked_prefill": ChunkedPrefillOptions(chunk_size=4, wavefront=wavefront, decode_step_ratio=1.2,
                                                            step_overhead_tokens=2),
                   "pipeline": PipelineOptions(depth=2, device_exit=device_exit)}
        enabled = {"chunked_prefill": True, "packed_prefill": False, "prefill_uva": False, "graphs": False}
        return build_engine(config, features=PREFILL + DECODE, enabled=enabled, options=options)

    def serve(e, items, late_at):
        """Two decoding requests, then a long prompt at step ``late_at``: the outputs and the step of
        the late request's first token."""
        done, first, step = {}, None, 0
        for i, (p, sp) in enumerate(items[:2]):
            e.add_request(f"r{i}", p, sp)
        while e.has_unfinished_requests() or step <= late_at:
            if step == late_at:
                e.add_request("r2", *items[2])
            for o in e.step():
                if o.request_id == "r2" and o.token_ids and first is None:
                    first = step
                if o.finished:
                    done[o.request_id] = o
            step += 1
            assert step < 2000
        return [done[f"r{i}"] for i in range(3)], first

    items = [([5, 9, 13, 200, 31], SamplingParams(max_tokens=40, **ADA)),
             ([77, 3, 150], SamplingParams(max_tokens=40, min_loops=2, **ADA)),
             ([(7 * i) % 300 + 3 for i in range(37)], SamplingParams(max_tokens=6, **ADA))]
    planned = engine(True)
    got, first_planned = serve(planned, items, 12)
    want, first_plain = serve(engine(False), items, 12)
    assert [(o.token_ids, o.exit_depths) for o in got] == [(o.token_ids, o.exit_depths) for o in want]
    _assert_oracle(_oracle(path), items, got)
    assert planned.describe()["executor"]["pipeline"]["device_exit"]["device_planned_steps"] > 0
    assert first_planned <= first_plain + 3, (first_planned, first_plain)


def test_off_with_preemption(tiny_checkpoint):
    path = tiny_checkpoint(seed=6, gate_bias=0.5)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=4)
    engine = build_engine(config, features=KVCACHE + DECODE, enabled={"preemption": True, "prefix_cache": False},
                          options={"pipeline": PipelineOptions(device_exit=True)})
    info = engine.describe()["executor"]["pipeline"]["device_exit"]
    assert not info["enabled"] and "preemption" in info["off_reason"]
    items = [([5, 9, 13, 200, 31], SamplingParams(max_tokens=12, **ADA)),
             ([77, 3, 150], SamplingParams(max_tokens=10, min_loops=2, **ADA))]
    _assert_oracle(_oracle(path), items, run_with_arrivals(engine, items, 2))
