"""Shared helpers for the Triton kernels: interpreter detection and its known gaps.

Kernels run natively on CUDA and on CPU under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported). The interpreter of Triton 3.9 multiplies bfloat16 tiles as their raw
uint16 bits in `tl.dot`; `patch_interpreter()` upcasts them first (what the GPU's tensor cores do),
so the bf16 code paths are testable on CPU too.
"""

from __future__ import annotations

import functools
import os

import torch


def is_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available(device: torch.device | str) -> bool:
    """Triton kernels can run on `device`: a CUDA GPU, or any device under the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.device(device).type == "cuda" or is_interpreting()


@functools.lru_cache(maxsize=1)
def patch_interpreter() -> None:
    if not is_interpreting():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp.InterpreterBuilder.create_dot
    if getattr(original, "_sglang_bf16_patch", False):
        return

    def upcast(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    create_dot._sglang_bf16_patch = True
    interp.InterpreterBuilder.create_dot = create_dot


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands are multiplied exactly ("ieee"): the torch twins and the transformers
    reference compute fp32 models in fp32; tf32 would cost ~1e-3 relative error."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
