"""Stores of the new tokens' KV into the paged pools, one launch each.

- MLA: latent [T, C] and k_rope [T, R] -> kv_buffer[loc] = [latent | k_rope] (cast to the pool dtype);
  for a uint8 buffer, DeepSeek's FP8 row [C e4m3 | ceil(C/128) fp32 scales | R bf16] (the format:
  sglang.srt.mem_cache.kv_fp8_format; torch twin: MLATokenToKVPool.set_mla_kv_buffer, byte-equal).
- Index K: k [T, D] -> the uint8 page buffer at slot loc: FP8 (e4m3) data with one fp32 scale per
  128 values, scale = max(|block|, 1e-10) / 448 (the torch twin: NSATokenToKVPool.set_index_k), or
  the raw bf16 / fp32 values in the exact modes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import next_pow2, patch_interpreter

patch_interpreter()

FP8_E4M3_MAX = 448.0
SCALE_BLOCK = 128


@triton.jit
def _store_mla_kv_kernel(KV, LOC, LAT, ROPE, stride_kv, stride_lat, stride_rope,
                         C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t).to(tl.int64)
    oc = tl.arange(0, BLOCK_C)
    orr = tl.arange(0, BLOCK_R)
    lat = tl.load(LAT + t * stride_lat + oc, mask=oc < C)
    rope = tl.load(ROPE + t * stride_rope + orr, mask=orr < R)
    tl.store(KV + slot * stride_kv + oc, lat.to(KV.dtype.element_ty), mask=oc < C)
    tl.store(KV + slot * stride_kv + C + orr, rope.to(KV.dtype.element_ty), mask=orr < R)


@triton.jit
def _store_mla_kv_fp8_kernel(KV_U8, KV_F32, KV_BF16, LOC, LAT, ROPE, row_bytes, stride_lat, stride_rope,
                             C: tl.constexpr, R: tl.constexpr, BLK: tl.constexpr, NB: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t).to(tl.int64)
    base = slot * row_bytes
    for b in tl.static_range(NB):  # one scale per 128 latent values (a short last block if C % 128)
        offs = b * BLK + tl.arange(0, BLK)
        m = offs < C
        x = tl.load(LAT + t * stride_lat + offs, mask=m, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / 448.0
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(KV_U8 + base + offs, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)
        tl.store(KV_F32 + (base + C) // 4 + b, scale)
    orr = tl.arange(0, BLOCK_R)
    rope = tl.load(ROPE + t * stride_rope + orr, mask=orr < R, other=0.0)
    tl.store(KV_BF16 + (base + C + 4 * NB) // 2 + orr, rope.to(tl.bfloat16), mask=orr < R)


def store_mla_kv(kv_buffer: torch.Tensor, loc: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Write the new tokens' latent [T, C] and k_rope [T, R] at slots `loc`; a uint8 buffer takes FP8 rows."""
    t, c = latent.shape
    if t == 0:
        return
    r = k_rope.shape[-1]
    kv = kv_buffer.reshape(kv_buffer.shape[0], -1)
    if kv.dtype == torch.uint8:
        nb = triton.cdiv(c, SCALE_BLOCK)
        blk = SCALE_BLOCK if nb > 1 else next_pow2(c)
        if kv.shape[1] != c + 4 * nb + 2 * r or c % 4 or r % 2 or not kv.is_contiguous():
            raise ValueError(f"FP8 KV rows of {kv.shape[1]} B do not fit kv_lora_rank {c} + rope {r}")
        _store_mla_kv_fp8_kernel[(t,)](kv, kv.view(torch.float32), kv.view(torch.bfloat16), loc, latent, k_rope,
                                       kv.shape[1], latent.stride(0), k_rope.stride(0),
                                       C=c, R=r, BLK=blk, NB=nb, BLOCK_R=next_pow2(r))
        return
    _store_mla_kv_kernel[(t,)](kv, loc, latent, k_rope, kv.stride(0), latent.stride(0), k_rope.stride(0),
                               C=c, R=r, BLOCK_C=next_pow2(c), BLOCK_R=next_pow2(r))


@triton.jit
def _store_index_k_kernel(BUF_DATA, BUF_F32, LOC, K, page_size, row_data, row_f32, scale_base, stride_k,
                          D: tl.constexpr, BLK: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    for b in tl.static_range(NB):
        offs = b * BLK + tl.arange(0, BLK)
        m = offs < D
        x = tl.load(K + t * stride_k + offs, mask=m, other=0.0).to(tl.float32)
        dst = BUF_DATA + page * row_data + off * D + offs
        if FP8:
            scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / 448.0
            y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
            tl.store(dst, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)
            tl.store(BUF_F32 + page * row_f32 + scale_base + off * NB + b, scale)
        else:
            tl.store(dst, x.to(BUF_DATA.dtype.element_ty), mask=m)


def store_index_k(buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, page_size: int,
                  data_dtype: torch.dtype) -> None:
    """Quantise (FP8) and write index K [T, D] at slots `loc` of the uint8 page buffer."""
    t, d = k.shape
    if t == 0:
        return
    fp8 = data_dtype == torch.float8_e4m3fn
    nb = triton.cdiv(d, SCALE_BLOCK) if fp8 else 1
    blk = (SCALE_BLOCK if nb > 1 else next_pow2(d)) if fp8 else next_pow2(d)
    if fp8 and nb > 1 and d % SCALE_BLOCK:
        raise ValueError(f"index_head_dim {d}: FP8 blocks of 128 must tile it")
    row = buffer.shape[1]
    data = buffer if fp8 else buffer.view(data_dtype)
    _store_index_k_kernel[(t,)](
        data, buffer.view(torch.float32), loc, k, page_size, row // data_dtype.itemsize, row // 4,
        page_size * d * data_dtype.itemsize // 4, k.stride(0), D=d, BLK=blk, NB=nb, FP8=fp8)
