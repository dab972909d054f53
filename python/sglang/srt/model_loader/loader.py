"""Build a model from its ModelConfig and load HF safetensors into it."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.debug.hooks import install_debug_hooks
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers.quantization.apply import (
    apply_quant_config,
    get_quant_config,
    init_dummy_quant_weights,
    process_weights_after_loading,
    weight_bytes_of,
)
from sglang.srt.layers.quantization.base_config import deferred_weights
from sglang.srt.model_loader import weight_utils
from sglang.srt.model_loader.weight_utils import iter_safetensors_weights, read_quant_config
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


# Elements drawn per call: bounds the temporaries of dtypes torch cannot draw into (FP8 goes
# through a float32 chunk); the dtypes it can draw into are filled in place, with no temporary.
DUMMY_CHUNK_ELEMS = 1 << 24
_DRAWABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _param_seed(seed: int, name: str) -> int:
    """A parameter's own seed: its values depend on (seed, name) only, not on which other
    parameters exist or how big they are (a --json-model-override-args n_routed_experts change
    leaves the attention weights as they were)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def fill_normal_(t: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """t ~ N(0, std), in place in t's dtype, DUMMY_CHUNK_ELEMS at a time along dim 0."""
    rows = max(1, DUMMY_CHUNK_ELEMS // max(1, t[0].numel() if t.dim() else 1))
    for i in range(0, t.shape[0], rows):
        part = t[i : i + rows]
        if t.dtype in _DRAWABLE:
            part.normal_(0.0, std, generator=generator)
        else:  # e.g. float8_e4m3fn: draw a float32 chunk, round into the parameter
            part.copy_(torch.empty(part.shape, dtype=torch.float32, device=t.device).normal_(0.0, std,
                                                                                             generator=generator))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for --load-format dummy: N(0, std) matrices, unit norm and quantisation
    scales, zero biases; integer (packed) tensors zero. std 0.02 keeps real-shape activations in
    range (a 7168-wide hidden state times N(0, 0.02) weights stays O(1) per layer).

    Each matrix is drawn in its own dtype, in place (fill_normal_): a float32 draw of a 15 GB
    bf16 expert tensor plus its cast took 30 + 15 GB of temporaries, which the caching
    allocator then kept. Deterministic per (seed, parameter name) on a given device type."""
    gens: dict[str, torch.Generator] = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if not p.dtype.is_floating_point:
            p.zero_()
        elif p.dim() >= 2 and "scale" not in leaf:
            g = gens.setdefault(str(p.device), torch.Generator(device=p.device))
            fill_normal_(p, std, g.manual_seed(_param_seed(seed, name)))
        elif leaf == "bias" or leaf.endswith("_bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def model_weight_bytes(model_config: ModelConfig, tp_group: GroupCoordinator = SINGLE_GROUP,
                       **parallel: object) -> int:
    """Bytes the model's parameters and buffers will take on the device, from an instance on the
    meta device (nothing allocated): the plan's figure for a model loaded after it (a draft)."""
    cls = resolve_model_class(model_config.architecture)
    with default_dtype(model_config.dtype), torch.device("meta"):
        model = cls(model_config.hf_config, max_position=model_config.context_len, tp_group=tp_group, **parallel)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def get_model(model_config: ModelConfig, device: str = "cpu", tp_group: GroupCoordinator = SINGLE_GROUP,
              load_format: str = "auto", quantization: str | None = None, dequantize_fp8_weights: bool = False,
              fp8_activation_dtype: str | None = None, **parallel: object) -> nn.Module:
    """`parallel`: expert-parallel options for the model class (ep_group, moe_dispatch). An FP8 checkpoint is
    served as FP8 (layers/quantization) unless `dequantize_fp8_weights`; `quantization="fp8"` quantises a
    model-dtype checkpoint at load."""
    cls = resolve_model_class(model_config.architecture)
    t0 = time.perf_counter()
    qc = get_quant_config(model_config.model_path, quantization, dequantize_fp8_weights, fp8_activation_dtype,
                          load_format)
    with default_dtype(model_config.dtype), torch.device(device):
        with deferred_weights() if qc is not None else contextlib.nullcontext():
            model = cls(model_config.hf_config, max_position=model_config.context_len, tp_group=tp_group, **parallel)
        if qc is not None:
            counts = apply_quant_config(model, qc)
    if load_format == "dummy":
        init_dummy_weights(model)
        if qc is not None:
            init_dummy_quant_weights(model)
            process_weights_after_loading(model)
        model.post_load_weights()
        logger.info("initialised %s with random (dummy) weights in %.1fs", model_config.architecture,
                    time.perf_counter() - t0)
        _log_weights(model, model_config, qc, counts if qc is not None else None, tp_group)
        return _ready(model)
    skip = getattr(model, "_ignored_weight", lambda name: False)
    # Drop unused tensors (e.g. the NextN layer) before dequantising them.
    weights = ((n, t) for n, t in iter_safetensors_weights(model_config.model_path) if not skip(n))
    quant = read_quant_config(model_config.model_path)
    if quant is not None and qc is None:  # --dequantize-fp8-weights: today's bf16 path, the reference
        block = tuple(quant.get("weight_block_size", (128, 128)))
        # fp32 out: each parameter's loader casts (fp32-kept params like weights_proj lose nothing).
        weights = weight_utils.dequantize_fp8_weights(weights, torch.float32, block)
    model.load_weights((name, t.to(device)) for name, t in weights)
    if qc is not None:
        process_weights_after_loading(model)
        model.post_load_weights()  # again: derived tensors (absorbed kv_b) from the final weights
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%.2fM params, %s) in %.1fs", model_config.architecture, n_params / 1e6,
                model_config.dtype, time.perf_counter() - t0)
    _log_weights(model, model_config, qc, counts if qc is not None else None, tp_group)
    return _ready(model)


def _ready(model: nn.Module) -> nn.Module:
    """The loaded model in eval mode, with the debug hooks the environment asks for (none unless a
    debug variable is set: debug/hooks.py)."""
    install_debug_hooks(model)
    return model.eval()


def _log_weights(model: nn.Module, model_config: ModelConfig, qc, counts: dict | None,
                 tp_group: GroupCoordinator) -> None:
    """Start-up log: the weight bytes this rank holds (the memory plan's first term)."""
    held = weight_bytes_of(model)
    if qc is None:
        logger.info("weights: %.3f GiB on this GPU/rank (%s, rank %d of %d)", held / 2**30, model_config.dtype,
                    tp_group.rank, tp_group.world_size)
        return
    logger.info("weights: %.3f GiB on this GPU/rank (%s; layers: %s; rank %d of %d)", held / 2**30, qc.describe(),
                ", ".join(f"{v} {k.removesuffix('Method')}" for k, v in sorted(counts.items())), tp_group.rank,
                tp_group.world_size)
