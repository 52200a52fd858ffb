"""Wide chains (``--self-spec-width``), eager steps: the newest position runs the draft's W best
tokens as W candidate rows below depth d, with private KV blocks; the candidate that ran the
full-depth token goes on. fp32 greedy output token-identical to the oracle; candidates rescue drafts that were not
the draft's first choice (fewer restarts than a plain chain on the same checkpoint); requests that
cannot run wide (sampling, a shallow draft depth, no lane left) run plain chains."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlt.platform import SamplingParams
from rlt.platform.models.ouro_reference import reference_generate
from rlt.spec.feature import SpecOptions
from rlt.spec.rows import CHAIN, CandidateRow, row_column
from rlt.spec.stats import SpecStats
from rlt.spec.bench_checkpoint import scale_loop_updates
from spec_helpers import drain, reference, spec_engine


class Rows:
    """Counts candidate rows and chain checks (with their verdicts) per request."""

    def __init__(self) -> None:
        self.candidates: dict[str, int] = {}
        self.checks: list[bool] = []
        self.most_wide = 0  # the most requests with candidates in one step
        self.wide_at: list[int] = []  # per step with candidates: the requests with rows in it

    def on_step(self, batch, result) -> None:
        wide = set()
        for r in batch.rows:
            if isinstance(r, CandidateRow):
                wide.add(r.request.request_id)
                self.candidates[r.request.request_id] = self.candidates.get(r.request.request_id, 0) + 1
        self.most_wide = max(self.most_wide, len(wide))
        if wide:
            self.wide_at.append(len({r.request.request_id for r in batch.rows}))
        acc = getattr(result, "accepted", None)
        if acc is not None:
            role = row_column(batch.rows, "role", 0, np.int8)
            self.checks += [bool(acc[i]) for i in np.nonzero((role == CHAIN) & (result.num_tokens > 0))[0]]


def _items(seed: int, n: int, **sp):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(3, 300) for _ in range(rng.randint(2, 13))],
             SamplingParams(max_tokens=rng.randint(8, 20), temperature=0.0, ignore_eos=True, **sp))
            for i in range(n)]


def _run(path, items, *, width, lanes=8, **cfg):
    """Every request may run wide here (a lane per slot: the engine's default is one lane)."""
    engine = spec_engine(path, overlap=True, options=SpecOptions(adaptive=False, width=width, wide_lanes=lanes), **cfg)
    rec = Rows()
    stats = SpecStats()
    engine.add_observer(rec)
    engine.add_observer(stats)
    return drain(engine, items), rec, stats, engine


@pytest.fixture(scope="module")
def checkpoints(spec_checkpoints, tmp_path_factory):
    """Random weights (acceptance ~0.1), loop updates scaled by 0.2 (~0.6: the full-depth token is
    often the draft's second to fourth best, the candidates' case) and by 0.03 (drafts mostly accepted)."""
    mid = scale_loop_updates(spec_checkpoints[0], tmp_path_factory.mktemp("mid"), 0.2)
    return {"random": spec_checkpoints[0], "mid": mid, "controlled": spec_checkpoints[1]}


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("which", ["random", "mid", "controlled"])
def test_wide_chains_are_exact(checkpoints, which, width):
    """Eager steps (this package's tests run without rlt-decode; the static buffers, the pipeline and the
    fused heads: tests/integration/test_spec_wide_compose.py)."""
    path = checkpoints[which]
    items = _items(3 + len(which), 5, speculation={"num_tokens": 8, "draft_loops": 2})
    outs, rec, _stats, engine = _run(path, items, width=width, max_num_seqs=4)
    ref = reference(path)
    for rid, prompt, sp in items:
        want, depths = reference_generate(ref, prompt, max_tokens=sp.max_tokens)
        assert outs[rid].error is None
        assert list(outs[rid].token_ids) == want, rid
        assert list(outs[rid].exit_depths) == depths
    assert sum(rec.candidates.values()) > 0  # positions ran as candidates
    audit = getattr(engine.ctx.parts.kv_manager, "audit", None)
    if audit is not None:
        audit()


def test_candidates_rescue_drafts_a_plain_chain_rejects(checkpoints):
    """Where the full-depth token is often among the draft's best four but not its first (scale
    0.2: a plain chain accepts ~0.6 of its checks), a four-wide chain accepts far more (~0.9), and
    the same requests decode the same tokens; a winner copied from the wrong candidate would break
    the next tokens."""
    items = _items(11, 4, speculation={"num_tokens": 8, "draft_loops": 2})
    outs_plain, plain, _, _ = _run(checkpoints["mid"], items, width=1)
    outs_wide, wide, _, _ = _run(checkpoints["mid"], items, width=4)
    rate = lambda r: sum(r.checks) / len(r.checks)  # noqa: E731
    assert not plain.candidates and wide.candidates
    assert rate(wide) > rate(plain) + 0.2, (rate(plain), rate(wide))
    assert all(list(outs_wide[rid].token_ids) == list(outs_plain[rid].token_ids) for rid, _, _ in items)


def test_requests_that_cannot_run_wide_run_plain_chains(spec_checkpoints):
    path = spec_checkpoints[1]
    items = [("greedy", [5, 9, 40], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                   speculation={"num_tokens": 4, "draft_loops": 2})),
             ("shallow", [5, 9, 41], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    speculation={"num_tokens": 4, "draft_loops": 1})),
             ("sampled", [5, 9, 42], SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True,
                                                    speculation={"num_tokens": 4, "draft_loops": 2}))]
    outs, rec, _, _ = _run(path, items, width=4)
    assert set(rec.candidates) == {"greedy"}
    assert all(o.error is None and len(o.token_ids) == 12 for o in outs.values())


def test_chains_start_wide_only_while_no_more_requests_run_than_lanes(spec_checkpoints):
    """Two lanes, three requests admitted together: while all three run, every chain is plain (each
    candidate row reads its request's whole context, so the defaults keep them to small batches);
    once the shortest finishes, the other two run wide."""
    path = spec_checkpoints[1]
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,  # noqa: E731
                                  speculation={"num_tokens": 4, "draft_loops": 2})
    items = [("short", [5, 9, 40], sp(6)), ("a", [5, 9, 41], sp(24)), ("b", [7, 9, 42], sp(24))]
    outs, rec, _, _ = _run(path, items, width=4, lanes=2, max_num_seqs=3)
    ref = reference(path)
    for rid, prompt, p in items:
        assert list(outs[rid].token_ids) == reference_generate(ref, prompt, max_tokens=p.max_tokens)[0]
    assert set(rec.candidates) == {"a", "b"}
    assert max(rec.wide_at) <= 2, rec.wide_at
    assert rec.most_wide == 2  # both lanes in use at once, never more


def test_wide_helpers_match_eager_indexing():
    """promote_winners (addresses from Groups.of): the winner is the candidate that ran the slot's token; its state, drafts and
    KV entries (every plane below d) land where the chain row and the next candidates read them."""
    from rlt.attention import KVCache, KVLayout
    from types import SimpleNamespace

    from rlt.spec.wide import Groups, promote_winners

    torch.manual_seed(0)
    kv = KVCache.allocate(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=1, head_dim=2, num_planes=3,
                          layout=KVLayout.LAST_EXITED, dtype=torch.float32, device="cpu")
    kv.k.normal_()
    kv.v.normal_()
    kv.token_depth.copy_(torch.randint(0, 3, kv.token_depth.shape))
    w, p = 3, 2
    state = torch.randn(20, 5)
    tokens = torch.zeros(20, dtype=torch.int64)
    cand = np.array([[10, 11, 12]])
    tokens[torch.tensor(cand[0])] = torch.tensor([7, 4, 9])
    tokens[1] = 4  # slot 1's full-depth token: candidate 1 ran it
    logits = torch.randn(w, 30)
    private = np.array([[[2, 3], [4, 5], [6, 7]]])  # [G, W, P]
    canonical = np.array([[8, 9]])
    before_k = kv.k.clone()
    want_state = state[11].clone()
    tables = np.zeros((2, 3, 1), np.int32)
    tables[1, :p, 0] = canonical[0]  # slot 1's page 0, planes 0 and 1
    row = SimpleNamespace(slot=1, start=2, lane=tuple(map(tuple, private[0])), candidates=tuple(cand[0]), chain_entry=15)
    promote_winners(kv=kv, state_table=state, token_table=tokens, logits=logits, groups=Groups.of([row], tables, 4),
                    device=torch.device("cpu"))
    assert torch.equal(state[15], want_state)
    assert tokens[torch.tensor(cand[0])].tolist() == logits[1].topk(w).indices.tolist()
    for plane in range(p):
        src = before_k[:, private[0, 1, plane], 2]
        for dst in [canonical[0, plane], *private[0, :, plane]]:
            assert torch.equal(kv.k[:, dst, 2], src)
        assert torch.equal(kv.k[:, canonical[0, plane], 1], before_k[:, canonical[0, plane], 1])  # other offsets kept


def test_lanes_come_on_top_of_an_explicit_pool(spec_checkpoints):
    """``--num-kv-blocks N`` counts the blocks requests can hold: the lanes' private blocks are reserved on
    top (2 lanes x 4 candidates x 3 planes below the depth of 4), the engine's stats report N (a drained engine
    0 % used), and a request needing every one of the N blocks is admitted and decodes exactly."""
    path = spec_checkpoints[1]
    n = 4 * 6  # block_size 4: 6 pages x 4 planes for 3 + 20 positions
    engine = spec_engine(path, overlap=True, options=SpecOptions(adaptive=False, width=4, wide_lanes=2),
                         num_kv_blocks=n, max_num_seqs=2)
    kv = engine.ctx.parts.kv_manager
    assert kv.num_blocks == n + 2 * 4 * 3 and kv.usable_blocks == n
    assert engine.stats().num_kv_blocks == n and engine.stats().kv_usage == 0.0
    prompt, sp = [5, 9, 40], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True,
                                            speculation={"num_tokens": 4, "draft_loops": 2})
    out = drain(engine, [("full", prompt, sp)])["full"]
    assert out.error is None
    assert list(out.token_ids) == reference_generate(reference(path), prompt, max_tokens=21)[0]
    assert engine.stats().num_free_kv_blocks == n and engine.stats().kv_usage == 0.0
