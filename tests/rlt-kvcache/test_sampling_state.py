"""A request's sampling state (logit_bias, min_p; the penalties' token history) lives in its slot's rows:
a slot reused by another request, or a preempted request resumed in another slot, carries exactly its
own — each request's tokens equal those it gets alone in a fresh engine."""

from __future__ import annotations

import pytest

from rlt.kvcache.options import PreemptionOptions
from rlt.platform import SamplingParams

from kv_helpers import base_engine, kv_engine, metrics, prompts, run


def _items():
    items = []
    for i, p in enumerate(prompts(5, seed=1)):
        if i % 2 == 0:  # biased (a boost, a ban, another boost) ...
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                logit_bias={(7 * i + 11) % 320: 6.0, 3: -100, 100 + i: 5.0})
        else:  # ... then unbiased, in turn
            sp = SamplingParams(max_tokens=8, temperature=0.9 if i == 3 else 0.0, seed=i, min_p=0.1, ignore_eos=True)
        if i in (1, 2, 4):  # penalised: a resumed request's history is its prompt and recorded output
            sp = sp.with_(max_tokens=12, frequency_penalty=1.0, repetition_penalty=1.5, presence_penalty=0.5 * (i - 2))
        items.append((p, sp))
    return items


def test_a_reused_slot_carries_no_earlier_bias(tiny_checkpoint):
    path = tiny_checkpoint(seed=1)
    items = _items()
    alone = [run(base_engine(path, max_num_seqs=1), [it])[0].token_ids for it in items]
    one_slot = run(base_engine(path, max_num_seqs=1), items)  # every request in slot 0, biased and not in turn
    assert [o.token_ids for o in one_slot] == alone


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_resume_with_their_own_bias(tiny_checkpoint, mode):
    path = tiny_checkpoint(seed=1)
    items = _items()
    alone = [run(base_engine(path, max_num_seqs=1), [it])[0].token_ids for it in items]
    engine = kv_engine(path, preemption=PreemptionOptions(mode=mode), num_kv_blocks=32, max_num_seqs=5)
    assert [o.token_ids for o in run(engine, items)] == alone
    m = metrics(engine)
    assert m["kv_preemptions"] > 0 and m["kv_resumed_in_other_slot"] > 0


def test_penalties_change_the_tokens_here(tiny_checkpoint):
    """(So that the tests above would see a lost or foreign token history.)"""
    path = tiny_checkpoint(seed=1)
    for p, sp in (it for i, it in enumerate(_items()) if i in (1, 2, 4)):
        off = sp.with_(frequency_penalty=0.0, repetition_penalty=1.0, presence_penalty=0.0)
        assert run(base_engine(path), [(p, sp)])[0].token_ids != run(base_engine(path), [(p, off)])[0].token_ids
