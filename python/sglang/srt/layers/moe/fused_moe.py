"""FusedMoE: stacked expert weights + a dispatcher + the expert runner.

Runners (--moe-runner-backend, registered in moe_registry): "torch" loops over the routed experts
on the host (fused_moe_native; the reference, and the CPU path; not graph-capturable), "triton" runs
sgl_kernel.moe.fused_experts (on-device token->expert alignment and two grouped GEMMs; no host
sync, graph-capturable).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers import batch_invariant
from sglang.srt.layers.moe.moe_registry import get_moe_runner
from sglang.srt.layers.moe.token_dispatcher import BaseDispatcher, StandardDispatcher
from sglang.srt.layers.moe.topk import TopKOutput


def set_moe_runner_backend(model: nn.Module, name: str) -> None:
    """Choose the expert runner of every FusedMoE in `model` (resolved name)."""
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.set_runner(name)


class FusedMoE(nn.Module):
    """Routed experts. Weights: w13 [E, 2 * I/tp, H] (gate rows then up rows), w2 [E, H, I/tp].

    HF checkpoints name experts `experts.{e}.{gate_proj,up_proj,down_proj}.weight`; fused
    checkpoints (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) load too.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_group: GroupCoordinator = SINGLE_GROUP,
        dispatcher: BaseDispatcher | None = None,
        dtype=None,
        ep_group: GroupCoordinator = SINGLE_GROUP,
    ) -> None:
        """Experts are TP-sharded along the intermediate dim (tp_group) or, with expert
        parallelism, split whole over ep_group: this rank holds experts [offset, offset + E / ep)."""
        super().__init__()
        tp, ep = tp_group.world_size, ep_group.world_size
        if intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size {intermediate_size} not divisible by tp size {tp}")
        if num_experts % ep:
            raise ValueError(f"n_routed_experts {num_experts} not divisible by --ep-size {ep}")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.num_local_experts = num_experts // ep
        self.intermediate_size, self.local_inter = intermediate_size, intermediate_size // tp
        self.tp_group = tp_group
        self.expert_offset = ep_group.rank * self.num_local_experts
        self.dispatcher = dispatcher or StandardDispatcher()
        self.set_runner("torch")
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.local_inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, self.local_inter, dtype=dtype), requires_grad=False)

    def set_runner(self, name: str) -> None:
        self.runner_backend = name
        self.run_experts = get_moe_runner(name).load()

    def _tp_slice(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_group.is_single:
            return w
        return w.narrow(dim, self.tp_group.rank * self.local_inter, self.local_inter)

    def load_expert_weight(self, loaded: torch.Tensor, expert_id: int, shard: str) -> None:
        """shard: 'w1' (gate_proj), 'w3' (up_proj) or 'w2' (down_proj), HF [out, in] layout."""
        n, i = self.hidden_size, self.intermediate_size
        expect = (n, i) if shard == "w2" else (i, n)
        if tuple(loaded.shape) != expect:
            raise ValueError(f"expert {expert_id} {shard}: checkpoint shape {tuple(loaded.shape)}, expected {expect}")
        local = expert_id - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return  # another expert-parallel rank's expert
        if shard == "w2":
            self.w2_weight.data[local].copy_(self._tp_slice(loaded, 1))
        else:
            off = 0 if shard == "w1" else self.local_inter
            self.w13_weight.data[local, off : off + self.local_inter].copy_(self._tp_slice(loaded, 0))

    def load_fused_weight(self, loaded: torch.Tensor, name: str) -> None:
        """`gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I]."""
        e_, n, i = self.num_experts, self.hidden_size, self.intermediate_size
        expect = (e_, 2 * i, n) if name == "gate_up_proj" else (e_, n, i)
        if tuple(loaded.shape) != expect:  # per-expert checks alone miss a wrong expert count
            raise ValueError(f"fused experts {name}: checkpoint shape {tuple(loaded.shape)}, expected {expect}")
        for e in range(self.num_experts):
            if name == "gate_up_proj":
                self.load_expert_weight(loaded[e, : self.intermediate_size], e, "w1")
                self.load_expert_weight(loaded[e, self.intermediate_size :], e, "w3")
            else:
                self.load_expert_weight(loaded[e], e, "w2")

    def forward(self, hidden_states: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        d = self.dispatcher.dispatch(hidden_states, topk)
        kw = {}
        if self.runner_backend == "triton" and batch_invariant.deterministic_inference():
            # one block config for every batch size (get_moe_config picks block_m by tokens per expert)
            from sgl_kernel.moe import batch_invariant_moe_config

            kw["config"] = batch_invariant_moe_config(self.w13_weight.dtype)
        out = self.run_experts(d.hidden_states, self.w13_weight, self.w2_weight, d.topk.topk_weights,
                               d.topk.topk_ids, self.expert_offset, **kw)
        return self.dispatcher.combine(out, d)
