"""Fused MoE with FP8 block-scaled expert weights (Triton); torch twin:
sglang.srt.layers.moe.fused_moe_native.fused_experts_fp8_native.

Same routing and pipeline as the bf16 `moe.fused_experts` (moe_align_block_size, gate-up with SiLU*mul
fused, down with the routing weight fused, the fixed-order combine), with block-scaled expert GEMMs:
w13 float8 [E, 2I, H] + scales [E, ceil(2I/bn), ceil(H/bk)], w2 float8 [E, H, I] + scales
[E, ceil(H/bn), ceil(I/bk)]; BLOCK_K = bk, so each K step meets one weight-scale column.

W8A8: the hidden states are quantised once (per_token_group_quant_fp8: T rows, not T*k gathered rows,
nor once per N tile as a GEMM prologue would); both kernels run fp8 x fp8. The gate-up epilogue rounds
SiLU(g)*u to the hidden dtype (what the twin stores) and, when its N tile is one K block of the down
GEMM (`Fp8MoEConfig.up_n == bk`), quantises it there with fp8_quant's formula, writing codes + scales
for the down kernel; other tiles store the rounded values and quantise them in one more launch. Both
give the bytes of per_token_group_quant_fp8 on the rounded intermediate (tested). W8A16 dequantises
the weight tile to the hidden dtype. Configs: the device's tuned table (fp8_tables; key
E, H, I, top-k; bucket = tokens), else `heuristic_fp8_moe_config`. No host syncs (graph-capturable);
batch invariance as the bf16 kernels: a row's K order and tile shapes depend only on the config, and
--enable-deterministic-inference fixes it (`fixed_fp8_moe_config`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from sgl_kernel import fp8_tables
from sgl_kernel.fp8_gemm import promotion
from sgl_kernel.fp8_quant import FP8_SCALE_EPS, per_token_group_quant_fp8
from sgl_kernel.moe import _alloc, _combine_kernel, _tile_ids, moe_align_block_size
from sgl_kernel.utils import dot_precision, fit_stages, next_pow2, patch_interpreter

patch_interpreter()

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8MoEConfig:
    """One block_m (the expert-sorted layout is shared), the rest per kernel (gate-up, down)."""
    block_m: int = 16
    up_n: int = 128
    up_warps: int = 4
    up_stages: int = 4
    down_n: int = 128
    down_warps: int = 4
    down_stages: int = 4
    group_m: int = 1  # GROUP_SIZE_M swizzle: neighbouring programs share weight tiles in L2

    def __post_init__(self) -> None:
        for name in ("block_m", "up_n", "down_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8MoEConfig.{name} = {v}: must be a power of two >= 16")
        if self.group_m < 1:
            raise ValueError(f"Fp8MoEConfig.group_m = {self.group_m}: must be >= 1")

    def to_json(self) -> dict:
        return asdict(self)


def heuristic_fp8_moe_config(num_tokens: int, top_k: int, num_experts: int,
                             block_size: tuple[int, int]) -> Fp8MoEConfig:
    """No table: block_m by the average rows per expert (as the bf16 heuristic), at most 64: the gate-up
    kernel holds two fp32 accumulators and a dot result, and at 128 x 128 on 8 warps that spills
    (ptxas for sm_90a: 255 registers + 76 B of spill stores; 64 rows: 180, none). Gate-up tiles one K
    block wide (the fused quant), 8 warps from 64 rows."""
    bn, bk = block_size
    avg = num_tokens * top_k / max(num_experts, 1)
    up_n = min(bk, bn) if bn % bk == 0 or bk % bn == 0 else min(64, bn)
    if avg <= 16:
        return Fp8MoEConfig(16, up_n, 4, 4, min(128, bn), 4, 4, 1)
    if avg <= 48:
        return Fp8MoEConfig(32, up_n, 4, 4, min(128, bn), 4, 4, 8)
    return Fp8MoEConfig(64, up_n, 8, 3, min(128, bn), 4, 4, 8)


def moe_shape_key(num_experts: int, hidden: int, inter: int, top_k: int) -> str:
    return f"E={num_experts},H={hidden},I={inter},k={top_k}"


def get_fp8_moe_config(num_tokens: int, top_k: int, num_experts: int, block_size: tuple[int, int],
                       hidden: int | None = None, inter: int | None = None,
                       device: torch.device | str | None = None) -> Fp8MoEConfig:
    """The device's tuned config for (E, H, I, k) at the tokens' bucket, else the heuristic."""
    if device is not None and hidden is not None and list(block_size) == [128, 128]:
        hit = fp8_tables.lookup("fp8_moe", device, moe_shape_key(num_experts, hidden, inter, top_k), num_tokens)
        if hit is not None:
            return Fp8MoEConfig(**hit)
    return heuristic_fp8_moe_config(num_tokens, top_k, num_experts, block_size)


def fixed_fp8_moe_config(block_size: tuple[int, int]) -> Fp8MoEConfig:
    """--enable-deterministic-inference: the mid-prefill tiles for every batch size."""
    return heuristic_fp8_moe_config(64, 1, 1, block_size)


@triton.jit
def _gate_up_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr, hd_ptr, sorted_ptr, expert_ptr, npp_ptr,
                        num_valid, top_k, K, N, num_pid_m,
                        stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
                        BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, A_FP8: tl.constexpr, OUT_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                        EPS: tl.constexpr, PRECISION: tl.constexpr):
    """inter[row] = silu(x[row // k] @ G^T) * (x[row // k] @ U^T), G / U = dequant W13[e, :N] / [e, N:].
    A_FP8: x is fp8 codes with per-row group scales xs. OUT_FP8 (BLOCK_N == BLOCK_K): inter rounded to
    hd_ptr's dtype, then stored as codes (out) + one scale per row (outs[:, pid_n])."""
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
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    if BLOCK_N <= BN:  # one weight-scale block per tile (N % BN == 0: gate and up blocks apart)
        gs_ptrs = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // BN) * stride_wsn
        us_ptrs = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N + N) // BN) * stride_wsn
    else:
        gs_ptrs = ws_ptr + expert * stride_wse + (offs_wn // BN) * stride_wsn
        us_ptrs = ws_ptr + expert * stride_wse + ((offs_wn + N) // BN) * stride_wsn
    xs_ptrs = xs_ptr + tok * stride_xsm
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = kb * BLOCK_K + offs_k < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        gs = tl.load(gs_ptrs + kb)
        us = tl.load(us_ptrs + kb)
        if A_FP8:
            s = tl.load(xs_ptrs + kb)
            acc_g += tl.dot(a, g) * promotion(s, gs, BLOCK_N <= BN)
            acc_u += tl.dot(a, u) * promotion(s, us, BLOCK_N <= BN)
        else:
            acc_g = tl.dot(a, (g.to(tl.float32) * gs).to(a.dtype), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, (u.to(tl.float32) * us).to(a.dtype), acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = (acc_g * tl.sigmoid(acc_g) * acc_u).to(hd_ptr.dtype.element_ty)  # the twin's stored intermediate
    mask = row_ok[:, None] & (offs_n[None, :] < N)
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if OUT_FP8:  # fp8_quant.group_scale / quantize_tile: one group per row of the tile
        hf = h.to(tl.float32)
        s = tl.div_rn(tl.maximum(tl.max(tl.abs(hf), 1), EPS), 448.0)
        q = tl.minimum(tl.maximum(tl.div_rn(hf, s[:, None]), -448.0), 448.0).to(tl.float8e4nv)
        tl.store(o_ptrs, q.to(tl.uint8, bitcast=True), mask=mask)
        tl.store(outs_ptr + rows.to(tl.int64) * stride_osm + pid_n, s, mask=row_ok)
    else:
        tl.store(o_ptrs, h, mask=mask)


@triton.jit
def _down_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, npp_ptr,
                     num_valid, K, N, num_pid_m,
                     stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                     BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, A_FP8: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
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
    a_ptrs = a_ptr + safe_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None]
    if BLOCK_N <= BN:
        bs_ptrs = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // BN) * stride_wsn
    else:
        bs_ptrs = ws_ptr + expert * stride_wse + (offs_wn // BN) * stride_wsn
    as_ptrs = as_ptr + safe_rows * stride_asm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = kb * BLOCK_K + offs_k < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        bs = tl.load(bs_ptrs + kb)
        if A_FP8:
            s = tl.load(as_ptrs + kb)
            acc += tl.dot(a, b) * promotion(s, bs, BLOCK_N <= BN)
        else:
            acc = tl.dot(a, (b.to(tl.float32) * bs).to(a.dtype), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
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


def _check_config(cfg: Fp8MoEConfig, block_size: tuple[int, int]) -> None:
    bn = block_size[0]
    for name in ("up_n", "down_n"):
        v = getattr(cfg, name)
        if bn % v and v % bn:
            raise ValueError(f"fused_experts_fp8: config {cfg}: {name} {v} must nest with the N block {bn}")


def gate_up_stage(a: torch.Tensor, a_scale: torch.Tensor | None, hidden_dtype: torch.dtype, w13: torch.Tensor,
                  w13_scale: torch.Tensor, route: tuple, block_size: tuple[int, int], cfg: Fp8MoEConfig,
                  fuse_quant: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gate-up GEMM + SiLU*mul over the sorted rows. a: fp8 codes with scales (W8A8) or the hidden
    states (a_scale None: W8A16). Returns the intermediate [T*k, I] as codes + scales (W8A8: fused in
    the epilogue when the tile is one K block and fuse_quant is not False, else one quant launch) or in
    the hidden dtype (W8A16, scales None)."""
    sorted_ids, expert_ids, npp, top_k = route
    bn, bk = block_size
    fp8 = a_scale is not None
    n, (num_local, two_i, hid) = a.shape[0] * top_k, w13.shape
    inter, dev, num_pid_m = two_i // 2, a.device, expert_ids.shape[0]
    fuse = fp8 and cfg.up_n == bk and inter % bk == 0 and fuse_quant is not False
    if fuse:
        h_inter = _alloc((n, inter), torch.uint8, dev)
        h_scale = _alloc((n, inter // bk), torch.float32, dev)
    else:
        h_inter = _alloc((n, inter), hidden_dtype, dev)
        h_scale = a_scale if fp8 else w13_scale  # unread without OUT_FP8
    hd = torch.empty(1, dtype=hidden_dtype, device=dev)  # only its dtype is read (the rounding)
    xs = a_scale if fp8 else w13_scale  # unread without A_FP8
    _gate_up_fp8_kernel[(num_pid_m * triton.cdiv(inter, cfg.up_n),)](
        a, xs, w13, w13_scale, h_inter, h_scale, hd, sorted_ids, expert_ids, npp, n, top_k, hid, inter,
        num_pid_m, a.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0),
        w13_scale.stride(1), h_inter.stride(0), h_scale.stride(0), BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.up_n,
        BLOCK_K=bk, GROUP_M=cfg.group_m, A_FP8=fp8, OUT_FP8=fuse, EVEN_K=hid % bk == 0, EPS=FP8_SCALE_EPS,
        PRECISION=dot_precision(hidden_dtype), num_warps=cfg.up_warps,
        # an activation tile and two 1-byte weight tiles per stage
        num_stages=fit_stages(cfg.up_stages, (cfg.block_m * a.element_size() + 2 * cfg.up_n) * bk))
    if fuse:
        return h_inter.view(FP8), h_scale
    if fp8:
        return per_token_group_quant_fp8(h_inter, bk)
    return h_inter, None


def fused_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_offset: int, block_size: tuple[int, int], fp8_activations: bool = True,
                      config: Fp8MoEConfig | None = None) -> torch.Tensor:
    """hidden [T, H] (model dtype); FP8 experts as the module docstring; topk ids global (ids outside
    [offset, offset + E_local) contribute nothing). Returns [T, H] in hidden's dtype."""
    _check(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block_size)
    num_tokens, hid = hidden.shape
    num_local, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0:
        return torch.zeros((num_tokens, hid), dtype=hidden.dtype, device=hidden.device)
    bn, bk = block_size
    cfg = config or get_fp8_moe_config(num_tokens, top_k, num_local, block_size, hid, inter, hidden.device)
    _check_config(cfg, block_size)
    dev, n = hidden.device, num_tokens * top_k
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    sorted_ids, expert_ids, npp = moe_align_block_size(ids, num_local, cfg.block_m, expert_offset)
    num_pid_m = expert_ids.shape[0]
    if fp8_activations:
        a, a_scale = per_token_group_quant_fp8(hidden, bk)
    else:
        a, a_scale = hidden, None
    route = (sorted_ids, expert_ids, npp, top_k)
    h_inter, h_scale = gate_up_stage(a, a_scale, hidden.dtype, w13, w13_scale, route, block_size, cfg)
    if h_scale is None:
        h_scale = w2_scale  # unread without A_FP8
    common = dict(BN=bn, BLOCK_M=cfg.block_m, BLOCK_K=bk, GROUP_M=cfg.group_m, A_FP8=fp8_activations,
                  PRECISION=dot_precision(hidden.dtype))
    out_k = _alloc((n, hid), hidden.dtype, dev)
    _down_fp8_kernel[(num_pid_m * triton.cdiv(hid, cfg.down_n),)](
        h_inter, h_scale, w2, w2_scale, out_k, weights, sorted_ids, expert_ids, npp, n, inter, hid, num_pid_m,
        h_inter.stride(0), h_scale.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        out_k.stride(0), BLOCK_N=cfg.down_n, EVEN_K=inter % bk == 0, num_warps=cfg.down_warps,
        num_stages=fit_stages(cfg.down_stages, (cfg.block_m * h_inter.element_size() + cfg.down_n) * bk), **common)
    out = _alloc((num_tokens, hid), hidden.dtype, dev)
    block_h = min(next_pow2(hid), 512)
    block_t = max(1, 4096 // block_h)
    _combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hid, block_h))](
        out_k, ids, out, num_tokens, hid, num_local, expert_offset, out_k.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return out
