"""The Triton kernels, run by Triton's interpreter on CPU, against the Torch reference backend.

Random paged problems (rlt.attention.synthetic): every plane of every row sits on its own random
blocks and the whole cache is random, LAST_EXITED history tokens carry random exit depths, so a
kernel reading the wrong plane/page/slot fails. Outputs and split scratch are poisoned with NaN
first (``poison_output``), so a pass also proves every element was written.

Tolerances, as ||out - ref|| / ||ref||: fp32 1e-5 (the kernels accumulate in fp32 with IEEE dots;
the reference is fp32 too, so only summation order differs); fp16 2e-3 and bf16 1e-2 (P and the
output are rounded to the input dtype; measured ~2.4e-4 and ~4.5e-3 on these shapes).
"""

from __future__ import annotations

import attrs
import pytest
import torch

pytest.importorskip("triton")

from rlt.attention import KVLayout  # noqa: E402
from rlt.attention.backends.torch_ref import TorchReferenceBackend  # noqa: E402
from rlt.attention.backends.triton_backend import (  # noqa: E402
    DecodeTiles, PrefillTiles, TritonBackend, decode_tiles_from_env,
)
from rlt.attention.synthetic import random_problem  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
REF = TorchReferenceBackend()
SMALL = dict(prefill_tiles=PrefillTiles(block_m=16, block_n=16), decode_tiles=DecodeTiles(block_n=16),
             split_decode_tiles=DecodeTiles(block_n=16))

# (context incl. new tokens, new tokens, depth). Block size 4: contexts 16/17 end on/after a page
# boundary, 1 is a first token, 64 spans many tiles.
DECODE_ROWS = [(37, 1, 2), (5, 1, 0), (64, 1, 3), (1, 1, 1), (16, 1, 3), (17, 1, 2)]
PREFILL_ROWS = [(50, 50, 3)]
CHUNK_ROWS = [(45, 13, 2), (33, 32, 3)]
MIXED_ROWS = [(37, 5, 2), (5, 1, 0), (64, 17, 3), (20, 20, 1), (9, 1, 3), (16, 4, 0)]
HEADS = {"mha": (4, 4), "gqa2": (4, 2), "gqa3": (6, 2), "mqa": (4, 1)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(rows, heads="mha", layout=KVLayout.LAST_EXITED, dtype=torch.float32, seed=0, head_dim=8,
          block_size=4, history="mixed", **backend_kw):
    nh, nkv = HEADS[heads]
    pb = random_problem(rows, num_heads=nh, num_kv_heads=nkv, head_dim=head_dim, block_size=block_size,
                        num_planes=4, layout=layout, dtype=dtype, seed=seed, history=history, num_layers=2,
                        layer=1)
    want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    got = TritonBackend(poison_output=True, **backend_kw).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not torch.isnan(got).any(), "unwritten (poisoned) output elements"
    err = rel_err(got, want)
    assert err < TOL[dtype], f"rel err {err:.2e}"
    return err


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS, CHUNK_ROWS, MIXED_ROWS],
                         ids=["decode", "prefill", "chunks", "mixed"])
@pytest.mark.parametrize("pre", [False, True], ids=["chained", "pre_resolved"])
def test_matches_reference(rows, heads, layout, pre):
    check(rows, heads, layout, seed=hash((len(rows), heads, layout.value)) % 1000, pre_resolve_decode=pre,
          pre_resolve_prefill=pre, **SMALL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", ["mha", "gqa2"])
def test_half_precision(dtype, heads):
    check(MIXED_ROWS, heads, dtype=dtype, seed=7, **SMALL)
    check(DECODE_ROWS, heads, dtype=dtype, seed=8)


@pytest.mark.parametrize("splits,variant,pre", [
    *[(s, v, p) for s in (1, 2, 3, 8) for v in ("elementwise", "grouped") for p in (False, True)],
    (64, "grouped", True),  # MAX_SPLITS, every merge lane live (slow under the interpreter: one case)
], ids=lambda x: {False: "chained", True: "pre_resolved"}.get(x, x) if isinstance(x, bool) else str(x))
def test_split_kv_decode(splits, variant, pre):
    """Every split count is correct, including more splits than key tiles (empty splits: the rows
    have at most 4 tiles of 16 keys, so 8 and 64 splits leave some empty)."""
    check(DECODE_ROWS, "gqa2", num_splits=splits, decode_variant=variant, pre_resolve_decode=pre, seed=splits,
          **SMALL)


@pytest.mark.parametrize("variant", ["elementwise", "grouped"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads", ["mha", "gqa3"])
def test_heads_fastest_grid_matches_reference(variant, splits, heads):
    """The heads-fastest grid order (``DecodeTiles.heads_fastest``) computes the same rows, split or not."""
    tiles = DecodeTiles(block_n=16, heads_fastest=True)
    check(DECODE_ROWS, heads, num_splits=splits, decode_variant=variant, seed=11 + splits, decode_tiles=tiles,
          split_decode_tiles=tiles)
    check(MIXED_ROWS, heads, num_splits=splits, decode_variant=variant, seed=12 + splits, decode_tiles=tiles,
          split_decode_tiles=tiles, prefill_tiles=PrefillTiles(block_m=16, block_n=16))


def test_decode_tiles_from_env(monkeypatch):
    assert decode_tiles_from_env("") == {}
    assert decode_tiles_from_env("decode=128x8x3x1, split=16x2x4") == {
        "decode_tiles": DecodeTiles(128, 8, 3, True), "split_decode_tiles": DecodeTiles(16, 2, 4, False)}
    for bad in ("decode=64x4", "prefill=64x4x2", "split=64x4x2x1x0", "decode=64xfourx2"):
        with pytest.raises(ValueError, match="RLT_DECODE_TILES entry"):
            decode_tiles_from_env(bad)
    monkeypatch.setenv("RLT_DECODE_TILES", "decode=32x4x3x1")
    backend = TritonBackend()
    assert backend.decode_tiles == DecodeTiles(32, 4, 3, True)
    assert backend.split_decode_tiles == DecodeTiles(32, 4, 3)  # the default for the kind not named
    assert TritonBackend(decode_tiles=DecodeTiles(16)).decode_tiles == DecodeTiles(16)  # arguments win


@pytest.mark.parametrize("variant", ["elementwise", "grouped"])
@pytest.mark.parametrize("heads,splits", [("gqa2", 3), ("mha", 8), ("gqa3", 2)])
def test_folded_merge_is_the_merge_kernel(monkeypatch, variant, heads, splits):
    """rlt.attention.fold: the decode program storing a (row, head)'s last partial merges them itself —
    bit for bit the merge kernel's result (same sums, same order); the counters end at zero. Under the
    interpreter programs run in order, so a fold before the last partial (or none) gives NaN/wrong rows."""
    from rlt.attention import fold

    nh, nkv = HEADS[heads]
    pb = random_problem(MIXED_ROWS, num_heads=nh, num_kv_heads=nkv, head_dim=8, block_size=4, num_planes=4,
                        layout=KVLayout.LAST_EXITED, dtype=torch.float32, seed=splits, num_layers=2, layer=1)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("RLT_FOLD", flag)
        fold.refresh()
        backend = TritonBackend(poison_output=True, num_splits=splits, decode_variant=variant, **SMALL)
        outs[flag] = backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
        assert fold.fold_enabled(pb.query) is (flag == "1")
        (_, _, counters), = backend._scratch.values()
        assert int(counters.abs().sum()) == 0
    monkeypatch.delenv("RLT_FOLD")
    fold.refresh()
    assert not torch.isnan(outs["1"]).any()
    assert torch.equal(outs["1"], outs["0"])
    assert rel_err(outs["1"], REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)) < TOL[torch.float32]


FRESH_ROWS = [(50, 50, 3), (17, 17, 1), (1, 1, 2), (33, 33, 0)]   # prompts' first chunks (no earlier context)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("heads", ["mha", "gqa2"])
@pytest.mark.parametrize("rows", [FRESH_ROWS, MIXED_ROWS, CHUNK_ROWS], ids=["fresh", "mixed", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_prefill_reads_fresh_rows_through_tma_descriptors(layout, heads, rows, dtype):
    """Rows whose context is only their new tokens read K/V densely from the step's K/V (TMA descriptors,
    triton_kernels.dense_prefill); the others stay on the paged kernels, which skip the fresh ones. Against
    the reference, with the output poisoned first (every element written by exactly one of the kernels)."""
    nh, nkv = HEADS[heads]
    pb = random_problem(rows, num_heads=nh, num_kv_heads=nkv, head_dim=16, block_size=4, num_planes=4,
                        layout=layout, dtype=dtype, seed=len(rows), num_layers=2, layer=1)
    flat = lambda t: t[pb.layer].reshape(-1, nkv, 16)  # noqa: E731 - the cache's flat slots
    new_kv = (flat(pb.kv.k)[pb.meta.slot_mapping], flat(pb.kv.v)[pb.meta.slot_mapping])
    backend = TritonBackend(poison_output=True, dense_prefill=True, **SMALL)
    assert backend.takes_new_kv and backend._dense_ready(pb.query, new_kv, pb.kv.k)
    paged_launches = []
    paged = backend._prefill
    backend._prefill = lambda *a, **kw: paged_launches.append(1) or paged(*a, **kw)
    got = backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale, new_kv=new_kv)
    want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    assert not torch.isnan(got).any(), "unwritten (poisoned) output elements"
    assert len(paged_launches) == (0 if pb.meta.fresh else 1)  # every row fresh: the paged kernel is not launched
    assert pb.meta.fresh == (rows is FRESH_ROWS)
    assert rel_err(got, want) < TOL[dtype]
    plain = TritonBackend(poison_output=True, **SMALL).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    assert rel_err(got, plain) < TOL[dtype]


def test_dense_prefill_is_on_unless_refused_and_used_only_where_usable(monkeypatch):
    monkeypatch.delenv("RLT_DENSE_PREFILL", raising=False)
    assert TritonBackend().takes_new_kv is True                      # on by default (measured on the H200)
    monkeypatch.setenv("RLT_DENSE_PREFILL", "0")
    assert TritonBackend().takes_new_kv is False
    assert TritonBackend(dense_prefill=True).takes_new_kv is True    # an explicit argument wins
    monkeypatch.setenv("RLT_DENSE_PREFILL", "1")
    assert TritonBackend().takes_new_kv is True
    q = torch.zeros(8, 2, 16)
    kv = (torch.zeros(8, 1, 16), torch.zeros(8, 1, 16))
    assert TritonBackend._dense_ready(q, kv, torch.zeros(1))
    assert not TritonBackend._dense_ready(q, kv, torch.zeros(1, dtype=torch.bfloat16))  # not the cache's values
    assert not TritonBackend._dense_ready(torch.zeros(8, 2, 24), kv, torch.zeros(1))     # head_dim not a power of 2
    small = (torch.zeros(8, 1, 8), torch.zeros(8, 1, 8))  # tl.dot's K >= 16 (the GPU compile refuses head_dim 8)
    assert not TritonBackend._dense_ready(torch.zeros(8, 2, 8), small, torch.zeros(1))
    assert not TritonBackend._dense_ready(q, (kv[0][:, :, :8], kv[1]), torch.zeros(1))    # shapes differ


def test_auto_split_policy_is_exercised():
    backend = TritonBackend(min_keys_per_split=16)
    cpu = torch.device("cpu")  # the interpreter pretends to have 16 SMs
    assert backend.splits_for(1, 4, 64, cpu) == 4  # few programs: split, >= 16 keys each
    assert backend.splits_for(1, 4, 10, cpu) == 1  # too short to split
    assert backend.splits_for(64, 16, 4096, cpu) == 1  # plenty of programs
    assert TritonBackend().splits_for(1, 16, 32768, cpu) == 4  # 64 programs = 4 per pretend SM
    assert TritonBackend().splits_for(1, 1, 1024, cpu) == 32  # by length: splits of >= 32 keys
    check(DECODE_ROWS, "mha", min_keys_per_split=16, **SMALL)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 160])
def test_head_dims(head_dim):
    check(MIXED_ROWS, "gqa2", head_dim=head_dim, seed=head_dim)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_block_sizes(block_size):
    check(MIXED_ROWS, "mha", block_size=block_size, seed=block_size, **SMALL)
    check(DECODE_ROWS, "gqa2", block_size=block_size, seed=block_size + 1)


def test_default_tiles_many_tiles():
    """Default (GPU) tile sizes, long enough that the unmasked and the masked loop both run."""
    check([(300, 200, 3), (150, 1, 1), (130, 129, 0)], "mha", seed=11)


#: every switch off (the kernel before the switches); each variant below is this plus its switches
OLD = dict(heads_fastest=False, one_loop=False, k_natural=False, fma_scale=False, dot_acc=False, lazy_rescale=False)
VARIANTS = {
    "old": {},
    "heads_fastest": dict(heads_fastest=True),
    "k_natural": dict(k_natural=True),
    "fma_scale": dict(fma_scale=True),
    "dot_acc": dict(dot_acc=True),
    "lazy_rescale": dict(lazy_rescale=True),
    "one_loop": dict(one_loop=True),
    "all": dict(heads_fastest=True, one_loop=True, k_natural=True, fma_scale=True, dot_acc=True, lazy_rescale=True),
}


def _variant_cases():
    """"old" and "all" in every (dtype, heads) combination; each single switch in one of them, in
    turn, so every combination meets several switches (the interpreter is slow: CI time)."""
    combos = [(dtype, heads) for dtype in (torch.float32, torch.bfloat16) for heads in ("mha", "gqa3")]
    for i, variant in enumerate(VARIANTS):
        for dtype, heads in (combos if variant in ("old", "all") else [combos[i % len(combos)]]):
            yield pytest.param(variant, dtype, heads, id=f"{heads}-{str(dtype).split('.')[-1]}-{variant}")


@pytest.mark.parametrize("variant,dtype,heads", list(_variant_cases()))
def test_prefill_variants_match_reference(variant, dtype, heads):
    """Every prefill kernel variant against the reference: mixed rows (decode rows, chunks with
    history, a whole prompt) at 16x16 tiles, so both key loops run many tiles; head_dim 24 also
    takes the masked-head-dim loads."""
    tiles = PrefillTiles(block_m=16, block_n=16, **dict(OLD, **VARIANTS[variant]))
    for head_dim, seed in ((8, 1), (24, 2)):
        check(MIXED_ROWS + PREFILL_ROWS, heads, dtype=dtype, head_dim=head_dim, seed=seed + len(variant),
              prefill_tiles=tiles, fp32_prefill_tiles=tiles, decode_tiles=DecodeTiles(block_n=16))


def test_lazy_rescale_skips_rescales_but_stays_exact():
    """Random scores stay within the threshold of the first tile's max (the no-rescale branch for
    most tiles); keys from position 48 on are scaled up so every later query's max jumps past it
    mid-sequence (the rescale branch after the first tile). bf16 against the fp32 reference."""
    from rlt.attention.gather import key_slots

    pb = random_problem([(96, 96, 3)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, num_planes=4,
                        dtype=torch.bfloat16, seed=9, history="full")
    k = pb.kv.k[pb.layer].view(-1, 2, 16)
    late = key_slots(pb.kv, pb.meta, 96)[0, 48:]
    k[late] = (k[late].float().abs() * 6.0).to(k.dtype)
    q = pb.query.abs()
    tiles = PrefillTiles(block_m=16, block_n=16, lazy_rescale=True, fma_scale=True, dot_acc=True)
    want = REF.forward(q, pb.kv, pb.layer, pb.meta, pb.scale)
    got = TritonBackend(prefill_tiles=tiles, poison_output=True).forward(q, pb.kv, pb.layer, pb.meta, pb.scale)
    assert rel_err(got, want) < TOL[torch.bfloat16]
    # Both branches are taken. Scores in log2 units, [query, key] per head; tile t = keys 16t..16t+15.
    c = pb.scale * 1.4426950408889634
    keys = k[key_slots(pb.kv, pb.meta, 96)[0]].float()  # [96, heads, d]
    sc = torch.einsum("qhd,khd->hqk", q.float(), keys) * c
    sc = sc.masked_fill(torch.ones(96, 96, dtype=torch.bool).triu(1), float("-inf"))

    def growth(q0, t):  # most any row of query block q0..q0+15 gains in key tile t over tiles < t
        before = sc[:, q0:q0 + 16, :16 * t].amax(-1)
        return (sc[:, q0:q0 + 16, 16 * t:16 * t + 16].amax(-1) - before).max().item()

    assert growth(16, 1) <= 8  # no rescale: query block 16..31, its second key tile
    assert growth(48, 3) > 8  # rescale after the first tile: block 48..63 meets the scaled-up keys


def test_lazy_rescale_is_off_for_fp32():
    """The exact fp32 path keeps the eager rescale whatever the tiles say."""
    tiles = PrefillTiles(lazy_rescale=True)
    assert tiles.variant_flags(4)["LAZY_RESCALE"] is False
    assert tiles.variant_flags(2)["LAZY_RESCALE"] is True


def test_last_exited_reads_through_version_map():
    """Changing one history token's stamped depth changes what a deeper query reads (no copies)."""
    pb = random_problem([(12, 1, 3)], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4, num_planes=4,
                        history="full", seed=5)
    backend = TritonBackend()
    before = backend.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    slot0 = int(pb.meta.block_tables[0, 0, 0]) * 4  # token 0, plane 0 slot
    pb.kv.token_depth.view(-1)[slot0] = 0  # token 0 exited after loop 1
    after = backend.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    want = REF.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    assert rel_err(after, want) < 1e-5
    assert rel_err(before, after) > 1e-3


def test_exact_fp32_ignores_platform_tf32():
    # fp32 inputs use IEEE dots unless exact_fp32=False (the interpreter computes exactly either way,
    # so this checks the choice, not the numerics).
    assert TritonBackend(dot_precision="tf32").describe() == "triton (fp32 dots: ieee)"
    assert TritonBackend(dot_precision="tf32", exact_fp32=False).describe() == "triton (fp32 dots: tf32)"
    check(MIXED_ROWS, "gqa2", dot_precision="tf32", exact_fp32=False, seed=3, **SMALL)


def test_fused_kv_write_matches_portable_write():
    pb = random_problem([(10, 3, 1), (7, 7, 2), (4, 1, 0)], num_heads=4, num_kv_heads=2, head_dim=8,
                        block_size=4, num_planes=4, num_layers=3, layer=1, seed=2)
    n = pb.meta.num_tokens
    key, value = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    k0, v0 = pb.kv.k.clone(), pb.kv.v.clone()
    TritonBackend().write_kv(pb.kv, 1, key, value, pb.meta)
    fused_k, fused_v = pb.kv.k.clone(), pb.kv.v.clone()
    pb.kv.k.copy_(k0)
    pb.kv.v.copy_(v0)
    TritonBackend(fused_kv_write=False).write_kv(pb.kv, 1, key, value, pb.meta)
    assert torch.equal(fused_k, pb.kv.k) and torch.equal(fused_v, pb.kv.v)
    assert not torch.equal(fused_k, k0)


def test_fused_kv_write_skips_padding_slots():
    pb = random_problem([(6, 2, 0)], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4, num_planes=1,
                        layout=KVLayout.SHARED, seed=4)
    k0 = pb.kv.k.clone()
    meta = pb.meta
    padded = attrs.evolve(meta, slot_mapping=torch.tensor([int(meta.slot_mapping[0]), -1]))
    key = torch.randn(2, 2, 8)
    TritonBackend().write_kv(pb.kv, 0, key, key, padded)
    flat = pb.kv.k[0].view(-1, 16)
    assert torch.equal(flat[int(meta.slot_mapping[0])], key[0].reshape(-1))
    changed = (pb.kv.k != k0).view(-1, 16).any(1).nonzero().flatten().tolist()
    assert changed == [int(meta.slot_mapping[0])]


def test_rejects_mismatched_dtype():
    pb = random_problem([(5, 1, 0)], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4, num_planes=1,
                        layout=KVLayout.SHARED)
    with pytest.raises(ValueError, match="dtype"):
        TritonBackend().forward(pb.query.half(), pb.kv, 0, pb.meta, pb.scale)


def test_spec_is_honest():
    spec = TritonBackend.spec
    assert spec.graph_safe and spec.packed_prefill and spec.depth_indirection
    spec.check(dtype=torch.bfloat16, head_dim=128, block_size=16)
    spec.check(dtype=torch.float32, head_dim=8, block_size=1)


def test_prefill_tiles_fit_shared_memory():
    """The estimate matches the sm_90 compiler's dynamic shared memory (bf16 128x128x3: 164,864 B;
    fp32 128x64x3: 164,864 B; fp32 128x128x3: 263,168 B, over the 227 KiB limit: the config under
    which the fp32 8K-prefill GPU tests failed in H200 run 3), and every clamped choice fits."""
    from rlt.attention.backends.triton_backend import SHARED_MEMORY_BYTES, _fit_shared, prefill_shared_bytes

    assert prefill_shared_bytes(128, 128, 3, 128, 2) == 164_864
    assert prefill_shared_bytes(128, 128, 3, 128, 4) >= 263_168 > SHARED_MEMORY_BYTES
    assert prefill_shared_bytes(128, 64, 3, 128, 4) == 164_864
    assert prefill_shared_bytes(64, 32, 2, 256, 2) == 66_560 <= 98_304  # compiler: 98,304 (estimate is a floor)
    for block_d in (16, 64, 128, 256):
        for elem in (2, 4):
            bn, st = _fit_shared(128 if block_d <= 128 else 64, 128, 3, block_d, elem)
            assert prefill_shared_bytes(128 if block_d <= 128 else 64, bn, st, block_d, elem) <= SHARED_MEMORY_BYTES
    assert _fit_shared(128, 128, 3, 128, 4) == (128, 2)  # one stage fewer fits
