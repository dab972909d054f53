"""DSA indexer: FP8 index-K quantisation, score error bound, top-k selection, sparse attention."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.layers.attention.nsa.nsa_backend import topk_to_mask
from sglang.srt.layers.attention.nsa.nsa_indexer import index_score_dtype, index_scores
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.attention.nsa.quant import hadamard_rotate
from sglang.srt.mem_cache.index_k_format import (
    FP8_E4M3_MAX,
    dequantize_fp8_per_block,
    fp8_round_trip,
    quantize_fp8_per_block,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.testing.runner_utils import backend_harness

BACKENDS = ["torch", "triton"]

# e4m3 keeps 3 mantissa bits: round-to-nearest is off by at most 1/16 of the value (normal
# range); below 2^-6 * scale the grid is uniform with step 2^-9 * scale.
E4M3_REL = 1 / 16


def test_fp8_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x[3, 17] = 1e4  # an outlier only hurts its own 128-value block
    q, s = quantize_fp8_per_block(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 3)
    y = dequantize_fp8_per_block(q, s)
    bound = torch.maximum(x.abs() * E4M3_REL, s.repeat_interleave(128, -1)[:, :300] * 2**-10)
    assert bool(((y - x).abs() <= bound * (1 + 1e-5)).all())
    # the block max maps to the top of the e4m3 range
    assert torch.allclose(s[:, 0], x[:, :128].abs().amax(-1) / FP8_E4M3_MAX)


def test_hadamard_rotation_is_orthogonal():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10, 128, generator=g), torch.randn(10, 128, generator=g)
    ra, rb = hadamard_rotate(a), hadamard_rotate(b)
    assert torch.allclose((ra * rb).sum(-1), (a * b).sum(-1), atol=1e-4)
    assert torch.allclose(hadamard_rotate(ra), a, atol=1e-5)
    with pytest.raises(ValueError):
        hadamard_rotate(torch.randn(3, 96))


def test_fp8_index_score_error_bound():
    """|score_fp8 - score_exact| <= scale * sum_h |w_h| * (2 * 1/16 + 1/256) * sum_i |q_hi| |k_i|
    on the rotated vectors (ReLU is 1-Lipschitz; each factor carries at most 1/16 relative error)."""
    g = torch.Generator().manual_seed(2)
    t, h, d, L = 7, 16, 128, 200
    q = torch.randn(t, h, d, generator=g)
    k = torch.nn.functional.layer_norm(torch.randn(L, d, generator=g) * 3, (d,))
    w = torch.randn(t, h, generator=g)
    scale = d**-0.5
    exact = index_scores(q, k[None], w, scale)
    qr, kr = hadamard_rotate(q), hadamard_rotate(k)
    approx = index_scores(fp8_round_trip(qr), fp8_round_trip(kr)[None], w, scale)
    mag = torch.einsum("th,thd,ld->tl", w.abs(), qr.abs(), kr.abs()) * scale
    err = (approx - exact).abs()
    assert bool((err <= mag * (2 * E4M3_REL + E4M3_REL**2) + 1e-5).all())
    # and in practice the error is far inside the worst case
    assert err.mean() < 0.05 * mag.mean()


def test_bf16_scoring_of_fp8_index_k_keeps_the_top_k():
    """The GPU scores FP8 index K in bf16 (index_score_dtype); against fp32 scoring of the same
    FP8 values, the selected top-k sets must overlap >= 0.98 per query (measured: >= 0.994)."""
    g = torch.Generator().manual_seed(2)
    t, h, d, L, topk = 16, 64, 128, 8192, 512
    q = fp8_round_trip(hadamard_rotate(torch.randn(t, h, d, generator=g)))
    k = fp8_round_trip(hadamard_rotate(torch.nn.functional.layer_norm(torch.randn(L, d, generator=g) * 3, (d,))))
    w = torch.randn(t, h, generator=g)
    exact = index_scores(q, k[None], w, d**-0.5)
    fast = index_scores(q.bfloat16(), k[None], w, d**-0.5)
    assert fast.dtype == torch.float32
    for a, b in zip(exact.topk(topk).indices, fast.topk(topk).indices):
        assert len(set(a.tolist()) & set(b.tolist())) >= 0.98 * topk

    fp8_pool, exact_pool = SimpleNamespace(index_k_fp8=True), SimpleNamespace(index_k_fp8=False)
    assert index_score_dtype(fp8_pool, torch.device("cuda")) == torch.bfloat16
    assert index_score_dtype(fp8_pool, torch.device("cpu")) == torch.float32
    assert index_score_dtype(exact_pool, torch.device("cuda")) == torch.float32


# -- top-k selection -------------------------------------------------------------------------------
def _setup(lens_prefix, lens_extend, page_size, index_k_dtype="float32", d=64, seed=0, backend="torch", topk=16,
           heads=16):
    g = torch.Generator().manual_seed(seed)
    size = 1024
    pool = NSATokenToKVPool(size, page_size, torch.float32, 16, 8, 1, d, index_k_dtype)
    r2t = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(size, page_size)
    slots = r2t.alloc(len(lens_prefix))
    seq = [p + e for p, e in zip(lens_prefix, lens_extend)]
    # Whole sequences are allocated at once; the prefix part's K is written up front.
    loc = alloc.alloc_extend([0] * len(seq), seq, [-1] * len(seq))
    off, new_loc = 0, []
    for s, p, n in zip(slots, lens_prefix, seq):
        r2t.write(s, 0, loc[off : off + n])
        new_loc.append(loc[off + p : off + n])
        off += n
    keys = [torch.randn(n, d, generator=g) for n in seq]
    for s, kk, n in zip(slots, keys, seq):
        pool.set_index_k(0, r2t.req_to_token[s, :n].long(), kk)
    mode = ForwardMode.DECODE if all(e == 1 for e in lens_extend) else ForwardMode.EXTEND
    fb = ForwardBatch.build(mode, [0] * sum(lens_extend), slots, lens_prefix, lens_extend, torch.cat(new_loc))
    be = create_attn_backend(backend, backend_harness(pool, r2t, index_heads=heads, index_topk=topk))
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, pool, be
    be.init_forward_metadata(fb)
    return pool, fb, be, keys, g


class _IndexerSpec:
    """What a backend reads of the Indexer module."""

    def __init__(self, topk: int, scale: float = 0.125, layer_id: int = 0) -> None:
        self.index_topk, self.softmax_scale, self.layer_id = topk, scale, layer_id


def _reference_topk(q, w, keys, lens_prefix, lens_extend, topk, scale):
    """Per query: score every causal key, keep the top-k positions (a set)."""
    out, t = [], 0
    for kk, p, e in zip(keys, lens_prefix, lens_extend):
        for j in range(e):
            pos = p + j
            sc = index_scores(q[t : t + 1], kk[None, : pos + 1], w[t : t + 1], scale)[0]
            out.append(set(range(pos + 1)) if pos + 1 <= topk else set(sc.topk(topk).indices.tolist()))
            t += 1
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [([0, 0, 5], [50, 9, 40]), ([30, 64, 3], [1, 1, 1]), ([20, 0], [25, 70])])
def test_topk_equals_dense_masked_reference(page_size, lens, backend):
    """Each backend's index_topk keeps exactly the reference's top-k set, in ascending order,
    -1 padded, for extend and decode batches with cached prefixes and short requests."""
    prefix, extend = lens
    topk = 16
    pool, fb, be, keys, g = _setup(prefix, extend, page_size, backend=backend, topk=topk)
    t = sum(extend)
    # 16 heads: a key whose ReLU scores are all zero (an exact tie) is a 2^-16 event.
    q, w = torch.randn(t, 16, 64, generator=g), torch.randn(t, 16, generator=g)
    got = be.index_topk(_IndexerSpec(topk), q, w, fb)
    ref = _reference_topk(q, w, keys, prefix, extend, topk, 0.125)
    assert got.shape == (t, topk) and got.dtype == torch.int32
    for row, expect in zip(got, ref):
        sel = row[row >= 0].tolist()
        assert sel == sorted(expect) and bool((row[len(sel):] == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_and_extend_paths_select_the_same(backend):
    """The last token of an extend and the same token as a decode step pick identical keys."""
    topk = 8
    pool, fb, be, keys, g = _setup([0], [40], 1, backend=backend, topk=topk, heads=4)
    q, w = torch.randn(40, 4, 64, generator=g), torch.randn(40, 4, generator=g)
    ext = be.index_topk(_IndexerSpec(topk), q, w, fb)[-1]
    pool2, fb2, be2, _, _ = _setup([39], [1], 1, backend=backend, topk=topk, heads=4)
    pool2.set_index_k(0, fb2.req_to_token_pool.read(fb2.req_pool_indices[0].item(), 40), keys[0])
    dec = be2.index_topk(_IndexerSpec(topk), q[-1:], w[-1:], fb2)[0]
    assert ext.tolist() == dec.tolist()


def test_topk_to_mask():
    topk = torch.tensor([[0, 3, -1], [2, -1, -1]])
    m = topk_to_mask(topk, 5)
    assert m.tolist() == [[True, False, False, True, False], [False, False, True, False, False]]


def _layer(h=2, nope=8, rope=8, v=8, c=16, seed=0) -> RadixAttention:
    g = torch.Generator().manual_seed(seed)
    layer = RadixAttention(0, h, nope, rope, v, c, (nope + rope) ** -0.5)
    layer.set_kv_b_proj(torch.randn(h * (nope + v), c, generator=g) * 0.3)
    return layer


@pytest.mark.parametrize("mla_path", ["plain", "absorbed", "auto", "triton"])
@pytest.mark.parametrize("decode", [False, True])
def test_sparse_attention_equals_masked_dense_reference(mla_path, decode, monkeypatch):
    """Attending over the selected keys only == dense softmax with unselected keys masked.
    plain = dense masked MHA; absorbed / auto = the selected latents gathered per query (in
    query chunks: the block size is shrunk so the 20-query request spans several); triton = the
    sparse MLA kernel (split-K in decode)."""
    from sglang.srt.layers.attention.nsa import nsa_backend

    monkeypatch.setattr(nsa_backend, "SCORE_BLOCK_ELEMS", 2 * 6 * 7)  # 7 queries per chunk
    g = torch.Generator().manual_seed(3)
    layer = _layer()
    prefix, extend = ([30, 12], [1, 1]) if decode else ([0, 10], [20, 9])
    seq = [p + e for p, e in zip(prefix, extend)]
    pool = NSATokenToKVPool(256, 1, torch.float32, 16, 8, 1, 16, "float32")
    r2t, alloc = ReqToTokenPool(4, 128), PagedTokenToKVPoolAllocator(256, 1)
    slots = r2t.alloc(2)
    loc = alloc.alloc_extend([0, 0], seq, [-1, -1])
    latents = [torch.randn(n, 16, generator=g) for n in seq]
    ropes = [torch.randn(n, 8, generator=g) for n in seq]
    off, new = 0, []
    for s, p, n, lat, rp in zip(slots, prefix, seq, latents, ropes):
        r2t.write(s, 0, loc[off : off + n])
        pool.set_mla_kv_buffer(0, loc[off : off + p], lat[:p], rp[:p])
        new.append(loc[off + p : off + n])
        off += n
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    fb = ForwardBatch.build(mode, [0] * sum(extend), slots, prefix, extend, torch.cat(new))
    name = "triton" if mla_path == "triton" else "torch"
    backend = create_attn_backend(name, backend_harness(pool, r2t, num_heads=2, mla_attn_path=mla_path if name ==
                                                        "torch" else "auto"))
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, pool, backend
    backend.init_forward_metadata(fb)
    t = sum(extend)
    q_nope, q_rope = torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)
    topk = torch.full((t, 6), -1, dtype=torch.int32)
    row = 0
    for n, p, e in zip(seq, prefix, extend):
        for j in range(e):
            cand = torch.randperm(p + j + 1, generator=g)[:6]
            topk[row, : len(cand)] = cand.to(torch.int32)
            row += 1
    lat_new = torch.cat([lat[p:] for lat, p in zip(latents, prefix)])
    rope_new = torch.cat([rp[p:] for rp, p in zip(ropes, prefix)])
    out = backend.forward_mla(q_nope, q_rope, lat_new, rope_new, layer, fb, topk_indices=topk)

    w_kc, w_vc = layer.w_kc, layer.w_vc
    row = 0
    for lat, rp, p, e in zip(latents, ropes, prefix, extend):
        k_nope = torch.einsum("lc,hnc->lhn", lat, w_kc)
        v = torch.einsum("lc,hvc->lhv", lat, w_vc)
        for j in range(e):
            sc = (torch.einsum("hn,lhn->hl", q_nope[row], k_nope) + q_rope[row] @ rp.T) * layer.scaling
            allowed = topk_to_mask(topk[row : row + 1], lat.shape[0])[0] & (torch.arange(lat.shape[0]) <= p + j)
            probs = torch.softmax(sc.masked_fill(~allowed, float("-inf")), -1)
            ref = torch.einsum("hl,lhv->hv", probs, v)
            assert torch.allclose(out[row], ref, atol=1e-5), (mla_path, decode, row)
            row += 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_k_dtype", ["fp8_e4m3", "float32"])
def test_topk_is_batch_invariant_under_exact_ties(backend, index_k_dtype):
    """Issue 9 item 6: a request's top-k must not depend on its batch. FP8 index scores tie
    exactly; which tied key survives the cut must not depend on the padded width of the batch
    (today's rule: ties keep the lower position). Request A decoded alone equals A decoded beside a
    longer request B, and among tied keys at the cut the lower positions are kept."""
    topk, d = 8, 64
    g = torch.Generator().manual_seed(7)
    base = torch.randn(5, d, generator=g)
    keys_a = base[torch.arange(30) % 5]  # 5 distinct keys, each 6 times: exact score ties
    q, w = torch.randn(1, 4, d, generator=g), torch.rand(1, 4, generator=g) + 0.1

    def run(lens_prefix, keys):
        pool, fb, be, _, _ = _setup(lens_prefix, [1] * len(lens_prefix), 1, index_k_dtype, d, backend=backend,
                                    topk=topk, heads=4)
        for i, kk in enumerate(keys):
            slot = fb.req_pool_indices[i].item()
            pool.set_index_k(0, fb.req_to_token_pool.read(slot, lens_prefix[i] + 1), kk)
        qq, ww = q.expand(len(keys), -1, -1).contiguous(), w.expand(len(keys), -1).contiguous()
        return be.index_topk(_IndexerSpec(topk), qq, ww, fb)

    alone = run([29], [keys_a])[0]
    # The old torch.topk over padded [B, Lmax] rows kept different tied keys at widths 31, 64, 2000.
    for len_b in (31, 64, 300):
        together = run([29, len_b - 1], [keys_a, torch.randn(len_b, d, generator=g)])[0]
        assert torch.equal(alone, together), len_b
    # the ties are real: the selection takes whole groups of equal keys from the lowest positions
    sel = alone.tolist()
    scores = index_scores(q, keys_a[None], w, 0.125)[0] if index_k_dtype == "float32" else None
    if scores is not None:
        cut = scores[sel].min()
        tied = [p for p in range(30) if scores[p] == cut]
        kept = [p for p in sel if scores[p] == cut]
        assert kept == tied[: len(kept)] and len(kept) < len(tied)
