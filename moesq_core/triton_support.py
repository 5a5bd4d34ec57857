"""Triton, where installed: `triton`, `tl` (None without it), `HAS_TRITON`, and `INTERPRET` (TRITON_INTERPRET=1:
kernels run on the CPU through Triton's interpreter, which the tests use without a GPU)."""
from __future__ import annotations

import os

try:  # triton is optional: CPU-only installs use the torch references
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns scalars into int with int(1-element array), which numpy >= 2.3 rejects;
    patch its tensor __index__ to take the single element (only under TRITON_INTERPRET)."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_moesq_index_fix", False):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._moesq_index_fix = True


if HAS_TRITON and INTERPRET:
    _fix_interpreter_index()
