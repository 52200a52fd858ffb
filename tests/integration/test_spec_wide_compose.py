"""Wide chains (rlt-spec, ``--self-spec-width``) composed with rlt-decode's static buffers and
pipeline: candidate rows carry page tables of their own into the static buffers' device mirror,
their steps are lagged, and with the fused greedy heads (built by Triton's interpreter here) the
wide checks, drafts and the winners' promotion run as kernels. fp32 greedy output
token-identical to the oracle; the fused path's verdicts equal the general path's, check for check."""

from __future__ import annotations

import importlib
import importlib.util
import random

import numpy as np
import pytest
import torch

from rlt.decode.feature import FEATURES as DECODE
from rlt.platform import EngineConfig, SamplingParams
from rlt.platform.checkpoint import load_checkpoint
from rlt.platform.composition import build_engine
from rlt.platform.models.ouro_reference import reference_generate
from rlt.spec.bench_checkpoint import scale_loop_updates
from rlt.spec.feature import SpecOptions, features as spec_features
from rlt.spec.rows import CHAIN, CandidateRow, row_column


class _Wide:
    """Steps whose candidate rows ran from the static buffers, and every check's verdict in order."""

    def __init__(self) -> None:
        self.static = 0
        self.checks: list[bool] = []

    def on_step(self, batch, result) -> None:
        wide = any(isinstance(r, CandidateRow) for r in batch.rows)
        self.static += wide and type(batch).__name__ == "DecodeBatch"
        acc = getattr(result, "accepted", None)
        if acc is not None:
            role = row_column(batch.rows, "role", 0, np.int8)
            self.checks += [bool(acc[i]) for i in np.nonzero((role == CHAIN) & (result.num_tokens > 0))[0]]


def _run(path, items, width: int = 4):
    engine = build_engine(EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=4),
                          features=spec_features() + DECODE, enabled={"self_spec": True, "async_self_spec": True},
                          options={"self_spec": SpecOptions(adaptive=False, width=width)})
    obs = _Wide()
    engine.add_observer(obs)
    for rid, prompt, sp in items:
        engine.add_request(rid, prompt, sp)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs, obs, engine


def _items(seed: int, d):
    """Five greedy speculating requests at draft depth ``d`` (a list: one per request, in turn)."""
    ds = d if isinstance(d, list) else [d]
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(3, 300) for _ in range(rng.randint(2, 13))],
             SamplingParams(max_tokens=rng.randint(8, 20), temperature=0.0, ignore_eos=True,
                            speculation={"num_tokens": 8, "draft_loops": ds[i % len(ds)]})) for i in range(5)]


def _assert_oracle(path, items, outs):
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    for rid, prompt, sp in items:
        want, depths = reference_generate(ref, prompt, max_tokens=sp.max_tokens)
        assert outs[rid].error is None and list(outs[rid].token_ids) == want, rid
        assert list(outs[rid].exit_depths) == depths


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("scale", [1.0, 0.2, 0.03])
def test_wide_chains_through_static_buffers_are_exact(tiny_checkpoint, tmp_path, scale, width):
    path = scale_loop_updates(tiny_checkpoint(seed=1), tmp_path / "ck", scale)
    items = _items(4, 2)
    outs, obs, engine = _run(path, items, width)
    _assert_oracle(path, items, outs)
    assert obs.static > 0  # candidates ran from the static buffers (own page tables in the device mirror)
    assert engine.ctx.parts.executor.describe()["steps"].get("lagged_with_feature_rows", 0) > 0


@pytest.fixture
def fused_interpreted(monkeypatch):
    """The fused greedy heads (wide roles and the promotion kernel) built by Triton's interpreter and
    taken by the engine on CPU tensors; the model's own fused ops stay on their CPU path."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (interpreter)")
    from triton_interpreter import fix_interpreter

    fix_interpreter()
    import rlt.spec.heads_kernel as kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only while the heads' kernels are built
    importlib.reload(kernel)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr("rlt.spec.executor.fused_heads_usable", lambda t: True)
    yield
    importlib.reload(kernel)


@pytest.mark.parametrize("d", [2, 3, [2, 3]], ids=["d2", "d3", "mixed"])
def test_fused_wide_heads_equal_the_general_path(tiny_checkpoint, tmp_path, fused_interpreted, d):
    """Lagged wide steps through the fused kernels (checks against the candidates, each candidate's W
    best in one pass each, the winners' promotion in one launch) on a checkpoint where candidates
    rescue drafts often: the oracle's tokens and the general path's verdicts, check for check. Mixed
    draft depths (the H100's first fused run: candidates of d = 2 and d = 3 in one step took the plain
    roles, and the d = 3 request decoded wrong tokens) take the general path for those steps."""
    path = scale_loop_updates(tiny_checkpoint(seed=1), tmp_path / "ck", 0.2)
    items = _items(21, d)
    outs, fused, engine = _run(path, items)
    assert engine.ctx.parts.executor.inner.fused_heads_off == ""  # the fused path ran, and never failed
    _assert_oracle(path, items, outs)
    import rlt.spec.executor as ex

    with pytest.MonkeyPatch.context() as mp:  # the general path, same requests
        mp.setattr(ex, "fused_heads_usable", lambda t: False)
        _, general, _ = _run(path, items)
    assert fused.checks == general.checks and len(fused.checks) > 0
    assert sum(fused.checks) < len(fused.checks)  # rejections too (none of the four was right)
