"""Batch invariance: a row's result must not depend on how many rows share a call.

Two levels, one place:
- Always (the default path, unchanged): `rows_invariant` zero-pads CPU matmuls of fewer than
  MIN_INVARIANT_ROWS rows, because CPU BLAS (MKL / oneDNN) switches kernels below that; the
  attention and MoE kernels of sgl_kernel already use fixed chunkings. This is what makes greedy
  decoding batch-invariant on CPU.
- `--enable-deterministic-inference` (upstream's flag): the dense projections (linears, MLA
  absorb / output bmm, router, lm_head), the MoE expert GEMMs and RMSNorm run through
  sgl_kernel.batch_invariant's fixed-order Triton kernels wherever Triton runs (CUDA, or CPU under
  TRITON_INTERPRET), and the fused MoE uses one block config for every batch size. On a GPU this is
  what removes cuBLAS's batch-size-dependent kernel choice; elsewhere it falls back to the default
  path (already invariant on CPU).

The switch is process-wide (`set_deterministic_inference`, set by every ModelRunner from its
ServerArgs), like the kernels it selects: a process serves one configuration.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

# CPU BLAS (MKL / oneDNN) runs matrices of fewer rows through other kernels, so a row's rounding
# would depend on how many rows (requests) share the call; from this many rows on, each row's
# result is the same whatever the count (tested in test_linear_rows_are_batch_invariant).
MIN_INVARIANT_ROWS = 16

_DETERMINISTIC = False


def set_deterministic_inference(enabled: bool) -> None:
    global _DETERMINISTIC
    _DETERMINISTIC = bool(enabled)


def deterministic_inference() -> bool:
    return _DETERMINISTIC


def _use_kernels(x: torch.Tensor) -> bool:
    if not _DETERMINISTIC:
        return False
    from sgl_kernel.utils import triton_available

    return triton_available(x.device)


def rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """fn(x) for a row-wise fn (a matmul over x's rows along `dim`), computed so each row's result
    does not depend on how many rows x has: on CPU, fewer than MIN_INVARIANT_ROWS rows are
    zero-padded up to it."""
    n = x.shape[dim]
    if x.device.type != "cpu" or n >= MIN_INVARIANT_ROWS or n == 0:
        return fn(x)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, MIN_INVARIANT_ROWS - n]
    return fn(F.pad(x, pad)).narrow(dim, 0, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), batch-invariant (x [..., K], weight [N, K])."""
    if _use_kernels(x):
        from sgl_kernel.batch_invariant import matmul

        out = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return rows_invariant(lambda a: F.linear(a, weight, bias), x)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) with a [B, M, K] (M = tokens), batch-invariant in M."""
    if _use_kernels(a):
        from sgl_kernel.batch_invariant import matmul

        return matmul(a, b)
    return rows_invariant(lambda t: torch.bmm(t, b), a, dim=1)


# Row width that covers whole SIMD vectors on every CPU (AVX-512: 16 fp32): see `rowwise`.
ROW_ALIGN = 64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fill: float) -> torch.Tensor:
    """fn over the last dim (element-wise, or a row softmax that `fill` does not change), batch-invariant.
    CPU element-wise kernels run whole vectors, then a scalar tail whose transcendental functions round
    differently; where a row's elements land relative to the tail depends on the row count when rows
    are not whole vectors (e.g. 8 router logits). In deterministic mode rows are padded with `fill` to a
    multiple of ROW_ALIGN so every element goes through the vector path. Otherwise fn(x)."""
    pad = -x.shape[-1] % ROW_ALIGN
    if not _DETERMINISTIC or x.device.type != "cpu" or not pad:
        return fn(x)
    return fn(F.pad(x, (0, pad), value=fill))[..., : x.shape[-1]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plain: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
    """RMSNorm through the per-row kernel in deterministic mode, else `plain(x)` (the twin)."""
    if _use_kernels(x):
        from sgl_kernel.batch_invariant import rms_norm as kernel

        return kernel(x, weight, eps)
    return plain(x)
