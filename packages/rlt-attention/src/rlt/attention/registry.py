"""The table of attention backends this package can build.

Each entry names a backend, tells whether its implementation is importable here (without
importing heavy kernels eagerly), and builds it from keyword parameters chosen by the platform
(for example ``dot_precision`` for Triton). Which entry to use is *not* decided here: hardware
knowledge lives in ``rlt.platform``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from typing import Any, Callable

import attrs

from rlt.attention.backend import AttentionBackend, BackendSpec


def _module_importable(name: str) -> bool:
    """Can ``name`` (possibly dotted) be imported? Decided without executing any package code: a
    submodule is looked up in its parent's search path, so asking about ``flash_attn.cute`` does
    not run FA2's heavy ``flash_attn/__init__``."""
    if name in sys.modules:
        return True
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    for depth in range(len(rest)):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join([top, *rest[:depth + 1]]),
                                                         list(spec.submodule_search_locations))
    return spec is not None


@attrs.frozen
class BackendEntry:
    name: str
    #: "module:Class" of the implementation, imported on first use.
    target: str
    #: Modules that must be importable for this backend to be available. They must tell the
    #: packages apart: FA4 (``flash-attn-4``) also installs a ``flash_attn`` package, so FA2 is
    #: recognised by its compiled extension ``flash_attn_2_cuda`` and FA4 by ``flash_attn.cute``.
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
            "fa4", "rlt.attention.backends.flash:FA4Backend", ("flash_attn.cute", "cutlass"), vendor="nvidia"
        ),
        BackendEntry(
            "fa3", "rlt.attention.backends.flash:FA3Backend", ("flash_attn_interface",), vendor="nvidia"
        ),
        BackendEntry("fa2", "rlt.attention.backends.flash:FA2Backend", ("flash_attn", "flash_attn_2_cuda"),
                     vendor="nvidia"),
    )
}


def create_backend(name: str, **params: Any) -> AttentionBackend:
    try:
        entry = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}") from None
    cls: Callable[..., AttentionBackend] = entry.load_class()
    return cls(**params)
