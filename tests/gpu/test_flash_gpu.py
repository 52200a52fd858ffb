"""GPU: the FlashAttention adapters (FA4 / FA3 / FA2) against the installed packages.

Each adapter runs only where its package imports (an explicit environment skip otherwise; the
H200 run carries the FA4 wheels, see scripts/gpu_suite.sh). What is checked:

* kernels: fresh random paged problems (rlt.attention.synthetic) with fixed-depth history
  (``history="full"``: every context token reached the deepest plane, which is when one page
  table per row is exact under LAST_EXITED) and under SHARED — decode rows with long contexts,
  packed prefill and mixed prefill + decode batches with history, across page boundaries; ‖out − ref‖ / ‖ref‖ against the fp32 Torch reference below
  the bf16 tolerance of the Triton suite (1.2e-2: P and output rounded to bf16, ~4e-3 expected);
* ``strict=True`` refuses a batch whose history exited shallower than the query row;
* the engine with ``fixed_depth=True``, the adapter alone and paired with Triton (the adapter for
  steps with prompt chunks + Triton for decode-only steps: what auto picks), in bf16: the first generated token's
  top-5 logprobs within 0.15 nat of the Triton backend on the same random weights (only attention
  numerics differ); later-token agreement is reported.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - the CPU suite deselects gpu tests anyway
    pytest.skip("needs a GPU", allow_module_level=True)

from rlt.attention import BACKENDS, KVLayout, create_backend  # noqa: E402
from rlt.attention.backends.torch_ref import TorchReferenceBackend  # noqa: E402
from rlt.attention.synthetic import random_problem  # noqa: E402

from gpu_helpers import FA_BF16_BOUND_NAT, first_token_gap, random_prompts, run_backends  # noqa: E402

CUDA = torch.device("cuda")
REF = TorchReferenceBackend()
TOL_BF16 = 1.2e-2
BLOCK = {"fa4": 16, "fa3": 16, "fa2": 256}

# (context incl. new tokens, new tokens, depth)
DECODE = [(4097, 1, 3), (1, 1, 0), (17, 1, 1), (1000, 1, 3), (2048, 1, 2)]
PREFILL = [(1000, 1000, 3), (77, 77, 0)]
MIXED = [(1200, 1, 3), (600, 257, 2), (33, 1, 0), (128, 128, 1), (3000, 1, 2), (90, 31, 3)]
CASES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}


def _available(name: str) -> bool:
    return not BACKENDS[name].missing_modules()


FLASH = [pytest.param(n, marks=pytest.mark.skipif(not _available(n), reason=f"{n} not importable here"))
         for n in ("fa4", "fa3", "fa2")]


def _problem(rows, name, layout, heads, history="full", seed=0):
    nh, nkv = heads
    return random_problem(rows, num_heads=nh, num_kv_heads=nkv, head_dim=128, block_size=BLOCK[name],
                          num_planes=4, layout=layout, dtype=torch.bfloat16, device=CUDA, num_layers=2, layer=1,
                          history=history, seed=seed)


@pytest.mark.parametrize("name", FLASH)
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_matches_reference(name, layout, heads, case):
    pb = _problem(CASES[case], name, layout, heads, seed=random.randrange(1 << 30))
    want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    got = create_backend(name, strict=True).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    print(f"{name} {case} {layout.value} heads={heads}: rel_err={err:.3e}")
    assert err < TOL_BF16


@pytest.mark.parametrize("name", FLASH)
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa4"])
def test_flash_dense_fresh_rows_match_reference_and_paged(name, layout, heads):
    """Fresh prompt rows through the dense varlen call over the step's K/V (``dense_fresh``): within the bf16
    bound of the reference, and of the paged call on the same data."""
    pb = _problem([(8192, 8192, 3), (1000, 1000, 0), (77, 77, 2), (1, 1, 1)], name, layout, heads,
                  seed=random.randrange(1 << 30))
    assert pb.meta.fresh
    flat = lambda t: t[pb.layer].reshape(-1, *t.shape[-2:])  # noqa: E731
    new_kv = (flat(pb.kv.k)[pb.meta.slot_mapping], flat(pb.kv.v)[pb.meta.slot_mapping])
    want = REF.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    dense = create_backend(name, dense_fresh=True).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale,
                                                           new_kv=new_kv)
    paged = create_backend(name, dense_fresh=False).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale,
                                                            new_kv=new_kv)
    torch.cuda.synchronize()
    for got in (dense, paged):
        assert not torch.isnan(got).any()
    err = ((dense.float() - want.float()).norm() / want.float().norm()).item()
    vs_paged = ((dense.float() - paged.float()).norm() / paged.float().norm()).item()
    print(f"{name} dense fresh {layout.value} heads={heads}: rel_err={err:.3e}, vs paged {vs_paged:.3e}")
    assert err < TOL_BF16 and vs_paged < TOL_BF16


@pytest.mark.parametrize("name", FLASH)
def test_flash_strict_refuses_shallower_history(name):
    pb = _problem(MIXED, name, KVLayout.LAST_EXITED, (16, 16), history="mixed", seed=3)
    with pytest.raises(RuntimeError, match="exited shallower"):
        create_backend(name, strict=True).forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)


@pytest.mark.parametrize("name", FLASH)
def test_engine_fixed_depth_bf16_flash_vs_triton(tmp_path, name):
    from rlt.platform import SamplingParams
    from rlt.platform.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ouro-wide", seed=9, hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=4096, total_ut_steps=4, torch_dtype="bfloat16")
    prompts = random_prompts(6, 320, 11, lo=20, hi=700)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    pair = f"{name}+triton"
    results = run_backends(path, prompts, sp, (name, pair, "triton"), dtype="bfloat16", block_size=BLOCK[name],
                           max_model_len=2048, num_kv_blocks=2048 if name != "fa2" else 160, max_num_seqs=8,
                           max_num_batched_tokens=1024, fixed_depth=True)
    for backend in (name, pair):
        worst, agree, total = first_token_gap(results[backend], results["triton"])
        print(f"{backend} ({name}) vs triton, bf16: first-token top-5 logprob max |diff| = {worst:.4f} nat; "
              f"greedy prefix agreement {agree}/{total}")
        assert worst < FA_BF16_BOUND_NAT


@pytest.mark.skipif(not _available("fa4"), reason="fa4 not importable here")
def test_auto_under_fixed_depth_pairs_fa4_with_triton():
    from rlt.platform.attention_select import select_attention
    from rlt.platform.platforms import detect_platform

    sel = select_attention(detect_platform("auto"), "auto", dtype=torch.bfloat16, head_dim=128, block_size=16,
                           kv_layout=KVLayout.LAST_EXITED, adaptive_exit=False)
    print("auto selection under fixed depth:", sel)
    assert sel.name == "fa4+triton"
