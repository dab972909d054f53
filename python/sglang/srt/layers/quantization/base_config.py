"""The seam between layers and weight formats (upstream SGLang's names).

A layer that owns weights (`LinearBase`, `FusedMoE`) holds a `quant_method`; the method creates the
layer's parameters (`create_weights`), may rewrite them once every checkpoint tensor is in
(`process_weights_after_loading`) and computes the layer's product (`apply`). The model never asks
which format a layer has: it builds layers, and the `QuantizationConfig` picks each one's method by
the layer's checkpoint names (`get_quant_method`).
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from typing import Iterator

import torch
from torch import nn

# Inside `deferred_weights()` layers create their weights on the meta device: a quantised model is
# built without ever allocating its model-dtype weights, then each layer's method creates the real
# ones (apply.apply_quant_config).
_DEFERRED = contextvars.ContextVar("sglang_deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_device() -> str | None:
    """Where a method creates parameters: meta while deferred, else the ambient default device."""
    return "meta" if _DEFERRED.get() else None


def register_weight(layer: nn.Module, name: str, param: nn.Parameter, loader=None) -> nn.Parameter:
    """Register a method-owned parameter (dropped again by `drop_weights` when the method changes)."""
    param.weight_loader = loader if loader is not None else layer.weight_loader
    layer.register_parameter(name, param)
    layer.__dict__.setdefault("_method_params", []).append(name)
    return param


def drop_weights(layer: nn.Module) -> None:
    for name in layer.__dict__.pop("_method_params", []):
        delattr(layer, name)


class QuantizeMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the layer's weight parameters (each with a `weight_loader`)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after every checkpoint tensor was loaded (e.g. quantise a bf16 weight)."""


class LinearMethodBase(QuantizeMethodBase):
    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] (this rank's shard; the layer reduces / gathers)."""

    @abstractmethod
    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight [N, K] in the layer's params dtype, for code that reads it as a matrix."""


class FusedMoEMethodBase(QuantizeMethodBase):
    @abstractmethod
    def apply(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """Routed experts of the rows the dispatcher delivered (global ids, layer.expert_offset)."""


class QuantizationConfig(ABC):
    @abstractmethod
    def get_name(self) -> str: ...

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str,
                         checkpoint_names: list[str]) -> QuantizeMethodBase | None:
        """The method for `layer` (module name `prefix`, loading the checkpoint tensors
        `checkpoint_names`, each without its `.weight` suffix); None keeps the layer as built."""

    def describe(self) -> str:
        return self.get_name()
