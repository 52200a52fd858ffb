"""Triton kernels run on CPU through Triton's interpreter.

Whether ``@triton.jit`` builds an interpreted function is read from ``TRITON_INTERPRET`` when the
decorator runs, and other packages' code decides per call whether to use Triton from the same
variable. So the variable is set only (1) while this conftest imports rlt's attention kernels and
(2) during each test of this directory (autouse fixture), never for the rest of the session.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch
from triton_interpreter import fix_interpreter

INTERPRET = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
_KERNEL_MODULES = ("paging", "paged_decode", "paged_prefill", "dense_prefill", "kv_write")


def _import_kernels_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in _KERNEL_MODULES:
            module = importlib.import_module(f"rlt.attention.backends.triton_kernels.{name}")
            jitted = [v for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")]
            if any(not isinstance(v, InterpretedFunction) for v in jitted):  # imported earlier, compiled mode
                importlib.reload(module)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


if INTERPRET:
    _import_kernels_interpreted()
    fix_interpreter()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
