"""The prefill+decode pair: which backend serves which step, who writes K/V, and equal results."""

from __future__ import annotations

import pytest
import torch

from rlt.attention import BackendSpec, KVLayout
from rlt.attention.backends.prefill_decode import PrefillDecodeBackend, combined_spec
from rlt.attention.backends.torch_ref import TorchReferenceBackend
from rlt.attention.synthetic import random_problem


class Recording(TorchReferenceBackend):
    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log

    def write_kv(self, kv, layer, key, value, meta):
        self.log.append((self.name, "write"))
        super().write_kv(kv, layer, key, value, meta)

    def forward(self, query, kv, layer, meta, scale):
        self.log.append((self.name, "forward"))
        return super().forward(query, kv, layer, meta, scale)


@pytest.mark.parametrize("rows,expect", [
    ([(9, 1, 2), (30, 1, 0)], "decode"),            # decode-only step
    ([(12, 12, 3)], "prefill"),                     # a prompt chunk
    ([(9, 1, 2), (20, 7, 1), (5, 1, 0)], "prefill"),  # mixed: the prefill backend takes the whole step
])
def test_step_goes_to_one_backend_and_results_match(rows, expect):
    log = []
    pair = PrefillDecodeBackend(Recording("prefill", log), Recording("decode", log))
    pb = random_problem(rows, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, num_planes=4,
                        layout=KVLayout.LAST_EXITED, seed=5)
    got = pair.forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    want = TorchReferenceBackend().forward(pb.query, pb.kv, pb.layer, pb.meta, pb.scale)
    assert log == [(expect, "forward")]
    assert torch.equal(got, want)
    k = torch.randn(pb.query.shape[0], 2, 16)
    pair.write_kv(pb.kv, pb.layer, k, k, pb.meta)
    assert log[-1] == ("decode", "write")  # one writer owns the cache in every step


def test_combined_spec_is_what_both_support():
    a = BackendSpec(dtypes=frozenset({torch.bfloat16, torch.float16}), head_dims=frozenset({64, 128}),
                    block_size_multiple=16, packed_prefill=True, graph_safe=False, depth_indirection=False)
    b = BackendSpec(dtypes=None, head_dims=frozenset({128, 256}), block_size_multiple=4, graph_safe=True)
    c = combined_spec(a, b)
    assert c.dtypes == a.dtypes and c.head_dims == frozenset({128}) and c.block_size_multiple == 16
    assert c.graph_safe and c.packed_prefill and not c.depth_indirection
    assert PrefillDecodeBackend(Recording("p", []), Recording("d", [])).name == "p+d"
