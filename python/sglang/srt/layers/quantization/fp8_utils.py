"""The FP8 block-scaled linear product, one entry for every device.

    y = x @ (W_q * s_W)^T,   s_W one fp32 scale per (bn x bk) block of W,   x quantised per token in
    groups of bk (s_x = amax / 448) when the activations are FP8 (W8A8), else kept (W8A16).

CUDA (or the Triton interpreter when a test asks): sgl_kernel.fp8_gemm. CPU: the torch twin, which
dequantises the operands in fp32 and multiplies them through `batch_invariant.linear` (CPU has no FP8
matmul; the twin computes the same function, and stays batch-invariant like every CPU projection).
W8A16 on the twin path is exactly the dequantised-weights path: the weight is dequantised to x's dtype
and multiplied by the same op, so `--fp8-activation-dtype model_dtype` equals `--dequantize-fp8-weights`.
"""

from __future__ import annotations

import torch

from sglang.srt.layers import batch_invariant
from sglang.srt.model_loader.weight_utils import block_dequant_fp8

# Tests set this to run the Triton kernels on CPU under TRITON_INTERPRET=1 (the CPU default is the twin).
KERNELS_ON_CPU = False


def use_fp8_kernels(device: torch.device) -> bool:
    from sgl_kernel.utils import is_interpreting, triton_available

    if device.type == "cuda":
        return triton_available(device)
    return KERNELS_ON_CPU and is_interpreting()


def apply_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None,
                     fp8_activations: bool = True) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T (+ bias) -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_fp8_kernels(x.device):
        from sgl_kernel.fp8_gemm import fp8_block_linear, fixed_gemm_config

        cfg = fixed_gemm_config(block_size) if batch_invariant.deterministic_inference() else None
        out = fp8_block_linear(x2, weight, weight_scale, block_size, bias, fp8_activations, config=cfg)
    elif fp8_activations:
        from sgl_kernel.fp8_quant import dequant_groups, per_token_group_quant_fp8_ref

        q, s = per_token_group_quant_fp8_ref(x2, block_size[1])
        w = block_dequant_fp8(weight, weight_scale, block_size, torch.float32)
        out = batch_invariant.linear(dequant_groups(q, s, block_size[1]), w).to(x.dtype)
        if bias is not None:
            out = out + bias
    else:
        out = batch_invariant.linear(x2, block_dequant_fp8(weight, weight_scale, block_size, x.dtype), bias)
    return out.view(*x.shape[:-1], weight.shape[0])
