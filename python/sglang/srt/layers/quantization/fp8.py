"""DeepSeek's block-FP8 weights served as FP8 (also zai-org's GLM-5-FP8).

Format: `quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bn, bk]}`; a quantised linear stores `weight` float8_e4m3fn [N, K] and
`weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)] (dequantised = weight x the scale of its block).

Which layers are FP8 is read from the checkpoint: a layer is FP8 iff its tensors have scales (and
`modules_to_not_convert` does not name it). Without scales to read -- `--quantization fp8` on a bf16
checkpoint, or dummy weights -- `is_fp8_by_default` decides, the rule the released checkpoints follow.

Scale grids cover a layer's (TP-local, fused) weight from row 0: a shard or fused-part boundary must
fall on a block edge (the last part may end in a partial block, as kv_a_proj_with_mqa's 576 rows do),
else start-up fails naming the layer. `--quantization fp8` quantises each local fused matrix whole,
so it has no such constraint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    drop_weights,
    register_weight,
    weight_device,
)
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
# Kept in the model dtype by the released FP8 checkpoints (DeepSeek-V3 / V3.2, GLM-5): the router,
# the indexer's head weights, the MTP layer's eh_proj, embeddings and output heads (dotted components).
DEFAULT_UNQUANTIZED = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate", "indexer.weights_proj",
                       "eh_proj")


def _names_module(name: str, module: str) -> bool:
    """`module` occurs in `name` as whole dotted components ("mlp.gate" is not "mlp.gate_proj")."""
    return f".{module}." in f".{name}."


def is_fp8_by_default(name: str) -> bool:
    """The released checkpoints' rule for a linear weight `name` (a checkpoint name without '.weight')."""
    return not any(_names_module(name, m) for m in DEFAULT_UNQUANTIZED)


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    weight_block_size: tuple[int, int] = (128, 128)
    is_checkpoint_fp8_serialized: bool = True  # False: a bf16 checkpoint quantised at load
    activation_dtype: str = "fp8_e4m3"  # or "model_dtype" (W8A16)
    scaled_names: frozenset[str] | None = None  # checkpoint tensors X with X.weight_scale_inv; None: the rule
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)

    def get_name(self) -> str:
        return "fp8"

    @property
    def fp8_activations(self) -> bool:
        return self.activation_dtype == "fp8_e4m3"

    def describe(self) -> str:
        src = "FP8 checkpoint" if self.is_checkpoint_fp8_serialized else "quantised at load"
        act = "FP8 per-token-group activations" if self.fp8_activations else "model-dtype activations"
        return f"fp8 block {list(self.weight_block_size)} ({src}, {act})"

    def is_fp8(self, name: str) -> bool:
        if any(_names_module(name, m) for m in self.modules_to_not_convert):
            return False
        return name in self.scaled_names if self.scaled_names is not None else is_fp8_by_default(name)

    def get_quant_method(self, layer: nn.Module, prefix: str, checkpoint_names: list[str]):
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe import FusedMoE

        fp8 = [n for n in checkpoint_names if self.is_fp8(n)]
        if not fp8:
            return None
        if len(fp8) != len(checkpoint_names):
            plain = sorted(set(checkpoint_names) - set(fp8))
            raise ValueError(f"{prefix}: one layer loads {checkpoint_names[:4]}..., but only some are FP8 in the "
                             f"checkpoint (no scales for {plain[:4]}); use --dequantize-fp8-weights")
        if isinstance(layer, FusedMoE):
            return Fp8MoEMethod(self, prefix)
        if isinstance(layer, LinearBase):
            return Fp8LinearMethod(self, prefix)
        return None


def _param(shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int] | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=weight_device()), requires_grad=False)
    if block is not None:
        p.block_size = block  # loaders shard this grid in blocks
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tp_hint(tp: int) -> str:
    return f" at --tp-size {tp}" if tp > 1 else ""


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, config: Fp8Config, prefix: str) -> None:
        self.config, self.prefix = config, prefix
        self.block = tuple(config.weight_block_size)

    def _check_shards(self, layer: nn.Module) -> None:
        bn, bk = self.block
        tp = layer.tp_group.world_size
        if layer.shard_dim == 1 and tp > 1 and layer.in_features % bk:
            raise ValueError(f"{self.prefix}: {layer.in_features} input columns per rank{_tp_hint(tp)} are not a "
                             f"multiple of the FP8 block {bk}: the shard would split a scale block")
        sizes = layer.local_output_sizes
        for i, size in enumerate(sizes):
            cut = (layer.shard_dim == 0 and tp > 1) or i < len(sizes) - 1
            if cut and size % bn:
                what = f"part {i} of the fused layer ({sizes} rows)" if len(sizes) > 1 else "the output rows"
                raise ValueError(f"{self.prefix}: {what}{' per rank' if tp > 1 else ''}{_tp_hint(tp)} is {size}, not a "
                                 f"multiple of the FP8 "
                                 f"block {bn}: a boundary would split a scale block; use --dequantize-fp8-weights")

    def create_weights(self, layer: nn.Module) -> None:
        if not self.config.is_checkpoint_fp8_serialized:  # model-dtype weight, quantised after loading
            return UnquantizedLinearMethod().create_weights(layer)
        self._check_shards(layer)
        (bn, bk), n, k = self.block, layer.out_features, layer.in_features
        register_weight(layer, "weight", _param((n, k), FP8))
        register_weight(layer, "weight_scale_inv", _param((_cdiv(n, bn), _cdiv(k, bk)), torch.float32, self.block))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.is_checkpoint_fp8_serialized:
            return
        from sglang.srt.model_loader.weight_utils import quantize_fp8_block

        q, s = quantize_fp8_block(layer.weight.data, self.block)
        drop_weights(layer)
        register_weight(layer, "weight", nn.Parameter(q, requires_grad=False))
        register_weight(layer, "weight_scale_inv", _param_from(s, self.block))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from sglang.srt.layers.quantization.fp8_utils import apply_fp8_linear

        return apply_fp8_linear(x, layer.weight, layer.weight_scale_inv, self.block, bias,
                                self.config.fp8_activations)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        from sglang.srt.model_loader.weight_utils import block_dequant_fp8

        if layer.weight.dtype != FP8:  # --quantization fp8 before process_weights_after_loading
            return layer.weight.data  # a plain tensor, like the dequantised one (never a second Parameter)
        return block_dequant_fp8(layer.weight, layer.weight_scale_inv, self.block, layer.params_dtype)


def _param_from(t: torch.Tensor, block: tuple[int, int] | None = None) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    if block is not None:
        p.block_size = block
    return p


class Fp8MoEMethod(FusedMoEMethodBase):
    """w13_weight fp8 [E, 2I, H] + w13_weight_scale_inv [E, ceil(2I/bn), ceil(H/bk)] (gate grid then up grid:
    one grid over the fused matrix, so I must be a multiple of bn in a checkpoint), w2 likewise [E, H, I]."""

    def __init__(self, config: Fp8Config, prefix: str) -> None:
        self.config, self.prefix = config, prefix
        self.block = tuple(config.weight_block_size)

    def create_weights(self, layer: nn.Module) -> None:
        if not self.config.is_checkpoint_fp8_serialized:
            return UnquantizedFusedMoEMethod().create_weights(layer)
        (bn, bk), i = self.block, layer.local_inter
        tp = layer.tp_group.world_size
        if i % bn or (tp > 1 and i % bk):
            raise ValueError(f"{self.prefix}: moe_intermediate_size{' per rank' if tp > 1 else ''}{_tp_hint(tp)} is {i}, "
                             "not a multiple of "
                             f"the FP8 block {bn if i % bn else bk}: gate and up (or a shard) would share a scale "
                             "block; use --dequantize-fp8-weights")
        e, h = layer.num_local_experts, layer.hidden_size
        reg = layer.weight_loader
        register_weight(layer, "w13_weight", _param((e, 2 * i, h), FP8), reg)
        register_weight(layer, "w13_weight_scale_inv", _param((e, _cdiv(2 * i, bn), _cdiv(h, bk)), torch.float32,
                                                              self.block), reg)
        register_weight(layer, "w2_weight", _param((e, h, i), FP8), reg)
        register_weight(layer, "w2_weight_scale_inv", _param((e, _cdiv(h, bn), _cdiv(i, bk)), torch.float32,
                                                             self.block), reg)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.is_checkpoint_fp8_serialized:
            return
        from sglang.srt.model_loader.weight_utils import quantize_fp8_block

        out = {}
        for name in ("w13_weight", "w2_weight"):
            parts = [quantize_fp8_block(w, self.block) for w in getattr(layer, name).data]  # one expert at a time
            out[name] = torch.stack([q for q, _ in parts])
            out[name + "_scale_inv"] = torch.stack([s for _, s in parts])
        drop_weights(layer)
        for name, t in out.items():
            register_weight(layer, name, _param_from(t, self.block if name.endswith("_inv") else None),
                            layer.weight_loader)

    def apply(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, deterministic: bool) -> torch.Tensor:
        args = (hidden_states, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                layer.w2_weight_scale_inv, topk_weights, topk_ids, layer.expert_offset, self.block,
                self.config.fp8_activations)
        if layer.runner_backend == "triton":
            from sgl_kernel.fp8_moe import fixed_fp8_moe_config, fused_experts_fp8

            return fused_experts_fp8(*args, config=fixed_fp8_moe_config(self.block) if deterministic else None)
        from sglang.srt.layers.moe.fused_moe_native import fused_experts_fp8_native

        return fused_experts_fp8_native(*args)
