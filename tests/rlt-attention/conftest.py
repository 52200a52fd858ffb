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

INTERPRET = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
_KERNEL_MODULES = ("paging", "paged_decode", "paged_prefill", "dense_prefill", "kv_write")


def _fix_interpreter_index() -> None:
    """Triton <= 3.6's interpreter does ``int(ndarray of shape (1,))`` for a loaded scalar used as a
    ``range`` bound, which NumPy >= 2.4 rejects; newer Triton squeezes first. Same fix here."""
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_tensor, "_rlt_fixed", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._rlt_fixed = True
    interpreter._patch_lang_tensor = patched


def _fix_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.6 .. 3.9) keeps bf16 as uint16 bit patterns and ``np.matmul``s the bits
    in ``tl.dot``. Widen bf16 operands to fp32 first (exact: bf16 is the top half of an fp32)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_rlt_fixed", False):
        return
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar.name == "bf16":
            bits = handle.data.astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), interpreter.tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._rlt_fixed = True
    builder.create_dot = create_dot


def _interpret_late_jit_functions() -> None:
    """Another test module may import Triton before this conftest sets ``TRITON_INTERPRET``; then
    ``triton.language``'s own helpers (``tl.cdiv``, ...) were built as compiled-mode JITFunctions,
    which refuse to be called from an interpreted kernel. Call them as interpreted device
    functions instead (exactly what ``InterpretedFunction.__call__`` does)."""
    from triton.runtime import interpreter, jit

    if getattr(jit.JITFunction.__call__, "_rlt_fixed", False):
        return
    cache: dict[int, interpreter.InterpretedFunction] = {}

    def call(self, *args, **kwargs):
        fn = cache.get(id(self))
        if fn is None:
            fn = cache[id(self)] = interpreter.InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    call._rlt_fixed = True
    jit.JITFunction.__call__ = call


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
    _fix_interpreter_index()
    _fix_interpreter_bf16_dot()
    _interpret_late_jit_functions()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
