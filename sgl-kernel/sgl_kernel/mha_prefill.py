"""Dense causal MHA for short DSA prefills (issue 31 item 4): the non-absorbed MLA formulation.

A prefill row whose request holds at most index_topk keys attends to every causal key (the
indexer would select them all), so it can skip the latent ("absorbed") form: decompress the keys'
latents once through kv_b_proj into per-head K_nope / V ([L, H, nope + v]), then run causal flash
attention with q = (q_nope, q_rope) against k = (K_nope, k_rope), k_rope shared by all heads:

    s[m, j] = (q_nope[m] . k_nope[j] + q_rope[m] . k_rope[j]) * sm_scale,   j <= pos[m]
    o[m]    = softmax_j(s[m]) @ v

Per key and head that is nope + rope + v = 320 multiply-adds where the absorbed form does
C + R + C = 1088 (V3.2), and the keys of a block of BLOCK_M query rows are loaded once for all
of them (the sparse kernel loads them per query row).

One program = BLOCK_M consecutive rows of one request x one head. `q_blocks` [NB, 3] int32 holds
(first row, rows, request) per block, planned on the host; the request indexes `kv_start` /
`kv_len` (its keys are rows kv_start .. kv_start + kv_len of K_nope / k_rope / V). The causal
bound is per row (`positions`), so rows need not be consecutive positions (a CP rank's lanes).
The torch twin is `mha_prefill_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import dot_precision, next_pow2, patch_interpreter

patch_interpreter()

LOG2E = 1.4426950408889634


@triton.jit
def _mha_prefill_kernel(
    Q_NOPE, Q_ROPE, K_NOPE, K_ROPE, V, O, Q_BLOCKS, KV_START, KV_LEN, POSITIONS, sm_scale_log2,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kt, stride_kh, stride_krt, stride_vt, stride_vh,
    stride_ot, stride_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    row0 = tl.load(Q_BLOCKS + qb * 3).to(tl.int64)
    nrows = tl.load(Q_BLOCKS + qb * 3 + 1)
    req = tl.load(Q_BLOCKS + qb * 3 + 2)
    kv0 = tl.load(KV_START + req).to(tl.int64)
    kv_len = tl.load(KV_LEN + req)

    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < nrows
    rows = row0 + offs_m
    pos = tl.load(POSITIONS + rows, mask=mmask, other=-1)
    d_n = tl.arange(0, BLOCK_DN)
    d_r = tl.arange(0, BLOCK_DR)
    d_v = tl.arange(0, BLOCK_DV)
    q = tl.load(Q_NOPE + rows[:, None] * stride_qt + h * stride_qh + d_n[None, :],
                mask=mmask[:, None] & (d_n[None, :] < DN), other=0.0)
    qr = tl.load(Q_ROPE + rows[:, None] * stride_rt + h * stride_rh + d_r[None, :],
                 mask=mmask[:, None] & (d_r[None, :] < DR), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    end = tl.minimum(tl.max(pos) + 1, kv_len)  # the block's last causal key
    for j0 in range(0, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        keys = kv0 + offs_n
        k = tl.load(K_NOPE + keys[:, None] * stride_kt + h * stride_kh + d_n[None, :],
                    mask=nmask[:, None] & (d_n[None, :] < DN), other=0.0)
        kr = tl.load(K_ROPE + keys[:, None] * stride_krt + d_r[None, :],
                     mask=nmask[:, None] & (d_r[None, :] < DR), other=0.0)
        v = tl.load(V + keys[:, None] * stride_vt + h * stride_vh + d_v[None, :],
                    mask=nmask[:, None] & (d_v[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s += tl.dot(qr, tl.trans(kr), input_precision=PREC)
        allowed = (offs_n[None, :] <= pos[:, None]) & nmask[None, :]
        s = tl.where(allowed, s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + d_v[None, :], out.to(O.dtype.element_ty),
             mask=mmask[:, None] & (d_v[None, :] < DV))


def plan_q_blocks(starts: list[int], lens: list[int], block_m: int) -> list[tuple[int, int, int]]:
    """(first row, rows, request) blocks of at most `block_m` rows of request d = 0, 1, ...:
    rows starts[d] .. starts[d] + lens[d] of the flat token layout."""
    blocks = []
    for d, (s, n) in enumerate(zip(starts, lens)):
        blocks.extend((r, min(block_m, s + n - r), d) for r in range(s, s + n, block_m))
    return blocks


def mha_prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    q_blocks: torch.Tensor,
    kv_start: torch.Tensor,
    kv_len: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """q_nope [T, H, DN], q_rope [T, H, DR]; k_nope [L, H, DN], k_rope [L, DR], v [L, H, DV] (row
    strides free, last dim contiguous); writes out [T, H, DV] for the rows `q_blocks` names (made
    by `plan_q_blocks` with the same block_m) and leaves the others as they are."""
    t, h, dn = q_nope.shape
    dr, dv = q_rope.shape[-1], v.shape[-1]
    for name, x in (("q_nope", q_nope), ("q_rope", q_rope), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v),
                    ("out", out)):
        if x.stride(-1) != 1:
            raise ValueError(f"mha_prefill: {name}'s last dim must be contiguous, strides {x.stride()}")
    if k_nope.shape[1:] != (h, dn) or v.shape[1] != h or k_rope.shape[-1] != dr or out.shape != (t, h, dv):
        raise ValueError(f"mha_prefill: shapes q {tuple(q_nope.shape)} k {tuple(k_nope.shape)} "
                         f"v {tuple(v.shape)} out {tuple(out.shape)} do not agree")
    nb = q_blocks.shape[0]
    if nb == 0:
        return out
    _mha_prefill_kernel[(nb, h)](
        q_nope, q_rope, k_nope, k_rope, v, out, q_blocks, kv_start, kv_len, positions, sm_scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_rope.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DN=dn, DR=dr, DV=dv, BLOCK_DN=max(16, next_pow2(dn)), BLOCK_DR=max(16, next_pow2(dr)),
        BLOCK_DV=max(16, next_pow2(dv)), BLOCK_M=block_m, BLOCK_N=block_n, PREC=dot_precision(q_nope.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def mha_prefill_ref(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    q_blocks: torch.Tensor,
    kv_start: torch.Tensor,
    kv_len: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The torch twin (fp32 math), block by block."""
    for row0, n, d in q_blocks.tolist():
        k0, kl = int(kv_start[d]), int(kv_len[d])
        rows = slice(row0, row0 + n)
        kn, kr, vv = k_nope[k0: k0 + kl].float(), k_rope[k0: k0 + kl].float(), v[k0: k0 + kl].float()
        s = torch.einsum("mhd,lhd->hml", q_nope[rows].float(), kn)
        s = s + torch.einsum("mhr,lr->hml", q_rope[rows].float(), kr)
        allowed = torch.arange(kl, device=s.device)[None, :] <= positions[rows][:, None]
        s = (s * sm_scale).masked_fill(~allowed[None], float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        out[rows] = torch.einsum("hml,lhv->mhv", p, vv).to(out.dtype)
    return out
