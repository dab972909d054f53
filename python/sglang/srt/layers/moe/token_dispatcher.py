"""Token dispatchers: the seam between routing and expert computation.

A dispatcher moves (hidden, topk) to where the experts live and brings results back. The
standard dispatcher keeps everything local (TP experts or a single rank); expert-parallel
dispatchers (all-to-all over torch.distributed, DeepEP where installed) implement the same
two calls. Rule: `combine(dispatch(x))` returns rows in the order and count of `x`.
`supports_cuda_graph`: whether dispatch + combine keep every shape and value on the device (no
host-read split sizes), so a decode step through them can be captured in a CUDA graph.
Dispatchers are built by name through moe_registry.create_dispatcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sglang.srt.layers.moe.topk import TopKOutput


@dataclass
class DispatchOutput:
    hidden_states: torch.Tensor
    topk: TopKOutput
    handle: object = None  # dispatcher-private state needed by combine


class BaseDispatcher(ABC):
    supports_cuda_graph: bool = False

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput: ...

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor: ...


class StandardDispatcher(BaseDispatcher):
    supports_cuda_graph = True  # nothing moves

    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        return DispatchOutput(hidden_states, topk)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        return expert_output


class AllToAllDispatcher(BaseDispatcher):
    """Expert parallelism over torch.distributed (the portable path: gloo on CPU, NCCL on GPU).

    Each token is sent once to every rank owning one of its top-k experts, with its full top-k
    (the expert runner ignores ids outside its range); each rank returns the partial sums of its
    experts and the sender adds them up. The split sizes cross to the host once per layer, as in
    DeepEP's normal mode, so this path is not CUDA-graph capturable."""

    supports_cuda_graph = False

    def __init__(self, ep_group, num_experts: int) -> None:
        self.group, self.num_local = ep_group, num_experts // ep_group.world_size
        self.elements_moved = 0  # hidden elements sent by dispatch + combine (tests, benchmarks)

    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), recv, send, group=self.group.group)
        return out

    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        ep = self.group.world_size
        dest = torch.where(topk.topk_ids >= 0, topk.topk_ids // self.num_local, -1)  # [n, k]
        to_rank = torch.stack([(dest == r).any(dim=1) for r in range(ep)])  # [ep, n]
        send_idx = torch.cat([torch.nonzero(m).flatten() for m in to_rank])
        send = to_rank.sum(dim=1)
        recv = torch.empty_like(send)
        torch.distributed.all_to_all_single(recv, send, group=self.group.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        x = self._a2a(hidden_states[send_idx], send_l, recv_l)
        ids = self._a2a(topk.topk_ids[send_idx], send_l, recv_l)
        w = self._a2a(topk.topk_weights[send_idx], send_l, recv_l)
        self.elements_moved += x.numel()
        return DispatchOutput(x, TopKOutput(w, ids), (send_idx, send_l, recv_l, hidden_states.shape[0]))

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        send_idx, send_l, recv_l, n = dispatch_output.handle
        back = self._a2a(expert_output, recv_l, send_l)
        self.elements_moved += back.numel()
        out = expert_output.new_zeros((n, expert_output.shape[-1]))
        return out.index_add_(0, send_idx, back)
