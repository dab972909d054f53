"""Reference expert computation (torch): the plain twin of any fused / Triton MoE kernel."""

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
