"""Platform detection, the capability table, UVA decisions and NPU dispatch with a fake torch_npu."""

from __future__ import annotations

import sys

import pytest
import torch

from rlt.platform.platforms import (PLATFORM_CAPABILITIES, Capability, PlatformError, detect_platform,
                                    make_platform)
from rlt.platform.uva import decide_uva

C = Capability


def test_capability_table_is_the_single_source():
    for name, caps in PLATFORM_CAPABILITIES.items():
        assert make_platform(name).capabilities == caps
    assert PLATFORM_CAPABILITIES["npu"] == frozenset({C.HTTP_SERVING})  # Ascend R0: nothing optional yet
    assert C.FLASH_ATTENTION in PLATFORM_CAPABILITIES["cuda"]
    assert C.FLASH_ATTENTION not in PLATFORM_CAPABILITIES["rocm"]
    assert C.TRITON in PLATFORM_CAPABILITIES["rocm"] and C.TRITON not in PLATFORM_CAPABILITIES["cpu"]


def test_rocm_uses_the_cuda_namespace_and_env():
    rocm = make_platform("rocm", torch.cuda)
    assert rocm.device_type == "cuda" and rocm.device_module is torch.cuda
    assert rocm.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert rocm.triton_dot_precision == "ieee" and make_platform("cuda").triton_dot_precision == "tf32"
    assert make_platform("npu").visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"


def test_detect_cpu_and_auto_here():
    assert detect_platform("cpu").name == "cpu"
    assert detect_platform("auto").name == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bad", ["tpu", "gpu", ""])
def test_unknown_device(bad):
    with pytest.raises(PlatformError, match="unknown device"):
        detect_platform(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_gpu_requested_without_gpu(name):
    with pytest.raises(PlatformError, match="no GPU"):
        detect_platform(name)


def test_npu_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    with pytest.raises(PlatformError, match="torch_npu"):
        detect_platform("npu")


def test_npu_with_fake_torch_npu(fake_torch_npu):
    p = detect_platform("npu")
    assert p.name == "npu" and p.device_type == "npu" and p.device_module is fake_torch_npu.npu
    p.synchronize()
    assert fake_torch_npu.calls.count("synchronize") == 1


def test_uva_switches():
    cuda = make_platform("cuda")
    never = lambda p: pytest.fail("probe must not run")  # noqa: E731
    assert not decide_uva(cuda, {"RLT_UVA": "0"}, probe=never).enabled
    assert decide_uva(cuda, {"RLT_UVA": "1"}, probe=never).enabled
    assert decide_uva(cuda, {}, probe=lambda p: (True, "same address")).enabled
    d = decide_uva(cuda, {}, probe=lambda p: (False, "different address"))
    assert not d.enabled and "different address" in d.reason
    for name in ("cpu", "npu"):
        assert not decide_uva(make_platform(name), {"RLT_UVA": "1"}, probe=never).enabled


def test_engine_describes_pdl_and_fold_with_their_reasons(tiny_checkpoint, monkeypatch):
    """/v1/engine's "pdl" and "fold" entries (rlt.attention.pdl / .fold): off on CPU, saying why."""
    from rlt.attention import fold
    from rlt.platform import EngineConfig, LLMEngine

    monkeypatch.delenv("RLT_FOLD", raising=False)
    fold.refresh()
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint()), device="cpu", dtype="float32"))
    described = engine.describe()
    assert described["pdl"] == {"enabled": False, "reason": "cpu device: PDL is a CUDA launch attribute"}
    assert described["fold"] == {"enabled": False, "reason": "off by default (RLT_FOLD=1 turns it on)"}
    assert described["weight_prefetch"]["enabled"] is False
