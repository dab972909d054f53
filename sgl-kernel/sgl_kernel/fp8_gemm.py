"""W8A8 / W8A16 block-scaled GEMM (Triton) and its torch twin `fp8_block_linear_ref`.

    y[m, n] = sum_kb  s_x[m, kb] * s_w[n // bn, kb] * sum_{k in block kb} q_x[m, k] * q_w[n, k]   (W8A8)
    y[m, n] = sum_k  x[m, k] * dequant(W)[n, k]                                                    (W8A16)

W: float8_e4m3fn [N, K] with fp32 scales [ceil(N/bn), ceil(K/bk)] (DeepSeek's `weight_scale_inv`).
BLOCK_K = bk, so one activation scale meets one weight scale per K step; the fp8 dot of each K block
is scaled into an fp32 accumulator (DeepSeek's promotion every 128 K). W8A8 gets its activation codes
one of two ways, with the same bytes (fp8_quant's formula) and the same arithmetic after, so the two
give equal outputs bit for bit (tested):
  prequant (`Fp8GemmConfig.prequant`, prefill-sized M): `per_token_group_quant_fp8` once, then the fp8 x
    fp8 kernel (A_MODE 2) -- a prologue would re-quantise A once per N tile, and its IEEE divisions
    cost several times the FP8 MMA at 128-row tiles;
  prologue (decode-sized M): each [BLOCK_M, bk] tile quantised in registers (A_MODE 1): a few rows,
    cheap, and one launch less, which is a large share of a microseconds-long decode GEMM.
`fp8_block_gemm` takes codes + scales that a previous op already produced (the fused-quant seam).
W8A16 (A_MODE 0) dequantises the weight tile to x's dtype in registers (the twin's operand exactly).

Configs: the device's tuned table (fp8_tables, written by benchmark/kernels/tune_fp8.py), else
`heuristic_gemm_config`. Split-K partials go to an fp32 buffer [S, M, N]; the last split of each tile
to finish sums them in a fixed order (s ascending) with the bias, in the same launch (`serial_reduce`,
a per-tile counter); without it a second reduction kernel does the same sum. --enable-deterministic-inference uses `fixed_gemm_config`:
one tile shape, no split-K, prequant, for every M, so a row's arithmetic (K order, MMA shape) is the
same at every M -- batch invariant. No host syncs, shapes fixed by (M, N, K): CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from sgl_kernel import fp8_tables
from sgl_kernel.fp8_quant import (FP8_SCALE_EPS, block_dequant, dequant_groups, per_token_group_quant_fp8,
                                  per_token_group_quant_fp8_ref)
from sgl_kernel.moe import _tile_ids
from sgl_kernel.utils import dot_precision, fit_stages, patch_interpreter

patch_interpreter()

FP8 = torch.float8_e4m3fn
_SMS = 132  # H100 SXM; the split-K heuristic only needs the order of magnitude
# The heuristic's one threshold: above this M the activations are quantised once before the GEMM.
PREQUANT_MIN_M = 65


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 64
    block_n: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    prequant: bool = True  # W8A8: quantise A once (True) or in the GEMM prologue (False); same bytes
    tma: bool = False  # prequant, no split-K: operand tiles by Hopper's tensor-memory copies (descriptors)
    serial_reduce: bool = True  # split-K: the last split of a tile sums the partials (one launch, see below)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig.{name} = {v}: must be a power of two >= 16")
        if self.split_k < 1 or self.group_m < 1:
            raise ValueError(f"Fp8GemmConfig: split_k {self.split_k} / group_m {self.group_m} must be >= 1")
        if self.tma and (not self.prequant or self.split_k > 1):
            raise ValueError("Fp8GemmConfig.tma needs prequant=True and split_k=1")

    def to_json(self) -> dict:
        return asdict(self)


def fixed_gemm_config(block_size: tuple[int, int]) -> Fp8GemmConfig:
    """--enable-deterministic-inference: one tile shape, no split-K, for every M (batch invariant)."""
    return Fp8GemmConfig(block_m=64, block_n=min(128, block_size[0]), split_k=1, group_m=8, num_warps=4,
                         num_stages=3, prequant=True)


def heuristic_gemm_config(m: int, n: int, k: int, block_size: tuple[int, int]) -> Fp8GemmConfig:
    """No table: decode-sized M (<= 64) 16-row tiles (the MMA minimum), the prologue quant and split-K up
    to ~2 waves of programs; mid M 64-row tiles; prefill M 128 x 128 tiles, 8 warps, 4 stages."""
    bn, bk = block_size
    k_blocks = triton.cdiv(k, bk)
    prequant = m >= PREQUANT_MIN_M
    if m <= 64:
        block_m, block_n = 16, min(64, bn)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split = 1
        while split * 2 <= k_blocks and tiles * split * 2 <= 2 * _SMS and k_blocks // (split * 2) >= 2:
            split *= 2
        return Fp8GemmConfig(block_m, block_n, split, 1, 4, 4, prequant)
    if m <= 512:
        return Fp8GemmConfig(64, min(128, bn), 1, 8, 4, 4, prequant)
    return Fp8GemmConfig(128, min(128, bn), 1, 8, 8, 4, prequant)


def get_gemm_config(m: int, n: int, k: int, block_size: tuple[int, int],
                    device: torch.device | str | None = None) -> Fp8GemmConfig:
    """The device's tuned config for (N, K) at M's bucket, else the heuristic."""
    if device is not None and list(block_size) == [128, 128]:  # the tables are tuned for DeepSeek's blocks
        hit = fp8_tables.lookup("fp8_gemm", device, gemm_shape_key(n, k), m)
        if hit is not None:
            return Fp8GemmConfig(**hit)
    return heuristic_gemm_config(m, n, k, block_size)


def gemm_shape_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


@triton.jit
def promotion(s, ws, SCALAR_WS: tl.constexpr):
    """The fp32 factor of one K block's fp8 dot: the activation scale per row x the weight scale per
    column. A tile inside one weight block has one weight scale, so the factor is a column [BM, 1] and
    acc += dot * factor is one FMA per element (an outer product costs a multiply more: next to a
    128 x 128 x 128 FP8 MMA, 2 extra ops per accumulator element rival the MMA itself)."""
    if SCALAR_WS:
        return (s * ws)[:, None]
    else:
        return s[:, None] * ws[None, :]


@triton.jit
def _w8_block_gemm_kernel(X, XS, W, WS, Y, P, BIAS, LOCKS, M, N, K,
                          stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym, stride_ps, stride_pm,
                          SPLIT_K, BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PARTIAL: tl.constexpr, SERIAL: tl.constexpr,
                          A_MODE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, EPS: tl.constexpr,
                          PRECISION: tl.constexpr):
    """A_MODE 0: X model dtype, W8A16; 1: X model dtype, quantised per tile here; 2: X fp8 codes, XS scales.
    SPLIT_K is a run-time value (one binary for every split); PARTIAL: store fp32 partials of split sk;
    SERIAL (with PARTIAL): the tile's last split to finish sums them into Y (`_reduce_partials`)."""
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    sk = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # wrap instead of masking: tail rows / columns load valid data and are never stored
    safe_m = (offs_m % M).to(tl.int64)
    safe_n = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb0 = sk * per_split
    kb1 = tl.minimum(kb0 + per_split, k_blocks)
    a_ptrs = X + safe_m[:, None] * stride_xm + (kb0 * BLOCK_K + offs_k)[None, :]
    b_ptrs = W + safe_n[None, :] * stride_wn + (kb0 * BLOCK_K + offs_k)[:, None]
    if BLOCK_N <= BN:  # the tile sits in one weight-scale block: one scale per K step (see promotion)
        ws_ptrs = WS + ((pid_n * BLOCK_N) // BN) * stride_wsn
    else:
        ws_ptrs = WS + (safe_n // BN) * stride_wsn
    xs_ptrs = XS + safe_m * stride_xsm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = kb * BLOCK_K + offs_k < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        ws = tl.load(ws_ptrs + kb)
        if A_MODE == 2:  # prequantised codes and their per-row scales
            s = tl.load(xs_ptrs + kb)
            acc += tl.dot(a, b) * promotion(s, ws, BLOCK_N <= BN)
        elif A_MODE == 1:  # fp8_quant.group_scale / quantize_tile on the tile: the same bytes
            af = a.to(tl.float32)
            s = tl.div_rn(tl.maximum(tl.max(tl.abs(af), 1), EPS), 448.0)
            q = tl.minimum(tl.maximum(tl.div_rn(af, s[:, None]), -448.0), 448.0).to(tl.float8e4nv)
            acc += tl.dot(q, b) * promotion(s, ws, BLOCK_N <= BN)
        else:  # W8A16: the weight tile dequantised to x's dtype (the twin's operand, bit for bit)
            bw = (b.to(tl.float32) * ws).to(a.dtype)  # ws: one scale, or one per column
            acc = tl.dot(a, bw, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_mask = m_ok[:, None] & n_ok[None, :]
    if not PARTIAL:
        _store_tile(acc, BIAS, Y, offs_m, offs_n, safe_n, out_mask, stride_ym, HAS_BIAS)
    else:
        tl.store(P + sk * stride_ps + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :], acc, mask=out_mask)
        if SERIAL:
            _reduce_partials(P, BIAS, Y, LOCKS + pid, offs_m, offs_n, safe_n, out_mask, stride_ps, stride_pm,
                             stride_ym, SPLIT_K, BLOCK_M, BLOCK_N, HAS_BIAS)


@triton.jit
def _store_tile(acc, BIAS, Y, offs_m, offs_n, safe_n, out_mask, stride_ym, HAS_BIAS: tl.constexpr):
    """The GEMMs' one epilogue: + bias (fp32), cast to Y's dtype, masked store of the tile."""
    if HAS_BIAS:
        acc += tl.load(BIAS + safe_n).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=out_mask)


@triton.jit
def _reduce_partials(P, BIAS, Y, lock, offs_m, offs_n, safe_n, out_mask, stride_ps, stride_pm, stride_ym, SPLIT_K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Split-K without a second launch (cuBLAS's serial reduction): after its partial is stored, each
    split counts itself in on the tile's lock; the last to arrive sums every split's partial, s
    ascending -- the order `_splitk_reduce_kernel` uses, so the output is the same bit for bit whichever
    split arrives last -- and zeroes the lock for the next launch. The barrier + acq_rel atomic is
    CUTLASS's semaphore: the CTA's stores happen before the release; the partials are read through L2
    (.cg), where the other SMs' stores landed."""
    tl.debug_barrier()
    arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rows = offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
        for s in range(0, SPLIT_K):
            acc += tl.load(P + s * stride_ps + rows, mask=out_mask, other=0.0, cache_modifier=".cg")
        _store_tile(acc, BIAS, Y, offs_m, offs_n, safe_n, out_mask, stride_ym, HAS_BIAS)
        tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _w8a8_tma_kernel(a_desc, b_desc, XS, WS, Y, BIAS, M, N, K, stride_xsm, stride_wsn, stride_ym,
                     BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A_MODE 2 of `_w8_block_gemm_kernel` with the fp8 tiles fetched through tensor descriptors (zero
    fill past the edges, as the masked loads); the same sum: acc += dot(a, b) * s_x * s_w per K block."""
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = (offs_n % N).to(tl.int64)
    xs_ptrs = XS + (offs_m % M).to(tl.int64) * stride_xsm
    if BLOCK_N <= BN:
        ws_ptrs = WS + ((pid_n * BLOCK_N) // BN) * stride_wsn
    else:
        ws_ptrs = WS + (safe_n // BN) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
        s = tl.load(xs_ptrs + kb)
        ws = tl.load(ws_ptrs + kb)
        acc += tl.dot(a, b.T) * promotion(s, ws, BLOCK_N <= BN)
    _store_tile(acc, BIAS, Y, offs_m, offs_n, safe_n, (offs_m < M)[:, None] & (offs_n < N)[None, :], stride_ym,
                HAS_BIAS)


@triton.jit
def _splitk_reduce_kernel(P, BIAS, Y, MN, N, stride_ps, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum_{s = 0..S-1} partial[s] (+ bias), s ascending: a fixed order, no atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(P + s * stride_ps + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


LOCK_RING = 1 << 18  # int32 tile counters per device (1 MiB); a decode graph of 61 layers takes ~25K
_LOCKS: dict[torch.device, list] = {}  # device -> [counters (zeros between launches), next free offset]


def split_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """`tiles` zeroed counters for one serial split-K launch, or None (the two-kernel reduction) when
    the ring would have to be allocated inside a CUDA-graph capture or cannot hold them. Each launch
    takes the next slice of a ring, so launches that could overlap (other streams) use other counters;
    each tile's last split re-zeroes its counter, so a slice is clean again once its launch is done."""
    state = _LOCKS.get(device)
    if state is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        state = _LOCKS[device] = [torch.zeros(LOCK_RING, dtype=torch.int32, device=device), 0]
    if tiles > LOCK_RING:
        return None
    buf, start = state
    if start + tiles > LOCK_RING:
        start = 0
    state[1] = start + tiles
    return buf[start:start + tiles]


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]) -> None:
    bn, bk = block_size
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8_block_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} [N, K]")
    if weight.dtype != FP8:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"fp8_block_linear: scale {tuple(scale.shape)} {scale.dtype}, expected fp32 {want} for "
                         f"block {list(block_size)}")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_block_linear: K block {bk} must be a power of two >= 16 (one tile per block)")


def _launch(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor,
            block_size: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype, a_mode: int,
            cfg: Fp8GemmConfig) -> torch.Tensor:
    m, k = a.shape
    n = weight.shape[0]
    bn, bk = block_size
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return y
    if bn % cfg.block_n and cfg.block_n % bn:
        raise ValueError(f"fp8_block_linear: BLOCK_N {cfg.block_n} and the N block {bn} must nest")
    a = a if a.stride(1) == 1 else a.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    xs = a_scale if a_scale is not None else scale  # unread unless A_MODE 2
    if cfg.tma and a_mode == 2 and k % 16 == 0:  # descriptors need 16-byte row strides
        _launch_tma(a, xs, weight, scale, y, bias, block_size, cfg)
        return y
    split = cfg.split_k
    part = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if split > 1 else y
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    locks = split_locks(a.device, tiles) if split > 1 and cfg.serial_reduce else None
    grid = (tiles, split)
    stage_bytes = (cfg.block_m * a.element_size() + cfg.block_n) * bk
    _w8_block_gemm_kernel[grid](
        a, xs, weight, scale, y, part, bias if bias is not None else y, locks if locks is not None else scale,
        m, n, k, a.stride(0), xs.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        part.stride(0) if split > 1 else 0, part.stride(1) if split > 1 else 0, split,
        BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, PARTIAL=split > 1,
        SERIAL=locks is not None, A_MODE=a_mode, EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, EPS=FP8_SCALE_EPS,
        PRECISION=dot_precision(a.dtype if a_mode == 0 else torch.float32), num_warps=cfg.num_warps,
        num_stages=fit_stages(cfg.num_stages, stage_bytes))
    if split > 1 and locks is None:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, bias if bias is not None else y, y, m * n, n, part.stride(0), split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y


def _launch_tma(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                bias: torch.Tensor | None, block_size: tuple[int, int], cfg: Fp8GemmConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = weight.shape[0]
    bn, bk = block_size
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, bk])
    b_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, bk])
    _w8a8_tma_kernel[(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)](
        a_desc, b_desc, a_scale, scale, y, bias if bias is not None else y, m, n, k, a_scale.stride(0),
        scale.stride(0), y.stride(0), BN=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        GROUP_M=cfg.group_m, HAS_BIAS=bias is not None, num_warps=cfg.num_warps,
        num_stages=fit_stages(cfg.num_stages, (cfg.block_m + cfg.block_n) * bk))


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                     bias: torch.Tensor | None = None, fp8_activations: bool = True,
                     config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (model dtype) @ dequant(weight [N, K])^T (+ bias) -> [M, N] in x's dtype."""
    _check(x, weight, scale, block_size)
    m, k = x.shape
    cfg = config or get_gemm_config(m, weight.shape[0], k, block_size, x.device)
    if fp8_activations and cfg.prequant and m:
        q, s = per_token_group_quant_fp8(x, block_size[1])
        return _launch(q, s, weight, scale, block_size, bias, x.dtype, 2, cfg)
    return _launch(x, None, weight, scale, block_size, bias, x.dtype, 1 if fp8_activations else 0, cfg)


def fp8_block_gemm(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block_size: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Activations already quantised (codes [M, K] float8_e4m3fn + fp32 scales [M, ceil(K / bk)], as
    per_token_group_quant_fp8 returns them) @ dequant(weight)^T -> [M, N] in out_dtype."""
    _check(q, weight, scale, block_size)
    m, k = q.shape
    if q.dtype != FP8 or tuple(q_scale.shape) != (m, triton.cdiv(k, block_size[1])) or q_scale.dtype != torch.float32:
        raise ValueError(f"fp8_block_gemm: codes {q.dtype} {tuple(q.shape)} / scales {q_scale.dtype} "
                         f"{tuple(q_scale.shape)}, expected float8_e4m3fn and fp32 [M, ceil(K / {block_size[1]})]")
    cfg = config or get_gemm_config(m, weight.shape[0], k, block_size, q.device)
    q_scale = q_scale if q_scale.stride(1) == 1 else q_scale.contiguous()
    return _launch(q, q_scale, weight, scale, block_size, bias, out_dtype, 2, cfg)


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                         bias: torch.Tensor | None = None, fp8_activations: bool = True) -> torch.Tensor:
    """Torch twin: fp32 dequantised operands (W8A8) or the weight dequantised to x's dtype (W8A16)."""
    bk = block_size[1]
    if fp8_activations:
        a = dequant_groups(*per_token_group_quant_fp8_ref(x, bk), bk)
        out = a @ block_dequant(weight, scale, block_size, torch.float32).t()
    else:
        out = (x @ block_dequant(weight, scale, block_size, x.dtype).t()).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
