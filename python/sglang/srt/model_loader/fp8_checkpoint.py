"""Write a checkpoint in DeepSeek's block-FP8 format (the `builtin:*-fp8` models), and its exact
fp32 dequantisation (the oracle checkpoint transformers loads in the parity tests).

Format, as DeepSeek-V3 / V3.2 and zai-org/GLM-5-FP8 ship it: config.json gains
`quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bn, bk]}`; each quantised linear `X.weight` becomes float8_e4m3fn [N, K] plus
`X.weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)] (dequantised = weight x its block's scale).
Which linears are quantised follows the released checkpoints (quantization.fp8.is_fp8_by_default):
embeddings, heads, the router, the indexer's weights_proj and the MTP eh_proj stay as they were.
"""

from __future__ import annotations

import json
import os
import zlib

import torch

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def _safetensors_files(model_dir: str) -> list[str]:
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {model_dir}, found {files}")
    return [os.path.join(model_dir, files[0])]


def quantizable(name: str, t: torch.Tensor) -> bool:
    """A linear weight the released FP8 checkpoints store as FP8."""
    from sglang.srt.layers.quantization.fp8 import is_fp8_by_default

    return name.endswith(".weight") and t.dim() == 2 and t.dtype.is_floating_point and is_fp8_by_default(
        name[: -len(".weight")])


def _block_gains(name: str, shape: torch.Size, block_size: tuple[int, int]) -> torch.Tensor:
    """A deterministic gain in [1/2, 2] per block (element-wise [N, K]): the random tiny weights have
    near-equal block maxima, so without it every scale would be ~equal and a misplaced block (a wrong
    partial-block offset, a transposed grid) would go unnoticed; real checkpoints' scales vary too."""
    bn, bk = block_size
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    gains = 2.0 ** (torch.rand(-(-shape[0] // bn), -(-shape[1] // bk), generator=g) * 2 - 1)
    return gains.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def quantize_checkpoint_fp8(model_dir: str, block_size: tuple[int, int] = (128, 128)) -> list[str]:
    """Rewrite `model_dir`'s weights in place in the block-FP8 format (each block first scaled by its
    `_block_gains`); returns the quantised names."""
    from safetensors.torch import load_file, save_file

    from sglang.srt.model_loader.weight_utils import quantize_fp8_block

    (path,) = _safetensors_files(model_dir)
    tensors = load_file(path)
    out: dict[str, torch.Tensor] = {}
    done = []
    for name, t in tensors.items():
        if quantizable(name, t):
            q, s = quantize_fp8_block(t.float() * _block_gains(name, t.shape, block_size), block_size)
            out[name], out[name + "_scale_inv"] = q, s
            done.append(name)
        else:
            out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata={"format": "pt"})
    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": list(block_size)}
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    return done


def write_fp32_dequantized(fp8_dir: str, out_dir: str) -> str:
    """`fp8_dir`'s checkpoint with every FP8 weight replaced by its exact fp32 dequantisation and every
    other tensor upcast to fp32 (both exact), config.json without quantization_config: a checkpoint any
    loader -- transformers included -- reads as plain fp32."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sglang.srt.model_loader.weight_utils import dequantize_fp8_weights, read_quant_config

    block = tuple(read_quant_config(fp8_dir)["weight_block_size"])
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(fp8_dir):
        if not f.endswith(".safetensors") and os.path.isfile(os.path.join(fp8_dir, f)):
            shutil.copy(os.path.join(fp8_dir, f), out_dir)
    (path,) = _safetensors_files(fp8_dir)
    deq = dict(dequantize_fp8_weights(load_file(path).items(), torch.float32, block))
    deq = {k: (v.float() if v.dtype.is_floating_point else v).contiguous() for k, v in deq.items()}
    save_file(deq, os.path.join(out_dir, os.path.basename(path)), metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
