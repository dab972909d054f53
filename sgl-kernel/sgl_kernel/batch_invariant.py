"""Batch-invariant matmul and RMSNorm (`--enable-deterministic-inference`).

Library GEMMs (cuBLAS, and CPU BLAS below a row count) pick kernels, tile shapes and split-K by the
problem size, so a row's rounding depends on how many rows share the call: a prompt alone and the
same prompt in a batch give different last bits, then different tokens. These kernels fix the
reduction order by construction:

- `matmul(a, b)`: one (BLOCK_M x BLOCK_N) output tile per program and K range, the K loop in BLOCK_K
  steps, fp32 accumulation; the tiles are constants and the split-K count a function of (N, K, the
  device) -- never of M -- and the splits' partials are summed in split order, so each output
  element is the same sequence of tile dots whatever the number of rows. Batched
  ([B, M, K] @ [B, K, N]) through a third grid axis. Twin: torch.matmul (equal within rounding).
- `rms_norm(x, w, eps)`: one program per row, the whole row in one block: the row's sum of squares
  has the same order in any batch. Twin: RMSNorm._norm (fp32 statistics, output in x's dtype).

Cost: one tile config means large shapes miss cuBLAS's tuned kernels, and split-K (for decode's
parallelism) costs prefill a pass over fp32 partials; benchmark/kernels/bench_batch_invariant.py
measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import dot_precision, next_pow2, patch_interpreter

patch_interpreter()

# The tile config is a constant (never chosen from M, the row count), sized for Hopper bf16 tiles;
# fp32 halves BLOCK_K so the pipelined tiles stay within shared memory.
MATMUL_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
# Split-K, chosen from the weight's (N, K) and the device only -- never from M -- so a row's sum is
# the same sequence of partial sums in any batch: without it a decode projection with few output
# tiles (kv_a 7168 -> 576: 9 tiles) runs 9 programs on 132 SMs, each looping over all of K.
# Splits are fixed K ranges of whole BLOCK_K steps; their fp32 partials are summed in split order.
SPLIT_K_MAX = 16
MIN_K_BLOCKS_PER_SPLIT = 4
_CPU_SMS = 8  # the interpreter has no SMs; a small count still exercises split-K in CPU tests


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_SMS


def matmul_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The config of every a [*, K] @ b [K, N] call on this device: tiles and SPLIT_K (the number of
    K ranges), enough programs for ~2 waves of the SMs at one M tile (decode)."""
    cfg = dict(MATMUL_CONFIG)
    if dtype == torch.float32:
        cfg["BLOCK_K"] = 32
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    k_blocks = triton.cdiv(k, cfg["BLOCK_K"])
    split = max(1, min(SPLIT_K_MAX, 2 * _num_sms(device) // max(n_tiles, 1), k_blocks // MIN_K_BLOCKS_PER_SPLIT))
    cfg["SPLIT_K"] = 1 << (split.bit_length() - 1)  # a power of two
    return cfg


@triton.jit
def _bi_matmul_kernel(A, B, C, BIAS, WS, M, N, K, K_PER_SPLIT, s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm,
                      s_cn, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    bat = tl.program_id(2).to(tl.int64)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mm, nm = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # fixed order within the split, for every M
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = offs_k < k_hi
        a = tl.load(A + bat * s_ab + offs_m[:, None] * s_am + offs_k[None, :] * s_ak,
                    mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(B + bat * s_bb + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn,
                    mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PREC)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(C + bat * s_cb + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn, acc.to(C.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])
    else:  # fp32 partials WS [SPLIT_K, B, M, N], summed by _bi_split_sum_kernel
        nb = tl.num_programs(2).to(tl.int64)
        ws = WS + ((split * nb + bat) * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(ws, acc, mask=mm[:, None] & nm[None, :])


@triton.jit
def _bi_split_sum_kernel(WS, C, BIAS, M, N, s_cb, s_cm, s_cn, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                         BLOCK: tl.constexpr):
    bat = tl.program_id(1).to(tl.int64)
    nb = tl.num_programs(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT_K):  # split order: the same sum for every M
        acc += tl.load(WS + (s * nb + bat) * M * N + offs, mask=mask, other=0.0)
    row, col = offs // N, offs % N
    if HAS_BIAS:
        acc += tl.load(BIAS + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + bat * s_cb + row * s_cm + col * s_cn, acc.to(C.dtype.element_ty), mask=mask)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) or a [B, M, K] @ b [B, K, N] -> a's dtype; any strides
    (pass weight.t() for a linear). Each output row is computed the same way for any M."""
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a[None], b[None])
    nb, m, k = a3.shape
    n = b3.shape[2]
    if b3.shape[1] != k or b3.shape[0] != nb:
        raise ValueError(f"matmul shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    out = torch.empty((nb, m, n), dtype=a.dtype, device=a.device)
    if m and n:
        cfg = matmul_config(n, k, a.dtype, a.device)
        split = cfg["SPLIT_K"]
        k_per_split = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), split) * cfg["BLOCK_K"]
        ws = torch.empty((split, nb, m, n), dtype=torch.float32, device=a.device) if split > 1 else out
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]) * split, nb)
        has_bias = bias is not None
        _bi_matmul_kernel[grid](a3, b3, out, bias if has_bias else out, ws, m, n, k, k_per_split,
                                a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
                                out.stride(0), out.stride(1), out.stride(2), HAS_BIAS=has_bias,
                                PREC=dot_precision(a.dtype), **cfg)
        if split > 1:
            block = 1024
            _bi_split_sum_kernel[(triton.cdiv(m * n, block), nb)](
                ws, out, bias if has_bias else out, m, n, out.stride(0), out.stride(1), out.stride(2),
                HAS_BIAS=has_bias, SPLIT_K=split, BLOCK=block)
    return out if batched else out[0]


@triton.jit
def _bi_rms_norm_kernel(X, W, Y, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    y = (x * r).to(X.dtype.element_ty)  # as the twin: normalise in fp32, cast to x's dtype, then scale
    w = tl.load(W + offs, mask=m, other=0.0)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, one program per row (x [..., H], weight [H])."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _bi_rms_norm_kernel[(x2.shape[0],)](x2, weight, y, h, x2.stride(0), y.stride(0), eps, BLOCK=next_pow2(h))
    return y.view(*x.shape[:-1], h)
