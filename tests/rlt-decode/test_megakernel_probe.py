"""The persistent GEMV-chain probe's bookkeeping (benchmarks/megakernel): the packed weight layout and
the kernel's tile dealing, emulated in torch on CPU, give the reference chain's output — so a device
call of the probe only has the bulk copies, mbarriers and grid barrier left to get right."""

from __future__ import annotations

import pytest
import torch

from benchmarks.megakernel import probe


def _layers(hidden: int, inter: int, count: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [probe.random_layer(hidden, inter, "cpu", g) for _ in range(count)]


def test_the_random_chain_stays_finite_over_24_layers():
    """No norms in the probe's chain: the weights' scales keep 24 layers' residual finite and moderate (the
    first lease's unscaled weights overflowed to NaN, which hid the correctness check)."""
    out = probe.reference(torch.randn(512, generator=torch.Generator().manual_seed(2)), _layers(512, 1536, 24))
    assert torch.isfinite(out).all() and out.abs().max().item() < 1e6


@pytest.mark.parametrize("ctas,kv_tiles", [(1, 0), (5, 0), (7, 0), (5, 6)])
def test_emulated_kernel_is_the_reference_chain(ctas, kv_tiles):
    """With and without the attention stand-in's stages between q/k/v and o_proj (its sums are not used)."""
    hidden, inter, count = 512, 1536, 2
    layers = _layers(hidden, inter, count)
    kv = torch.randn(kv_tiles * probe.ROWS, probe.CK).to(torch.bfloat16) if kv_tiles else None
    packed = torch.cat([probe.pack_layer(*ws, kv=kv) for ws in layers])
    assert packed.numel() == count * probe.layer_stages(hidden, inter, kv_tiles) * probe.STAGE_ELEMS
    x = torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    ref = probe.reference(x, layers)
    out = probe.emulate(packed, x, hidden, inter, count, ctas, kv_tiles)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_gate_and_up_rows_are_paired_in_each_tile():
    """A tile of the gate/up phase holds 8 gate rows and the same 8 up rows (the epilogue pairs them)."""
    hidden, inter = 512, 512
    ws = [torch.zeros(n, k, dtype=torch.bfloat16)
          for n, k in ((3 * hidden, hidden), (hidden, hidden), (inter, hidden), (inter, hidden), (hidden, inter))]
    ws[2][:, 0] = torch.arange(inter, dtype=torch.bfloat16)  # gate row j: j in column 0
    ws[3][:, 0] = -torch.arange(inter, dtype=torch.bfloat16)  # up row j: -j
    packed = probe.pack_layer(*ws).reshape(-1, probe.ROWS, probe.CK)
    ph = probe.phases(hidden, inter)[probe.GATE_UP]
    tile = 3
    first = packed[ph["stage0"] + tile * ph["chunks"]]
    rows = torch.arange(tile * 8, tile * 8 + 8, dtype=torch.bfloat16)
    assert torch.equal(first[:8, 0], rows) and torch.equal(first[8:, 0], -rows)


def test_shapes_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="multiples of 512"):
        probe.check_shape(2048, 5600)
    with pytest.raises(ValueError, match="at most"):
        probe.check_shape(2048, 8192)
    probe.check_shape(2048, 5632)  # Ouro-1.4B
