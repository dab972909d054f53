"""Build a model from its ModelConfig and load HF safetensors into it."""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.model_loader.weight_utils import (
    dequantize_fp8_weights,
    iter_safetensors_weights,
    read_quant_config,
)
from sglang.srt.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for --load-format dummy: N(0, std) matrices, unit norm scales, zero biases."""
    gens: dict[str, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            g = gens.setdefault(str(p.device), torch.Generator(device=p.device).manual_seed(seed))
            p.copy_(torch.randn(p.shape, generator=g, device=p.device).mul_(std).to(p.dtype))
        elif name.endswith("bias") or "e_score_correction_bias" in name:
            p.zero_()
        else:
            p.fill_(1.0)


def get_model(model_config: ModelConfig, device: str = "cpu", tp_group: GroupCoordinator = SINGLE_GROUP,
              load_format: str = "auto", **parallel: object) -> nn.Module:
    """`parallel`: expert-parallel options for the model class (ep_group, moe_dispatch)."""
    cls = resolve_model_class(model_config.architecture)
    t0 = time.perf_counter()
    with default_dtype(model_config.dtype), torch.device(device):
        model = cls(model_config.hf_config, max_position=model_config.context_len, tp_group=tp_group, **parallel)
    if load_format == "dummy":
        init_dummy_weights(model)
        model.post_load_weights()
        logger.info("initialised %s with random (dummy) weights in %.1fs", model_config.architecture,
                    time.perf_counter() - t0)
        return model.eval()
    skip = getattr(model, "_ignored_weight", lambda name: False)
    # Drop unused tensors (e.g. the NextN layer) before dequantising them.
    weights = ((n, t) for n, t in iter_safetensors_weights(model_config.model_path) if not skip(n))
    quant = read_quant_config(model_config.model_path)
    if quant is not None:
        block = tuple(quant.get("weight_block_size", (128, 128)))
        # fp32 out: each parameter's loader casts (fp32-kept params like weights_proj lose nothing).
        weights = dequantize_fp8_weights(weights, torch.float32, block)
    model.load_weights((name, t.to(device)) for name, t in weights)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%.2fM params, %s) in %.1fs", model_config.architecture, n_params / 1e6,
                model_config.dtype, time.perf_counter() - t0)
    return model
