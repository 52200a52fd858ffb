"""The eager backends against a naive per-row statement of the semantics.

Random paged layouts (shuffled blocks, rows crossing page boundaries), mixed depths, stamped exit
depths (LAST_EXITED indirection) and the SHARED layout; the naive version walks every row, query
and key in Python, so it shares no indexing code with the backends.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlt.attention import AttentionMetadata, KVCache, KVLayout, create_backend
from rlt.attention.kv_cache import portable_row_scatter


def make_case(seed, layout=KVLayout.LAST_EXITED, planes=3, nh=4, nkv=2, d=8, bs=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(1, 5)):
        q = rng.choice([1, 1, rng.randint(2, 9)])
        hist = rng.randint(0, 11)
        rows.append((hist, q, rng.randrange(planes if layout is KVLayout.LAST_EXITED else 1)))
    pages = max(-(-(h + q) // bs) for h, q, _ in rows)
    p = planes if layout is KVLayout.LAST_EXITED else 1
    nblocks = len(rows) * p * pages + 3
    perm = torch.randperm(nblocks, generator=g)
    tables = perm[: len(rows) * p * pages].view(len(rows), p, pages).int()
    kv = KVCache.allocate(num_layers=2, num_blocks=nblocks, block_size=bs, num_kv_heads=nkv, head_dim=d,
                          num_planes=planes, layout=layout, dtype=dtype, device="cpu")
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    if kv.token_depth is not None:
        kv.token_depth.copy_(torch.randint(0, planes, kv.token_depth.shape, generator=g))
    qsl, seq, depth, slots, plane0, tqd, pos = [0], [], [], [], [], [], []
    for r, (h, q, dd) in enumerate(rows):
        qsl.append(qsl[-1] + q)
        seq.append(h + q)
        depth.append(dd)
        for t in range(h, h + q):
            blk = int(tables[r, dd if p > 1 else 0, t // bs])
            slots.append(blk * bs + t % bs)
            plane0.append(int(tables[r, 0, t // bs]) * bs + t % bs)
            tqd.append(dd)
            pos.append(t)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
        query_depth=torch.tensor(depth, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots), plane0_slot_mapping=torch.tensor(plane0),
        token_query_depth=torch.tensor(tqd, dtype=torch.int32), positions=torch.tensor(pos),
        max_query_len=max(q for _, q, _ in rows), max_seq_len=max(seq), layout=layout)
    # the step stamps its own tokens' depth before running (kv_cache docstring)
    kv.stamp_depth(meta.plane0_slot_mapping, meta.token_query_depth)
    query = torch.randn(meta.num_tokens, nh, d, generator=g).to(dtype)
    return kv, meta, query, rows, tables


def naive(kv, meta, query, rows, tables, layer, scale):
    bs = kv.block_size
    nh, d = query.shape[1], query.shape[2]
    g = nh // kv.k.shape[3]
    out = torch.zeros(query.shape[0], nh * d)
    tok = 0
    for r, (h, q, dd) in enumerate(rows):
        for i in range(q):
            qpos = h + i
            ks, vs = [], []
            for j in range(qpos + 1):
                b0 = int(tables[r, 0, j // bs])
                if kv.layout is KVLayout.SHARED:
                    plane = 0
                else:
                    plane = min(dd, int(kv.token_depth[b0, j % bs]))
                blk = int(tables[r, plane, j // bs])
                ks.append(kv.k[layer, blk, j % bs].double())
                vs.append(kv.v[layer, blk, j % bs].double())
            k = torch.stack(ks).repeat_interleave(g, dim=1)  # [C, nh, d]
            v = torch.stack(vs).repeat_interleave(g, dim=1)
            s = torch.einsum("hd,chd->hc", query[tok + i].double(), k) * scale
            out[tok + i] = torch.einsum("hc,chd->hd", torch.softmax(s, -1), v).reshape(-1).float()
        tok += q
    return out


@pytest.mark.parametrize("layout", [KVLayout.LAST_EXITED, KVLayout.SHARED])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("backend", ["torch", "ascend_eager"])
def test_backend_matches_naive_fp32(layout, seed, backend):
    kv, meta, q, rows, tables = make_case(seed, layout, nkv=[1, 2, 4][seed % 3])
    be = create_backend(backend)
    for layer in (0, 1):
        out = be.forward(q, kv, layer, meta, 8 ** -0.5)
        ref = naive(kv, meta, q, rows, tables, layer, 8 ** -0.5)
        assert out.shape == ref.shape and out.dtype == q.dtype
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5)


def test_last_exited_reads_min_of_query_and_exit_depth():
    """A key stamped at depth 0 is read from plane 0 even by a depth-2 query; poisoning plane 2 proves it."""
    kv, meta, q, rows, tables = make_case(3, KVLayout.LAST_EXITED)
    be = create_backend("torch")
    before = be.forward(q, kv, 0, meta, 0.3)
    history = torch.ones_like(kv.token_depth, dtype=torch.bool)
    history.view(-1)[meta.plane0_slot_mapping] = False
    kv.token_depth[history] = 0  # every history token exited at depth 0
    for r in range(tables.shape[0]):
        for pl in range(1, tables.shape[1]):
            for b in tables[r, pl].tolist():
                # plane >= 1 blocks hold only the running chunk's own tokens now; poison the rest
                mask = history[b]
                kv.k[:, b][:, mask] = 1e4
    after = be.forward(q, kv, 0, meta, 0.3)
    assert torch.isfinite(after).all()
    ref = naive(kv, meta, q, rows, tables, 0, 0.3)
    assert torch.allclose(after, ref, atol=2e-5)
    assert not torch.allclose(before, after)


def test_ascend_eager_rounding_order_bf16():
    """bf16: scores rounded, then scaled (rounded), fp32 softmax cast to bf16, PV in bf16 (HF eager)."""
    kv, meta, q, rows, tables = make_case(5, KVLayout.SHARED, dtype=torch.bfloat16)
    out = create_backend("ascend_eager").forward(q, kv, 0, meta, 8 ** -0.5)
    tok = 0
    g = q.shape[1] // kv.k.shape[3]
    for r, (h, n, _) in enumerate(rows):
        c = h + n
        slots = [int(tables[r, 0, j // 4]) * 4 + j % 4 for j in range(c)]
        k = kv.k[0].view(-1, kv.k.shape[3], 8)[slots].repeat_interleave(g, 1).transpose(0, 1)
        v = kv.v[0].view(-1, kv.k.shape[3], 8)[slots].repeat_interleave(g, 1).transpose(0, 1)
        qq = q[tok:tok + n].transpose(0, 1)
        s = torch.matmul(qq, k.transpose(1, 2)) * 8 ** -0.5
        mask = torch.zeros(n, c, dtype=torch.bfloat16)
        mask[torch.arange(c)[None, :] > (h + torch.arange(n))[:, None]] = torch.finfo(torch.bfloat16).min
        p = torch.softmax(s + mask, -1, dtype=torch.float32).to(torch.bfloat16)
        want = torch.matmul(p, v).transpose(0, 1).reshape(n, -1)
        assert torch.equal(out[tok:tok + n], want)
        tok += n
    fp32 = create_backend("torch").forward(q.float(), _as_fp32(kv), 0, meta, 8 ** -0.5)
    rel = (out.float() - fp32).norm() / fp32.norm()
    assert rel < 2e-2  # bf16 operands: ||out - ref|| / ||ref|| below 2e-2


def _as_fp32(kv):
    return KVCache(k=kv.k.float(), v=kv.v.float(), token_depth=kv.token_depth, layout=kv.layout, num_planes=kv.num_planes)


def test_kv_write_and_stamp():
    kv = KVCache.allocate(num_layers=2, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=2, num_planes=2,
                          layout=KVLayout.LAST_EXITED, dtype=torch.float32, device="cpu")
    kv.write(1, torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]]), torch.zeros(2, 1, 2), torch.tensor([5, 0]))
    assert kv.k[1].view(-1, 2)[5].tolist() == [1.0, 2.0] and kv.k[1].view(-1, 2)[0].tolist() == [3.0, 4.0]
    assert kv.k[0].abs().sum() == 0
    kv.stamp_depth(torch.tensor([1, 4]), torch.tensor([1, 0]))
    assert kv.token_depth.view(-1).tolist() == [0, 1, 0, 0, 0, 0]
    calls = []
    kv.write(0, torch.ones(1, 1, 2), torch.ones(1, 1, 2), torch.tensor([2]),
             lambda dst, idx, rows: (calls.append(idx.tolist()), portable_row_scatter(dst, idx, rows)))
    assert calls == [[2], [2]]


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("nope")
