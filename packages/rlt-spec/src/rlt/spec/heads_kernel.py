"""The Triton kernel of :func:`rlt.spec.heads.greedy_heads`: a lagged step's greedy heads after the
LM head, one program per batch row. Imported on first use only (Triton is optional)."""

from __future__ import annotations

import triton
import triton.language as tl

#: row roles in the descriptor (``rlt.spec.heads``): no head, chain draft, chain check, plain sample; a wide
#: chain's check (against ``W`` candidates at consecutive entries from ``entry``) and a wide chain's draft (its
#: ``W`` best tokens into consecutive entries from ``entry``: the next candidates' inputs, or a candidate's scratch)
NONE, DRAFT, CHECK, SAMPLE, WCHECK, WDRAFT = 0, 1, 2, 3, 4, 5
# the same inside the kernel: a jitted function reads module globals only as ``tl.constexpr`` objects
_DRAFT, _CHECK, _SAMPLE = tl.constexpr(DRAFT), tl.constexpr(CHECK), tl.constexpr(SAMPLE)
_WCHECK, _WDRAFT = tl.constexpr(WCHECK), tl.constexpr(WDRAFT)


@triton.jit
def _at(v, ks, k):
    """``v[k]`` of a small vector (a masked reduction: registers cannot be indexed at run time)."""
    return tl.sum(tl.where(ks == k, v, 0), axis=0)


@triton.jit
def _top(base, vocab, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr):
    """A row's ``W`` best logits' indices in (value descending, index ascending) order, in one pass over
    the vocabulary: each block's ``W`` best (taken out of the block's registers one by one), merged with
    the running ``W`` best like two sorted lists (an earlier block's entry first on equal values: its
    index is smaller). ``WP``: ``W`` rounded up to a power of two (vector lengths); -1 marks none (a row with
    fewer than ``W`` finite logits)."""
    ks = tl.arange(0, WP)
    run_v = tl.full((WP,), float("-inf"), tl.float32)
    run_i = tl.full((WP,), -1, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = tl.arange(0, BLOCK)
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        blk_v = tl.full((WP,), float("-inf"), tl.float32)
        blk_i = tl.full((WP,), -1, tl.int64)
        for k in tl.static_range(W):
            m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            valid = (start + i < vocab) & (m > float("-inf"))  # fewer than W candidates left: none
            blk_v = tl.where(ks == k, m, blk_v)
            blk_i = tl.where((ks == k) & valid, start + i.to(tl.int64), blk_i)
            x = tl.where(offs == i, float("-inf"), x)
        new_v = tl.full((WP,), float("-inf"), tl.float32)
        new_i = tl.full((WP,), -1, tl.int64)
        a = tl.zeros((), tl.int32)
        b = tl.zeros((), tl.int32)
        for k in tl.static_range(W):
            va, ia = _at(run_v, ks, a), _at(run_i, ks, a)
            vb, ib = _at(blk_v, ks, b), _at(blk_i, ks, b)
            take_a = (ia >= 0) & ((ib < 0) | (va >= vb))
            new_v = tl.where(ks == k, tl.where(take_a, va, vb), new_v)
            new_i = tl.where(ks == k, tl.where(take_a, ia, ib), new_i)
            a += take_a.to(tl.int32)
            b += (~take_a).to(tl.int32)
        run_v = new_v
        run_i = new_i
    return run_i


@triton.jit(do_not_specialize=["n_rows"])  # the row count varies per step: one compile
def greedy_heads_kernel(LOGITS, stride_l, DESC, n_rows, vocab, TABLE, DEAD, OUT, WINNER, BLOCK: tl.constexpr,
                        W: tl.constexpr = 1, WP: tl.constexpr = 1):
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
        if role == _WDRAFT:  # the W best, best first (the first is best_i: the same tie rule)
            top = _top(base, vocab, W, WP, BLOCK)
            top = tl.where(top < 0, best_i, top)  # no W-th finite logit: the best again (a candidate never wins twice)
            tl.store(TABLE + entry + tl.arange(0, WP), top, mask=tl.arange(0, WP) < W)
        if role == _WCHECK:  # accepted when any candidate ran the token; the first such is the winner
            winner = tl.full((), -1, tl.int64)
            for k in tl.static_range(W):
                hit = (tl.load(TABLE + entry + k) == best_i) & (winner < 0)
                winner = tl.where(hit, k, winner)
            accept = winner >= 0
            valid = tl.load(DEAD + slot) == 0
            tl.store(WINNER + slot, tl.maximum(winner, 0))
            tl.store(DEAD + slot, (valid & ~accept).to(tl.uint8), mask=valid)
            tl.store(TABLE + slot, best_i, mask=valid)
            token = best_i
            count = valid.to(tl.int64)
            verdict = accept.to(tl.int64)
    tl.store(OUT + row, token)
    tl.store(OUT + n_rows + row, count)
    tl.store(OUT + 2 * n_rows + row, verdict)


@triton.jit
def _copy_entry(ptr, addr, src_addr, row_size, W: tl.constexpr, BLOCK: tl.constexpr):
    """One layer's K (or V) entry at ``src_addr`` to the ``W + 1`` addresses from ``addr``."""
    for start in range(0, row_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        vals = tl.load(ptr + src_addr * row_size + cols, mask=cols < row_size)
        for k in tl.static_range(W + 1):
            tl.store(ptr + tl.load(addr + k) * row_size + cols, vals, mask=cols < row_size)


@triton.jit
def promote_kernel(DESC, n_groups, n_planes, num_layers, layer_stride, row_size, TABLE, WINNER, STATE, state_stride,
                   hidden, K, V, STAMPS, W: tl.constexpr, BLOCK: tl.constexpr):
    """Wide chains' winners (:func:`rlt.spec.wide.promote_winners`, fused): program (g, 0) copies group
    ``g``'s winner's state to the chain row's entry and its next candidates (its scratch) to the candidates'
    inputs; program (g, 1 + u) copies one layer's K or V entry of one plane below d from the winner's private
    block to the page and every candidate's block (the stamps with it, at layer 0). The winner is
    ``WINNER[slot]``, which the check of the previous position wrote (``greedy_heads_kernel``, WCHECK).
    Descriptor per group: slot, first candidate entry, scratch entry, chain-row entry, then per plane the
    page's address and the W private addresses (``block * block_size + offset``)."""
    g = tl.program_id(0)
    u = tl.program_id(1)
    width = 4 + n_planes * (1 + W)
    d = DESC + g * width
    slot = tl.load(d)
    cand = tl.load(d + 1)
    scratch = tl.load(d + 2)
    chain = tl.load(d + 3)
    winner = tl.load(WINNER + slot)
    if u == 0:
        src = STATE + (cand + winner) * state_stride
        dst = STATE + chain * state_stride
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(dst + cols, tl.load(src + cols, mask=cols < hidden), mask=cols < hidden)
        for k in tl.static_range(W):
            tl.store(TABLE + cand + k, tl.load(TABLE + scratch + winner * W + k))
    else:
        job = u - 1
        kv = job % 2
        layer = (job // 2) % num_layers
        plane = job // (2 * num_layers)
        addr = d + 4 + plane * (1 + W)
        src_addr = tl.load(addr + 1 + winner)
        offset = layer.to(tl.int64) * layer_stride
        if kv == 0:
            _copy_entry(K + offset, addr, src_addr, row_size, W, BLOCK)
        else:
            _copy_entry(V + offset, addr, src_addr, row_size, W, BLOCK)
        if (layer == 0) & (kv == 0):
            stamp = tl.load(STAMPS + src_addr)
            for k in tl.static_range(W + 1):
                tl.store(STAMPS + tl.load(addr + k), stamp)
