"""The table of attention backends this package can build.

Each entry names a backend, tells whether its implementation is importable here (without
importing heavy kernels eagerly), and builds it from keyword parameters chosen by the platform
(for example ``dot_precision`` for Triton). Which entry to use is *not* decided here: hardware
knowledge lives in ``rlt.platform``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

import attrs

from rlt.attention.backend import AttentionBackend, BackendSpec


def _module_importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@attrs.frozen
class BackendEntry:
    name: str
    #: "module:Class" of the implementation, imported on first use.
    target: str
    #: Top-level modules that must be importable for this backend to be available.
    requires_modules: tuple[str, ...] = ()
    #: Vendor restriction, e.g. "nvidia" for FlashAttention.
    vendor: str | None = None

    def missing_modules(self) -> tuple[str, ...]:
        return tuple(m for m in self.requires_modules if not _module_importable(m))

    def is_available(self) -> bool:
        return not self.missing_modules()

    def load_class(self) -> type[AttentionBackend]:
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)

    def spec(self) -> BackendSpec:
        return self.load_class().spec


BACKENDS: dict[str, BackendEntry] = {
    e.name: e
    for e in (
        BackendEntry("torch", "rlt.attention.backends.torch_ref:TorchReferenceBackend"),
        BackendEntry("ascend_eager", "rlt.attention.backends.ascend_eager:AscendEagerBackend"),
        BackendEntry("triton", "rlt.attention.backends.triton_backend:TritonBackend", ("triton",)),
        BackendEntry(
            "fa4", "rlt.attention.backends.flash:FA4Backend", ("flash_attn", "cutlass"), vendor="nvidia"
        ),
        BackendEntry(
            "fa3", "rlt.attention.backends.flash:FA3Backend", ("flash_attn_interface",), vendor="nvidia"
        ),
        BackendEntry("fa2", "rlt.attention.backends.flash:FA2Backend", ("flash_attn",), vendor="nvidia"),
    )
}


def create_backend(name: str, **params: Any) -> AttentionBackend:
    try:
        entry = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}") from None
    cls: Callable[..., AttentionBackend] = entry.load_class()
    return cls(**params)
