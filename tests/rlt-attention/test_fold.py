"""rlt.attention.fold: where the last-arriver folds run, and why not elsewhere."""

from __future__ import annotations

import types

import pytest
import torch

from rlt.attention import fold


def _status(monkeypatch, device="cuda", env="1", hip=None, interpret=None):
    monkeypatch.setattr(torch.version, "hip", hip)
    for name, value in (("RLT_FOLD", env), ("TRITON_INTERPRET", interpret)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    fold.refresh()
    dev = torch.device(device, 0) if device == "cuda" else types.SimpleNamespace(type=device, index=None)
    return fold.fold_status(dev), fold.fold_enabled(types.SimpleNamespace(device=dev))


@pytest.fixture(autouse=True)
def _fresh_setting():
    yield
    fold.refresh()  # after monkeypatch restored the environment


def test_on_for_cuda_and_the_interpreter_only(monkeypatch):
    assert _status(monkeypatch) == ((True, "CUDA device (RLT_FOLD=1)"), True)
    assert _status(monkeypatch, hip="6.2") == ((False, "ROCm: the fold's memory ordering is not verified there"), False)
    assert _status(monkeypatch, device="cpu", interpret="1") == ((True, "Triton interpreter (RLT_FOLD=1)"), True)
    assert _status(monkeypatch, device="cpu")[1] is False                     # CPU without the interpreter: eager ops
    assert _status(monkeypatch, device="xpu")[0] == (False, "xpu device: the folded kernels are Triton kernels for CUDA")
    assert _status(monkeypatch, env="0") == ((False, "RLT_FOLD=0"), False)


def test_default_is_off_until_measured(monkeypatch):
    """Unset (or empty, as a script's unset variable): DEFAULT, which stays "0" until an H200 A/B
    measures the folds (docs/decode.md)."""
    assert fold.DEFAULT == "0"
    for env in (None, ""):
        assert _status(monkeypatch, env=env) == ((False, "off by default (RLT_FOLD=1 turns it on)"), False)


def test_environment_is_read_once(monkeypatch):
    assert _status(monkeypatch)[1] is True
    monkeypatch.setenv("RLT_FOLD", "0")
    assert fold.fold_enabled(types.SimpleNamespace(device=torch.device("cuda", 0))) is True  # cached per device
    fold.refresh()
    assert fold.fold_enabled(types.SimpleNamespace(device=torch.device("cuda", 0))) is False


def test_sites_are_switched_by_name(monkeypatch):
    """RLT_FOLD=<comma list of sites>: those folds alone (each timed on its own); 1 all, 0 none."""
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert _status(monkeypatch, env="attention,tiles") == ((True, "CUDA device (RLT_FOLD=attention,tiles)"), True)
    assert [fold.fold_enabled(cuda, s) for s in fold.SITES] == [True, False, True]
    _status(monkeypatch, env="1")
    assert all(fold.fold_enabled(cuda, s) for s in fold.SITES)
    _status(monkeypatch, env="0")
    assert not any(fold.fold_enabled(cuda, s) for s in (*fold.SITES, None))
    assert fold.parse_sites(" split_k ") == {"split_k"}
    for bad in ("attn", "attention,merge", ",", "2"):
        with pytest.raises(ValueError, match="RLT_FOLD="):
            fold.parse_sites(bad)
