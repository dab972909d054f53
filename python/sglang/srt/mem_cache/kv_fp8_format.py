"""The FP8 MLA KV page format (`--kv-cache-dtype fp8_e4m3`): one place for its byte layout.

DeepSeek's FlashMLA layout, per token and layer (row of `row_bytes(C, R)` uint8):

    [ C x e4m3 latent | S x fp32 scales | R x bf16 rope ]      S = num_scale_blocks(C)

For V3.2 (C = 512, R = 64): 512 + 4 * 4 + 64 * 2 = 656 bytes (vs 1152 in bf16). Scale block b covers
latent values [128 b, min(128 (b + 1), C)): ceil(C / 128) scales; a rank under 128 is one block of C
values, a rank not divisible by 128 has a short last block (the same rule as the FP8 index K,
index_k_format.quantize_fp8_per_block). scale = max(|block|, 1e-10) / 448; the rope part stays
bf16 (rotary phases lose too much in 3 mantissa bits; upstream keeps it bf16 too).

Rows are packed back to back in a page, so a page is `page_size * row_bytes` raw bytes: HiCache and PD
move pages as bytes, never dequantised. C % 4 == 0 and R % 2 == 0 keep the fp32 scales and bf16 rope
aligned within a row (every DSA model so far: C = 512, R = 64; the tiny models: 64, 16).

Error bound (what the greedy-parity tests assume): e4m3 has 3 mantissa bits, so round to nearest is
within 2^-4 relative per value down to the subnormal range (scaled |x| < 2^-6), where the step is 2^-9;
with the block max mapped to 448: |x - deq(q(x))| <= max(2^-4 |x|, 2^-10 * blockmax / 448).
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.index_k_format import (
    FP8_E4M3_MAX,
    INDEX_K_SCALE_BLOCK,
    dequantize_fp8_per_block,
    num_scale_blocks,
    quantize_fp8_per_block,
)

KV_CACHE_DTYPES = ["auto", "fp8_e4m3"]  # --kv-cache-dtype (upstream's names)
FP8_SCALE_BLOCK = INDEX_K_SCALE_BLOCK
FP8_MAX = FP8_E4M3_MAX
ROPE_DTYPE = torch.bfloat16
# Per-value relative error of an e4m3 round to nearest (3 mantissa bits): 2^-4.
E4M3_REL_ERR = 2.0**-4


def check_dims(kv_lora_rank: int, rope_dim: int) -> None:
    if kv_lora_rank % 4 or rope_dim % 2:
        raise ValueError(f"--kv-cache-dtype fp8_e4m3 needs kv_lora_rank % 4 == 0 and qk_rope_head_dim % 2 == 0 "
                         f"(aligned scales / rope), got {kv_lora_rank}, {rope_dim}")


def num_scales(kv_lora_rank: int) -> int:
    return num_scale_blocks(kv_lora_rank)


def row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's row: 656 for C = 512, R = 64."""
    return kv_lora_rank + 4 * num_scales(kv_lora_rank) + ROPE_DTYPE.itemsize * rope_dim


def scale_offset(kv_lora_rank: int) -> int:
    """Byte offset of the fp32 scales in a row."""
    return kv_lora_rank


def rope_offset(kv_lora_rank: int) -> int:
    """Byte offset of the bf16 rope values in a row."""
    return kv_lora_rank + 4 * num_scales(kv_lora_rank)


def pack(latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """latent [..., C], k_rope [..., R] -> uint8 rows [..., row_bytes] (torch twin of the store kernel)."""
    c, r = latent.shape[-1], k_rope.shape[-1]
    q, s = quantize_fp8_per_block(latent)
    lead = latent.shape[:-1]
    parts = [q.view(torch.uint8), s.float().contiguous().view(torch.uint8).reshape(*lead, -1),
             k_rope.to(ROPE_DTYPE).contiguous().view(torch.uint8).reshape(*lead, -1)]
    out = torch.cat(parts, dim=-1)
    assert out.shape[-1] == row_bytes(c, r)
    return out


def unpack(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 rows [..., row_bytes] -> (e4m3 latent [..., C], fp32 scales [..., S], bf16 rope [..., R]);
    copies (a row's fp32 / bf16 parts need not be aligned in a gathered tensor)."""
    c, ns = kv_lora_rank, num_scales(kv_lora_rank)
    so, ro = scale_offset(c), rope_offset(c)
    q = rows[..., :c].contiguous().view(torch.float8_e4m3fn)
    s = rows[..., so:ro].contiguous().view(torch.float32)
    rope = rows[..., ro : ro + ROPE_DTYPE.itemsize * rope_dim].contiguous().view(ROPE_DTYPE)
    assert s.shape[-1] == ns
    return q, s, rope


def dequantize(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows [..., row_bytes] -> (latent [..., C], k_rope [..., R]) in `dtype` (what every reader sees)."""
    q, s, rope = unpack(rows, kv_lora_rank, rope_dim)
    return dequantize_fp8_per_block(q, s).to(dtype), rope.to(dtype)


def round_trip(latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What readers of an FP8 cache see of (latent, k_rope), in fp32."""
    return dequantize(pack(latent, k_rope), latent.shape[-1], k_rope.shape[-1])


def error_bound(latent: torch.Tensor) -> torch.Tensor:
    """Per-value bound on |latent - dequantised|: 2^-4 relative, floored by the block's subnormal step."""
    c = latent.shape[-1]
    nb = num_scales(c)
    blk = FP8_SCALE_BLOCK if nb > 1 else c
    x = latent.float()
    pad = nb * blk - c
    xp = torch.nn.functional.pad(x.abs(), (0, pad)).view(*x.shape[:-1], nb, blk)
    bmax = xp.amax(-1, keepdim=True).expand_as(xp).reshape(*x.shape[:-1], nb * blk)[..., :c]
    return torch.maximum(E4M3_REL_ERR * x.abs(), 2.0**-10 * bmax / FP8_MAX) * (1 + 1e-5) + 1e-30
