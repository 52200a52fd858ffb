"""The decode kernels (and the dense prefill kernel) compiled for sm_90 (no GPU: ``sass_sm90.py``): properties of the machine code that no
CPU run can observe and that the GPU tests only see as speed — weight prefetches issued before
``griddepcontrol.wait`` (``rlt.attention.pdl``), the folds' release fence / GPU-scope atomic /
L1-bypassing loads (``rlt.attention.fold``), and no spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def sass() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("sass_sm90.py"))], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    if not result:
        pytest.skip("this Triton wheel ships no cuobjdump")
    return result


def index_of(ops: list[str], needle: str) -> list[int]:
    return [i for i, op in enumerate(ops) if needle in op]


@pytest.mark.parametrize("kernel", ["split_k", "silu_mul", "rope_kv"])
def test_weight_prefetch_is_issued_before_the_pdl_wait(sass, kernel):
    ops = sass[kernel + "/prefetch"]["ops"]
    prefetches, waits = index_of(ops, "CCTL.E.PF2"), index_of(ops, "ACQBULK")  # prefetch.global.L2, griddepcontrol.wait
    loads = index_of(ops, "LDG")
    assert prefetches and len(waits) == 1, (len(prefetches), waits)
    assert max(prefetches) < waits[0] < min(loads)  # every prefetch before the wait; no load before it
    assert sass[kernel + "/prefetch"]["local"] == 0
    assert not index_of(sass[kernel + "/plain"]["ops"], "CCTL.E.PF2")


def _ticket_then_l2_reads(ops: list[str]) -> None:
    atomic = index_of(ops, "ATOMG.E.ADD.STRONG.GPU")  # the ticket (atom.add.acq_rel.gpu)
    assert len(atomic) == 1
    fences = [i for i in index_of(ops, "MEMBAR.ALL.GPU") if i < atomic[0]]           # release: before it
    invalidates = [i for i in index_of(ops, "CCTL.IVALL") if i > atomic[0]]         # acquire: L1 dropped after
    reads = [i for i in index_of(ops, "STRONG.GPU") if "LDG" in ops[i]]             # the pieces, from L2
    assert fences and invalidates and reads and min(reads) > atomic[0]


def test_split_k_fold_orders_its_ticket(sass):
    _ticket_then_l2_reads(sass["split_k/fold"]["ops"])
    assert sass["split_k/fold"]["local"] == 0


def test_decode_attention_fold_orders_its_ticket(sass):
    _ticket_then_l2_reads(sass["decode/fold"]["ops"])
    assert sass["decode/fold"]["local"] == 0


@pytest.mark.parametrize("kernel", ["silu_mul", "rope_kv"])
def test_split_tile_fold_orders_its_ticket(sass, kernel):
    _ticket_then_l2_reads(sass[kernel + "/fold"]["ops"])
    assert sass[kernel + "/fold"]["local"] == 0


def test_dense_prefill_loads_tiles_with_tma_and_chains_its_mma(sass):
    """dense_prefill: Q/K/V tiles by TMA (UTMALDG), none by cp.async gathers; the QK and PV wgmma chains
    wait twice in all (no ptxas serialisation after every HGMMA, paged_prefill's C7515 finding); no spills."""
    ops = sass["prefill/dense"]["ops"]
    assert index_of(ops, "UTMALDG") and not index_of(ops, "LDGSTS")
    assert len(index_of(ops, "HGMMA")) >= 16 and len(index_of(ops, "WARPGROUP.DEPBAR")) <= 2
    assert sass["prefill/dense"]["local"] == 0


def test_dense_prefill_compiles_for_every_head_dim_the_backend_sends_it(sass, monkeypatch):
    """head_dim 16 (the smallest ``TritonBackend._dense_ready`` accepts) compiles for sm_90 in bf16 and fp32;
    head_dim 8 does not (``tl.dot``'s K >= 16, which the interpreter never checks: lease 9's GPU suite failed 27
    tiny-model tests when the backend still sent it)."""
    import torch

    from rlt.attention.backends.triton_backend import TritonBackend

    for dtype in ("bf16", "fp32"):
        assert sass[f"prefill/dense16-{dtype}"]["local"] == 0 and index_of(sass[f"prefill/dense16-{dtype}"]["ops"], "UTMALDG")
    assert sass["prefill/dense8-compiles"] is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU tensor counts as TMA-capable under the interpreter
    for d, sent in ((8, False), (16, True)):
        q, kv = torch.zeros(8, 2, d), (torch.zeros(8, 1, d), torch.zeros(8, 1, d))
        assert TritonBackend._dense_ready(q, kv, torch.zeros(1)) is sent, d


@pytest.mark.parametrize("kernel", ["silu_mul", "rope_kv", "split_k"])
def test_tma_projections_load_x_and_w_with_tma(sass, kernel):
    """Tiles.tma — the fused projections at 64 rows (64-wide tiles, 8 warps, 2 K splits), split-K down_proj at
    one row (RLT_SPLIT_K_TMA): X and W tiles by TMA (UTMALDG), no cp.async pointer loads of them (LDGSTS),
    the dots on tensor cores, no spills."""
    ops = sass[kernel + "/tma"]["ops"]
    assert index_of(ops, "UTMALDG") and not index_of(ops, "LDGSTS")
    assert index_of(ops, "HGMMA" if kernel != "split_k" else "HMMA")  # 16-row tiles: mma.sync, not wgmma
    assert sass[kernel + "/tma"]["local"] == 0

