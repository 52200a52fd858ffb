"""Fixes to Triton's interpreter (Triton <= 3.6 with NumPy >= 2.4), applied by the tests that run rlt's
Triton kernels on CPU: the rlt-attention conftest, and engine scripts run in a subprocess with
``TRITON_INTERPRET=1`` (``sys.path`` holding this directory). Each fix is idempotent."""

from __future__ import annotations


def fix_interpreter() -> None:
    """Apply every fix below (call before the first interpreted launch)."""
    _fix_interpreter_index()
    _fix_interpreter_bf16_dot()
    _interpret_late_jit_functions()


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
