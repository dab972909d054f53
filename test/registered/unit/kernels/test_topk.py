"""sgl_kernel.topk: the Triton top-k (under TRITON_INTERPRET on CPU, compiled with
SGLANG_TEST_DEVICE=cuda) equals its torch twin bit for bit, and both equal a brute-force Python
top-k. Both launch shapes (fused and split rows) and several radix widths are covered; block sizes
are tiny so rows span many blocks (and chunks) at interpreter-friendly widths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_kernel.topk import fast_topk, fast_topk_ref, prefilter_candidates_ref

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
POISON = -7

# (split, radix_bits, block): fused at the default / widest / a width not dividing 32, and split
# rows with 8- and 6-bit digits (chunks of a few blocks each).
# The fused path also with the prefilter (a sampled threshold, the passes over the gathered rows).
CONFIGS = [(1, 6, 64), (1, 8, 32), (1, 5, 64), (4, 8, 32), (3, 6, 32), (1, 6, 64, True), (1, 8, 16, True)]
IDS = [f"split{c[0]}-rb{c[1]}-blk{c[2]}" + ("-prefilter" if c[3:] and c[3] else "") for c in CONFIGS]


def brute_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Python floats: -0.0 == 0.0 and -inf is lowest natively; ties go to the lower column."""
    rows = []
    for vals, n in zip(scores.tolist(), lengths.tolist()):
        if n <= k:
            rows.append(list(range(n)) + [-1] * (k - n))
        else:
            best = sorted(range(n), key=lambda c: (-vals[c], c))[:k]
            rows.append(sorted(best))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), k)


def run(scores: torch.Tensor, lengths: torch.Tensor, k: int, cfg) -> torch.Tensor:
    """fast_topk on DEVICE into a poisoned output (unwritten entries show up as POISON)."""
    split, rb, block, *pre = cfg
    out = torch.full((scores.shape[0], k), POISON, dtype=torch.int32, device=DEVICE)
    got = fast_topk(scores.to(DEVICE), lengths.to(DEVICE), k, out=out, split=split, radix_bits=rb, block=block,
                    prefilter=bool(pre and pre[0]))
    assert got.data_ptr() == out.data_ptr()
    return got.cpu()


def fp8_grid(shape, gen) -> torch.Tensor:
    """FP8 (e4m3) values: what the indexer scores look like, with many exact ties."""
    return (torch.randn(shape, generator=gen) * 4).to(torch.float8_e4m3fn).float()


def zoo(width: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of hard rows with assorted lengths (edge lengths 0, 1, k-1, k, k+1, W)."""
    rows = [
        torch.randn(width, generator=gen),
        fp8_grid(width, gen),
        fp8_grid(width, gen).abs(),
        torch.randn(width, generator=gen).bfloat16().float(),  # low 16 bits zero: early stop
        torch.full((width,), 1.5),  # all equal
        torch.full((width,), -0.0),
        torch.where(torch.rand(width, generator=gen) < 0.5, 0.0, -0.0),  # +0.0 / -0.0 mix: all tied
        torch.where(torch.rand(width, generator=gen) < 0.5, float("-inf"), torch.randn(width, generator=gen)),
        torch.full((width,), float("-inf")),
        torch.randint(-2, 3, (width,), generator=gen).float() * torch.tensor([1.0, -1.0])[torch.arange(width) % 2],
        torch.tensor([float(c % 7) for c in range(width)]),
        -torch.rand(width, generator=gen) * 1e-38,  # negative denormals / tiny
        torch.randn(width, generator=gen),
        fp8_grid(width, gen),
    ]
    lengths = [width, width, k + 1, width, width, k + 3, width, width, width - 1, k, 0, 1, k - 1, k + 1]
    return torch.stack(rows), torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_zoo_matches_twin_and_brute_force(cfg):
    gen = torch.Generator().manual_seed(0)
    k, width = 13, 150  # k not a power of two; W not a multiple of any block
    scores, lengths = zoo(width, k, gen)
    ref = fast_topk_ref(scores, lengths, k)
    assert torch.equal(ref, brute_topk(scores, lengths, k))
    assert torch.equal(run(scores, lengths, k, cfg), ref)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=[IDS[0], IDS[3]])  # prefilter: exact in the zoo
def test_batch_invariance_and_padding(cfg):
    """A row's indices do not depend on its neighbours, its position or the width / contents of
    the padding beyond its length (+inf and NaN there would win if read), nor on the row stride."""
    gen = torch.Generator().manual_seed(1)
    k, width = 8, 96
    scores, lengths = zoo(width, k, gen)
    lengths = lengths.to(torch.int64)  # int64 lengths are accepted too
    batch = run(scores, lengths, k, cfg)
    assert torch.equal(batch, fast_topk_ref(scores, lengths, k))
    picks = [1, 3, 13]
    perm = torch.tensor(picks[::-1])
    assert torch.equal(run(scores[perm], lengths[perm], k, cfg), batch[perm])
    for r in picks:
        n = int(lengths[r])
        wide = torch.full((1, width + 77), float("inf"))
        wide[0, n + 1 :: 2] = float("nan")
        wide[0, :n] = scores[r, :n]
        assert torch.equal(run(wide, lengths[r : r + 1], k, cfg), batch[r : r + 1])
    strided = torch.full((len(lengths), width + 40), float("inf"))
    strided[:, :width] = scores  # row stride 136, a view: no copy needed
    assert torch.equal(run(strided[:, :width], lengths, k, cfg), batch)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=[IDS[0], IDS[3]])
def test_small_widths_and_empty_batch(cfg):
    gen = torch.Generator().manual_seed(2)
    k = 5
    for width in (1, 4, 5, 6):  # W < k, W == k, W == k + 1
        scores = fp8_grid((3, width), gen)
        lengths = torch.tensor([width, width // 2, 0], dtype=torch.int32)
        assert torch.equal(run(scores, lengths, k, cfg), brute_topk(scores, lengths, k))
    empty = run(torch.empty(0, 10), torch.empty(0, dtype=torch.int32), k, cfg)
    assert empty.shape == (0, k)
    assert fast_topk_ref(torch.empty(0, 10), torch.empty(0, dtype=torch.int32), k).shape == (0, k)


def test_long_rows_with_massive_ties():
    """k equal-score winners spread over many chunks: the threshold-equal run is cut mid-chunk."""
    k, width = 37, 700
    scores = torch.zeros(2, width)
    scores[0, ::3] = 1.0  # 234 columns tied at the top: take the first 37 (up to column 108)
    scores[1, 5::50] = 2.0  # 14 winners, then 23 of the zeros from the left
    scores[1, 600:] = float("-inf")
    lengths = torch.tensor([width, 650], dtype=torch.int32)
    ref = fast_topk_ref(scores, lengths, k)
    assert torch.equal(ref, brute_topk(scores, lengths, k))
    for cfg in [(1, 8, 128), (6, 8, 64), (1, 8, 128, True)]:
        assert torch.equal(run(scores, lengths, k, cfg), ref)


def test_nan_is_ordered_by_bits():
    """Documented, not relied on: +NaN ranks above +inf, -NaN below -inf, in kernel and twin."""
    scores = torch.tensor([[1.0, float("nan"), float("inf"), -float("nan"), float("-inf"), 2.0]])
    lengths = torch.tensor([6], dtype=torch.int32)
    ref = fast_topk_ref(scores, lengths, 3)
    assert ref.tolist() == [[1, 2, 5]]
    assert torch.equal(run(scores, lengths, 3, CONFIGS[0]), ref)
    assert fast_topk_ref(scores, lengths, 5).tolist() == [[0, 1, 2, 4, 5]]


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sgl_kernel.topk as T

ptr, i32 = "*fp32", "i32"
def build(fn, sig, consts, warps):
    sig = {**sig, **{c: "constexpr" for c in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

common = {"len_ptr": "*i64", "state_ptr": "*i32"}
for pre in (False, True):
    build(T._topk_fused_kernel, {"x_ptr": ptr, "len_ptr": "*i32", "out_ptr": "*i32", "cv_ptr": ptr, "cc_ptr": "*i32",
                                 "stride": i32, "K": i32, "CAP": i32},
          {"RB": 6, "NPASS": 6, "BLOCK": 1024, "KBLOCK": 1024, "PREFILTER": pre, "SAMPLE": 1024}, 8)
split = {"x_ptr": ptr, **common, "hist_ptr": "*i32", "low_ptr": "*i32", "cnt_ptr": "*i32", "stride": i32,
         "K": i32, "CHUNK": i32, "S": i32, "R": i32}
for p, lo_prev, lo in ((0, 0, 24), (3, 8, 0)):
    build(T._split_pass_kernel, split, {"P": p, "LO_PREV": lo_prev, "LO": lo, "RB": 8, "BLOCK": 1024}, 4)
build(T._split_write_kernel, {**split, "out_ptr": "*i32"}, {"P": 3, "LO": 0, "RB": 8, "BLOCK": 1024,
                                                            "KBLOCK": 1024}, 4)
print("compiled")
"""


def test_kernels_compile_for_h200():
    """The interpreter bypasses Triton's compiler: build every kernel for sm_90 (H200) down to a
    cubin (ptxas ships with Triton), no GPU needed. Catches frontend errors the CPU tests cannot."""
    import triton.backends.nvidia.compiler  # noqa: F401  (a CPU install of triton ships it too)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_rejects_bad_arguments():
    s, n = torch.zeros(2, 8), torch.tensor([8, 8], dtype=torch.int32)
    with pytest.raises(ValueError):
        fast_topk(s.half(), n, 4)
    with pytest.raises(ValueError):
        fast_topk(s, n.float(), 4)
    with pytest.raises(ValueError):
        fast_topk(s, n.to("meta"), 4)  # lengths must live with the scores
    with pytest.raises(ValueError):
        fast_topk(s, n, 0)
    with pytest.raises(ValueError):
        fast_topk(s, n, 4, out=torch.empty(2, 4, dtype=torch.int64))


_VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-40, -1e-40, 3.4e38, float("inf"), float("-inf"),
                           448.0, -448.0, 0.1, 0.2])


@st.composite
def cases(draw, max_rows: int, max_width: int):
    rows = draw(st.integers(0, max_rows))
    width = draw(st.integers(1, max_width))
    k = draw(st.integers(1, width + 2))
    vals = draw(st.lists(st.one_of(_VALUES, st.floats(width=32, allow_nan=False)),
                         min_size=rows * width, max_size=rows * width))
    lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    scores = torch.tensor(vals, dtype=torch.float32).reshape(rows, width)
    return scores, torch.tensor(lengths, dtype=torch.int32), k


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_rows=4, max_width=40))
def test_twin_matches_brute_force(case):
    scores, lengths, k = case
    assert torch.equal(fast_topk_ref(scores, lengths, k), brute_topk(scores, lengths, k))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_rows=3, max_width=48), st.sampled_from(CONFIGS))
def test_kernel_matches_brute_force(case, cfg):
    scores, lengths, k = case
    split, rb, _, *pre = cfg
    assert torch.equal(run(scores, lengths, k, (split, rb, 16, *pre)), brute_topk(scores, lengths, k))


def test_prefilter_takes_the_short_path_on_indexer_like_rows():
    """The prefilter pays only if its sampled threshold leaves k..2k candidates: on rows shaped like
    indexer scores (Gaussian, FP8-valued with ties, a causal length) at V3.2's k = 2048 it does, so
    the radix passes run over at most 2k columns, not the row (the output is exact either way)."""
    g = torch.Generator().manual_seed(3)
    k = 2048
    for width in (8192, 32768):
        scores = torch.cat([torch.randn(4, width, generator=g), fp8_grid((4, width), g)])
        lengths = torch.tensor([width, width, width // 2, 3 * k] * 2, dtype=torch.int32)
        cnt = prefilter_candidates_ref(scores, lengths, k)
        assert ((cnt >= k) & (cnt <= 2 * k)).all(), (width, cnt.tolist())
    same = torch.full((1, 8192), 1.5)  # all tied: every column is a candidate, the row path runs
    assert prefilter_candidates_ref(same, torch.tensor([8192]), k).item() == 8192
