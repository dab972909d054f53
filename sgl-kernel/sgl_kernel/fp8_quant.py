"""Per-token-group FP8 activation quantisation (DeepSeek's dynamic scheme) and its torch twin.

    s[m, g] = max(amax(|x[m, g*G : (g+1)*G]|), EPS) / 448        (fp32, IEEE division)
    q[m, k] = e4m3(clamp(x[m, k] / s[m, k // G], -448, 448))      (round to nearest even)

G is the weight's K block (128 in the checkpoints), so one activation scale meets one weight scale per
K block of the block-scaled GEMM. The kernel divides with `tl.div_rn` (the default `/` is approximate on
the GPU) so its bytes equal the twin's on every device. A row's values depend only on the row: batch
invariant by construction; no host syncs (graph-capturable). The same formula also runs in the GEMM's
prologue at decode M (fp8_gemm, A_MODE 1) and in the fused MoE's gate-up epilogue (fp8_moe, on the
SiLU-and-mul output rounded to the hidden dtype), with the same bytes (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sgl_kernel.utils import next_pow2, patch_interpreter

patch_interpreter()

FP8_E4M3_MAX = 448.0
FP8_SCALE_EPS = 1e-10  # an all-zero group gets this floor, not 0/0
FP8 = torch.float8_e4m3fn


@triton.jit
def group_scale(x, EPS: tl.constexpr):
    """Row-wise scales of an fp32 tile [BM, G] (one group per row)."""
    return tl.div_rn(tl.maximum(tl.max(tl.abs(x), 1), EPS), 448.0)


@triton.jit
def quantize_tile(x, scale):
    """fp32 tile [BM, G] / its row scales -> e4m3 (same bytes as the torch twin)."""
    return tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def _per_token_group_quant_kernel(X, Q, S, M, K, stride_x, stride_q, stride_s,
                                  G: tl.constexpr, G_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                                  EPS: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    g = tl.program_id(1)
    cols = g * G + tl.arange(0, G_P2)
    mask = (rows[:, None] < M) & (cols[None, :] < K) & (tl.arange(0, G_P2)[None, :] < G)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = group_scale(x, EPS)
    q = quantize_tile(x, s)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q.to(tl.uint8, bitcast=True), mask=mask)
    tl.store(S + rows * stride_s + g, s, mask=rows < M)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q float8_e4m3fn [M, K], scales fp32 [M, ceil(K / group_size)])."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant_fp8: x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    ng = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    if m and k:
        x = x if x.stride(1) == 1 else x.contiguous()
        block_m = max(1, min(16, 4096 // next_pow2(group_size)))
        _per_token_group_quant_kernel[(triton.cdiv(m, block_m), ng)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), G=group_size, G_P2=next_pow2(group_size),
            BLOCK_M=block_m, EPS=FP8_SCALE_EPS, num_warps=4)
    return q.view(FP8), s


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `per_token_group_quant_fp8` (equal bytes)."""
    m, k = x.shape
    ng = -(-k // group_size)
    xp = F.pad(x.float(), (0, ng * group_size - k)).view(m, ng, group_size)  # zeros never raise an amax
    amax = xp.abs().amax(dim=-1).clamp(min=FP8_SCALE_EPS)
    # a tensor divisor: CUDA torch divides by a Python scalar as a multiply by its reciprocal, which
    # rounds differently from the kernel's correctly rounded division (1-ulp scale differences)
    s = amax / torch.full_like(amax, FP8_E4M3_MAX)
    q = (xp / s[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).view(m, ng * group_size)[:, :k]
    return q.contiguous().to(FP8), s


def dequant_groups(q: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 values of per-token-group quantised activations (the twins' exact operand)."""
    k = q.shape[-1]
    return q.float() * s.repeat_interleave(group_size, dim=-1)[..., :k]


def block_dequant(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
    """weight [..., N, K] float8 x its [..., ceil(N/bn), ceil(K/bk)] block scales, in fp32, cast to dtype."""
    bn, bk = block_size
    n, k = weight.shape[-2:]
    s = scale.float().repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    return (weight.float() * s).to(dtype)
