"""Mapped host metadata (UVA): may kernels read pinned host memory at its host address?

Enabled only after a probe shows the device pointer of a pinned host buffer equals its host
address (on ROCm ``hipHostGetDevicePointer`` must return the host address). ``RLT_UVA=0`` forces
copies, ``RLT_UVA=1`` skips the probe. The result and its reason are recorded.

:func:`mapped_copy_` is the one reader features share: a Triton kernel that loads a pinned host
buffer through its host address and stores it into a device buffer (one launch, no copy-engine
transfer). Callers use it only when the decision is enabled and keep a plain copy otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import attrs
import torch

from rlt.platform.platforms import Capability, Platform


@attrs.frozen
class UvaDecision:
    enabled: bool
    reason: str


def _runtime_library(platform: Platform):
    names = (
        ["amdhip64", "libamdhip64.so"] if platform.name == "rocm" else
        ["cudart", "libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    )
    for name in names:
        path = ctypes.util.find_library(name) or name
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _device_pointer_equals_host(platform: Platform) -> tuple[bool, str]:
    lib = _runtime_library(platform)
    if lib is None:
        return False, "runtime library not loadable for the probe"
    fn_name = "hipHostGetDevicePointer" if platform.name == "rocm" else "cudaHostGetDevicePointer"
    fn = getattr(lib, fn_name, None)
    if fn is None:
        return False, f"{fn_name} not found"
    host = torch.empty(64, dtype=torch.int32, pin_memory=True)
    dptr = ctypes.c_void_p()
    err = fn(ctypes.byref(dptr), ctypes.c_void_p(host.data_ptr()), ctypes.c_uint(0))
    if err != 0:
        return False, f"{fn_name} returned error {err}"
    if dptr.value != host.data_ptr():
        return False, f"{fn_name} returned a different address than the host pointer"
    return True, f"{fn_name} returned the host address"


def decide_uva(platform: Platform, env: dict[str, str] | None = None, probe=None) -> UvaDecision:
    env = os.environ if env is None else env
    forced = env.get("RLT_UVA")
    if forced == "0":
        return UvaDecision(False, "RLT_UVA=0 forces host-to-device copies")
    if not platform.has(Capability.MAPPED_HOST_MEMORY):
        return UvaDecision(False, f"platform {platform.name} does not declare mapped host memory")
    if forced == "1":
        return UvaDecision(True, "RLT_UVA=1 skips the probe")
    ok, why = (probe or _device_pointer_equals_host)(platform)
    return UvaDecision(ok, f"probe: {why}")


_WORDS_PER_PROGRAM = 1024


def _mapped_copy_kernel():
    from rlt.platform.uva_kernel import copy_words_kernel

    return copy_words_kernel


def mapped_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` where ``src`` is pinned host memory read by a kernel at its host address
    (UVA) and ``dst`` device memory; both contiguous, same byte size, a multiple of 4 bytes."""
    nbytes = src.numel() * src.element_size()
    if nbytes != dst.numel() * dst.element_size() or nbytes % 4 or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"mapped_copy_: contiguous buffers of one size, a multiple of 4 bytes (got {nbytes} and "
                         f"{dst.numel() * dst.element_size()} bytes)")
    n = nbytes // 4
    if n:
        _mapped_copy_kernel()[(-(-n // _WORDS_PER_PROGRAM),)](src.view(torch.int32), dst.view(torch.int32), n,
                                                             BLOCK=_WORDS_PER_PROGRAM)
