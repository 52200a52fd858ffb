"""rlt.attention.pdl: when the decode kernels launch with programmatic dependent launch."""

from __future__ import annotations

import types

import pytest
import torch

from rlt.attention import pdl


def _on(monkeypatch, capability=(9, 0), hip=None, env="1", interpret=None, triton_pdl=True):
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: triton_pdl)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    for name, value in (("RLT_PDL", env), ("TRITON_INTERPRET", interpret)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    pdl.refresh()
    return pdl.pdl_enabled(types.SimpleNamespace(device=torch.device("cuda", 0)))


@pytest.fixture(autouse=True)
def _fresh_setting():
    yield
    pdl.refresh()  # after monkeypatch restored the environment


def test_on_for_hopper_cuda_only(monkeypatch):
    assert _on(monkeypatch) is True
    assert _on(monkeypatch, capability=(10, 0)) is True
    assert _on(monkeypatch, capability=(8, 0)) is False       # Ampere: no griddepcontrol
    assert _on(monkeypatch, hip="6.2") is False                # ROCm: no PDL
    assert _on(monkeypatch, env="0") is False                  # RLT_PDL=0 (A/B runs)
    assert _on(monkeypatch, env=None) is (pdl.DEFAULT == "1")  # unset: the measured default
    assert _on(monkeypatch, env="") is (pdl.DEFAULT == "1")    # empty (a script's unset variable): the same
    assert _on(monkeypatch, interpret="1") is False            # the interpreter runs no inline PTX
    assert _on(monkeypatch, triton_pdl=False) is False         # a Triton before 3.3: no launch_pdl
    assert pdl.pdl_enabled(torch.empty(2)) is False            # CPU tensors


def test_status_says_why(monkeypatch):
    assert pdl.pdl_status(torch.device("cpu")) == (False, "cpu device: PDL is a CUDA launch attribute")
    _on(monkeypatch, capability=(8, 6))
    assert pdl.pdl_status(torch.device("cuda", 0)) == (False, "sm_86: griddepcontrol needs sm_90 or later")
    _on(monkeypatch, env="0")
    assert pdl.pdl_status(torch.device("cuda", 0)) == (False, "RLT_PDL=0")
    _on(monkeypatch, capability=(9, 0))
    assert pdl.pdl_status(torch.device("cuda", 0)) == (True, "sm_90 CUDA device (RLT_PDL=1)")


def test_this_triton_has_pdl():
    pytest.importorskip("triton")
    assert pdl._triton_has_pdl() is True   # the pinned Triton 3.6


def test_kernel_options(monkeypatch):
    # the interpreter's launcher takes no launch_pdl keyword, so it is passed only when on
    assert pdl.kernel_options(torch.empty(2)) == {"PDL": False}
    monkeypatch.setattr(pdl, "pdl_enabled", lambda t: True)
    assert pdl.kernel_options(torch.empty(2)) == {"PDL": True, "launch_pdl": True}


def test_environment_is_read_once(monkeypatch):
    """A launch pays one dict lookup, not environment reads: RLT_PDL changes take effect on refresh()."""
    assert _on(monkeypatch, env="1") is True
    monkeypatch.setenv("RLT_PDL", "0")
    assert pdl.pdl_enabled(types.SimpleNamespace(device=torch.device("cuda", 0))) is True  # cached
    pdl.refresh()
    assert pdl.pdl_enabled(types.SimpleNamespace(device=torch.device("cuda", 0))) is False


def test_weight_prefetch_needs_pdl_and_its_switch(monkeypatch):
    """RLT_PREFETCH=1 (off by default: measured slower) turns on the projection kernels' L2 prefetch before the
    PDL wait, only where PDL itself is on."""
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.delenv("RLT_PREFETCH", raising=False)
    assert _on(monkeypatch) is True and pdl.weight_prefetch(cuda) is False
    assert pdl.weight_prefetch_status(torch.device("cuda", 0)) == (
        False, "off by default (RLT_PREFETCH=1 turns it on, with PDL)")
    monkeypatch.setenv("RLT_PREFETCH", "1")
    assert _on(monkeypatch) is True and pdl.weight_prefetch(cuda) is True
    assert pdl.weight_prefetch_status(torch.device("cuda", 0)) == (True, "RLT_PREFETCH=1")
    assert _on(monkeypatch, env="0") is False and pdl.weight_prefetch(cuda) is False
    assert pdl.weight_prefetch_status(torch.device("cuda", 0)) == (False, "needs PDL, which is off: RLT_PDL=0")
    assert pdl.weight_prefetch(torch.empty(2)) is False  # CPU tensors (the interpreter runs no inline PTX)
