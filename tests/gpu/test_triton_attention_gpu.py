"""GPU: what tests/gpu/test_attention_gpu.py and test_engine_gpu.py leave out for the Triton backend:
mixed prefill + decode batches (each kernel skips the other's rows), every split-KV count in both
decode variants, graph capture + replay with refilled inputs (no host sync allowed), tf32, the
fused KV write, more head dims / page sizes / GQA ratios, chunked prefill across small pages in
the engine, and bf16 end to end compared with the torch backend by logprobs.

Kernel checks draw fresh random paged problems (rlt.attention.synthetic: each plane of each row on
its own random blocks, random cache, LAST_EXITED history with random exit depths) and poison the
output and split scratch with NaN first, so a pass proves every element was written.

Tolerances, as ||out - ref|| / ||ref|| against the fp32 Torch reference:
  fp32 (IEEE dots, the default for fp32)   2e-5   (summation order only)
  fp32 with tf32 dots (exact_fp32=False)   3e-3   (tf32 operands: ~1e-3 expected)
  fp16                                     3e-3   (P and output rounded to fp16)
  bf16                                     1.2e-2 (P and output rounded to bf16: ~4e-3 expected)
Engine: fp32 greedy tokens and exit depths identical to the in-repo oracle (ARCHITECTURE §5).
bf16 end to end on Ouro-1.4B shapes: see the test's docstring for what is compared.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - the CPU suite deselects gpu tests anyway
    pytest.skip("needs a GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from rlt.attention import KVLayout  # noqa: E402
from rlt.attention.backends.torch_ref import TorchReferenceBackend  # noqa: E402
from rlt.attention.backends.triton_backend import DecodeTiles, PrefillTiles, TritonBackend  # noqa: E402
from rlt.attention.synthetic import random_problem  # noqa: E402

from gpu_helpers import first_token_gap, random_prompts as _prompts, run_backends, run_prompts as _run  # noqa: E402

CUDA = torch.device("cuda")
REF = TorchReferenceBackend()
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.2e-2}

# (context incl. new tokens, new tokens, depth); block 16: 16/17 on/after a page boundary.
DECODE = [(4097, 1, 3), (1, 1, 0), (16, 1, 2), (17, 1, 1), (1000, 1, 3), (2048, 1, 0)]
PREFILL = [(1000, 1000, 3)]
CHUNKS = [(1500, 300, 2), (700, 129, 3)]
MIXED = [(1200, 1, 3), (600, 257, 2), (33, 1, 0), (128, 128, 1), (3000, 1, 2), (90, 31, 3)]
CASES = {"decode": DECODE, "prefill": PREFILL, "chunks": CHUNKS, "mixed": MIXED}


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(rows, *, heads=(16, 16), head_dim=128, block_size=16, layout=KVLayout.LAST_EXITED,
          dtype=torch.bfloat16, seed=0, tol=None, **backend_kw) -> float:
    nh, nkv = heads
    pb = random_problem(rows, num_heads=nh, num_kv_heads=nkv, head_dim=head_dim, block_size=block_size,
                        num_planes=4, layout=layout, dtype=dtype, device=CUDA, num_layers=2, layer=1, seed=seed)
    want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    backend = TritonBackend(poison_output=True, **backend_kw)
    got = backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), "unwritten (poisoned) output elements"
    err = rel_err(got, want)
    print(f"rel_err={err:.3e} rows={rows} heads={heads} d={head_dim} bs={block_size} {layout.value} {dtype}")
    assert err < (tol or TOL[dtype]), f"rel err {err:.2e}"
    return err


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("case", ["mixed", "chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mixed_and_chunked_batches(case, heads, layout, dtype):
    check(CASES[case], heads=heads, layout=layout, dtype=dtype, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("splits", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("variant", ["elementwise", "grouped"])
def test_split_kv_counts(splits, variant):
    check(DECODE, num_splits=splits, decode_variant=variant, seed=splits)


@pytest.mark.parametrize("splits", [1, 7])
@pytest.mark.parametrize("variant", ["elementwise", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_heads_fastest_decode_grid(splits, variant, dtype):
    """``DecodeTiles.heads_fastest`` (grid ``(heads, rows, splits)``) in both decode variants, split or not."""
    tiles = dict(decode_tiles=DecodeTiles(heads_fastest=True),
                 split_decode_tiles=DecodeTiles(block_n=32, num_warps=4, num_stages=3, heads_fastest=True))
    check(DECODE, num_splits=splits, decode_variant=variant, dtype=dtype, seed=40 + splits, **tiles)
    check(MIXED, heads=(16, 4), num_splits=splits, decode_variant=variant, dtype=dtype, seed=41 + splits, **tiles)


@pytest.mark.parametrize("variant", ["elementwise", "grouped"])
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa4"])
def test_folded_merge_matches_merge_kernel(monkeypatch, variant, heads):
    """rlt.attention.fold on the GPU, where split programs run concurrently: the program that stores a
    (row, head)'s last partial merges them (acq_rel ticket, .cg loads) — the merge kernel's values (the same
    sums in the same order, in another kernel whose reductions may be laid out over other threads) and the
    same bits on 50 launches each (a missed ordering shows as a NaN from the poisoned scratch or a wrong row)."""
    from rlt.attention import fold

    for splits in (2, 33, 64):
        pb = random_problem(DECODE, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, block_size=16,
                            num_planes=4, layout=KVLayout.LAST_EXITED, dtype=torch.bfloat16, device=CUDA,
                            num_layers=2, layer=1, seed=splits)
        outs = {}
        for flag in ("0", "1"):
            monkeypatch.setenv("RLT_FOLD", flag)
            fold.refresh()
            backend = TritonBackend(poison_output=True, num_splits=splits, decode_variant=variant)
            outs[flag] = [backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale).clone() for _ in range(50)]
            (_, _, counters), = backend._scratch.values()
            torch.cuda.synchronize()
            assert int(counters.abs().sum()) == 0
        monkeypatch.delenv("RLT_FOLD")
        fold.refresh()
        assert not torch.isnan(outs["1"][0]).any()
        err = rel_err(outs["1"][0], outs["0"][0])  # same sums in the same order, possibly other threads' layout
        print(f"folded merge vs merge kernel: splits {splits} rel_err {err:.2e}")
        assert err < 1e-3, (splits, err)
        for got in outs["1"][1:]:
            assert torch.equal(got, outs["1"][0]), splits  # deterministic whichever program arrives last


@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_prefill_against_reference(heads, dtype):
    """Fresh prompt rows read their keys densely through TMA (RLT_DENSE_PREFILL's path): an 8K prompt and
    a mixed batch (fresh rows, rows with history, decode rows) against the reference, poisoned output."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90")
    for rows, seed in (([(8192, 8192, 3)], 1), (MIXED + [(700, 700, 1), (129, 129, 0)], 2)):
        pb = random_problem(rows, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, block_size=16,
                            num_planes=4, layout=KVLayout.LAST_EXITED, dtype=dtype, device=CUDA, num_layers=2, layer=1,
                            seed=seed)
        flat = lambda t: t[pb.layer].reshape(-1, heads[1], 128)  # noqa: E731
        new_kv = (flat(pb.kv.k)[pb.meta.slot_mapping], flat(pb.kv.v)[pb.meta.slot_mapping])
        backend = TritonBackend(poison_output=True, dense_prefill=True)
        assert backend._dense_ready(pb.query, new_kv, pb.kv.k)
        got = backend.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale, new_kv=new_kv)
        want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
        torch.cuda.synchronize()
        assert not torch.isnan(got).any()
        err = rel_err(got, want)
        print(f"dense prefill rel_err={err:.3e} rows={len(rows)} heads={heads} {dtype}")
        assert err < TOL[dtype], err


def test_one_long_row_uses_splits():
    backend = TritonBackend()
    assert backend.splits_for(1, 16, 32768, CUDA) > 16
    check([(32768, 1, 3)], seed=5)


def test_other_shapes():
    check(MIXED, heads=(16, 16), head_dim=64, block_size=64, seed=1)
    check(MIXED, heads=(12, 4), head_dim=96, block_size=32, seed=2)
    check(MIXED, dtype=torch.float16, seed=3)
    check(MIXED, heads=(8, 1), block_size=128, seed=4, prefill_tiles=PrefillTiles(block_m=64, block_n=32, num_warps=4))
    check(MIXED, heads=(8, 8), head_dim=256, seed=5)  # the spec's largest head dim: tiles must fit shared memory
    check(MIXED, seed=6, pre_resolve_decode=False, pre_resolve_prefill=False)  # the chained-lookup path


def test_tf32_when_allowed():
    check(MIXED, dtype=torch.float32, dot_precision="tf32", exact_fp32=False, tol=3e-3, seed=6)


def test_fused_kv_write_matches_portable():
    pb = random_problem([(40, 17, 1), (9, 1, 3)], num_heads=16, num_kv_heads=16, head_dim=128, block_size=16,
                        num_planes=4, dtype=torch.bfloat16, device=CUDA, num_layers=2, layer=1)
    n = pb.meta.num_tokens
    key = torch.randn(n, 16, 128, device=CUDA, dtype=torch.bfloat16)
    value = torch.randn(n, 16, 128, device=CUDA, dtype=torch.bfloat16)
    k0, v0 = pb.kv.k.clone(), pb.kv.v.clone()
    TritonBackend().write_kv(pb.kv, 1, key, value, pb.meta)
    fk, fv = pb.kv.k.clone(), pb.kv.v.clone()
    pb.kv.k.copy_(k0)
    pb.kv.v.copy_(v0)
    TritonBackend(fused_kv_write=False).write_kv(pb.kv, 1, key, value, pb.meta)
    assert torch.equal(fk, pb.kv.k) and torch.equal(fv, pb.kv.v) and not torch.equal(fk, k0)


@pytest.mark.parametrize("rows", [[(3000, 1, 3), (17, 1, 1)], [(3000, 1, 3), (500, 64, 2), (2000, 1, 1)]],
                         ids=["decode-split", "mixed"])
def test_graph_capture_and_replay_with_new_inputs(rows):
    """Capture one forward in a CUDA graph (no host sync allowed), refill every input in place
    (query, K/V, version map, context lengths), replay, and compare with the reference on the
    new inputs: the kernels read everything from device memory at replay."""
    pb = random_problem(rows, num_heads=16, num_kv_heads=16, head_dim=128, block_size=16, num_planes=4,
                        dtype=torch.bfloat16, device=CUDA, seed=11)
    backend = TritonBackend()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: JIT compile, scratch allocation
        backend.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            static_out = backend.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gen = torch.Generator(device=CUDA).manual_seed(12)
    pb.query.copy_(torch.randn(pb.query.shape, generator=gen, device=CUDA))
    pb.kv.k.copy_(torch.randn(pb.kv.k.shape, generator=gen, device=CUDA))
    pb.kv.v.copy_(torch.randn(pb.kv.v.shape, generator=gen, device=CUDA))
    pb.kv.token_depth.random_(0, 4, generator=gen)
    qlen = (pb.meta.query_start_loc[1:] - pb.meta.query_start_loc[:-1])
    shorter = torch.maximum(qlen, (pb.meta.seq_lens.float() * 0.6).int())
    pb.meta.seq_lens.copy_(shorter)  # the host bound max_seq_len stays a valid upper bound
    graph.replay()
    torch.cuda.synchronize()
    want = REF.forward(pb.query, pb.kv, 0, pb.meta, pb.scale)
    err = rel_err(static_out, want)
    print(f"graph replay rel_err={err:.3e}")
    assert err < TOL[torch.bfloat16]


def test_selection_on_this_gpu_prefers_triton_for_last_exited():
    from rlt.platform.attention_select import select_attention
    from rlt.platform.platforms import detect_platform

    sel = select_attention(detect_platform("auto"), "auto", dtype=torch.bfloat16, head_dim=128, block_size=16,
                           kv_layout=KVLayout.LAST_EXITED)
    print("auto selection:", sel)
    assert sel.name == "triton"


# -- engine ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend, layout, kw", [
    ("triton", "last_exited", dict(seed=71)),
    ("triton", "shared", dict(seed=72)),
    ("triton", "last_exited", dict(seed=73, num_attention_heads=4, num_key_value_heads=4, head_dim=16)),
    ("triton", "last_exited", dict(seed=74, gate_bias=1.5)),  # adaptive exits: mixed-depth history
    ("torch", "last_exited", dict(seed=74, gate_bias=1.5)),   # control for the rest of the GPU path
    ("triton-dense", "last_exited", dict(seed=75, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    ("triton-fold", "last_exited", dict(seed=76, hidden_size=512, intermediate_size=1024, head_dim=32,
                                        num_attention_heads=16, num_key_value_heads=8)),
])
def test_engine_fp32_chunked_prefill_small_pages(tiny_checkpoint, backend, layout, kw, monkeypatch):
    """Prompts up to 40 tokens in chunks of <= 48 batched tokens over 4-token pages: rows with history,
    mixed prefill + decode steps, page boundaries; greedy tokens and exit depths equal the oracle.
    ``triton``: every prompt row on the paged kernel (RLT_DENSE_PREFILL=0); ``triton-dense``: the default, fresh
    prompt rows' keys read densely."""
    from rlt.platform import EngineConfig, LLMEngine, SamplingParams

    monkeypatch.setenv("RLT_DENSE_PREFILL", "0" if backend == "triton" else "1")
    if backend == "triton-dense":
        backend = "triton"
    if backend == "triton-fold":  # every last-arriver fold engaged (K ranges short enough to split here)
        from rlt.attention import fold
        from rlt.platform.models import fused_linear

        monkeypatch.setenv("RLT_FOLD", "1")
        monkeypatch.setattr(fused_linear, "MIN_TILE_SPLIT_K", 256)
        monkeypatch.setattr(fused_linear, "MIN_SPLIT_K", 128)
        fold.refresh()
        backend = "triton"
    from rlt.platform.checkpoint import load_checkpoint
    from rlt.platform.models.ouro_reference import reference_generate

    adaptive = "gate_bias" in kw
    path = tiny_checkpoint(**kw)
    tau = 0.5 if adaptive else 1.0
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", attention_backend=backend,
                                    kv_layout=layout, block_size=4, max_num_batched_tokens=48))
    assert engine.selection.name == backend
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=tau)
    prompts = _prompts(6, 320, kw["seed"])
    outs = _run(engine, prompts, sp)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    depths_seen = set()
    for p, o in zip(prompts, outs):
        want, depths = reference_generate(ref, p, max_tokens=8, layout=layout, exit_threshold=tau)
        assert list(o.token_ids) == want, f"prompt {p}"
        assert list(o.exit_depths) == depths
        depths_seen.update(depths)
    if adaptive:
        assert len(depths_seen) > 1, "the adaptive case should exit at several depths"


def test_engine_bf16_ouro_1p4b_shapes(tmp_path):
    """bf16 end to end on Ouro-1.4B shapes (24 layers x 4 loops, hidden 2048, 16 x 128 MHA, random
    weights): prompts crossing pages and prefill chunks, mixed prefill + decode steps. Compared with
    the same engine on the torch backend by the first generated token's top-5 logprobs (identical
    inputs; only attention numerics differ): max |difference| over shared tokens < 0.15 nat. Later
    tokens may legitimately diverge (random weights make near-ties), so their agreement is reported,
    not asserted."""
    from rlt.platform import SamplingParams
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ouro-1.4b-shapes", seed=7, hidden_size=2048, intermediate_size=5632,
                                 num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                                 max_position_embeddings=4096, total_ut_steps=4, torch_dtype="bfloat16")
    prompts = _prompts(6, 320, 5, lo=20, hi=900)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    results = run_backends(path, prompts, sp, ("triton", "torch"), dtype="bfloat16", block_size=16,
                           max_model_len=2048, num_kv_blocks=4096, max_num_seqs=8, max_num_batched_tokens=1024)
    assert all(len(o.token_ids) == 12 for o in results["triton"])
    worst, agree, total = first_token_gap(results["triton"], results["torch"])
    print(f"bf16 1.4B-shapes: first-token top-5 logprob max |diff| = {worst:.4f} nat; "
          f"greedy prefix agreement {agree}/{total} tokens")
    assert worst < 0.15
