"""Hardware platforms and the capabilities each declares.

One helper, :func:`detect_platform`, decides the platform; call sites never read
``torch.version.hip`` or probe ``torch_npu`` themselves. A :class:`Platform` is a frozen value:
its name, the torch device type, the device module (``torch.cuda`` for CUDA *and* ROCm,
``torch.npu`` for Ascend, imported lazily and only for ``--device npu``) and its capabilities.

The capability table :data:`PLATFORM_CAPABILITIES` is data, kept in this one place. A platform
declares a capability only once rlt's features that need it run there; Ascend declares none of
the optional ones yet, so features needing them are absent on NPU rather than broken.
"""

from __future__ import annotations

import enum
import importlib
import os
from types import ModuleType
from typing import Any

import attrs
import torch


class Capability(str, enum.Enum):
    GRAPH_CAPTURE = "graph_capture"
    MAPPED_HOST_MEMORY = "mapped_host_memory"
    MULTI_STREAM = "multi_stream"
    ASYNC_EXECUTION = "async_execution"
    TRITON = "triton"
    FLASH_ATTENTION = "flash_attention"
    PACKED_PREFILL = "packed_prefill"
    CHUNKED_PREFILL = "chunked_prefill"
    PREFIX_CACHE = "prefix_cache"
    PREEMPTION = "preemption"
    SPECULATION = "speculation"
    HTTP_SERVING = "http_serving"


C = Capability
_PORTABLE = {C.CHUNKED_PREFILL, C.PREFIX_CACHE, C.PREEMPTION, C.SPECULATION, C.HTTP_SERVING}

#: The capability table: platform name -> declared capabilities.
PLATFORM_CAPABILITIES: dict[str, frozenset[Capability]] = {
    "cpu": frozenset(_PORTABLE | {C.ASYNC_EXECUTION}),
    "cuda": frozenset(
        _PORTABLE
        | {
            C.GRAPH_CAPTURE,
            C.MAPPED_HOST_MEMORY,
            C.MULTI_STREAM,
            C.ASYNC_EXECUTION,
            C.TRITON,
            C.FLASH_ATTENTION,
            C.PACKED_PREFILL,
        }
    ),
    "rocm": frozenset(
        _PORTABLE
        | {C.GRAPH_CAPTURE, C.MAPPED_HOST_MEMORY, C.MULTI_STREAM, C.ASYNC_EXECUTION, C.TRITON, C.PACKED_PREFILL}
    ),
    # Ascend R0 scope: full prefill, synchronous decoding, HTTP serving (RFC §6; PR #168).
    "npu": frozenset({C.HTTP_SERVING}),
}

#: torch device type and the env var that masks devices, per platform.
_DEVICE_TYPE = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "npu": "npu"}
_VISIBLE_DEVICES_ENV = {"cpu": None, "cuda": "CUDA_VISIBLE_DEVICES", "rocm": "CUDA_VISIBLE_DEVICES",
                        "npu": "ASCEND_RT_VISIBLE_DEVICES"}
DEVICE_CHOICES = ("auto", "cpu", "cuda", "rocm", "npu")


class PlatformError(RuntimeError):
    """The requested device cannot be used here; the message says what to change."""


@attrs.frozen
class Platform:
    name: str
    device_type: str
    capabilities: frozenset[Capability]
    device_module: Any = attrs.field(default=None, eq=False, repr=False)
    visible_devices_env: str | None = None
    #: Architecture string, e.g. "sm90" or "gfx950"; None when unknown or CPU.
    arch: str | None = None

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities

    @property
    def is_cuda_alike(self) -> bool:
        return self.name in ("cuda", "rocm")

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type if self.name == "cpu" else f"{self.device_type}:{index}")

    def synchronize(self) -> None:
        if self.device_module is not None:
            self.device_module.synchronize()

    @property
    def sync_before_reuse(self) -> bool:
        """Ascend: synchronise before request metadata or KV pages are reused (PR #168)."""
        return self.name == "npu"

    def select_device(self, index: int = 0) -> None:
        """Make ``index`` the current device (``torch.npu.set_device`` / ``torch.cuda.set_device``)."""
        if self.device_module is not None and hasattr(self.device_module, "set_device"):
            self.device_module.set_device(index)

    @property
    def triton_dot_precision(self) -> str:
        """fp32 ``tl.dot`` precision: tf32 on NVIDIA, ieee on ROCm (kernels.md §2.4)."""
        return "ieee" if self.name == "rocm" else "tf32"


def make_platform(name: str, device_module: Any = None, arch: str | None = None) -> Platform:
    """Build the platform value for ``name`` from the capability table (also used by tests)."""
    if name not in PLATFORM_CAPABILITIES:
        raise PlatformError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    return Platform(
        name=name,
        device_type=_DEVICE_TYPE[name],
        capabilities=PLATFORM_CAPABILITIES[name],
        device_module=device_module,
        visible_devices_env=_VISIBLE_DEVICES_ENV[name],
        arch=arch,
    )


def _import_torch_npu() -> ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise PlatformError(
            "--device npu needs torch_npu (the Ascend PyTorch adapter) and CANN; "
            f"it could not be imported here ({exc}). Install the torch_npu build matching your torch."
        ) from None


def _cuda_arch() -> str | None:
    try:
        if torch.version.hip:
            props = torch.cuda.get_device_properties(0)
            return getattr(props, "gcnArchName", "gfx").split(":")[0]
        major, minor = torch.cuda.get_device_capability(0)
        return f"sm{major}{minor}"
    except Exception:  # noqa: BLE001 - arch is informative only
        return None


def detect_platform(requested: str = "auto") -> Platform:
    """Decide the platform for ``requested`` (one of :data:`DEVICE_CHOICES`)."""
    if requested not in DEVICE_CHOICES:
        raise PlatformError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if requested == "npu":
        torch_npu = _import_torch_npu()
        npu = getattr(torch, "npu", None) or getattr(torch_npu, "npu", None)
        if npu is None or not npu.is_available():
            raise PlatformError("--device npu: torch_npu imported but no NPU is available")
        return make_platform("npu", npu)
    if requested == "cpu":
        return make_platform("cpu")
    gpu_kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    gpu_ok = torch.cuda.is_available()
    if requested in ("cuda", "rocm"):
        if not gpu_ok:
            raise PlatformError(f"--device {requested}: no GPU is visible to torch "
                                f"(torch {torch.__version__}, {_VISIBLE_DEVICES_ENV[requested]}="
                                f"{os.environ.get(_VISIBLE_DEVICES_ENV[requested], '<unset>')})")
        if requested != gpu_kind:
            raise PlatformError(f"--device {requested}: this torch build targets {gpu_kind}, not {requested}")
        return make_platform(gpu_kind, torch.cuda, _cuda_arch())
    if gpu_ok:
        return make_platform(gpu_kind, torch.cuda, _cuda_arch())
    return make_platform("cpu")
