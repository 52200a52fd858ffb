"""GPU: the Triton backend against the Torch reference on fresh random paged problems.

Outputs are poisoned (NaN, `poison_output=True`) before each run so an unwritten element fails. Tolerances are
‖out − ref‖ / ‖ref‖: fp32 1e-5 (exact fp32 dots, against
the fp32 reference), bf16 1e-2 (bf16 operands, fp32 accumulation).
"""

from __future__ import annotations

import random

import pytest
import torch

from rlt.attention import KVLayout, create_backend
from rlt.attention.synthetic import random_problem

pytestmark = pytest.mark.gpu

CASES = [
    [(1, 1, 0)], [(4097, 1, 3)] * 2, [(17, 1, 1), (300, 1, 2), (5, 1, 0), (64, 1, 3)],   # decode, page edges
    [(33, 33, 0)], [(100, 37, 2), (9, 9, 0), (1024, 3, 1)],                               # prefill / chunks
    [(32768, 1, 3)], [(4096, 1, 1)] * 64, [(8192, 8192, 0)],                               # Ouro-scale
]


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("layout", [KVLayout.LAST_EXITED, KVLayout.SHARED])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_matches_torch_reference(layout, dtype, tol, case):
    rows = CASES[case]
    big = case >= 5
    nh, nkv, d = (16, 16, 128) if big else random.Random(case).choice([(4, 2, 64), (16, 16, 128), (8, 1, 128)])
    p = random_problem(rows, num_heads=nh, num_kv_heads=nkv, head_dim=d, block_size=16, num_planes=4,
                       layout=layout, dtype=dtype, device="cuda", seed=case * 7 + (layout is KVLayout.SHARED))
    ref = create_backend("torch").forward(p.query, p.kv, p.layer, p.meta, p.scale)
    tri = create_backend("triton", dot_precision="ieee", poison_output=True)
    torch.cuda.synchronize()
    out = tri.forward(p.query, p.kv, p.layer, p.meta, p.scale)
    out2 = tri.forward(p.query, p.kv, p.layer, p.meta, p.scale)  # scratch reuse must not change results
    assert torch.isfinite(out).all()
    assert torch.equal(out, out2)
    assert _rel(out, ref) < tol, _rel(out, ref)
