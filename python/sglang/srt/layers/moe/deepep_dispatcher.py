"""DeepEP normal-mode dispatch / combine (`--moe-a2a-backend deepep`), for NVLink/RDMA expert
parallelism on GPUs. Start-up validation already proved `deep_ep` importable.

DeepEP returns received top-k ids local to this rank (-1 for other ranks' experts); they are
shifted back to global ids so the expert runners keep one convention (global ids + offset).
Not run in CI (needs several GPUs and the package); the all-to-all dispatcher is its tested twin.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.moe.token_dispatcher import BaseDispatcher, DispatchOutput
from sglang.srt.layers.moe.topk import TopKOutput

NVL_BUFFER_BYTES = 1 << 30


class DeepEPDispatcher(BaseDispatcher):
    supports_cuda_graph = False  # normal mode: the layout's counts size the receive buffers on the host

    def __init__(self, ep_group, num_experts: int) -> None:
        import deep_ep

        self.num_experts = num_experts
        self.offset = ep_group.rank * (num_experts // ep_group.world_size)
        self.buffer = deep_ep.Buffer(ep_group.group, NVL_BUFFER_BYTES, 0)

    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        idx = topk.topk_ids.to(torch.int64)
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, self.num_experts)
        x, r_idx, r_w, _, handle, _ = self.buffer.dispatch(
            hidden_states, topk_idx=idx, topk_weights=topk.topk_weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        ids = torch.where(r_idx >= 0, r_idx + self.offset, -1)
        return DispatchOutput(x, TopKOutput(r_w, ids), handle)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        out, _, _ = self.buffer.combine(expert_output, dispatch_output.handle)
        return out
