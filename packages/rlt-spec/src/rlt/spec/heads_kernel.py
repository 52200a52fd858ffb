"""The Triton kernel of :func:`rlt.spec.heads.greedy_heads`: a lagged step's greedy heads after the
LM head, one program per batch row. Imported on first use only (Triton is optional)."""

from __future__ import annotations

import triton
import triton.language as tl

#: row roles in the descriptor (``rlt.spec.heads``): no head, chain draft, chain check, plain sample
NONE, DRAFT, CHECK, SAMPLE = 0, 1, 2, 3
# the same inside the kernel: a jitted function reads module globals only as ``tl.constexpr`` objects
_DRAFT, _CHECK, _SAMPLE = tl.constexpr(DRAFT), tl.constexpr(CHECK), tl.constexpr(SAMPLE)


@triton.jit(do_not_specialize=["n_rows"])  # the row count varies per step: one compile
def greedy_heads_kernel(LOGITS, stride_l, DESC, n_rows, vocab, TABLE, DEAD, OUT, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    head = tl.load(DESC + row)
    role = tl.load(DESC + n_rows + row)
    entry = tl.load(DESC + 2 * n_rows + row)
    slot = tl.load(DESC + 3 * n_rows + row)
    token = tl.zeros((), tl.int64)
    count = tl.zeros((), tl.int64)
    verdict = tl.zeros((), tl.int64)
    if head >= 0:
        # argmax of the row's logits, the first index of the largest value (torch.argmax's tie rule)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int64)
        base = LOGITS + head * stride_l
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
            m = tl.max(x, axis=0)
            i = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
            better = m > best  # strictly: an equal later block keeps the earlier index
            best_i = tl.where(better, i, best_i)
            best = tl.where(better, m, best)
        if role == _DRAFT:  # the draft, where the chain's next row embeds it and this row's check judges it
            tl.store(TABLE + entry, best_i)
        if role == _CHECK:
            accept = tl.load(TABLE + entry) == best_i
            valid = tl.load(DEAD + slot) == 0
            tl.store(DEAD + slot, (valid & ~accept).to(tl.uint8), mask=valid)
            tl.store(TABLE + slot, best_i, mask=valid)
            token = best_i
            count = valid.to(tl.int64)
            verdict = accept.to(tl.int64)
        if role == _SAMPLE:
            tl.store(TABLE + slot, best_i)
            token = best_i
            count = tl.full((), 1, tl.int64)
    tl.store(OUT + row, token)
    tl.store(OUT + n_rows + row, count)
    tl.store(OUT + 2 * n_rows + row, verdict)
