"""Reference expert computation (torch): the plain twin of any fused / Triton MoE kernel, for
model-dtype experts and for FP8 block-scaled ones (the CPU path of each)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from sglang.srt.layers import batch_invariant


def fused_experts_native(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E_local, 2I, H] (gate then up); w2 [E_local, H, I]; ids global.

    Experts are visited in ascending id and their weighted outputs index-added, the same
    accumulation order as the transformers reference. Ids outside [offset, offset + E_local)
    (other EP ranks' experts, or -1 for dropped slots) contribute nothing.
    """
    out = torch.zeros_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return out
    num_local = w13.shape[0]
    local_ids = topk_ids - expert_offset
    hit = torch.unique(local_ids[(local_ids >= 0) & (local_ids < num_local)])
    inter = w2.shape[2]
    for e in hit.tolist():
        tok, slot = torch.where(local_ids == e)
        x = hidden_states[tok]
        gate_up = batch_invariant.linear(x, w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = batch_invariant.linear(h, w2[e]) * topk_weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def fused_experts_fp8_native(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int,
    block_size: tuple[int, int],
    fp8_activations: bool = True,
) -> torch.Tensor:
    """FP8 experts (w13 / w2 float8 with block grids, as Fp8MoEMethod holds them), same routing and
    order as `fused_experts_native`. Model-dtype activations: each hit expert's weights dequantised to
    the hidden dtype, then exactly `fused_experts_native`'s arithmetic (the dequantised-weights path).
    FP8 activations: the expert input and the SiLU-and-mul output are quantised per token in groups of
    bk (sgl_kernel.fp8_quant's formula) and both GEMMs run on fp32 dequantised operands; the SiLU-and-mul
    output is rounded to the hidden dtype first (the Triton kernel stores it so)."""
    from sgl_kernel.fp8_quant import dequant_groups, per_token_group_quant_fp8_ref

    from sglang.srt.model_loader.weight_utils import block_dequant_fp8

    out = torch.zeros_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return out
    bk = block_size[1]
    num_local = w13.shape[0]
    local_ids = topk_ids - expert_offset
    hit = torch.unique(local_ids[(local_ids >= 0) & (local_ids < num_local)])
    inter = w2.shape[2]
    dt = hidden_states.dtype

    def act(x: torch.Tensor) -> torch.Tensor:
        return dequant_groups(*per_token_group_quant_fp8_ref(x, bk), bk) if fp8_activations else x

    for e in hit.tolist():
        wdt = torch.float32 if fp8_activations else dt
        g13 = block_dequant_fp8(w13[e], w13_scale[e], block_size, wdt)
        g2 = block_dequant_fp8(w2[e], w2_scale[e], block_size, wdt)
        tok, slot = torch.where(local_ids == e)
        gate_up = batch_invariant.linear(act(hidden_states[tok]), g13)
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(dt)  # stored in the hidden dtype, as the kernel
        y = batch_invariant.linear(act(h), g2) * topk_weights[tok, slot, None].to(g2.dtype)
        out.index_add_(0, tok, y.to(out.dtype))
    return out
