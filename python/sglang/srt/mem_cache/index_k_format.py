"""The DSA index-K storage format, shared by the KV pool and the indexer / attention kernels.

`--nsa-index-k-dtype` names -> storage dtype: "fp8_e4m3" stores FP8 (e4m3) with one fp32 scale
per 128 values (upstream's layout); "bfloat16" / "float32" store K exactly, without scales.
"""

from __future__ import annotations

import functools
import math

import torch

INDEX_K_DTYPE_NAMES = ["fp8_e4m3", "bfloat16", "float32"]  # --nsa-index-k-dtype
# index-K dtype name -> storage dtype; None = FP8 + scales.
INDEX_K_DTYPES = dict(zip(INDEX_K_DTYPE_NAMES, (None, torch.bfloat16, torch.float32)))

FP8_E4M3_MAX = 448.0
INDEX_K_SCALE_BLOCK = 128


def num_scale_blocks(dim: int) -> int:
    return math.ceil(dim / INDEX_K_SCALE_BLOCK)


def quantize_fp8_per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 [..., D], scales fp32 [..., ceil(D/128)])."""
    d = x.shape[-1]
    nb = num_scale_blocks(d)
    blk = INDEX_K_SCALE_BLOCK if nb > 1 else d
    xf = x.float()
    if nb * blk != d:  # ragged last block: pad with zeros (they do not change the block max)
        xf = torch.nn.functional.pad(xf, (0, nb * blk - d))
    blocks = xf.view(*x.shape[:-1], nb, blk)
    scales = blocks.abs().amax(dim=-1).clamp_min(1e-10) / FP8_E4M3_MAX
    q = (blocks / scales[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(*x.shape[:-1], nb * blk)[..., :d]
    return q.contiguous(), scales


@functools.lru_cache(maxsize=4)
def _fp8_lut(device: str) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """e4m3 -> fp32. On CPU a 256-entry table lookup beats the element-wise cast ~3x."""
    if q.device.type != "cpu":
        return q.float()
    return torch.take(_fp8_lut("cpu"), q.contiguous().view(torch.uint8).reshape(-1).long()).view(q.shape)


def dequantize_fp8_per_block(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    d = q.shape[-1]
    nb = scales.shape[-1]
    if d == nb * INDEX_K_SCALE_BLOCK or nb == 1:
        # No ragged block: scale whole blocks through a view (no repeat_interleave copy).
        blk = d // nb
        return (fp8_to_float(q).view(*q.shape[:-1], nb, blk) * scales[..., None]).view(q.shape)
    s = scales.repeat_interleave(INDEX_K_SCALE_BLOCK, dim=-1)[..., :d]
    return fp8_to_float(q) * s


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the FP8 kernels see of x (quantise then dequantise), in fp32."""
    return dequantize_fp8_per_block(*quantize_fp8_per_block(x))
