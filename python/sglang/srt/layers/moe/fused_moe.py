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
from sglang.srt.layers.linear import default_weight_loader
from sglang.srt.layers.moe.moe_registry import get_moe_runner
from sglang.srt.layers.moe.token_dispatcher import BaseDispatcher, StandardDispatcher
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase, drop_weights
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod


def set_moe_runner_backend(model: nn.Module, name: str) -> None:
    """Choose the expert runner of every FusedMoE in `model` (resolved name)."""
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.set_runner(name)


class FusedMoE(nn.Module):
    """Routed experts. Weights: w13 [E, 2 * I/tp, H] (gate rows then up rows), w2 [E, H, I/tp].

    HF checkpoints name experts `experts.{e}.{gate_proj,up_proj,down_proj}.weight`; fused
    checkpoints (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) load too. The
    `quant_method` creates and applies the weights (FP8 adds `*_weight_scale_inv` block grids, loaded
    per expert from `...{proj}.weight_scale_inv`).
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
        self.params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.set_quant_method(UnquantizedFusedMoEMethod())

    def set_quant_method(self, method: FusedMoEMethodBase) -> None:
        drop_weights(self)
        self.quant_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)  # whole stacked tensors; experts load via load_expert_weight

    def set_runner(self, name: str) -> None:
        self.runner_backend = name
        self.run_experts = get_moe_runner(name).load()

    def load_expert_weight(self, loaded: torch.Tensor, expert_id: int, shard: str, leaf: str = "weight") -> None:
        """shard: 'w1' (gate_proj), 'w3' (up_proj) or 'w2' (down_proj), HF [out, in] layout; leaf: 'weight' or
        'weight_scale_inv' (an FP8 block grid: the same slicing, in blocks)."""
        param = getattr(self, f"{'w2' if shard == 'w2' else 'w13'}_{leaf}", None)
        if param is None:
            raise ValueError(f"expert {expert_id} {shard}: the checkpoint has '{leaf}' but these experts hold "
                             f"{self.w13_weight.dtype} weights without block scales")
        block = getattr(param, "block_size", (1, 1))
        rows, cols = (lambda n: -(-n // block[0])), (lambda n: -(-n // block[1]))
        n, i, li = self.hidden_size, self.intermediate_size, self.local_inter
        expect = (rows(n), cols(i)) if shard == "w2" else (rows(i), cols(n))
        if tuple(loaded.shape) != expect:
            raise ValueError(f"expert {expert_id} {shard} {leaf}: checkpoint shape {tuple(loaded.shape)}, expected "
                             f"{expect}" + (" (wrong weight_block_size in config?)" if leaf != "weight" else ""))
        local = expert_id - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return  # another expert-parallel rank's expert
        r = self.tp_group.rank
        if shard == "w2":
            part = loaded if self.tp_group.is_single else loaded.narrow(1, r * cols(li), cols(li))
            dst = param.data[local]
        else:
            part = loaded if self.tp_group.is_single else loaded.narrow(0, r * rows(li), rows(li))
            off = 0 if shard == "w1" else rows(li)
            dst = param.data[local, off : off + part.shape[0]]
        if loaded.dtype.itemsize == 1 and loaded.dtype.is_floating_point and param.dtype != loaded.dtype:
            raise ValueError(f"expert {expert_id} {shard}: the checkpoint weight is {loaded.dtype} but these experts "
                             f"hold {param.dtype}: an FP8 weight needs its '_scale_inv' block scales")
        dst.copy_(part.to(param.dtype))

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
        out = self.quant_method.apply(self, d.hidden_states, d.topk.topk_weights, d.topk.topk_ids,
                                      batch_invariant.deterministic_inference())
        return self.dispatcher.combine(out, d)
