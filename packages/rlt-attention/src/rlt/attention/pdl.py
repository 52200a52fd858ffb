"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (host-side policy).

A decode loop step is a chain of small kernels (per layer: q/k/v + RoPE, attention, merge, o_proj,
add + norm, gate/up + SiLU, down_proj, add + norm) that each stream a few MB; between two of them the
GPU drains the first, flushes it, then launches and ramps up the second — microseconds per boundary,
paid eight times per layer. With PDL (Hopper and later, ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_
SERIALIZATION``) a kernel is launched while its predecessor still runs: its programs start and block
in ``griddepcontrol.wait`` until the predecessor has completed and its memory is visible, and after
their main loop signal that their own dependent may launch
(:mod:`rlt.attention.backends.triton_kernels.pdl`).

The contract that keeps this exact: a kernel launched with PDL calls ``dependent_wait`` before any
global load of data another kernel writes and before any global store, so what it computes is
unchanged (bit-identical to a plain launch); only the launch latency overlaps. Kernels that do not
follow the contract are never launched with PDL. Works under CUDA-graph capture (programmatic
edges). The signal comes after the main loop, not at the start: programs that wait hold SM
resources (measured below). ``RLT_PDL=1`` turns it on, ``0`` off; unset: :data:`DEFAULT` (read once,
at import; :func:`refresh` reads it again). Never on ROCm, before sm_90, or under the Triton
interpreter.

Weight prefetch (``RLT_PREFETCH=1``, with PDL only; off: measured slower — C=1 decode -7 % alone on an H100, lease 12,
and slower with the folds on the H200, lease 8): the small-M
projection kernels (``rlt.platform.models.fused_linear``) ask L2 for their weight rows before
``griddepcontrol.wait`` — weights are never written by a kernel, so this is inside the contract — so a
kernel's DRAM stream starts while its predecessor finishes (:func:`weight_prefetch`).
"""

from __future__ import annotations

import functools
import os

import torch

#: ``RLT_PDL`` when unset: on. Measured on the H200 (lease 7, Ouro-1.4B shapes, rlt-decode, same build back
#: to back): with each kernel triggering its dependents after its main loop, C=1 decode 176.4 -> 189.6 tok/s
#: (+7.5 %, 1.41 -> 1.31 ms per loop step), C=64 3,357 -> 3,447 (+2.7 %); triggering at each kernel's start
#: instead made C=1 6 % slower (175.9 -> 164.8) — waiting programs held SM resources.
DEFAULT = "1"

_ON_OPTIONS = {"PDL": True, "launch_pdl": True}
_OFF_OPTIONS = {"PDL": False}


class _Setting:
    """``RLT_PDL`` / ``TRITON_INTERPRET`` as read once (a kernel launch must not pay for environment
    lookups: eager paths are host-bound), and the per-device decisions made from them."""

    def __init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        self.flag = os.environ.get("RLT_PDL") or DEFAULT
        self.explicit = os.environ.get("RLT_PDL") == "1"
        self.prefetch = os.environ.get("RLT_PREFETCH") == "1"
        self.interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        self.by_index: dict[int | None, bool] = {}


_SETTING = _Setting()


def refresh() -> None:
    """Read ``RLT_PDL`` / ``TRITON_INTERPRET`` again (they are read when this module is imported;
    tests that flip them call this)."""
    _SETTING.refresh()


@functools.cache
def _triton_has_pdl() -> bool:
    """The device side (``triton_kernels.pdl``: griddepcontrol) and the launcher option both exist."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        from rlt.attention.backends.triton_kernels import pdl as device_side
    except ImportError:
        return False
    return device_side.gdc_wait is not None and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_status(device: torch.device) -> tuple[bool, str]:
    """Whether kernels on ``device`` launch with PDL, and why (for ``/v1/engine``)."""
    if device.type != "cuda":
        return False, f"{device.type} device: PDL is a CUDA launch attribute"
    if torch.version.hip is not None:
        return False, "ROCm: HIP has no programmatic dependent launch"
    if _SETTING.interpreting:
        return False, "Triton interpreter"
    if _SETTING.flag != "1":
        return False, "RLT_PDL=0"
    if not _triton_has_pdl():
        return False, "this Triton has no griddepcontrol / launch_pdl (Triton 3.3 or later has them)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return False, f"sm_{major}{minor}: griddepcontrol needs sm_90 or later"
    return True, f"sm_{major}{minor} CUDA device" + (" (RLT_PDL=1)" if _SETTING.explicit else "")


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels over ``t``'s device launch with PDL (decided from the device only: graph-safe;
    one dict lookup after the device's first call)."""
    device = t.device
    if device.type != "cuda":
        return False
    on = _SETTING.by_index.get(device.index)
    if on is None:
        on = _SETTING.by_index[device.index] = pdl_status(device)[0]
    return on


def kernel_options(t: torch.Tensor) -> dict:
    """Keywords of a launch over ``t``'s device for a kernel that follows the contract (its ``PDL``
    constexpr parameter, plus ``launch_pdl`` when on — the interpreter's launcher takes no such
    keyword). Shared dicts: unpack them, do not change them."""
    return _ON_OPTIONS if pdl_enabled(t) else _OFF_OPTIONS


def weight_prefetch(t: torch.Tensor) -> bool:
    """Whether the projection kernels over ``t`` prefetch their weights into L2 before the PDL wait
    (``RLT_PREFETCH=1`` and PDL on; graph-safe, from the device only)."""
    return _SETTING.prefetch and pdl_enabled(t)


def weight_prefetch_status(device: torch.device) -> tuple[bool, str]:
    """:func:`weight_prefetch` on ``device``, and why (for ``/v1/engine``)."""
    if not _SETTING.prefetch:
        return False, "off by default (RLT_PREFETCH=1 turns it on, with PDL)"
    on, why = pdl_status(device)
    return on, ("RLT_PREFETCH=1" if on else f"needs PDL, which is off: {why}")
