"""Fixtures of the rlt-platform tests."""

from __future__ import annotations

import sys
import types

import pytest
import torch


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """A stand-in ``torch_npu`` that records calls; the device math runs on CPU (same ops)."""
    calls: list[str] = []
    mod = types.ModuleType("torch_npu")
    npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        synchronize=lambda *a: calls.append("synchronize"),
        current_stream=lambda *a: calls.append("current_stream"),
        set_device=lambda *a: calls.append("set_device"),
    )

    def npu_scatter_nd_update_(dst, indices, updates):
        calls.append("npu_scatter_nd_update_")
        assert indices.dim() == 2 and indices.shape[1] == 1
        dst[indices[:, 0]] = updates

    mod.npu = npu
    mod.npu_scatter_nd_update_ = npu_scatter_nd_update_
    mod.calls = calls
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return mod

