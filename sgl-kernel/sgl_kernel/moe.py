"""Fused MoE experts (Triton) and their torch reference twin `fused_experts_ref`.

    out[t] = sum_j w[t, j] * W2[e] @ (silu(W13[e, :I] @ x_t) * (W13[e, I:] @ x_t)),  e = ids[t, j] - offset

Pipeline, every step on the device with shapes fixed by (T, k, E, block_m) -- no host syncs, so the
whole call can be captured in a CUDA graph:
  1. `moe_align_block_size` (3 small Triton launches; torch twin `moe_align_block_size_ref`):
     assignments (t*k + j) grouped by local expert in ascending order, each expert's group padded
     to a multiple of block_m with the sentinel T*k; non-local experts dropped.
  2. `_gate_up_kernel`: grouped GEMM of each block of rows with its expert's gate and up tiles, SiLU*mul
     fused, into inter [T*k, I] (indexed by assignment).
  3. `_down_kernel`: grouped GEMM inter @ W2[e]^T, routing weight fused, into out_k [T*k, H].
  4. `_combine_kernel`: out[t] = sum over j = 0..k-1 of out_k[t*k + j] in fp32, in that order, skipping
     non-local assignments -- no atomics, so the sum does not depend on scheduling.

Batch invariance: every output row is computed from its own rows only (rows of a tile do not mix in
tl.dot; padding rows are masked), with a K loop whose BLOCK_K is the same in every heuristic config,
so a token's output does not depend on the rest of the batch for a fixed config. Across the decode
and prefill configs only BLOCK_M/BLOCK_N/warps change, which on the GPU may select another MMA
instruction (mma.sync vs wgmma); bench_fused_moe.py checks that bitwise on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import SMEM_BUDGET, dot_precision, next_pow2, patch_interpreter

patch_interpreter()

# Tests set this to fill every buffer with NaN (ints: -7) first, so a row left unwritten shows up.
_POISON_INTERMEDIATES = False


@dataclass(frozen=True)
class MoEConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1  # GROUP_SIZE_M swizzle: neighbouring programs share weight tiles in L2
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:  # tl.arange / tl.dot need powers of two, tl.dot at least 16
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEConfig.{name} = {v}: must be a power of two >= 16")


# One BLOCK_K for every config: the K-order of each row's dot product then does not change with T.
_BLOCK_K = 64
_SMEM_BUDGET = SMEM_BUDGET  # bytes of pipelined tiles per program (sgl_kernel.utils)


def get_moe_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                   dtype: torch.dtype) -> MoEConfig:
    """Block sizes from the average tokens per expert.

    Decode (<= 16 per expert): block_m 16 (one block per expert, weights streamed once), narrow N
    tiles so enough programs stream in parallel. Prefill: block_m grows with the load; padding waste
    per expert is ~block_m / 2 rows, so 128 only when experts hold >= 512 rows.
    """
    avg = num_tokens * top_k / max(num_experts, 1)
    if avg <= 16:
        cfg = MoEConfig(block_m=16, block_n=64, group_m=1, num_warps=4, num_stages=5)
    elif avg <= 48:
        cfg = MoEConfig(block_m=32, block_n=64, group_m=8, num_warps=4, num_stages=4)
    elif avg <= 512:
        cfg = MoEConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4)
    else:
        cfg = MoEConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)
    # Gate-up holds an A tile and two weight tiles per stage; fp32 doubles them: narrow N, then drop
    # stages to fit (block_n does not change a row's arithmetic, so invariance is kept).
    size = torch.empty((), dtype=dtype).element_size()
    block_n = cfg.block_n
    while block_n > 32 and 2 * (cfg.block_m + 2 * block_n) * _BLOCK_K * size > _SMEM_BUDGET:
        block_n //= 2
    stages = max(2, min(cfg.num_stages, _SMEM_BUDGET // ((cfg.block_m + 2 * block_n) * _BLOCK_K * size)))
    return MoEConfig(cfg.block_m, block_n, _BLOCK_K, cfg.group_m, cfg.num_warps, stages)


def batch_invariant_moe_config(dtype: torch.dtype) -> MoEConfig:
    """The one config of --enable-deterministic-inference: the mid-prefill tiles (block_m 64) for every
    batch size, so the tensor-core tile shape, hence a row's rounding, cannot change with the batch."""
    return get_moe_config(64, 1, 1, 0, 0, dtype)


def max_sorted_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded row count: at most min(E, T*k) experts are non-empty and each
    pads fewer than block_m rows. Depends only on (T*k, E, block_m)."""
    rows = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty; under _POISON_INTERMEDIATES NaN (floats) or -7 (ints, a value no step writes)."""
    if _POISON_INTERMEDIATES:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _onehot(ids_ptr, offs, n, num_experts, expert_offset, E_P2: tl.constexpr):
    """[len(offs), E_P2] int32: row i has a 1 at its local expert; non-local / out-of-range rows are 0."""
    e = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int64) - expert_offset
    e = tl.where((offs < n) & (e >= 0) & (e < num_experts), e, E_P2)  # E_P2 matches no column
    return (e[:, None] == tl.arange(0, E_P2)[None, :]).to(tl.int32)


@triton.jit
def _align_count_kernel(ids_ptr, cnt_ptr, n, num_experts, expert_offset,
                        CHUNK: tl.constexpr, SUB: tl.constexpr, E_P2: tl.constexpr):
    """cnt[c, e] = assignments of chunk c on local expert e."""
    c = tl.program_id(0)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        counts += tl.sum(_onehot(ids_ptr, c * CHUNK + s + tl.arange(0, SUB), n, num_experts, expert_offset, E_P2), 0)
    tl.store(cnt_ptr + c * E_P2 + tl.arange(0, E_P2), counts)


@triton.jit
def _align_scan_kernel(cnt_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, n, num_chunks, max_rows,
                       BLOCK_M: tl.constexpr, E_P2: tl.constexpr, C_P2: tl.constexpr, FILL: tl.constexpr):
    """One program: expert group starts, cnt -> each chunk's first destination per expert (in place),
    padding and tail sentinels, expert_ids, num_tokens_post_padded."""
    chunks = tl.arange(0, C_P2)[:, None]
    experts = tl.arange(0, E_P2)
    ptrs = cnt_ptr + chunks * E_P2 + experts[None, :]
    cnt = tl.load(ptrs, mask=chunks < num_chunks, other=0)
    total = tl.sum(cnt, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    npp = tl.sum(padded, 0)
    tl.store(npp_ptr, npp)
    tl.store(ptrs, starts[None, :] + tl.cumsum(cnt, 0) - cnt, mask=chunks < num_chunks)
    pad = tl.arange(0, BLOCK_M)[None, :]  # each group's padding rows, after its real rows
    tl.store(sorted_ptr + (starts + total)[:, None] + pad, tl.zeros((E_P2, BLOCK_M), tl.int32) + n,
             mask=total[:, None] + pad < padded[:, None])
    for r in range(0, max_rows, FILL):
        rows = r + tl.arange(0, FILL)
        tl.store(sorted_ptr + rows, tl.zeros((FILL,), tl.int32) + n, mask=(rows >= npp) & (rows < max_rows))
    for b in range(0, max_rows // BLOCK_M, 64):
        blocks = b + tl.arange(0, 64)
        row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), 1)  # groups ending at or before row
        tl.store(expert_ids_ptr + blocks, tl.where(row < npp, expert, -1), mask=row < max_rows)


@triton.jit
def _align_place_kernel(ids_ptr, cnt_ptr, sorted_ptr, n, num_experts, expert_offset,
                        CHUNK: tl.constexpr, SUB: tl.constexpr, E_P2: tl.constexpr):
    """sorted[dest] = flat index; dest = chunk start of its expert + rank among earlier same-expert rows."""
    c = tl.program_id(0)
    cursor = tl.load(cnt_ptr + c * E_P2 + tl.arange(0, E_P2))
    for s in range(0, CHUNK, SUB):
        offs = c * CHUNK + s + tl.arange(0, SUB)
        hot = _onehot(ids_ptr, offs, n, num_experts, expert_offset, E_P2)
        dest = tl.sum(hot * (cursor[None, :] + tl.cumsum(hot, 0) - hot), 1)
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=tl.sum(hot, 1) > 0)
        cursor += tl.sum(hot, 0)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k assignments by local expert, padded to block_m. Three launches, no host syncs.

    Returns sorted_token_ids [max_rows] int32 (flat indices t*k + j, ascending within an expert,
    padding = T*k), expert_ids [max_rows // block_m] int32 (local expert per block, -1 past the end),
    num_tokens_post_padded [1] int32. Stable order without atomics: chunks count their rows per
    expert, one program scans the counts, chunks place their rows at scanned cursors.
    """
    n, dev = topk_ids.numel(), topk_ids.device
    max_rows = max_sorted_rows(n, num_experts, block_m)
    sorted_ids = _alloc((max_rows,), torch.int32, dev)  # every position is written by the kernels
    expert_ids = _alloc((max_rows // block_m,), torch.int32, dev)
    npp = _alloc((1,), torch.int32, dev)
    if n == 0:
        return sorted_ids, expert_ids.fill_(-1), npp.zero_()
    ids = topk_ids.reshape(-1)
    e_p2 = max(next_pow2(num_experts), 16)  # no degenerate 1-wide tiles for tiny E
    sub = max(1, min(32, 8192 // e_p2))  # one-hot tile [SUB, E_P2] of <= 8K elements
    chunk = max(sub, next_pow2(triton.cdiv(n, 64)))  # <= 64 chunks: the scan holds them in one tile
    num_chunks = triton.cdiv(n, chunk)
    cnt = _alloc((num_chunks, e_p2), torch.int32, dev)
    dims = dict(CHUNK=chunk, SUB=sub, E_P2=e_p2)
    _align_count_kernel[(num_chunks,)](ids, cnt, n, num_experts, expert_offset, **dims)
    _align_scan_kernel[(1,)](cnt, sorted_ids, expert_ids, npp, n, num_chunks, max_rows, BLOCK_M=block_m,
                             E_P2=e_p2, C_P2=next_pow2(num_chunks), FILL=1024, num_warps=8)
    _align_place_kernel[(num_chunks,)](ids, cnt, sorted_ids, n, num_experts, expert_offset, **dims)
    return sorted_ids, expert_ids, npp


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of `moe_align_block_size` (same outputs, bit for bit). Also sync-free, but ~35 small
    launches (stable argsort, cumsums, scatters), which dominate a graph-replayed decode at batch 1."""
    n = topk_ids.numel()
    dev = topk_ids.device
    max_rows = max_sorted_rows(n, num_experts, block_m)
    ids = topk_ids.reshape(-1).long() - expert_offset
    # Non-local (other EP ranks, -1) go to an extra bucket E that is never placed.
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount syncs on CUDA; this does not
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # Destination of bucket e's first element; the dropped bucket goes to n spare slots past max_rows
    # (one each: no duplicate scatter indices, so nothing races and deterministic mode is happy).
    dest_start = torch.cat([ends - padded, ends.new_full((1,), max_rows)])
    raw_start = counts.cumsum(0) - counts
    order = torch.argsort(key, stable=True)  # stable: ascending flat index inside each expert
    skey = key[order]
    dest = dest_start[skey] + torch.arange(n, device=dev) - raw_start[skey]
    sorted_ids = torch.full((max_rows + n,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_start, right=True)  # first expert whose end > row
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:max_rows], expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """GROUP_M swizzle: GROUP_M consecutive row blocks walk the N tiles together (L2 reuse)."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr,
                    num_valid, top_k, K, N, num_pid_m,
                    stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """inter[row] = silu(x[row // k] @ W13[e, :N]^T) * (x[row // k] @ W13[e, N:]^T), N = I, K = H."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npp_ptr):  # grid is sized for the worst case; skip unused blocks
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_valid
    tok = tl.where(row_ok, rows // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # wrap instead of masking: tail columns load valid rows and are not stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _down_kernel(a_ptr, w_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, npp_ptr,
                 num_valid, K, N, num_pid_m,
                 stride_am, stride_we, stride_wn, stride_wk, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """out_k[row] = topk_weight[row] * inter[row] @ W2[e]^T, N = H, K = I."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npp_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_valid
    safe_rows = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + safe_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    acc = acc * tl.load(weight_ptr + safe_rows, mask=row_ok, other=0.0)[:, None]
    o_ptrs = out_ptr + safe_rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _combine_kernel(src_ptr, ids_ptr, out_ptr, T, H, num_local, expert_offset, stride_sm, stride_om,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_{j < k} out_k[t*k + j] in fp32, j ascending; non-local slots (never written) masked."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = offs_t < T
    h_ok = offs_h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = offs_t * TOP_K + j
        e = tl.load(ids_ptr + slot, mask=t_ok, other=-1) - expert_offset
        ok = t_ok & (e >= 0) & (e < num_local)
        v = tl.load(src_ptr + slot[:, None] * stride_sm + offs_h[None, :], mask=ok[:, None] & h_ok[None, :],
                    other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_om + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])


def _check(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    t, h = hidden.shape
    e, two_i, h13 = w13.shape
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_experts: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} do not match [T, H], [E, 2I, H], [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_experts: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={t}, k]")
    if not (hidden.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"fused_experts: dtypes differ: {hidden.dtype}, {w13.dtype}, {w2.dtype}")


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_offset: int = 0, config: MoEConfig | None = None) -> torch.Tensor:
    """hidden [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows); w2 [E_local, H, I];
    topk_weights [T, k] (scaled); topk_ids [T, k] global ids -- ids outside [offset, offset + E_local)
    contribute nothing. Returns [T, H] in hidden's dtype. No host syncs (CUDA-graph capturable)."""
    _check(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hid = hidden.shape
    num_local, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0:
        return torch.zeros((num_tokens, hid), dtype=hidden.dtype, device=hidden.device)
    cfg = config or get_moe_config(num_tokens, top_k, num_local, hid, inter, hidden.dtype)
    dev, n = hidden.device, num_tokens * top_k
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()

    sorted_ids, expert_ids, npp = moe_align_block_size(ids, num_local, cfg.block_m, expert_offset)
    num_pid_m = expert_ids.shape[0]
    prec = dot_precision(hidden.dtype)
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  PRECISION=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    h_inter = _alloc((n, inter), hidden.dtype, dev)
    grid = (num_pid_m * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](hidden, w13, h_inter, sorted_ids, expert_ids, npp, n, top_k, hid, inter, num_pid_m,
                          hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h_inter.stride(0),
                          EVEN_K=hid % cfg.block_k == 0, **launch)

    out_k = _alloc((n, hid), hidden.dtype, dev)  # hidden dtype: half the combine traffic of fp32
    grid = (num_pid_m * triton.cdiv(hid, cfg.block_n),)
    _down_kernel[grid](h_inter, w2, out_k, weights, sorted_ids, expert_ids, npp, n, inter, hid, num_pid_m,
                       h_inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out_k.stride(0),
                       EVEN_K=inter % cfg.block_k == 0, **launch)

    out = _alloc((num_tokens, hid), hidden.dtype, dev)
    block_h = min(next_pow2(hid), 512)
    block_t = max(1, 4096 // block_h)  # several tokens per program: fewer, fuller programs
    _combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hid, block_h))](
        out_k, ids, out, num_tokens, hid, num_local, expert_offset, out_k.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return out


def fused_experts_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """Torch twin: experts in ascending local id, weighted outputs index-added (host reads allowed)."""
    out = torch.zeros_like(hidden)
    if hidden.shape[0] == 0:
        return out
    num_local, inter = w13.shape[0], w2.shape[2]
    local = topk_ids.long() - expert_offset
    for e in torch.unique(local[(local >= 0) & (local < num_local)]).tolist():
        tok, slot = torch.where(local == e)
        gate_up = torch.nn.functional.linear(hidden[tok], w13[e])
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = torch.nn.functional.linear(h, w2[e]) * topk_weights[tok, slot, None].to(hidden.dtype)
        out.index_add_(0, tok, y.to(out.dtype))
    return out
