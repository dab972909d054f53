"""Fused MoE with FP8 block-scaled expert weights (Triton); torch twin:
sglang.srt.layers.moe.fused_moe_native.fused_experts_fp8_native.

Same routing and pipeline as the bf16 `moe.fused_experts` (moe_align_block_size, gate-up with SiLU*mul
fused, down with the routing weight fused, the fixed-order combine), with the expert GEMMs of
fp8_gemm: w13 float8 [E, 2I, H] + scales [E, ceil(2I/bn), ceil(H/bk)], w2 float8 [E, H, I] + scales
[E, ceil(H/bn), ceil(I/bk)]; BLOCK_K = bk, so each K step meets one weight-scale column. W8A8
quantises each gathered activation tile in the prologue (fp8_quant's formula: per token, groups of
bk; the intermediate is stored in the hidden dtype and quantised again by the down kernel, as the
twin does); W8A16 dequantises the weight tile to the hidden dtype. No host syncs (graph-capturable);
batch invariance as the bf16 kernels: a row's K order and tile shape depend only on the config, and
--enable-deterministic-inference fixes the config (`fixed_fp8_moe_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.fp8_quant import FP8_SCALE_EPS
from sgl_kernel.moe import MoEConfig, _alloc, _combine_kernel, _tile_ids, get_moe_config, moe_align_block_size
from sgl_kernel.utils import dot_precision, fit_stages, next_pow2, patch_interpreter

patch_interpreter()

FP8 = torch.float8_e4m3fn


def get_fp8_moe_config(num_tokens: int, top_k: int, num_experts: int, block_size: tuple[int, int]) -> MoEConfig:
    """The bf16 heuristic (block_m by tokens per expert) on 1-byte weights, with BLOCK_K = the K block and
    BLOCK_N nested in the N block."""
    cfg = get_moe_config(num_tokens, top_k, num_experts, 0, 0, FP8)
    return MoEConfig(cfg.block_m, min(cfg.block_n, block_size[0]), block_size[1], cfg.group_m, cfg.num_warps,
                     cfg.num_stages)


def fixed_fp8_moe_config(block_size: tuple[int, int]) -> MoEConfig:
    """--enable-deterministic-inference: the mid-prefill tiles for every batch size."""
    return get_fp8_moe_config(64, 1, 1, block_size)


@triton.jit
def _quant_rows(a, EPS: tl.constexpr):
    """fp8_quant's per-row group quantisation of an activation tile [BM, BK]: (e4m3 codes, fp32 scales)."""
    af = a.to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(af), 1), EPS), 448.0)
    return tl.minimum(tl.maximum(tl.div_rn(af, s[:, None]), -448.0), 448.0).to(tl.float8e4nv), s


@triton.jit
def _gate_up_fp8_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr,
                        num_valid, top_k, K, N, num_pid_m,
                        stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                        BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, QUANT_A: tl.constexpr, EPS: tl.constexpr, PRECISION: tl.constexpr):
    """inter[row] = silu(x[row // k] @ G^T) * (x[row // k] @ U^T), G / U = dequant W13[e, :N] / [e, N:]."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npp_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_valid
    tok = tl.where(row_ok, rows // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    g_base = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn
    u_base = g_base + N * stride_wn
    gs_ptrs = ws_ptr + expert * stride_wse + (offs_wn // BN) * stride_wsn
    us_ptrs = ws_ptr + expert * stride_wse + ((offs_wn + N) // BN) * stride_wsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        a = tl.load(x_ptr + tok[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_base + ks[:, None], mask=k_ok[:, None], other=0.0)
        u = tl.load(u_base + ks[:, None], mask=k_ok[:, None], other=0.0)
        gs = tl.load(gs_ptrs + kb)
        us = tl.load(us_ptrs + kb)
        if QUANT_A:
            q, s = _quant_rows(a, EPS)
            acc_g += tl.dot(q, g) * s[:, None] * gs[None, :]
            acc_u += tl.dot(q, u) * s[:, None] * us[None, :]
        else:
            acc_g = tl.dot(a, (g.to(tl.float32) * gs[None, :]).to(a.dtype), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, (u.to(tl.float32) * us[None, :]).to(a.dtype), acc_u, input_precision=PRECISION)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _down_fp8_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, npp_ptr,
                     num_valid, K, N, num_pid_m,
                     stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                     BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, QUANT_A: tl.constexpr, EPS: tl.constexpr, PRECISION: tl.constexpr):
    """out_k[row] = topk_weight[row] * inter[row] @ dequant(W2[e])^T, N = H, K = I."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npp_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_valid
    safe_rows = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn
    bs_ptrs = ws_ptr + expert * stride_wse + (offs_wn // BN) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + offs_k
        k_ok = ks < K
        a = tl.load(a_ptr + safe_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_base + ks[:, None], mask=k_ok[:, None], other=0.0)
        bs = tl.load(bs_ptrs + kb)
        if QUANT_A:
            q, s = _quant_rows(a, EPS)
            acc += tl.dot(q, b) * s[:, None] * bs[None, :]
        else:
            acc = tl.dot(a, (b.to(tl.float32) * bs[None, :]).to(a.dtype), acc, input_precision=PRECISION)
    acc = acc * tl.load(weight_ptr + safe_rows, mask=row_ok, other=0.0)[:, None]
    o_ptrs = out_ptr + safe_rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def _check(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block_size) -> None:
    t, h = hidden.shape
    e, two_i, h13 = w13.shape
    bn, bk = block_size
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_experts_fp8: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} do not match [T, H], [E, 2I, H], [E, H, I]")
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"fused_experts_fp8: weights must be float8_e4m3fn, got {w13.dtype}, {w2.dtype}")
    i = two_i // 2
    for name, s, want in (("w13_scale", w13_scale, (e, triton.cdiv(two_i, bn), triton.cdiv(h, bk))),
                          ("w2_scale", w2_scale, (e, triton.cdiv(h, bn), triton.cdiv(i, bk)))):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"fused_experts_fp8: {name} {tuple(s.shape)} {s.dtype}, expected fp32 {want}")
    if i % bn:
        raise ValueError(f"fused_experts_fp8: intermediate {i} not a multiple of the N block {bn} (gate and up "
                         "would share a scale block)")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_experts_fp8: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={t}, k]")


def fused_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_offset: int, block_size: tuple[int, int], fp8_activations: bool = True,
                      config: MoEConfig | None = None) -> torch.Tensor:
    """hidden [T, H] (model dtype); FP8 experts as the module docstring; topk ids global (ids outside
    [offset, offset + E_local) contribute nothing). Returns [T, H] in hidden's dtype."""
    _check(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block_size)
    num_tokens, hid = hidden.shape
    num_local, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0:
        return torch.zeros((num_tokens, hid), dtype=hidden.dtype, device=hidden.device)
    bn, bk = block_size
    cfg = config or get_fp8_moe_config(num_tokens, top_k, num_local, block_size)
    if cfg.block_k != bk or (bn % cfg.block_n and cfg.block_n % bn):
        raise ValueError(f"fused_experts_fp8: config {cfg} must have block_k = {bk} and block_n nested in {bn}")
    dev, n = hidden.device, num_tokens * top_k
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    sorted_ids, expert_ids, npp = moe_align_block_size(ids, num_local, cfg.block_m, expert_offset)
    num_pid_m = expert_ids.shape[0]
    launch = dict(BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
                  QUANT_A=fp8_activations, EPS=FP8_SCALE_EPS, PRECISION=dot_precision(hidden.dtype),
                  num_warps=cfg.num_warps)
    # gate-up holds an activation tile and two 1-byte weight tiles per stage (down: one)
    stages = fit_stages(cfg.num_stages, (cfg.block_m * hidden.element_size() + 2 * cfg.block_n) * bk)

    h_inter = _alloc((n, inter), hidden.dtype, dev)
    _gate_up_fp8_kernel[(num_pid_m * triton.cdiv(inter, cfg.block_n),)](
        hidden, w13, w13_scale, h_inter, sorted_ids, expert_ids, npp, n, top_k, hid, inter, num_pid_m,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), h_inter.stride(0),
        num_stages=stages, **launch)
    out_k = _alloc((n, hid), hidden.dtype, dev)
    _down_fp8_kernel[(num_pid_m * triton.cdiv(hid, cfg.block_n),)](
        h_inter, w2, w2_scale, out_k, weights, sorted_ids, expert_ids, npp, n, inter, hid, num_pid_m,
        h_inter.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), out_k.stride(0),
        num_stages=stages, **launch)
    out = _alloc((num_tokens, hid), hidden.dtype, dev)
    block_h = min(next_pow2(hid), 512)
    block_t = max(1, 4096 // block_h)
    _combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hid, block_h))](
        out_k, ids, out, num_tokens, hid, num_local, expert_offset, out_k.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return out
