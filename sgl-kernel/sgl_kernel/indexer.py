"""DSA lightning-indexer scores over the paged index-K cache.

    score[t, j] = ks_j * sum_h w[t, h] * relu(q[t, h] . k_j),   for keys j <= p_t of t's request

q [T, H, D] holds the (Hadamard-rotated) index queries; with FP8 index K they are the FP8 values
of q (e4m3 values: exact in bf16) and the per-(t, h) FP8 scales, the softmax scale and H^-0.5
are folded into w by the caller, while the key's scale ks_j is
applied after the head sum: all factors are positive, so relu commutes with them and the products
of FP8 values are exact. Exact modes (bf16 / fp32 index K) have ks = 1.

Keys are read in place from the pool's uint8 page buffer (FP8 data, then the page's fp32 scales);
nothing is dequantised into a [tokens, L, D] tensor. Programs own a block of up to BLOCK_T
consecutive tokens of one request (the host builds the block table; decode blocks are single
tokens), so a K tile loaded once serves BLOCK_T x H query rows; their key blocks are strided over
`num_splits` programs. Token blocks whose last position is below `skip_below` are not scored at
all: the top-k of a row no longer than index_topk is all of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import dot_precision, next_pow2, patch_interpreter

patch_interpreter()


@triton.jit
def _index_scores_kernel(
    Q, W, KDATA, KSCALE, OUT, REQ_TO_TOKEN, REQ_POOL_IDX, TOKEN_TO_REQ, POSITIONS, BLOCKS,
    skip_below, out_row0, page_size, row_data, row_f32, scale_base,
    stride_qt, stride_wt, stride_out, stride_r2t,
    H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BT_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, FP8_DOT: tl.constexpr, PREC: tl.constexpr,
    PREC_W: tl.constexpr, HEAD_SUM: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    t0 = tl.load(BLOCKS + 2 * pid_b)
    nt = tl.load(BLOCKS + 2 * pid_b + 1)
    if nt == 0:
        return
    req = tl.load(TOKEN_TO_REQ + t0)
    row = tl.load(REQ_POOL_IDX + req).to(tl.int64)
    # A block's tokens belong to one request but need not be consecutive (CP local layouts).
    offs_t = tl.arange(0, BT_PAD)
    tmask = offs_t < nt
    pos_t = tl.load(POSITIONS + t0 + offs_t, mask=tmask, other=-1)
    n = tl.max(pos_t, 0) + 1  # keys of the block's latest token: 0 .. max position
    if n <= skip_below:
        return

    M: tl.constexpr = BLOCK_T * H
    rows = tl.arange(0, M)
    tok = (rows // H).to(tl.int64)  # (t0 + tok) * stride_qt must not wrap at long contexts
    head = rows % H
    rmask = tok < nt
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (t0 + tok)[:, None] * stride_qt + head[:, None] * D + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    if FP8_DOT:
        q = q.to(tl.float8e4nv)  # exact: q holds FP8 values; FP8 x FP8 tensor-core products, fp32 sums
    w = tl.load(W + (t0 + tok) * stride_wt + head, mask=rmask, other=0.0)
    if HEAD_SUM == "dot":
        # The head-weighted sum as a second matmul: W [BT_PAD, M] holds token i's head weights in its
        # own columns, so sum_h w * relu(s) runs on tensor cores instead of a cross-thread reduction
        # (tf32 for bf16 queries; BT_PAD >= 16 rows of which BLOCK_T are used).
        wmat = tl.where(tok[None, :] == offs_t[:, None], w[None, :], 0.0)  # [BT_PAD, M] fp32

    for kb in range(pid_s, tl.cdiv(n, BLOCK_N), NUM_SPLITS):
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < n
        slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + offs_n, mask=nmask, other=0).to(tl.int64)
        page = slot // page_size
        off = slot % page_size
        k_ptrs = KDATA + page[:, None] * row_data + off[:, None] * D + offs_d[None, :]
        if FP8_DOT:
            k = tl.load(k_ptrs, mask=nmask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        elif FP8:
            k = tl.load(k_ptrs, mask=nmask[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(q.dtype)
        else:
            k = tl.load(k_ptrs, mask=nmask[:, None], other=0.0).to(q.dtype)
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC), 0.0)  # [M, BLOCK_N] fp32
        if HEAD_SUM == "dot":
            sc = tl.dot(wmat, s, input_precision=PREC_W)  # [BT_PAD, BLOCK_N]
        else:  # "sum": fp32 products reduced over the H rows of each token (BT_PAD == BLOCK_T here)
            sc = tl.sum(tl.reshape(s * w[:, None], (BT_PAD, H, BLOCK_N)), axis=1)
        if FP8:
            ks = tl.load(KSCALE + page * row_f32 + scale_base + off, mask=nmask, other=0.0)
            sc = sc * ks[None, :]
        causal = offs_n[None, :] <= pos_t[:, None]
        tl.store(OUT + (t0 - out_row0 + offs_t)[:, None] * stride_out + offs_n[None, :], sc,
                 mask=tmask[:, None] & nmask[None, :] & causal)


def token_blocks(extend_starts: list[int], extend_lens: list[int], block_t: int) -> list[tuple[int, int]]:
    """(first token, count) blocks of <= block_t consecutive tokens, never crossing a request."""
    out = []
    for s, e in zip(extend_starts, extend_lens):
        out += [(s + i, min(block_t, e - i)) for i in range(0, e, block_t)]
    return out


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k_buffer: torch.Tensor,
    page_size: int,
    data_dtype: torch.dtype,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor,
    block_t: int,
    skip_below: int = 0,
    out_row0: int = 0,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    head_sum: str = "dot",
) -> torch.Tensor:
    """Write scores of each block's tokens into out[t - out_row0, :p_t + 1] (others untouched).

    q [T, H, D] (bf16 / fp32), weights [T, H] fp32 (folded), index_k_buffer uint8
    [pages, page_size * bytes/token], blocks int32 [NB, 2] (first token, count <= block_t) whose
    tokens share a request (any positions), out [T, W] fp32 with W > max position.
    `head_sum`: "dot" (the head-weighted sum as a tensor-core matmul over >= 16 padded token rows,
    tf32 for bf16 queries) or "sum" (an fp32 reduction over each token's H rows; block_t is rounded
    up to a power of two) -- same sum, other rounding and cost; bench_attention_kernels times both.
    """
    if head_sum not in ("dot", "sum"):
        raise ValueError(f"head_sum {head_sum!r} is not one of dot, sum")
    t, h, d = q.shape
    if h & (h - 1) or d & (d - 1):
        raise ValueError(f"index heads ({h}) and head dim ({d}) must be powers of two")
    nb = blocks.shape[0]
    if nb == 0 or t == 0:
        return out
    fp8 = data_dtype == torch.float8_e4m3fn
    row_bytes = index_k_buffer.shape[1]
    kdata = index_k_buffer if fp8 else index_k_buffer.view(data_dtype)
    kscale = index_k_buffer.view(torch.float32)
    data_bytes = page_size * d * data_dtype.itemsize
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(out.shape[1], block_n), triton.cdiv(264, nb)))
    _index_scores_kernel[(nb, num_splits)](
        q, weights, kdata, kscale, out, req_to_token, req_pool_indices, token_to_req, positions, blocks,
        skip_below, out_row0, page_size, row_bytes // data_dtype.itemsize, row_bytes // 4, data_bytes // 4,
        q.stride(0), weights.stride(0), out.stride(0), req_to_token.stride(0),
        H=h, D=d, BLOCK_T=next_pow2(block_t) if head_sum == "sum" else block_t,
        BT_PAD=next_pow2(block_t) if head_sum == "sum" else max(16, next_pow2(block_t)), BLOCK_N=block_n,
        NUM_SPLITS=num_splits, FP8=fp8, FP8_DOT=fp8 and q.dtype == torch.bfloat16,
        PREC=dot_precision(q.dtype), PREC_W="ieee" if q.dtype == torch.float32 else "tf32", HEAD_SUM=head_sum,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
