"""Sparse (DSA top-k) and dense-causal MLA attention over the paged latent cache, absorbed form.

One kernel serves decode and extend. Query token t (request r = token_to_req[t], position p_t)
attends, with every head, over keys given either by its top-k list (request-local positions,
-1 = none, valid entries first as the indexer emits them; SPARSE) or by all causal positions
0..p_t (dense, DeepSeek-V3). A token has at most p_t + 1 valid entries, so its loop stops there:
short requests cost their length, not index_topk. Keys are rows of the
layer's KV buffer [slots, C + R] (latent then rope), found through req_to_token; nothing is
gathered into a [tokens, k, C + R] tensor first.

    s[h, j] = (q_lat[h] . k_lat[j] + q_rope[h] . k_rope[j]) * sm_scale
    o[h]    = softmax_j(s[h]) @ k_lat        (the latent "V"; the caller applies w_vc)

Decode has few tokens, so the keys of a token are split into chunks of SPLIT_KEYS key slots, one
program each (split-K), whose partial (output, log-sum-exp) pairs a second kernel combines; extend
uses one split and writes the output directly. Shapes and grids depend only on (tokens, heads,
splits): graph-capturable. Splits past a token's keys contribute exact zeros, so with a chunking
fixed by the model (mla_split.split_keys_for, deterministic inference) the reduction order of a
(token, head) never depends on its batch mates; the serving default picks the chunking by batch
size (mla_split.decode_split_keys).

FP8 KV (a uint8 buffer of DeepSeek's rows, sglang.srt.mem_cache.kv_fp8_format): keys are
dequantised in-kernel as they are loaded (e4m3 bytes * the block's fp32 scale, cast to q's dtype;
rope read as bf16), so HBM traffic is the 656-byte row, not a dequantised copy. The torch twin is
mla_attention_ref over the dequantised buffer (the same values, so the same tolerance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import dot_precision, next_pow2, patch_interpreter

patch_interpreter()

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_rows(KV, KV_F32, KV_BF16, Q_LAT, Q_ROPE, slot, valid, offs_c, offs_r, cmask, rmask, stride_kv,
                  C: tl.constexpr, FP8: tl.constexpr, SBLK: tl.constexpr, NSCALE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """The latent and rope parts of the KV rows at `slot` (masked by `valid`), in the queries' dtypes."""
    kmask = valid[:, None] & cmask[None, :]
    if FP8:  # row = [C e4m3 | NSCALE fp32 | R bf16]; stride_kv in bytes (a multiple of 4)
        row0 = slot[:, None] * stride_kv
        raw = tl.load(KV + row0 + offs_c[None, :], mask=kmask, other=0)
        kf = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if NSCALE * SBLK == BLOCK_C:  # the row's NSCALE scales loaded once, broadcast over their blocks:
            # a [BLOCK_N, C] gather of repeated scales would be a 4-byte-per-element smem stage each
            # pipelined step (279 KB at 3 stages, over Hopper's 227 KB)
            offs_s = tl.arange(0, NSCALE)
            sc = tl.load(KV_F32 + (row0 + C) // 4 + offs_s[None, :], mask=valid[:, None], other=0.0)
            kf = tl.reshape(tl.reshape(kf, (BLOCK_N, NSCALE, SBLK)) * sc[:, :, None], (BLOCK_N, BLOCK_C))
        else:  # C not a whole number of power-of-two scale blocks
            kf = kf * tl.load(KV_F32 + (row0 + C) // 4 + offs_c[None, :] // SBLK, mask=kmask, other=0.0)
        k_lat = kf.to(Q_LAT.dtype.element_ty)
        k_rope = tl.load(KV_BF16 + (row0 + C + 4 * NSCALE) // 2 + offs_r[None, :],
                         mask=valid[:, None] & rmask[None, :], other=0.0).to(Q_ROPE.dtype.element_ty)
    else:
        k_lat = tl.load(KV + slot[:, None] * stride_kv + offs_c[None, :], mask=kmask, other=0.0)
        k_rope = tl.load(KV + slot[:, None] * stride_kv + C + offs_r[None, :],
                         mask=valid[:, None] & rmask[None, :], other=0.0)
    return k_lat, k_rope


@triton.jit
def _mla_fwd_kernel(
    Q_LAT, Q_ROPE, KV, KV_F32, KV_BF16, REQ_TO_TOKEN, REQ_POOL_IDX, TOKEN_TO_REQ, POSITIONS, TOPK, O, LSE,
    sm_scale_log2, num_heads, k_top,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kv, stride_r2t, stride_topk,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    SPARSE: tl.constexpr, FINAL: tl.constexpr, PREC: tl.constexpr,
    FP8: tl.constexpr = False, SBLK: tl.constexpr = 128, NSCALE: tl.constexpr = 1, NUM_HB: tl.constexpr = 1,
):
    # head block fastest: a token's programs run side by side and share its gathered keys in L2
    # (tokens x head blocks on axis 0: 2^31 programs; axis 1 stops at 65535, short of 128K tokens)
    t = (tl.program_id(0) // NUM_HB).to(tl.int64)  # offsets pass 2^31 at long contexts
    hb = tl.program_id(0) % NUM_HB
    split = tl.program_id(1)
    req = tl.load(TOKEN_TO_REQ + t)
    row = tl.load(REQ_POOL_IDX + req).to(tl.int64)
    pos = tl.load(POSITIONS + t)

    # int64: q_lat is a transposed bmm output whose head stride is T * C (2^25 at 64K tokens)
    heads = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    hmask = heads < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    cmask = offs_c < C
    rmask = offs_r < R
    q_lat = tl.load(Q_LAT + t * stride_qt + heads[:, None] * stride_qh + offs_c[None, :],
                    mask=hmask[:, None] & cmask[None, :], other=0.0)
    q_rope = tl.load(Q_ROPE + t * stride_rt + heads[:, None] * stride_rh + offs_r[None, :],
                     mask=hmask[:, None] & rmask[None, :], other=0.0)

    if SPARSE:  # top-k rows hold their valid positions first (-1 after), at most p_t + 1 of them
        n = tl.minimum(k_top, pos + 1)
    else:
        n = pos + 1
    if FINAL:
        start = 0
        end = n
    else:
        start = split * SPLIT_KEYS
        end = tl.minimum(start + SPLIT_KEYS, n)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        if SPARSE:
            idx = tl.load(TOPK + t * stride_topk + offs_n, mask=in_range, other=-1)
            valid = idx >= 0
            key_pos = tl.maximum(idx, 0)
        else:
            valid = in_range
            key_pos = offs_n
        slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + key_pos, mask=valid, other=0).to(tl.int64)
        k_lat, k_rope = _load_kv_rows(KV, KV_F32, KV_BF16, Q_LAT, Q_ROPE, slot, valid, offs_c, offs_r, cmask, rmask,
                                      stride_kv, C, FP8, SBLK, NSCALE, BLOCK_N, BLOCK_C)
        qk = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
        qk += tl.dot(q_rope, tl.trans(k_rope), input_precision=PREC)
        qk = tl.where(valid[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PREC)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    omask = hmask[:, None] & cmask[None, :]
    o_ptrs = O + t * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :]
    if FINAL:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=omask)
    else:
        tl.store(o_ptrs, out, mask=omask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(LSE + t * stride_lt + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _mla_combine_kernel(
    O_PART, LSE, O, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < NUM_SPLITS
    lse = tl.load(LSE + t * stride_lt + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    total = tl.sum(w, 0)
    w = w / tl.where(total == 0.0, 1.0, total)
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < C
    part = tl.load(O_PART + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps + offs_c[None, :],
                   mask=smask[:, None] & cmask[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_c, out.to(O.dtype.element_ty), mask=cmask)


def mla_attention(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_lora_rank: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    topk: torch.Tensor | None,
    sm_scale: float,
    split_keys: int = 0,
    max_keys: int = 0,
    out: torch.Tensor | None = None,
    partial: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """q_lat [T, H, C], q_rope [T, H, R], kv_buffer [slots, 1 or none, C + R] -> o_lat [T, H, C].
    A uint8 kv_buffer holds FP8 rows [C e4m3 | ceil(C/128) fp32 scales | R bf16], dequantised in-kernel.

    `topk` [T, K] int32 request-local positions (-1 = none) or None for dense causal attention.
    split_keys > 0 splits each token's keys into chunks of that many key slots (decode), for up to
    `max_keys` keys per token (K, or a bound on the context for dense): S = cdiv(max_keys,
    split_keys) programs per (token, head block). `partial` may pass preallocated
    (o_part [>= T * H * S * C] fp32, lse [>= T * H * S]) flat buffers (CUDA graphs).
    """
    t, h, c = q_lat.shape
    r = q_rope.shape[-1]
    kv = kv_buffer.reshape(kv_buffer.shape[0], -1)
    fp8 = kv.dtype == torch.uint8
    nscale = triton.cdiv(c, 128)
    width = c + 4 * nscale + 2 * r if fp8 else c + r
    if kv.shape[1] != width or c != kv_lora_rank or (fp8 and (c % 4 or r % 2 or not kv.is_contiguous())):
        raise ValueError(f"kv buffer width {kv.shape[1]} ({kv.dtype}) does not fit kv_lora_rank {c} + rope {r}")
    kv_f32, kv_bf16 = (kv.view(torch.float32), kv.view(torch.bfloat16)) if fp8 else (kv, kv)
    if out is None:
        out = q_lat.new_empty(t, h, c)
    if t == 0:
        return out
    if topk is not None and topk.stride(-1) != 1:
        topk = topk.contiguous()
    block_h = max(16, min(block_h, next_pow2(h)))
    if split_keys and split_keys % block_n:
        raise ValueError(f"split_keys {split_keys} must be a multiple of block_n {block_n}")
    num_splits = triton.cdiv(max_keys, split_keys) if split_keys else 1
    grid = (t * (num_hb := triton.cdiv(h, block_h)), num_splits)
    final = not split_keys
    if final:
        o_part, lse = out, out  # lse unused
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (0, 0)
    else:
        if partial is None:
            partial = (torch.empty(t * h * num_splits * c, dtype=torch.float32, device=q_lat.device),
                       torch.empty(t * h * num_splits, dtype=torch.float32, device=q_lat.device))
        o_part = partial[0][: t * h * num_splits * c].view(t, h, num_splits, c)
        lse = partial[1][: t * h * num_splits].view(t, h, num_splits)
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    topk_arg = topk if topk is not None else positions
    _mla_fwd_kernel[grid](
        q_lat, q_rope, kv, kv_f32, kv_bf16, req_to_token, req_pool_indices, token_to_req, positions, topk_arg, o_part, lse,
        sm_scale * LOG2E, h, topk.shape[1] if topk is not None else 0,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0), req_to_token.stride(0),
        topk_arg.stride(0), *o_strides, *l_strides,
        C=c, R=r, BLOCK_C=next_pow2(c), BLOCK_R=max(16, next_pow2(r)), BLOCK_H=block_h, BLOCK_N=block_n,
        SPLIT_KEYS=split_keys, SPARSE=topk is not None, FINAL=final, PREC=dot_precision(q_lat.dtype),
        FP8=fp8, SBLK=128 if nscale > 1 else max(c, 1), NSCALE=nscale, NUM_HB=num_hb,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not final:
        _mla_combine_kernel[(t, h)](
            o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)), C=c, BLOCK_C=next_pow2(c),
        )
    return out


def mla_attention_ref(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_lora_rank: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    topk: torch.Tensor | None,
    sm_scale: float,
) -> torch.Tensor:
    """The torch twin (fp32 math): gathers each token's keys and runs a masked softmax."""
    t, h, c = q_lat.shape
    kv = kv_buffer.reshape(kv_buffer.shape[0], -1).float()
    rows = req_to_token[req_pool_indices[token_to_req]].long()  # [T, ctx]
    if topk is None:
        width = int(positions.max()) + 1 if t else 0
        idx = torch.arange(width, device=q_lat.device).expand(t, width)
        valid = idx <= positions[:, None]
    else:
        idx, valid = topk.long().clamp(min=0), topk >= 0
    keys = kv[rows.gather(1, idx)]  # [T, K, C + R]
    scores = torch.einsum("thc,tkc->thk", q_lat.float(), keys[..., :c])
    scores = scores + torch.einsum("thr,tkr->thk", q_rope.float(), keys[..., c:])
    scores = (scores * sm_scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("thk,tkc->thc", probs, keys[..., :c]).to(q_lat.dtype)
