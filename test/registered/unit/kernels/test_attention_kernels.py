"""sgl_kernel.sparse_mla, .indexer and .kv_store against their torch twins (TRITON_INTERPRET on
CPU; compiled with SGLANG_TEST_DEVICE=cuda). Odd sizes, page sizes 1 and 64, empty batches,
split-K decode, batch invariance. Outputs are poisoned first so unwritten entries are caught."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel.indexer import index_scores, token_blocks
from sgl_kernel.kv_store import store_index_k, store_mla_kv
from sgl_kernel.mla_split import split_keys_for
from sgl_kernel.sparse_mla import mla_attention, mla_attention_ref
from sglang.srt.layers.attention.nsa.nsa_indexer import fold_fp8_query
from sglang.srt.layers.attention.nsa.nsa_indexer import index_scores as index_scores_ref
from sglang.srt.mem_cache.index_k_format import fp8_round_trip
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(seq_lens: list[int], extend: list[int], slots: int, g: torch.Generator, ctx: int = 160):
    """A req_to_token table for requests of `seq_lens`, the last `extend[i]` tokens being new."""
    rows = len(seq_lens) + 2
    perm = torch.randperm(slots, generator=g)
    r2t = torch.zeros(rows, ctx, dtype=torch.int32)
    off = 0
    pool_idx = torch.randperm(rows, generator=g)[: len(seq_lens)]
    for r, n in zip(pool_idx.tolist(), seq_lens):
        r2t[r, :n] = perm[off : off + n].int()
        off += n
    tok_req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(extend))
    positions = torch.cat([torch.arange(n - e, n) for n, e in zip(seq_lens, extend)]) if extend else torch.empty(0)
    return r2t, pool_idx.long(), tok_req.long(), positions.long()


def _topk_lists(positions: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    out = torch.full((len(positions), k), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        sel = torch.randperm(p + 1, generator=g)[:k].sort().values
        out[i, : len(sel)] = sel.int()
    return out


def _to(*xs):
    return [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("split_keys", [0, 32, 64])
def test_mla_attention_matches_reference(dtype, sparse, split_keys):
    g = _gen(1)
    c, r, h = 48, 16, 5  # C not a power of two, heads not a multiple of the head block
    kv = (torch.randn(400, 1, c + r, generator=g)).to(dtype)
    seq, ext = [37, 130, 1], [3, 2, 1]
    r2t, pidx, tok_req, pos = _batch(seq, ext, 400, g)
    t = sum(ext)
    q_lat, q_rope = torch.randn(t, h, c, generator=g).to(dtype), torch.randn(t, h, r, generator=g).to(dtype)
    topk = _topk_lists(pos, 40, g) if sparse else None
    args = _to(q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk)
    out = torch.full((t, h, c), float("nan"), dtype=dtype, device=DEVICE)
    max_keys = 40 if sparse else 160
    got = mla_attention(*args, 0.1, split_keys=split_keys, max_keys=max_keys, out=out)
    ref = mla_attention_ref(*args, 0.1)
    assert not got.isnan().any()
    err = (got.float() - ref.float()).abs().max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention_split_of_several_tiles(dtype):
    """Splits of 3 tiles (the next tile's slots are fetched one iteration ahead), a top-k of 40 that
    is no multiple of the 16-key tile, -1 padding (short requests), and a last split partly empty."""
    g = _gen(21)
    c, r, h = 48, 16, 20  # two head blocks of 16, the second partial
    kv = torch.randn(400, 1, c + r, generator=g).to(dtype)
    seq, ext = [37, 130, 1, 90], [1, 1, 1, 1]
    r2t, pidx, tok_req, pos = _batch(seq, ext, 400, g)
    q_lat, q_rope = torch.randn(4, h, c, generator=g).to(dtype), torch.randn(4, h, r, generator=g).to(dtype)
    topk = _topk_lists(pos, 40, g)
    args = _to(q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk)
    out = torch.full((4, h, c), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_attention(*args, 0.1, split_keys=48, max_keys=40 + 48, out=out, block_h=16, block_n=16)
    ref = mla_attention_ref(*args, 0.1)
    assert not got.isnan().any()
    assert (got.float() - ref.float()).abs().max().item() < TOL[dtype]


def test_mla_attention_empty_batch_and_batch_invariance():
    g = _gen(2)
    c, r, h = 32, 16, 4
    kv = torch.randn(300, 1, c + r, generator=g)
    seq, ext = [50, 90, 20], [1, 1, 1]
    r2t, pidx, tok_req, pos = _batch(seq, ext, 300, g)
    q_lat, q_rope = torch.randn(3, h, c, generator=g), torch.randn(3, h, r, generator=g)
    topk = _topk_lists(pos, 24, g)
    empty = mla_attention(*_to(q_lat[:0], q_rope[:0], kv, c, r2t, pidx, tok_req[:0], pos[:0], topk[:0]), 0.1)
    assert empty.shape == (0, h, c)
    together = mla_attention(*_to(q_lat, q_rope, kv, c, r2t, pidx, tok_req, pos, topk), 0.1, split_keys=32,
                             max_keys=24)
    for i in range(3):  # the same request alone, as batch index 0
        alone = mla_attention(*_to(q_lat[i : i + 1], q_rope[i : i + 1], kv, c, r2t, pidx[i : i + 1],
                                   torch.zeros(1, dtype=torch.long), pos[i : i + 1], topk[i : i + 1]), 0.1,
                              split_keys=32, max_keys=24)
        assert torch.equal(alone[0], together[i])


def test_split_keys_is_a_function_of_the_model_only():
    assert split_keys_for(2048) == 256 and split_keys_for(2048, 64) == 256
    assert split_keys_for(163840) == 5120 and split_keys_for(32) == 256


@pytest.mark.parametrize("index_k_dtype", ["fp8_e4m3", "bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_index_k_store_matches_pool_bytes(index_k_dtype, page_size):
    g = _gen(3)
    for d in (64, 128):
        a = NSATokenToKVPool(256, page_size, torch.float32, 16, 8, 2, d, index_k_dtype, device=DEVICE)
        b = NSATokenToKVPool(256, page_size, torch.float32, 16, 8, 2, d, index_k_dtype, device=DEVICE)
        loc = torch.randperm(256, generator=g)[:13].to(DEVICE) + page_size
        k = (torch.randn(13, d, generator=g) * torch.logspace(-2, 2, 13)[:, None]).to(DEVICE)
        a.set_index_k(1, loc, k)
        store_index_k(b.index_k_with_scale_buffer[1], loc, k, page_size, b.data_dtype)
        assert torch.equal(a.index_k_with_scale_buffer[1], b.index_k_with_scale_buffer[1])
        assert b.index_k_with_scale_buffer[0].eq(0).all()
        store_index_k(b.index_k_with_scale_buffer[1], loc[:0], k[:0], page_size, b.data_dtype)  # empty: no-op


def test_mla_kv_store_matches_pool():
    g = _gen(4)
    for dtype in (torch.float32, torch.bfloat16):
        a = NSATokenToKVPool(128, 1, dtype, 48, 16, 1, 64, device=DEVICE)
        b = NSATokenToKVPool(128, 1, dtype, 48, 16, 1, 64, device=DEVICE)
        loc = torch.randperm(128, generator=g)[:9].to(DEVICE) + 1
        lat, rope = torch.randn(9, 48, generator=g).to(DEVICE), torch.randn(9, 16, generator=g).to(DEVICE)
        a.set_mla_kv_buffer(0, loc, lat, rope)
        store_mla_kv(b.kv_buffer[0], loc, lat, rope)
        assert torch.equal(a.kv_buffer[0], b.kv_buffer[0])


def _scores_ref(q, w, keys_of, tok_req, pos, width, fp8: bool):
    out = torch.full((len(pos), width), float("nan"))
    for t, (r, p) in enumerate(zip(tok_req.tolist(), pos.tolist())):
        kk = keys_of[r][: p + 1]
        out[t, : p + 1] = index_scores_ref(q[t : t + 1], kk[None], w[t : t + 1], 1.0)[0]
    return out


@pytest.mark.parametrize("index_k_dtype,q_dtype", [("fp8_e4m3", torch.float32), ("fp8_e4m3", torch.bfloat16),
                                                   ("float32", torch.float32)])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("block_t,head_sum", [(1, "dot"), (4, "dot"), (1, "sum"), (3, "sum")])
@pytest.mark.parametrize("shuffle", [False, True])
def test_index_scores_match_reference(index_k_dtype, q_dtype, page_size, block_t, head_sum, shuffle):
    """bf16 queries with FP8 keys take the FP8 x FP8 tensor-core path (FP8 query values are exact
    in bf16); fp32 the exact one. Either way the products are exact and only the sums round.
    `shuffle`: a request's rows in any position order (a CP rank's local rows are not consecutive)."""
    g = _gen(5)
    h, d = 16, 64
    seq, ext = [70, 9, 133], [30, 9, 1]
    pool = NSATokenToKVPool(512, page_size, torch.float32, 16, 8, 1, d, index_k_dtype)
    r2t, pidx, tok_req, pos = _batch(seq, ext, 448, g)
    if shuffle:
        pos = torch.cat([seg[torch.randperm(len(seg), generator=g)] for seg in pos.split(ext)])
    r2t = r2t + page_size  # keep clear of the padding page
    keys_of = []
    for r, n in zip(pidx.tolist(), seq):
        kk = torch.randn(n, d, generator=g)
        pool.set_index_k(0, r2t[r, :n].long(), kk)
        keys_of.append(pool.get_index_k(0, r2t[r, :n].long()))  # what the pool holds (dequantised)
    t = sum(ext)
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    fp8 = index_k_dtype == "fp8_e4m3"
    if fp8:
        q8, wf = fold_fp8_query(q, w, 1.0, q_dtype)
        ref = _scores_ref(fp8_round_trip(q), w, keys_of, tok_req, pos, 140, True)
    else:
        q8, wf = q, w
        ref = _scores_ref(q, w, keys_of, tok_req, pos, 140, False)
    starts = [0, 30, 39]
    blocks = torch.tensor(token_blocks(starts, ext, block_t), dtype=torch.int32)
    out = torch.full((t, 140), float("nan"))
    buf = pool.index_k_with_scale_buffer[0]
    got = index_scores(*_to(q8, wf), index_k_buffer=buf.to(DEVICE), page_size=page_size, data_dtype=pool.data_dtype,
                       req_to_token=r2t.to(DEVICE), req_pool_indices=pidx.to(DEVICE), token_to_req=tok_req.to(DEVICE),
                       positions=pos.to(DEVICE), blocks=blocks.to(DEVICE), out=out.to(DEVICE), block_t=block_t,
                       block_n=32, head_sum=head_sum).cpu()
    causal = torch.arange(140)[None, :] <= pos[:, None]
    assert not got[causal].isnan().any() and got[~causal].isnan().all()  # exactly the causal entries
    err = (got[causal] - ref[causal]).abs().max().item()
    # bf16 queries: FP8 x FP8 tensor cores, whose accumulator on Hopper keeps fewer bits than fp32
    # (the H100 gave 1.4e-4 of the max with the fp32 "sum"), and a tf32 head sum with "dot"
    tol = 1e-4 if q_dtype == torch.float32 or (head_sum == "sum" and DEVICE != "cuda") else 2e-3
    assert err < tol * max(1.0, ref[causal].abs().max().item()), err


def test_index_scores_skip_short_blocks_and_empty():
    """Blocks whose last row is no longer than skip_below are not scored (their top-k is all of it)."""
    g = _gen(6)
    pool = NSATokenToKVPool(256, 1, torch.float32, 16, 8, 1, 64, "float32")
    r2t, pidx, tok_req, pos = _batch([20, 60], [20, 1], 200, g)
    q, w = torch.randn(21, 16, 64, generator=g), torch.randn(21, 16, generator=g)
    blocks = torch.tensor(token_blocks([0, 20], [20, 1], 4), dtype=torch.int32)
    out = torch.full((21, 64), float("nan"), device=DEVICE)
    buf = pool.index_k_with_scale_buffer[0].to(DEVICE)
    args = _to(q, w, buf, 1, torch.float32, r2t, pidx, tok_req, pos)
    index_scores(*args, blocks.to(DEVICE), out, block_t=4, skip_below=32)
    assert out[:20].isnan().all() and not out[20, :60].isnan().any()
    index_scores(*args, blocks[:0].to(DEVICE), out, block_t=4)


# -- FP8 MLA KV (--kv-cache-dtype fp8_e4m3) ----------------------------------------------------------
@pytest.mark.parametrize("c,r", [(64, 16), (320, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_kv_store_fp8_byte_equal_to_pool_twin(c, r, dtype):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    g = _gen(11)
    a = MLATokenToKVPool(64, 4, dtype, c, r, 1, device=DEVICE, kv_cache_dtype="fp8_e4m3")
    b = MLATokenToKVPool(64, 4, dtype, c, r, 1, device=DEVICE, kv_cache_dtype="fp8_e4m3")
    loc = (torch.randperm(64, generator=g)[:9] + 4).to(DEVICE)
    lat = (torch.randn(9, c, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(dtype).to(DEVICE)
    rope = torch.randn(9, r, generator=g).to(dtype).to(DEVICE)
    a.set_mla_kv_buffer(0, loc, lat, rope)
    store_mla_kv(b.get_kv_store_buffer(0), loc, lat, rope)
    assert torch.equal(a.kv_buffer[0], b.kv_buffer[0])
    assert b.kv_buffer[0][:4].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("split_keys", [0, 32])
# two scale blocks, the second short; one block (a scale per row); three (not a power of two: the
# per-element scale gather instead of the per-row broadcast)
@pytest.mark.parametrize("c", [160, 64, 384])
def test_mla_attention_fp8_kv_matches_reference_on_dequantised_cache(dtype, sparse, split_keys, c):
    """The kernel dequantises in-kernel; the twin runs on fmt.dequantize's values: same function."""
    from sglang.srt.mem_cache import kv_fp8_format as fmt

    g = _gen(12)
    r, h = 16, 5
    lat, rope = torch.randn(400, c, generator=g) * 3, torch.randn(400, r, generator=g)
    kv_u8 = fmt.pack(lat, rope)[:, None, :]
    deq_lat, deq_rope = fmt.dequantize(kv_u8, c, r)
    kv_ref = torch.cat([deq_lat.to(dtype), deq_rope.to(dtype)], -1)
    seq, ext = [37, 130, 1], [3, 2, 1]
    r2t, pidx, tok_req, pos = _batch(seq, ext, 400, g)
    t = sum(ext)
    q_lat, q_rope = torch.randn(t, h, c, generator=g).to(dtype), torch.randn(t, h, r, generator=g).to(dtype)
    topk = _topk_lists(pos, 40, g) if sparse else None
    out = torch.full((t, h, c), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_attention(*_to(q_lat, q_rope, kv_u8, c, r2t, pidx, tok_req, pos, topk), 0.1, split_keys=split_keys,
                        max_keys=40 if sparse else 160, out=out)
    ref = mla_attention_ref(*_to(q_lat, q_rope, kv_ref, c, r2t, pidx, tok_req, pos, topk), 0.1)
    assert not got.isnan().any()
    err = (got.float() - ref.float()).abs().max().item()
    assert err < TOL[dtype] * 3, err  # outputs are ~3x larger (latents scaled by 3)


_COMPILE_INDEXER_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sgl_kernel.indexer import _index_scores_kernel as K

i32 = "i32"
sig = {"Q": "*bf16", "W": "*fp32", "KDATA": "*u8", "KSCALE": "*fp32", "OUT": "*fp32", "REQ_TO_TOKEN": "*i32",
       "REQ_POOL_IDX": "*i64", "TOKEN_TO_REQ": "*i32", "POSITIONS": "*i64", "BLOCKS": "*i32",
       **{a: i32 for a in ("skip_below", "out_row0", "page_size", "row_data", "row_f32", "scale_base",
                           "stride_qt", "stride_wt", "stride_out", "stride_r2t")}}
for head_sum, bt, bt_pad in (("dot", 2, 16), ("dot", 1, 16), ("sum", 2, 2), ("sum", 1, 1)):
    consts = {"H": 64, "D": 128, "BLOCK_T": bt, "BT_PAD": bt_pad, "BLOCK_N": 128, "NUM_SPLITS": 1, "FP8": True,
              "FP8_DOT": True, "PREC": "tf32", "PREC_W": "tf32", "HEAD_SUM": head_sum}
    src = ASTSource(fn=K, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("compiled")
"""


def test_index_scores_compile_for_sm90():
    """Both head sums of the indexer scores kernel at V3.2's shapes (64 heads x 128, FP8 keys, bf16
    queries) built for sm_90 down to a cubin, no GPU needed: frontend errors the interpreter cannot see."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_INDEXER_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
