"""Weights in the model dtype: the path every layer takes without a quantisation config (unchanged
behaviour: the reference, and the CPU default)."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers import batch_invariant
from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    register_weight,
    weight_device,
)


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=weight_device()), requires_grad=False)


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer: nn.Module) -> None:
        register_weight(layer, "weight", _param((layer.out_features, layer.in_features), layer.params_dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return batch_invariant.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def create_weights(self, layer: nn.Module) -> None:
        e, i, h = layer.num_local_experts, layer.local_inter, layer.hidden_size
        register_weight(layer, "w13_weight", _param((e, 2 * i, h), layer.params_dtype), layer.weight_loader)
        register_weight(layer, "w2_weight", _param((e, h, i), layer.params_dtype), layer.weight_loader)

    def apply(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, deterministic: bool) -> torch.Tensor:
        kw = {}
        if layer.runner_backend == "triton" and deterministic:
            # one block config for every batch size (get_moe_config picks block_m by tokens per expert)
            from sgl_kernel.moe import batch_invariant_moe_config

            kw["config"] = batch_invariant_moe_config(layer.w13_weight.dtype)
        return layer.run_experts(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 layer.expert_offset, **kw)
