"""Choosing the quantisation config and applying it to a built model (the loader's steps).

    qc = get_quant_config(...)               # None: the model-dtype path (today's, the reference)
    with deferred_weights(): model = cls(...) # layers' weights on meta: nothing in the model dtype allocated
    apply_quant_config(model, qc)            # each LinearBase / FusedMoE: its method creates real weights
    model.load_weights(...)                  # checkpoint tensors, scales included, as they ship
    process_weights_after_loading(model)     # e.g. quantise a bf16 checkpoint (--quantization fp8)
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from sglang.srt.layers.quantization.base_config import QuantizationConfig

logger = logging.getLogger(__name__)

SCALE_SUFFIX = ".weight_scale_inv"


class QuantArgsError(ValueError):
    """A quantisation flag the checkpoint cannot take (`flag`: the ServerArgs field)."""

    def __init__(self, flag: str, reason: str) -> None:
        self.flag, self.reason = flag, reason
        super().__init__(f"--{flag.replace('_', '-')}: {reason}")


def get_quant_config(model_path: str, quantization: str | None = None, dequantize_fp8_weights: bool = False,
                     fp8_activation_dtype: str | None = None, load_format: str = "auto") -> QuantizationConfig | None:
    """The config a model is served with. An FP8 checkpoint is served as FP8 unless
    --dequantize-fp8-weights; --quantization fp8 quantises a bf16 checkpoint at load."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.weight_utils import checkpoint_tensor_names, read_quant_config

    ckpt = read_quant_config(model_path)
    if dequantize_fp8_weights:
        if quantization is not None:
            raise QuantArgsError("dequantize_fp8_weights", "conflicts with --quantization (serve FP8 or "
                                 "dequantise, not both)")
        if ckpt is None:
            raise QuantArgsError("dequantize_fp8_weights", f"{model_path} is not an FP8 checkpoint (no "
                                 "quantization_config in its config.json)")
        if fp8_activation_dtype is not None:
            raise QuantArgsError("fp8_activation_dtype", "the weights are dequantised (--dequantize-fp8-weights)")
        return None
    act = fp8_activation_dtype or "fp8_e4m3"  # the checkpoints' activation_scheme "dynamic"
    if ckpt is not None:
        scaled = None
        if load_format != "dummy":
            names = checkpoint_tensor_names(model_path)
            scaled = frozenset(n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX))
        skip = tuple(ckpt.get("modules_to_not_convert") or ckpt.get("ignored_layers") or ())
        return Fp8Config(tuple(ckpt["weight_block_size"]), True, act, scaled, skip)
    if quantization == "fp8":
        return Fp8Config(is_checkpoint_fp8_serialized=False, activation_dtype=act)
    if quantization is not None:
        raise QuantArgsError("quantization", f"unknown method {quantization!r}")
    if fp8_activation_dtype is not None:
        raise QuantArgsError("fp8_activation_dtype", f"{os.path.basename(model_path)} has no FP8 weights (needs "
                             "an FP8 checkpoint, or --quantization fp8)")
    return None


def _weight_layers(model: nn.Module):
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe import FusedMoE

    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LinearBase, FusedMoE))]


def apply_quant_config(model: nn.Module, qc: QuantizationConfig) -> dict[str, int]:
    """Give every weight-owning layer its method (created on the ambient device); returns the count of
    layers per method class, for the start-up log."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

    counts: dict[str, int] = {}
    for prefix, m in _weight_layers(model):
        method = qc.get_quant_method(m, prefix, model.quant_checkpoint_names(prefix, m))
        if method is None:
            method = UnquantizedLinearMethod() if isinstance(m, LinearBase) else UnquantizedFusedMoEMethod()
        m.set_quant_method(method)
        counts[type(method).__name__] = counts.get(type(method).__name__, 0) + 1
    return counts


def process_weights_after_loading(model: nn.Module) -> None:
    for _, m in _weight_layers(model):
        m.quant_method.process_weights_after_loading(m)


@torch.no_grad()
def init_dummy_quant_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """--load-format dummy on FP8 layers: e4m3 codes of N(0, 1) * 32 (normal numbers, never zeros) with
    scales std / 32, so dequantised weights are ~N(0, std) like the model-dtype dummy ones. One expert at
    a time: no full-size fp32 temporary."""
    fp8 = torch.float8_e4m3fn
    gens: dict[str, torch.Generator] = {}
    for _, m in _weight_layers(model):
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dtype != fp8:
                continue
            g = gens.setdefault(str(p.device), torch.Generator(device=p.device).manual_seed(seed))
            for chunk in (p.data if p.dim() == 3 else [p.data]):
                chunk.copy_((torch.randn(chunk.shape, generator=g, device=p.device) * 32).clamp_(-448, 448).to(fp8))
            getattr(m, name + "_scale_inv").data.fill_(std / 32)


def weight_bytes_of(model: nn.Module) -> int:
    """Bytes of the model's weights as held: parameters (FP8 codes, scale grids, model-dtype tensors) and
    the tensors derived from them that modules keep as attributes (the absorbed MLA's dequantised kv_b); each
    storage once. Buffers (rope tables) are not weights."""
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters())
    for m in model.modules():
        tensors += [v for k, v in vars(m).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total
