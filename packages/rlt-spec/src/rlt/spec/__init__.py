"""rlt-spec: synchronous self-speculation for looped language models.

A looped model is its own draft model: a token run through only ``d`` of its ``D`` loops is a
cheap guess of the full-depth token, and the draft's depth-``d`` hidden state and depth-``<d`` KV
are exactly what the full-depth computation needs first. Per round a speculating request drafts
``K`` tokens with ``d`` loops (one-token rows that exit at depth ``d``), then verifies all ``K+1``
positions in one multi-token row that runs depths ``d..D-1`` only, and keeps the longest accepted
prefix plus the correction (greedy: argmax match, exact; temperature > 0: rejection sampling
against the draft distribution). Rejected positions are rolled back by frontier: their KV is
simply overwritten by the next round.

Modules: :mod:`.rows` (the row and result values), :mod:`.adaptive` (the K rule),
:mod:`.verify` (draft sampling and verification, a sampler that accepts drafts),
:mod:`.scheduler` (the round state machine, wrapping the scheduler policy), :mod:`.executor`
(draft hidden states and verification), :mod:`.feature` (options, refusals, installation),
:mod:`.bench_checkpoint` (controlled-acceptance benchmark checkpoints).
"""
