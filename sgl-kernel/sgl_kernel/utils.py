"""Shared helpers for the Triton kernels: interpreter detection and its known gaps.

Kernels run natively on CUDA and on CPU under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported). The interpreter of Triton 3.9 multiplies bfloat16 tiles as their raw
uint16 bits in `tl.dot`; `patch_interpreter()` upcasts them first (what the GPU's tensor cores do)
and multiplies float32 tiles in float64 (each row independent of its tile neighbours, as on a GPU),
so the bf16 code paths are testable on CPU too. Its fp32 -> bf16 / e4m3 casts truncate, while the
GPU rounds to nearest even; the patch rounds like the GPU (through torch's casts, which do), so CPU
kernel results equal the torch twins bit for bit where the GPU's would. Triton 3.6's interpreter (the
GPU machine's) cannot take a kernel scalar as a `range` bound under NumPy 2.4; the patch converts it
the way 3.9 does.
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
        a, b = upcast(a), upcast(b)
        if a.data.dtype == np.float32 and b.data.dtype == np.float32 and d.data.dtype == np.float32:
            # A GPU's MMA gives each row of a tile the same K order wherever the row sits; BLAS
            # does not (OpenBLAS 0.3.31's sgemm rounds a row by its position in the tile), which
            # broke batch invariance under the interpreter only. In float64, rounded once to float32,
            # a row's result no longer depends on its neighbours.
            prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
            return interp.TensorHandle(prod + d.data, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._sglang_bf16_patch = True
    interp.InterpreterBuilder.create_dot = create_dot

    torch_of = {tl.bfloat16: (torch.bfloat16, np.uint16), tl.float8e4nv: (torch.float8_e4m3fn, np.uint8)}
    cast_impl, fp_to_fp = interp.InterpreterBuilder.cast_impl, interp.InterpreterBuilder.create_fp_to_fp

    def rounded(src, dst_type):
        dst = dst_type.scalar
        if dst in torch_of and src.dtype.scalar == tl.float32:
            tdt, npdt = torch_of[dst]
            out = torch.from_numpy(np.ascontiguousarray(src.data)).to(tdt).view(torch.uint8 if npdt == np.uint8
                                                                                  else torch.int16)
            return interp.TensorHandle(out.numpy().view(npdt).reshape(src.data.shape), dst)
        return None

    def cast_rne(self, src, dst_type):
        out = rounded(src, dst_type)
        return cast_impl(self, src, dst_type) if out is None else out

    def fp_to_fp_rne(self, src, dst_type, rounding_mode):
        out = rounded(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    interp.InterpreterBuilder.cast_impl = cast_rne
    interp.InterpreterBuilder.create_fp_trunc = lambda self, src, dst_type: cast_rne(self, src, dst_type)
    interp.InterpreterBuilder.create_fp_to_fp = fp_to_fp_rne

    patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    if patch_tensor is not None:  # Triton 3.6's interpreter (the device's): see scalar_index
        def patch_lang_tensor(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", scalar_index)

        interp._patch_lang_tensor = patch_lang_tensor


def scalar_index(t) -> int:
    """A kernel scalar as a Python int (`range(kb0, kb1)` bounds). The interpreter holds scalars as
    1-element arrays; Triton 3.6 converts them with int(array), which NumPy 2.4 refuses for ndim > 0
    (3.9 squeezes first, as here)."""
    return int(t.handle.data.squeeze())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands are multiplied exactly ("ieee"): the torch twins and the transformers
    reference compute fp32 models in fp32; tf32 would cost ~1e-3 relative error."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# Bytes of pipelined tiles per program: under the H100's / H200's 227 KB of shared memory per block,
# with room for the epilogue's layout conversions.
SMEM_BUDGET = 160 * 1024


def fit_stages(num_stages: int, stage_bytes: int) -> int:
    """The software-pipelining depth to launch with: the config's, cut to what SMEM_BUDGET holds
    (at least 2). Stages do not change a row's arithmetic, so this keeps batch invariance; a config
    tuned for bf16 activations would otherwise ask fp32 ones for more shared memory than the GPU has."""
    return max(2, min(num_stages, SMEM_BUDGET // max(stage_bytes, 1)))

