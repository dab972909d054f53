"""W8A8 / W8A16 block-scaled GEMM (Triton) and its torch twin `fp8_block_linear_ref`.

    y[m, n] = sum_kb  s_x[m, kb] * s_w[n // bn, kb] * sum_{k in block kb} q_x[m, k] * q_w[n, k]   (W8A8)
    y[m, n] = sum_k  x[m, k] * dequant(W)[n, k]                                                    (W8A16)

W: float8_e4m3fn [N, K] with fp32 scales [ceil(N/bn), ceil(K/bk)] (DeepSeek's `weight_scale_inv`).
W8A8 takes x in the model dtype and quantises each [BLOCK_M, bk] tile in the prologue with
fp8_quant's formula (`QUANT_A`: same bytes as `per_token_group_quant_fp8`, no extra launch or HBM
round trip), so BLOCK_K = bk and one activation scale meets one weight scale per K step; the fp8
dot accumulates each K block in fp32 and is scaled into an fp32 accumulator (DeepSeek's promotion
every 128 K). W8A16 dequantises the weight tile to x's dtype in registers (the twin: the same
product of the same rounded operands).

Configs: decode-sized M (memory bound: the weight bytes are the cost) uses BLOCK_M 16 and split-K so
that enough programs stream the weight; prefill-sized M uses 128 x 128 tiles. Split-K partials go to
an fp32 buffer [S, M, N] summed in a fixed order (no atomics). --enable-deterministic-inference uses
`fixed_gemm_config`: one tile shape, no split-K, so a row's arithmetic (K order, MMA shape) is the
same at every M -- batch invariant. No host syncs, shapes fixed by (M, N, K): CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_kernel.fp8_quant import FP8_SCALE_EPS, block_dequant, dequant_groups, per_token_group_quant_fp8_ref
from sgl_kernel.utils import dot_precision, fit_stages, patch_interpreter

patch_interpreter()

FP8 = torch.float8_e4m3fn
_SMS = 132  # H100 SXM; the split-K heuristic only needs the order of magnitude


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 64
    block_n: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig.{name} = {v}: must be a power of two >= 16")
        if self.split_k < 1:
            raise ValueError(f"Fp8GemmConfig.split_k = {self.split_k}: must be >= 1")


def fixed_gemm_config(block_size: tuple[int, int]) -> Fp8GemmConfig:
    """--enable-deterministic-inference: one tile shape, no split-K, for every M (batch invariant)."""
    return Fp8GemmConfig(block_m=64, block_n=min(128, block_size[0]), split_k=1, group_m=8, num_warps=4,
                         num_stages=3)


def get_gemm_config(m: int, n: int, k: int, block_size: tuple[int, int]) -> Fp8GemmConfig:
    """Decode-sized M (<= 64): 16-row tiles (the MMA minimum) and split-K up to ~2 waves of programs;
    mid M: 64-row tiles; prefill M: 128 x 128 tiles, 8 warps."""
    bn, bk = block_size
    k_blocks = triton.cdiv(k, bk)
    if m <= 64:
        block_m, block_n = 16, min(64, bn)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split = 1
        while split * 2 <= k_blocks and tiles * split * 2 <= 2 * _SMS and k_blocks // (split * 2) >= 2:
            split *= 2
        return Fp8GemmConfig(block_m, block_n, split, 1, 4, 4)
    if m <= 512:
        return Fp8GemmConfig(64, min(128, bn), 1, 8, 4, 3)
    return Fp8GemmConfig(128, min(128, bn), 1, 8, 8, 3)


@triton.jit
def _w8_block_gemm_kernel(X, W, WS, Y, P, BIAS, M, N, K,
                          stride_xm, stride_wn, stride_wsn, stride_ym, stride_ps, stride_pm,
                          BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, QUANT_A: tl.constexpr,
                          HAS_BIAS: tl.constexpr, EPS: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    sk = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    safe_n = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb0 = sk * per_split
    kb1 = tl.minimum(kb0 + per_split, k_blocks)
    ws_ptrs = WS + (safe_n // BN) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        a = tl.load(X + offs_m.to(tl.int64)[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(W + safe_n[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        ws = tl.load(ws_ptrs + kb)
        if QUANT_A:  # W8A8: the activation tile quantised per row (fp8_quant.group_scale / quantize_tile)
            af = a.to(tl.float32)
            s = tl.div_rn(tl.maximum(tl.max(tl.abs(af), 1), EPS), 448.0)
            q = tl.minimum(tl.maximum(tl.div_rn(af, s[:, None]), -448.0), 448.0).to(tl.float8e4nv)
            part = tl.dot(q, b)
            acc += part * s[:, None] * ws[None, :]
        else:  # W8A16: the weight tile dequantised to x's dtype (the twin's operand, bit for bit)
            bw = (b.to(tl.float32) * ws[None, :]).to(a.dtype)
            acc = tl.dot(a, bw, acc, input_precision=PRECISION)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + safe_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(P + sk * stride_ps + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]) -> None:
    bn, bk = block_size
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8_block_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} [N, K]")
    if weight.dtype != FP8:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"fp8_block_linear: scale {tuple(scale.shape)} {scale.dtype}, expected fp32 {want} for "
                         f"block {list(block_size)}")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_block_linear: K block {bk} must be a power of two >= 16 (one tile per block)")


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                     bias: torch.Tensor | None = None, fp8_activations: bool = True,
                     config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (model dtype) @ dequant(weight [N, K])^T (+ bias) -> [M, N] in x's dtype."""
    _check(x, weight, scale, block_size)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bn, bk = block_size
    cfg = config or get_gemm_config(m, n, k, block_size)
    if bn % cfg.block_n and cfg.block_n % bn:
        raise ValueError(f"fp8_block_linear: BLOCK_N {cfg.block_n} and the N block {bn} must nest")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    split = cfg.split_k
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _w8_block_gemm_kernel[grid](
        x, weight, scale, y, part, bias if bias is not None else y, m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        part.stride(0) if split > 1 else 0, part.stride(1) if split > 1 else 0,
        BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, SPLIT_K=split,
        QUANT_A=fp8_activations, HAS_BIAS=bias is not None, EPS=FP8_SCALE_EPS, PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=fit_stages(cfg.num_stages, (cfg.block_m * x.element_size() + cfg.block_n) * bk))
    if split > 1:  # fixed-order reduction of the partials (no atomics)
        out = part.sum(0)
        if bias is not None:
            out += bias.float()
        y.copy_(out)
    return y


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                         bias: torch.Tensor | None = None, fp8_activations: bool = True) -> torch.Tensor:
    """Torch twin: fp32 dequantised operands (W8A8) or the weight dequantised to x's dtype (W8A16)."""
    bk = block_size[1]
    if fp8_activations:
        a = dequant_groups(*per_token_group_quant_fp8_ref(x, bk), bk)
        out = a @ block_dequant(weight, scale, block_size, torch.float32).t()
    else:
        out = (x @ block_dequant(weight, scale, block_size, x.dtype).t()).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
