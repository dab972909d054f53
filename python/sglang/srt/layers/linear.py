"""Linear layers with tensor-parallel sharding and per-parameter weight loaders.

Each parameter carries `weight_loader(param, loaded, shard_id=None)` so the model's
`load_weights` maps HF names to parameters and the layer decides how to shard. The layer's
`quant_method` (layers/quantization) creates its parameters and computes its product: the model dtype
by default; FP8 block weights add a `weight_scale_inv` grid whose loaders shard in blocks
(`param.block_size`), so one loader serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers.batch_invariant import MIN_INVARIANT_ROWS, rows_invariant  # noqa: F401 (re-exported)
from sglang.srt.layers.quantization.base_config import LinearMethodBase, drop_weights
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        block = getattr(param, "block_size", None)
        hint = f" (an FP8 scale grid of {list(block)} blocks: wrong weight_block_size in config?)" if block else ""
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(loaded.shape)} vs model "
                         f"{tuple(param.shape)}{hint}")


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.dtype.itemsize == 1


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    what = getattr(param, "hf_name", "parameter")
    _check_shape(param, loaded, what)
    if _is_fp8(loaded) and not _is_fp8(param):
        raise ValueError(f"{what} is {loaded.dtype} but its layer holds {param.dtype} weights: an FP8 weight "
                         "needs its '_scale_inv' block scales in the checkpoint")
    param.data.copy_(loaded.to(param.dtype))


def _units(param: torch.Tensor, n: int, dim: int) -> int:
    """`n` weight rows (dim 0) or columns (dim 1) in the param's own units: blocks for a scale grid
    (a partial last block counts as one)."""
    block = getattr(param, "block_size", None)
    return n if block is None else -(-n // block[dim])


class LinearBase(nn.Module):
    """`tp_size` / `shard_dim`: the weight dim split over the TP group (0 column, 1 row, None replicated);
    `local_output_sizes`: this rank's rows of each fused part (one part unless merged)."""

    shard_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        if not hasattr(self, "tp_group"):
            self.tp_group = SINGLE_GROUP
        if not hasattr(self, "local_output_sizes"):
            self.local_output_sizes = [out_features]
        self.set_quant_method(UnquantizedLinearMethod())
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Replace the weight format: drops the previous method's parameters, creates the new ones."""
        drop_weights(self)
        self.quant_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight [N, K] in the params dtype (the weight itself unless quantised)."""
        return self.quant_method.dequantized_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, dtype)


class MergedReplicatedLinear(ReplicatedLinear):
    """Several replicated projections of the same input fused into one matmul
    (upstream's fused_qkv_a_proj_with_mqa = q_a_proj + kv_a_proj_with_mqa)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=None) -> None:
        self.output_sizes = self.local_output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        offset = _units(param, sum(self.output_sizes[:shard_id]), 0)
        size = _units(param, self.output_sizes[shard_id], 0)
        part = param.data.narrow(0, offset, size)
        _check_shape(part, loaded, f"shard {shard_id} of a fused projection")
        default_weight_loader(part, loaded)


class ColumnParallelLinear(LinearBase):
    """Output dim split over the TP group; optionally all-gathered back."""

    shard_dim = 0

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
        if not hasattr(self, "local_output_sizes"):
            self.local_output_sizes = [out_features // tp_group.world_size]
        super().__init__(in_features, out_features // tp_group.world_size, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_group.rank * shard, shard) if not self.tp_group.is_single else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return self.tp_group.all_gather(out, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one weight (gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_group: GroupCoordinator = SINGLE_GROUP, dtype=None) -> None:
        self.output_sizes = output_sizes
        self.local_output_sizes = [s // tp_group.world_size for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, False, tp_group, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        tp = self.tp_group.world_size
        offset = _units(param, sum(self.output_sizes[:shard_id]) // tp, 0)
        size = _units(param, self.output_sizes[shard_id] // tp, 0)
        if loaded.shape[0] != _units(param, self.output_sizes[shard_id], 0) or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch for shard {shard_id}: checkpoint {tuple(loaded.shape)}")
        part = loaded.narrow(0, self.tp_group.rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class RowParallelLinear(LinearBase):
    """Input dim split over the TP group; partial outputs all-reduced."""

    shard_dim = 1

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
        out = self.quant_method.apply(self, x)
        if self.reduce_results:
            out = self.tp_group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
