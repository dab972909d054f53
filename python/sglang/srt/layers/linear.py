"""Linear layers with tensor-parallel sharding and per-parameter weight loaders.

Each parameter carries `weight_loader(param, loaded, shard_id=None)` so the model's
`load_weights` maps HF names to parameters and the layer decides how to shard.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers import batch_invariant
from sglang.srt.layers.batch_invariant import MIN_INVARIANT_ROWS, rows_invariant  # noqa: F401 (re-exported)


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    _check_shape(param, loaded, getattr(param, "hf_name", "parameter"))
    param.data.copy_(loaded.to(param.dtype))


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, dtype)


class MergedReplicatedLinear(ReplicatedLinear):
    """Several replicated projections of the same input fused into one matmul
    (upstream's fused_qkv_a_proj_with_mqa = q_a_proj + kv_a_proj_with_mqa)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        offset, size = sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]
        part = param.data.narrow(0, offset, size)
        _check_shape(part, loaded, f"shard {shard_id} of a fused projection")
        part.copy_(loaded.to(param.dtype))


class ColumnParallelLinear(LinearBase):
    """Output dim split over the TP group; optionally all-gathered back."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_group: GroupCoordinator = SINGLE_GROUP,
        dtype=None,
    ) -> None:
        if out_features % tp_group.world_size:
            raise ValueError(f"out_features {out_features} not divisible by tp size {tp_group.world_size}")
        self.tp_group, self.gather_output = tp_group, gather_output
        super().__init__(in_features, out_features // tp_group.world_size, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_group.rank * shard, shard) if not self.tp_group.is_single else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = batch_invariant.linear(x, self.weight, self.bias)
        return self.tp_group.all_gather(out, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one weight (gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_group: GroupCoordinator = SINGLE_GROUP, dtype=None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, False, tp_group, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        tp = self.tp_group.world_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        if loaded.shape[0] != self.output_sizes[shard_id] or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch for shard {shard_id}: checkpoint {tuple(loaded.shape)}")
        part = loaded.narrow(0, self.tp_group.rank * size, size)
        param.data.narrow(0, offset, size).copy_(part.to(param.dtype))


class RowParallelLinear(LinearBase):
    """Input dim split over the TP group; partial outputs all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        reduce_results: bool = True,
        tp_group: GroupCoordinator = SINGLE_GROUP,
        dtype=None,
    ) -> None:
        if in_features % tp_group.world_size:
            raise ValueError(f"in_features {in_features} not divisible by tp size {tp_group.world_size}")
        self.tp_group, self.reduce_results = tp_group, reduce_results
        super().__init__(in_features // tp_group.world_size, out_features, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2 and not self.tp_group.is_single:
            shard = param.shape[1]
            loaded = loaded.narrow(1, self.tp_group.rank * shard, shard)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = batch_invariant.linear(x, self.weight)
        if self.reduce_results:
            out = self.tp_group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
