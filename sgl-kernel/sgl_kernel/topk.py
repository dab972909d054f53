"""Deterministic, length-aware top-k for the DSA lightning indexer (`fast_topk`), and its torch
twin (`fast_topk_ref`). Both return bit-identical int32 index tensors on any input.

Semantics. Row r of `scores` [R, W] (fp32) considers columns [0, n), n = lengths[r]. If n <= k the
row is [0, 1, ..., n-1, -1, ..., -1]; otherwise it holds the k columns with the largest scores, ties
broken by the LOWER column, in ascending column order. Values are compared through an
order-preserving map of their bits (+x -> bits | 2^31, -x -> ~bits, -0.0 first made +0.0), so
comparisons are exact and -inf is simply the lowest value. NaN is ordered by its bit pattern:
positive NaNs rank above +inf, negative ones below -inf (same in kernel and twin; the indexer never
produces NaN). The result depends only on the row's own values, never on the batch, the padding
beyond its length or thread scheduling: no atomics, no floating-point sums.

Kernel: MSB-first radix select on the 32-bit keys, RADIX_BITS per pass. A pass histograms (one
`tl.histogram`, masked) the digit of the candidates -- valid columns whose higher key bits equal the
prefix chosen so far -- takes the highest digit at which the count from the top reaches `need`,
removes the strictly-greater count from `need`, and descends. It stops early when the chosen bin
is taken whole (count == need) or all candidates share every lower bit (max == min of those bits):
bf16-valued scores (the indexer's bf16 matmul cast to fp32, whose low 16 bits are zero) finish
after 16 bits. The last pass walks the row in column order: columns above the threshold prefix
plus the first `need` equal to it (rank by tl.cumsum, carried across blocks) are stored at a
running output offset, so the output is ascending and exactly k entries are written.

Launch shapes (same result; `split` picks one, shapes depend only on R, W, k: graph capturable):
- fused (split=1): one program per row runs every pass; the row stays in L2 between passes.
  For prefill (R = query tokens >> #SMs).
- split (split=S>1): rows are cut into S chunks, one (R, S) launch per pass. Program (r, c) of
  pass p first makes pass p-1's choice from its per-chunk histograms in scratch -- every program
  of the row the same one, from the same integers; program 0 stores the state, program c adds its
  own chunk's count above the chosen bin and keeps its count in it -- then histograms chunk c for
  digit p. The write launch makes the last choice and turns the counts of the chunks before c into
  chunk c's output offset. passes + 1 launches (was 2 * passes + 1 with a separate select
  launch per pass), no host sync. For decode (R = batch <= 160, W up to 160K), where one program
  per row idles most SMs.

Cost model (H200, unmeasured). Triton 3.6 lowers tl.histogram to warp ballots: ~RADIX_BITS
ballots + 2^RADIX_BITS / 32 popcounts per element, so 8-bit digits cost ~4x the ALU work of 6-bit
ones per pass (newer Triton, e.g. 3.9, emits one shared-memory atomic per element: then try 8).
The fused path is ALU-bound, hence 6 bits there: 3 histogram passes + 1 write pass for bf16-valued
scores (4 reads of the row, from L2 after the first), up to 6 + 1 for arbitrary fp32. The split
path is launch-bound, hence 8 bits there: 4 pass launches + 1 write (was 9); a row settled early
(bf16-valued scores: after 2 passes) leaves the later launches at once.
Knobs for the H200: radix_bits, split (auto_split, SPLIT_MIN_CHUNK), block, num_warps.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import next_pow2, patch_interpreter

patch_interpreter()

_INT_MIN = -(2**31)
# Columns per program in the split path. H100, 32K keys in a CUDA graph: batch 1 at 8 / 16 / 32
# chunks 0.033 / 0.025 / 0.023 ms; batch 64 at 5 / 8 / 16 chunks 0.076 / 0.068 / 0.071 ms.
SPLIT_MIN_CHUNK = 1024
PREFILTER_SAMPLE = 1024  # columns of a row sampled for the prefilter's threshold
MAX_SPLIT = 64  # each program of a pass reads all S histograms of its row: S^2 x 2^RADIX_BITS per row


@triton.jit
def _ukey(x):
    """fp32 -> int32 holding the unsigned order-preserving key (-0.0 canonicalised to +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return tl.where(bits < 0, bits ^ -1, bits ^ -2147483648)


@triton.jit
def _scan_pass(row, start, end, pref, pmask, LO: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of digit (key >> LO) & (BINS-1) over the candidates in [start, end), and the
    max / min of their key bits below LO (equal: the candidates are tied on all remaining bits)."""
    hist = tl.zeros([BINS], tl.int32)
    lmax = tl.full([BLOCK], -1, tl.int32)  # elementwise, reduced once after the loop
    lmin = tl.full([BLOCK], 2147483647, tl.int32)
    for s in range(start, end, BLOCK):
        cols = s + tl.arange(0, BLOCK)
        valid = cols < end
        key = _ukey(tl.load(row + cols, mask=valid, other=0.0))
        cand = valid & ((key & pmask) == pref)
        # The last pass of a width not dividing 32 overlaps bits already in the prefix: they are
        # constant over the candidates, so the digit just spans a shifted range of bins.
        hist += tl.histogram((key >> LO) & (BINS - 1), BINS, mask=cand)
        low = key & ((1 << LO) - 1)
        lmax = tl.maximum(lmax, tl.where(cand, low, -1))
        lmin = tl.minimum(lmin, tl.where(cand, low, 2147483647))
    return hist, tl.max(lmax, 0), tl.min(lmin, 0)


@triton.jit
def _choose(hist, need, BINS: tl.constexpr):
    """Highest bin b with #candidates >= b reaching `need`; #candidates above b; #in b."""
    bins = tl.arange(0, BINS)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    b = tl.max(tl.where(ge >= need, bins, -1), 0)
    above = tl.sum(tl.where(bins == b, ge - hist, 0), 0)
    count = tl.sum(tl.where(bins == b, hist, 0), 0)
    return b, above, count


@triton.jit
def _write_pass(row, out, start, end, pref, pmask, need, eq_seen, off, BLOCK: tl.constexpr, colmap,
                MAPPED: tl.constexpr):
    """Stores, in column order from out[off], the columns of [start, end) whose key prefix is above
    `pref`, and those equal to it while fewer than `need` equal ones were seen (eq_seen before).
    MAPPED: `row` holds gathered candidates and colmap[i] the column of candidate i."""
    thr = pref ^ -2147483648  # unsigned prefixes compared as signed after flipping the top bit
    for s in range(start, end, BLOCK):
        cols = s + tl.arange(0, BLOCK)
        valid = cols < end
        pk = (_ukey(tl.load(row + cols, mask=valid, other=0.0)) & pmask) ^ -2147483648
        eq = (valid & (pk == thr)).to(tl.int32)
        take = (valid & (pk > thr)) | ((eq == 1) & (eq_seen + tl.cumsum(eq, 0) <= need))
        t = take.to(tl.int32)
        if MAPPED:
            cols = tl.load(colmap + cols, mask=take, other=0)
        tl.store(out + off + tl.cumsum(t, 0) - 1, cols, mask=take)
        off += tl.sum(t, 0)
        eq_seen += tl.sum(eq, 0)


@triton.jit
def _write_short(out, n, K, KBLOCK: tl.constexpr):
    for s in range(0, K, KBLOCK):
        j = s + tl.arange(0, KBLOCK)
        tl.store(out + j, tl.where(j < n, j, -1), mask=j < K)


@triton.jit
def _radix_select(row, n, K, RB: tl.constexpr, NPASS: tl.constexpr, BLOCK: tl.constexpr):
    """Every pass of one program over row[0, n): the k-th key's prefix, its mask, and how many keys
    equal to it are still needed."""
    BINS: tl.constexpr = 1 << RB
    zero = n * 0
    pref, pmask, need, done = zero, zero, zero + K, zero
    for p in tl.static_range(NPASS):
        if done == 0:
            # Digit of pass p: key bits [LO, 32 - p * RB), the last one clamped at bit 0.
            LO: tl.constexpr = 32 - (p + 1) * RB if 32 - (p + 1) * RB > 0 else 0
            hist, lmax, lmin = _scan_pass(row, 0, n, pref, pmask, LO, BINS, BLOCK)
            b, above, count = _choose(hist, need, BINS)
            need -= above
            pref |= b << LO
            pmask |= (zero + (BINS - 1)) << LO  # int32 shift: wraps into the sign bit
            done = ((count == need) | (lmax == lmin)).to(tl.int32)
    return pref, pmask, need


@triton.jit
def _gather_pass(row, cv, cc, n, thr, CAP, BLOCK: tl.constexpr):
    """Copies the values of row[0, n) whose signed-order key is >= thr, in column order, into cv and
    their columns into cc (the first CAP of them); returns how many there are, stored or not."""
    off = n * 0
    for s in range(0, n, BLOCK):
        cols = s + tl.arange(0, BLOCK)
        valid = cols < n
        x = tl.load(row + cols, mask=valid, other=0.0)
        take = valid & ((_ukey(x) ^ -2147483648) >= thr)
        t = take.to(tl.int32)
        pos = off + tl.cumsum(t, 0) - 1
        keep = take & (pos < CAP)
        tl.store(cv + pos, x, mask=keep)
        tl.store(cc + pos, cols, mask=keep)
        off += tl.sum(t, 0)
    return off


@triton.jit
def _topk_fused_kernel(x_ptr, len_ptr, out_ptr, cv_ptr, cc_ptr, stride, K, CAP, RB: tl.constexpr,
                       NPASS: tl.constexpr, BLOCK: tl.constexpr, KBLOCK: tl.constexpr, PREFILTER: tl.constexpr,
                       SAMPLE: tl.constexpr):
    """One program per row runs every radix pass, then the write. PREFILTER: one cheap pass first --
    a threshold from a strided sample of the row (its key of rank ~1.5 k n / SAMPLE), every column at
    or above it gathered in column order into cv / cc; when they are at least k and at most CAP the
    passes run over those candidates only, else over the row. Either way the k largest are the same
    (they all sit at or above a threshold that at least k columns reach)."""
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * stride
    out = out_ptr + r.to(tl.int64) * K
    n = tl.load(len_ptr + r).to(tl.int32)
    if n <= K:
        _write_short(out, n, K, KBLOCK)
    else:
        use_row = n * 0 + 1
        if PREFILTER:
            j = tl.arange(0, SAMPLE)
            pick = ((j.to(tl.int64) * n) // SAMPLE).to(tl.int32)  # strided positions < n
            sk = _ukey(tl.load(row + pick)) ^ -2147483648  # signed order
            srt = tl.sort(sk, descending=True)
            rank = tl.minimum((3 * K * SAMPLE) // (2 * n), SAMPLE - 1)
            thr = tl.sum(tl.where(j == rank, srt, 0), 0)
            cv = cv_ptr + r.to(tl.int64) * CAP
            cc = cc_ptr + r.to(tl.int64) * CAP
            cnt = _gather_pass(row, cv, cc, n, thr, CAP, BLOCK)
            use_row = ((cnt < K) | (cnt > CAP)).to(tl.int32)  # the sample misjudged this row
            if use_row == 0:
                pref, pmask, need = _radix_select(cv, cnt, K, RB, NPASS, BLOCK)
                _write_pass(cv, out, 0, cnt, pref, pmask, need, n * 0, n * 0, BLOCK, cc, True)
        if use_row == 1:
            pref, pmask, need = _radix_select(row, n, K, RB, NPASS, BLOCK)
            _write_pass(row, out, 0, n, pref, pmask, need, n * 0, n * 0, BLOCK, row, False)


@triton.jit
def _split_choice(hist, low, S, pref, pmask, need, LO: tl.constexpr, RB: tl.constexpr):
    """One pass's choice from its per-chunk histograms (`hist` [S, BINS], `low` [S, 2] of the row):
    the chosen bin and the state after it (prefix, mask, need, done)."""
    BINS: tl.constexpr = 1 << RB
    bins = tl.arange(0, BINS)
    tot = tl.zeros([BINS], tl.int32)
    lmax = need * 0 - 1
    lmin = need * 0 + 2147483647
    for cc in range(0, S):
        tot += tl.load(hist + cc * BINS + bins)
        lmax = tl.maximum(lmax, tl.load(low + cc * 2))
        lmin = tl.minimum(lmin, tl.load(low + cc * 2 + 1))
    b, above, count = _choose(tot, need, BINS)
    need -= above
    done = ((count == need) | (lmax == lmin)).to(tl.int32)
    return b, pref | (b << LO), pmask | ((need * 0 + (BINS - 1)) << LO), need, done


@triton.jit
def _chunk_counts(hist, b):
    """A chunk's candidates above the chosen bin b and in it (hist: its [BINS] histogram)."""
    bins = tl.arange(0, hist.shape[0])
    return tl.sum(tl.where(bins > b, hist, 0), 0), tl.sum(tl.where(bins == b, hist, 0), 0)


@triton.jit
def _split_pass_kernel(x_ptr, len_ptr, state_ptr, hist_ptr, low_ptr, cnt_ptr, stride, K, CHUNK, S, R,
                       P: tl.constexpr, LO_PREV: tl.constexpr, LO: tl.constexpr, RB: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Pass P over chunk c of row r: first the choice of pass P - 1 (every program of the row makes
    the same one from the same histograms; program 0 stores the state, program c counts its own
    chunk's candidates above the chosen bin and in it), then chunk c's histogram for digit P."""
    BINS: tl.constexpr = 1 << RB
    r = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.load(len_ptr + r).to(tl.int32)
    if n > K:
        bins = tl.arange(0, BINS)
        cnt = cnt_ptr + (r * 2) * S + c  # [gt so far, in the last chosen bin] of chunk c
        if P == 0:
            pref, pmask, need, done = n * 0, n * 0, n * 0 + K, n * 0
            tl.store(cnt, 0)
        else:
            st = state_ptr + ((P - 1) * R + r) * 4
            pref = tl.load(st)
            pmask = tl.load(st + 1)
            need = tl.load(st + 2)
            done = tl.load(st + 3)
            if done == 0:
                hrow = hist_ptr + ((P - 1) * R + r).to(tl.int64) * S * BINS
                b, pref, pmask, need, done = _split_choice(hrow, low_ptr + ((P - 1) * R + r) * S * 2, S, pref,
                                                           pmask, need, LO_PREV, RB)
                gt, eq = _chunk_counts(tl.load(hrow + c * BINS + bins), b)
                tl.store(cnt, tl.load(cnt) + gt)
                tl.store(cnt + S, eq)
        if c == 0:
            st = state_ptr + (P * R + r) * 4
            tl.store(st, pref)
            tl.store(st + 1, pmask)
            tl.store(st + 2, need)
            tl.store(st + 3, done)
        if done == 0:
            start = c * CHUNK
            hist, lmax, lmin = _scan_pass(x_ptr + r.to(tl.int64) * stride, start, tl.minimum(start + CHUNK, n),
                                          pref, pmask, LO, BINS, BLOCK)
            slot = (P * R + r) * S + c
            tl.store(hist_ptr + slot.to(tl.int64) * BINS + bins, hist)
            tl.store(low_ptr + slot * 2, lmax)
            tl.store(low_ptr + slot * 2 + 1, lmin)


@triton.jit
def _split_write_kernel(x_ptr, len_ptr, state_ptr, hist_ptr, low_ptr, cnt_ptr, out_ptr, stride, K, CHUNK, S, R,
                        P: tl.constexpr, LO: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr,
                        KBLOCK: tl.constexpr):
    """The last pass's choice (if the row is still open), then chunk c's columns from its output
    offset: the selected-above and the first `need` tied columns of the chunks before it."""
    BINS: tl.constexpr = 1 << RB
    r = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.load(len_ptr + r).to(tl.int32)
    out = out_ptr + r.to(tl.int64) * K
    if n <= K:
        if c == 0:
            _write_short(out, n, K, KBLOCK)
    else:
        st = state_ptr + (P * R + r) * 4
        pref = tl.load(st)
        pmask = tl.load(st + 1)
        need = tl.load(st + 2)
        done = tl.load(st + 3)
        gt = n * 0
        eq = n * 0
        if done == 0:
            bins = tl.arange(0, BINS)
            hrow = hist_ptr + (P * R + r).to(tl.int64) * S * BINS
            b, pref, pmask, need, done = _split_choice(hrow, low_ptr + (P * R + r) * S * 2, S, pref, pmask,
                                                       need, LO, RB)
            for cc in range(0, c):
                cgt, ceq = _chunk_counts(tl.load(hrow + cc * BINS + bins), b)
                gt += tl.load(cnt_ptr + (r * 2) * S + cc) + cgt
                eq += ceq
        else:
            for cc in range(0, c):
                gt += tl.load(cnt_ptr + (r * 2) * S + cc)
                eq += tl.load(cnt_ptr + (r * 2 + 1) * S + cc)
        start = c * CHUNK
        row = x_ptr + r.to(tl.int64) * stride
        _write_pass(row, out, start, tl.minimum(start + CHUNK, n), pref, pmask, need, eq, gt + tl.minimum(eq, need),
                    BLOCK, row, False)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_split(rows: int, width: int, device: torch.device) -> int:
    """Chunks per row: 1 (fused) once the rows alone fill the GPU; else ~4 programs per SM, each
    at least SPLIT_MIN_CHUNK columns. Depends on shapes only (CUDA-graph safe)."""
    sms = _num_sms(torch.device(device))
    if rows >= sms:
        return 1
    return max(1, min(triton.cdiv(width, SPLIT_MIN_CHUNK), triton.cdiv(4 * sms, max(rows, 1)), MAX_SPLIT))


def fast_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
              split: int | None = None, radix_bits: int | None = None, block: int | None = None,
              num_warps: int | None = None, prefilter: bool = False) -> torch.Tensor:
    """Indices [R, k] int32 of each row's top-k over its first lengths[r] columns (module docstring).

    scores: [R, W] fp32 with unit column stride (any row stride). lengths: [R] int32/int64 on the
    same device, 0 <= lengths[r] <= W (read by the kernel: no host sync). Knobs (results do not
    depend on them): split (chunks per row, None = auto_split), radix_bits (5..8; default 6 fused,
    8 split), block (columns per loop step, power of 2), num_warps, prefilter (fused path only: one
    gather pass above a sampled threshold, then the radix passes over <= 2k candidates per row;
    scratch 8 x 2k bytes per row).
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D float32 tensor, got {tuple(scores.shape)} {scores.dtype}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    rows, width = scores.shape
    if lengths.shape != (rows,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != scores.device:
        raise ValueError(f"lengths must be int32/int64 of shape ({rows},) on {scores.device}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    elif out.shape != (rows, k) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous int32 tensor of shape (R, k)")
    if rows == 0:
        return out
    split = auto_split(rows, width, scores.device) if split is None else max(1, int(split))
    rb = radix_bits or (6 if split == 1 else 8)
    if not 5 <= rb <= 8:
        raise ValueError("radix_bits must be in [5, 8]")
    npass = triton.cdiv(32, rb)
    kblock = min(1024, next_pow2(k))
    stride = scores.stride(0)
    if split == 1:  # (the prefilter's scratch: topk_plan.scratch_bytes_per_row)
        cap = 2 * k if prefilter else 0
        cv = torch.empty((rows, cap), dtype=torch.float32, device=scores.device) if prefilter else scores
        cc = torch.empty((rows, cap), dtype=torch.int32, device=scores.device) if prefilter else out
        _topk_fused_kernel[(rows,)](scores, lengths, out, cv, cc, stride, k, cap, RB=rb, NPASS=npass,
                                    BLOCK=block or 1024, KBLOCK=kblock, PREFILTER=prefilter, SAMPLE=PREFILTER_SAMPLE,
                                    num_warps=num_warps or 8)
        return out
    chunk = triton.cdiv(triton.cdiv(width, split), block or 1024) * (block or 1024)
    s = triton.cdiv(width, chunk) if width else 1
    if s > MAX_SPLIT:
        raise ValueError(f"split {s} > {MAX_SPLIT}: raise block or lower split")
    dev = scores.device
    state = torch.empty((npass, rows, 4), dtype=torch.int32, device=dev)  # state before each pass's choice
    hist = torch.empty((npass, rows, s, 1 << rb), dtype=torch.int32, device=dev)
    low = torch.empty((npass, rows, s, 2), dtype=torch.int32, device=dev)
    cnt = torch.empty((rows, 2, s), dtype=torch.int32, device=dev)
    blk = min(block or 1024, next_pow2(chunk))
    los = [max(32 - (p + 1) * rb, 0) for p in range(npass)]
    for p in range(npass):
        _split_pass_kernel[(rows, s)](scores, lengths, state, hist, low, cnt, stride, k, chunk, s, rows, P=p,
                                      LO_PREV=los[p - 1] if p else 0, LO=los[p], RB=rb, BLOCK=blk,
                                      num_warps=num_warps or 4)
    _split_write_kernel[(rows, s)](scores, lengths, state, hist, low, cnt, out, stride, k, chunk, s, rows,
                                   P=npass - 1, LO=los[-1], RB=rb, BLOCK=blk, KBLOCK=kblock,
                                   num_warps=num_warps or 4)
    return out


def prefilter_candidates_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, how many columns the prefilter gathers (its sampled threshold, as the kernel takes it):
    in [k, 2k] the radix passes run over those only, else over the whole row. Rows with n <= k: 0."""
    rows = scores.shape[0]
    n = lengths.to(torch.int64)
    j = torch.arange(PREFILTER_SAMPLE, device=scores.device)
    pick = (j[None, :] * n[:, None]) // PREFILTER_SAMPLE
    keys = order_key(scores)
    sample = keys.gather(1, pick.clamp(max=scores.shape[1] - 1)).sort(dim=1, descending=True).values
    rank = torch.clamp((3 * k * PREFILTER_SAMPLE) // (2 * n.clamp(min=1)), max=PREFILTER_SAMPLE - 1)
    thr = sample.gather(1, rank[:, None])
    cols = torch.arange(scores.shape[1], device=scores.device)
    cnt = ((keys >= thr) & (cols[None, :] < n[:, None])).sum(1)
    return torch.where(n > k, cnt, torch.zeros(rows, dtype=cnt.dtype, device=cnt.device))


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """Signed int32 key with the order of the fp32 values (-0.0 == +0.0); the kernel's unsigned key
    is this one with the top bit flipped."""
    bits = scores.contiguous().view(torch.int32)
    bits = torch.where(bits == _INT_MIN, torch.zeros_like(bits), bits)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def fast_topk_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Torch twin of fast_topk: torch.topk on int64 (key << 32 | W-1-col), so equal keys rank the
    lower column higher; the selected columns are then sorted ascending. No host syncs either."""
    rows, width = scores.shape
    dev = scores.device
    ar = torch.arange(k, device=dev, dtype=torch.int32)
    n = lengths.to(torch.int64)[:, None]
    out = torch.where(ar[None, :] < n, ar[None, :], -1).to(torch.int32)  # rows with n <= k
    if rows == 0 or width <= k:  # then every row has n <= W <= k
        return out
    cols = torch.arange(width, device=dev, dtype=torch.int64)
    packed = (order_key(scores).to(torch.int64) << 32) | (width - 1 - cols)[None, :]
    packed = packed.masked_fill(cols[None, :] >= n, torch.iinfo(torch.int64).min)  # below every key
    top = packed.topk(k, dim=1, sorted=False).values
    sel = (width - 1 - (top & 0xFFFFFFFF)).sort(dim=1).values.to(torch.int32)
    return torch.where(n > k, sel, out)
