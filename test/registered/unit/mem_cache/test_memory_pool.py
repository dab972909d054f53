"""ReqToTokenPool, MLATokenToKVPool and NSATokenToKVPool (DSA index-K buffer: byte layout, FP8 and
exact modes, index-layer subsets). CPU, fast."""

from __future__ import annotations

import inspect

import pytest


import torch

from sglang.srt.mem_cache.index_k_format import (
    dequantize_fp8_per_block,
    quantize_fp8_per_block,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import (
    MLATokenToKVPool,
    NSATokenToKVPool,
    ReqToTokenPool,
)

RANK, ROPE = 32, 8


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def nsa(size=64, page_size=16, layer_num=3, index_head_dim=128, index_k_dtype="fp8_e4m3",
        index_layer_ids=None, dtype=torch.bfloat16) -> NSATokenToKVPool:
    return NSATokenToKVPool(size, page_size, dtype, RANK, ROPE, layer_num, index_head_dim,
                            index_k_dtype=index_k_dtype, index_layer_ids=index_layer_ids)


# -- ReqToTokenPool ------------------------------------------------------------------------------------


def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(4, 16)
    # one extra all-zero row: the padding slot CUDA-graph padding rows point at
    assert pool.req_to_token.shape == (5, 16) and pool.req_to_token.dtype == torch.int32
    assert pool.padding_slot == 4
    assert pool.available_size() == 4
    a = pool.alloc(3)
    assert len(a) == 3 and len(set(a)) == 3 and all(0 <= i < 4 for i in a)
    assert pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1
    b = pool.alloc(1)
    assert not set(a) & set(b) and pool.available_size() == 0
    assert pool.alloc(1) is None
    assert pool.alloc(0) == []
    pool.free(a[0])
    pool.free(a[1:])
    assert pool.available_size() == 3
    c = pool.alloc(3)
    assert sorted(c) == sorted(a)


def test_req_to_token_pool_double_free():
    pool = ReqToTokenPool(4, 16)
    a = pool.alloc(2)
    pool.free(a[0])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[0])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[1], a[0]])
    assert pool.available_size() == 3  # the failed call freed nothing
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(3)  # never allocated
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[1], a[1]])  # duplicate inside one call
    assert pool.available_size() == 3
    pool.free(a[1])
    assert pool.available_size() == 4 and len(set(pool.free_slots)) == 4


def test_req_to_token_pool_out_of_range_free():
    pool = ReqToTokenPool(4, 16)
    pool.alloc(4)
    for bad in (4, -1, [0, 9]):
        with pytest.raises(RuntimeError, match="out-of-range"):
            pool.free(bad)
    assert pool.available_size() == 0


def test_req_to_token_pool_write_and_clear():
    pool = ReqToTokenPool(3, 10)
    (r,) = pool.alloc(1)
    pool.write(r, 0, torch.tensor([5, 6, 7]))
    pool.write(r, 3, torch.tensor([9, 10], dtype=torch.int32))
    assert pool.req_to_token[r, :5].tolist() == [5, 6, 7, 9, 10]
    assert pool.req_to_token[r, 5:].eq(0).all()
    others = [i for i in range(3) if i != r]
    assert pool.req_to_token[others].eq(0).all()
    pool.alloc(2)
    pool.clear()
    assert pool.available_size() == 3 and sorted(pool.free_slots) == [0, 1, 2]


def test_req_to_token_host_mirror_and_batched_device_writes():
    """The scheduler writes and reads the host mirror; a device table (emulated here by a separate
    tensor) receives all queued writes in one flush, and nothing before it."""
    pool = ReqToTokenPool(3, 10)
    pool.req_to_token = torch.zeros_like(pool.req_to_token_cpu)  # "the device copy"
    a, b = pool.alloc(2)
    pool.write(a, 0, torch.tensor([5, 6, 7]))
    pool.write(b, 2, torch.tensor([9], dtype=torch.int64))
    pool.write(a, 3, torch.tensor([8]))
    assert pool.read(a, 4).tolist() == [5, 6, 7, 8] and pool.last_loc(b, 3) == 9 and pool.last_loc(b, 0) == -1
    assert pool.req_to_token.eq(0).all()  # not flushed yet
    pool.flush_writes()
    assert torch.equal(pool.req_to_token, pool.req_to_token_cpu)
    assert pool.req_to_token[pool.padding_slot].eq(0).all()
    pool.flush_writes()  # nothing pending: a no-op
    assert torch.equal(pool.req_to_token, pool.req_to_token_cpu)


class _Counter:
    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_until(self, layer_id: int) -> None:
        self.waited.append(layer_id)


# Methods taking a layer_id that are not accessors of its buffers: writers, the CP view builder
# (its buffers come from already-waited layers), the id lookup, the layer-end hook.
_NOT_READERS = {"layer_view", "index_buffer_id", "on_layer_end", "check_index_layer_ids"}


def test_every_kv_reader_waits_for_its_layer():
    """HiCache's layer-wise load hook: every accessor that reads a layer's KV (MLA and index K,
    the raw buffers kernels get included, store buffers and page payloads) consults the layer
    transfer counter first."""
    pool = nsa(layer_num=3, index_layer_ids=[0, 2])
    counter = _Counter()
    pool.register_layer_transfer_counter(counter)
    loc, pages = torch.tensor([17, 18]), torch.tensor([1, 2])
    readers = {
        "get_key_buffer": lambda: pool.get_key_buffer(2),
        "get_kv_store_buffer": lambda: pool.get_kv_store_buffer(2),
        "get_mla_kv": lambda: pool.get_mla_kv(2, loc),
        "get_kv_pages": lambda: pool.get_kv_pages(2, pages),
        "get_index_k_buffer": lambda: pool.get_index_k_buffer(2),
        "get_index_k_store_buffer": lambda: pool.get_index_k_store_buffer(2),
        "get_index_k": lambda: pool.get_index_k(2, loc),
        "get_index_k_pages": lambda: pool.get_index_k_pages(2, pages),
        "page_payloads": lambda: pool.page_payloads(2),
    }
    public_getters = {n for n in dir(pool) if n.startswith("get_") and n not in ("get_kv_size_bytes",)}
    layer_methods = {n for n in dir(pool) if not n.startswith("_") and callable(getattr(pool, n))
                     and "layer_id" in inspect.signature(getattr(pool, n)).parameters}
    layer_readers = {n for n in layer_methods if not n.startswith("set_")} - _NOT_READERS
    assert public_getters | layer_readers == set(readers), "a new accessor must be added here (and must wait)"
    for name, read in readers.items():
        counter.waited.clear()
        read()
        assert counter.waited == [2], name


def test_kv_pages_round_trip():
    pool = nsa(size=64, page_size=16, layer_num=2)
    data = torch.randn(2, 16, RANK + ROPE).to(pool.dtype)
    pool.set_kv_pages(1, torch.tensor([1, 3]), data)
    assert torch.equal(pool.get_kv_pages(1, torch.tensor([3, 1])), data.flip(0))
    assert pool.get_kv_pages(0, torch.tensor([1, 3])).eq(0).all()
    with pytest.raises(ValueError, match="MLA pages"):
        pool.set_kv_pages(1, torch.tensor([1]), data)


# -- MLATokenToKVPool ------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_set_get_round_trip(page_size, dtype):
    size, layers = 8 * page_size, 2
    pool = MLATokenToKVPool(size, page_size, dtype, RANK, ROPE, layers)
    assert len(pool.kv_buffer) == layers
    assert pool.kv_buffer[0].shape == (size + page_size, 1, RANK + ROPE)
    assert pool.get_key_buffer(1) is pool.kv_buffer[1]
    alloc = PagedTokenToKVPoolAllocator(size, page_size)
    loc = alloc.alloc(size)[torch.randperm(size, generator=gen())[:7]]
    latent = torch.randn(7, RANK, generator=gen(1))
    rope = torch.randn(7, ROPE, generator=gen(2))
    pool.set_mla_kv_buffer(1, loc, latent, rope)
    got_latent, got_rope = pool.get_mla_kv(1, loc)
    assert got_latent.dtype == dtype and got_latent.shape == (7, RANK) and got_rope.shape == (7, ROPE)
    assert torch.equal(got_latent, latent.to(dtype)) and torch.equal(got_rope, rope.to(dtype))
    # Any index shape; other slots and the other layer untouched.
    gl, gr = pool.get_mla_kv(1, loc.view(7, 1))
    assert gl.shape == (7, 1, RANK) and torch.equal(gl[:, 0], latent.to(dtype))
    mask = torch.ones(size + page_size, dtype=torch.bool)
    mask[loc] = False
    assert pool.kv_buffer[1][mask].eq(0).all()
    assert pool.kv_buffer[0].eq(0).all()


def test_mla_sizes():
    pool = MLATokenToKVPool(32, 16, torch.bfloat16, RANK, ROPE, 3)
    assert pool.kv_bytes_per_token() == 3 * (RANK + ROPE) * 2
    assert pool.get_kv_size_bytes() == 3 * (32 + 16) * (RANK + ROPE) * 2


# -- NSATokenToKVPool: shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_nsa_fp8_buffer_shape_matches_upstream(page_size):
    size = 8 * page_size
    pool = nsa(size=size, page_size=page_size, index_head_dim=128)
    num_pages = size // page_size
    assert len(pool.index_k_with_scale_buffer) == 3
    for buf in pool.index_k_with_scale_buffer:
        # upstream: [num_pages (+ the padding page), page_size * (128 + 128 // 128 * 4)] uint8
        assert buf.dtype == torch.uint8
        assert buf.shape == (num_pages + 1, page_size * (128 + 4))
    assert pool.index_bytes_per_token == 132 and pool.num_scales == 1


@pytest.mark.parametrize("d,bytes_per_token,num_scales", [(128, 132, 1), (256, 264, 2), (64, 68, 1), (192, 200, 2)])
def test_nsa_fp8_bytes_per_token(d, bytes_per_token, num_scales):
    pool = nsa(index_head_dim=d)
    assert pool.index_bytes_per_token == bytes_per_token and pool.num_scales == num_scales
    assert pool.index_k_with_scale_buffer[0].shape == (64 // 16 + 1, 16 * bytes_per_token)


@pytest.mark.parametrize("mode,itemsize", [("bfloat16", 2), ("float32", 4)])
def test_nsa_exact_buffer_shape(mode, itemsize):
    pool = nsa(index_head_dim=128, index_k_dtype=mode)
    assert pool.num_scales == 0 and not pool.index_k_fp8
    assert pool.index_bytes_per_token == 128 * itemsize
    assert pool.index_k_with_scale_buffer[0].shape == (5, 16 * 128 * itemsize)


def test_nsa_bad_config_raises():
    with pytest.raises(ValueError, match="index_k_dtype"):
        nsa(index_k_dtype="int8")
    with pytest.raises(ValueError, match="multiple of 4"):
        nsa(index_head_dim=3, index_k_dtype="bfloat16")
    with pytest.raises(ValueError, match="multiple of 4"):
        nsa(index_head_dim=130)  # fp8: 130 + 2 * 4 bytes


# -- NSATokenToKVPool: byte layout ---------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("d", [128, 256, 64])
def test_nsa_fp8_byte_layout(page_size, d):
    size = 4 * page_size
    pool = nsa(size=size, page_size=page_size, index_head_dim=d, layer_num=2)
    ns = pool.num_scales
    # A few slots on different pages and offsets, including the last slot of the last page.
    cand = [page_size, page_size + page_size // 2, 3 * page_size + 1, 5 * page_size - 1, 2 * page_size + 3]
    loc = torch.tensor(sorted({c for c in cand if page_size <= c < 5 * page_size}))
    k = torch.randn(len(loc), d, generator=gen(3)) * torch.logspace(-2, 2, len(loc))[:, None]
    pool.set_index_k(1, loc, k)
    buf = pool.index_k_with_scale_buffer[1]
    q_ref, s_ref = quantize_fp8_per_block(k)
    touched = torch.zeros_like(buf, dtype=torch.bool)
    for i, slot in enumerate(loc.tolist()):
        p, off = divmod(slot, page_size)
        data = buf[p, off * d : (off + 1) * d]
        assert torch.equal(data, q_ref[i].view(torch.uint8)), f"FP8 bytes of slot {slot}"
        s0 = page_size * d + off * 4 * ns
        scale = buf[p, s0 : s0 + 4 * ns]
        assert torch.equal(scale, s_ref[i].contiguous().view(torch.uint8)), f"scale bytes of slot {slot}"
        assert torch.equal(scale.view(torch.float32), s_ref[i])
        touched[p, off * d : (off + 1) * d] = True
        touched[p, s0 : s0 + 4 * ns] = True
    assert buf[~touched].eq(0).all(), "bytes outside the written tokens changed"
    assert pool.index_k_with_scale_buffer[0].eq(0).all(), "other layer changed"
    assert buf[0].eq(0).all(), "padding page changed"
    # Read back through the API: dequantised with the same scales.
    got = pool.get_index_k(1, loc)
    assert got.dtype == torch.float32 and got.shape == (len(loc), d)
    assert torch.equal(got, dequantize_fp8_per_block(q_ref, s_ref))
    assert torch.allclose(got, k, rtol=1 / 8, atol=1e-3 * k.abs().amax(-1, keepdim=True).max())
    # Any index shape.
    assert torch.equal(pool.get_index_k(1, loc.view(-1, 1))[:, 0], got)


def test_nsa_fp8_page_copy_moves_whole_tokens():
    """A page's bytes hold all of its tokens' K + scales: copying the raw row moves the page."""
    ps = 16
    pool = nsa(size=4 * ps, page_size=ps)
    src = torch.arange(ps, 2 * ps)
    k = torch.randn(ps, 128, generator=gen(4))
    pool.set_index_k(0, src, k)
    buf = pool.index_k_with_scale_buffer[0]
    buf[3] = buf[1]
    assert torch.equal(pool.get_index_k(0, src + 2 * ps), pool.get_index_k(0, src))


def test_nsa_fp8_overwrite_and_zero_vector():
    pool = nsa()
    loc = torch.tensor([16, 17])
    pool.set_index_k(0, loc, torch.randn(2, 128, generator=gen(5)))
    k = torch.zeros(2, 128)
    k[1] = torch.randn(128, generator=gen(6))
    pool.set_index_k(0, loc, k)
    got = pool.get_index_k(0, loc)
    assert got[0].eq(0).all() and torch.isfinite(got).all()
    assert torch.allclose(got[1], k[1], rtol=1 / 8, atol=1e-2)


@pytest.mark.parametrize("mode,dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_nsa_exact_modes_round_trip_and_layout(mode, dtype, page_size):
    d = 128
    size = 4 * page_size
    pool = nsa(size=size, page_size=page_size, index_head_dim=d, index_k_dtype=mode, layer_num=2)
    isz = dtype.itemsize
    loc = torch.tensor(sorted({page_size, page_size + 1 if page_size > 1 else 2 * page_size, 4 * page_size + page_size - 1}))
    k = torch.randn(len(loc), d, generator=gen(7))
    pool.set_index_k(0, loc, k)
    got = pool.get_index_k(0, loc)
    assert got.dtype == torch.float32
    assert torch.equal(got, k.to(dtype).float())
    if dtype == torch.float32:
        assert torch.equal(got, k)
    buf = pool.index_k_with_scale_buffer[0]
    touched = torch.zeros_like(buf, dtype=torch.bool)
    for i, slot in enumerate(loc.tolist()):
        p, off = divmod(slot, page_size)
        b = buf[p, off * d * isz : (off + 1) * d * isz]
        assert torch.equal(b, k[i].to(dtype).view(torch.uint8))
        touched[p, off * d * isz : (off + 1) * d * isz] = True
    assert buf[~touched].eq(0).all()
    assert pool.index_k_with_scale_buffer[1].eq(0).all()


# -- NSATokenToKVPool: index-layer subsets --------------------------------------------------------------------


def test_nsa_index_layer_subset():
    pool = nsa(layer_num=4, index_layer_ids=[2, 0])
    assert pool.index_layer_ids == [0, 2]
    assert len(pool.index_k_with_scale_buffer) == 2
    assert pool.index_buffer_id(0) == 0 and pool.index_buffer_id(2) == 1
    # MLA KV still exists for every layer.
    assert len(pool.kv_buffer) == 4
    loc = torch.tensor([16, 33])
    k0, k2 = torch.randn(2, 128, generator=gen(8)), torch.randn(2, 128, generator=gen(9))
    pool.set_index_k(0, loc, k0)
    pool.set_index_k(2, loc, k2)
    assert torch.allclose(pool.get_index_k(0, loc), k0, rtol=1 / 8, atol=0.05)
    assert torch.allclose(pool.get_index_k(2, loc), k2, rtol=1 / 8, atol=0.05)
    assert not torch.equal(pool.index_k_with_scale_buffer[0], pool.index_k_with_scale_buffer[1])
    for layer in (1, 3):
        for fn in (lambda: pool.get_index_k(layer, loc), lambda: pool.set_index_k(layer, loc, k0),
                   lambda: pool.index_buffer_id(layer)):
            with pytest.raises(KeyError) as ei:
                fn()
            msg = str(ei.value)
            assert f"layer {layer}" in msg and "[0, 2]" in msg and "index-K" in msg


def test_nsa_kv_bytes_per_token_counts_index_layers_only():
    mla = 4 * (RANK + ROPE) * 2
    assert nsa(layer_num=4).kv_bytes_per_token() == mla + 4 * 132
    assert nsa(layer_num=4, index_layer_ids=[1, 3]).kv_bytes_per_token() == mla + 2 * 132
    assert nsa(layer_num=4, index_layer_ids=[]).kv_bytes_per_token() == mla
    assert nsa(layer_num=4, index_layer_ids=[1], index_k_dtype="bfloat16").kv_bytes_per_token() == mla + 256
    empty = nsa(layer_num=4, index_layer_ids=[])
    assert empty.index_k_with_scale_buffer == []
    with pytest.raises(KeyError):
        empty.get_index_k(0, torch.tensor([16]))


def test_nsa_get_kv_size_bytes():
    pool = nsa(size=64, page_size=16, layer_num=4, index_layer_ids=[0, 3])
    mla = 4 * (64 + 16) * (RANK + ROPE) * 2
    assert pool.get_kv_size_bytes() == mla + 2 * 5 * 16 * 132


@pytest.mark.parametrize("ids", [[-1], [4], [0, 5], [1, 1]])
def test_nsa_bad_index_layer_ids_raise(ids):
    with pytest.raises(ValueError):
        nsa(layer_num=4, index_layer_ids=ids)


def test_nsa_mla_part_still_works():
    pool = nsa(layer_num=2, index_layer_ids=[1])
    loc = torch.tensor([16, 20])
    lat, rope = torch.randn(2, RANK, generator=gen(10)), torch.randn(2, ROPE, generator=gen(11))
    pool.set_mla_kv_buffer(0, loc, lat, rope)
    gl, gr = pool.get_mla_kv(0, loc)
    assert torch.equal(gl, lat.bfloat16()) and torch.equal(gr, rope.bfloat16())


def test_index_k_page_moves_are_layer_checked():
    """Page moves (HiCache / PD transfer) go through the logical-layer map and validate layouts."""
    src = NSATokenToKVPool(64, 16, torch.float32, 16, 8, 4, 128, "fp8_e4m3", index_layer_ids=[0, 2])
    dst = NSATokenToKVPool(64, 16, torch.float32, 16, 8, 4, 128, "fp8_e4m3", index_layer_ids=[0, 2])
    k = torch.randn(32, 128)
    loc = torch.arange(16, 48)
    src.set_index_k(2, loc, k)
    pages = torch.tensor([1, 2])
    dst.set_index_k_pages(2, pages, src.get_index_k_pages(2, pages))
    assert torch.equal(dst.get_index_k(2, loc), src.get_index_k(2, loc))
    with pytest.raises(KeyError, match="no index-K buffer"):
        src.get_index_k_pages(1, pages)
    with pytest.raises(ValueError, match="uint8"):
        dst.set_index_k_pages(2, pages, src.get_index_k_pages(2, pages)[:, :-4])
    dst.check_index_layer_ids([0, 2])
    with pytest.raises(ValueError, match="layout mismatch"):
        dst.check_index_layer_ids([0, 1, 2, 3], "prefill peer")


# -- layout() and page_payloads(): what HiCache / PD ask instead of recomputing -------------------
def test_mla_layout_and_page_payloads():
    pool = MLATokenToKVPool(64, 16, torch.bfloat16, RANK, ROPE, 3)
    lay = pool.layout()
    assert (lay.layer_num, lay.kv_cache_dim, lay.dtype, lay.page_size, lay.num_pages) == (3, RANK + ROPE,
                                                                                         torch.bfloat16, 16, 4)
    assert lay.kv_row_bytes == (RANK + ROPE) * 2 and lay.kv_bytes_per_page == 16 * (RANK + ROPE) * 2
    assert lay.index_k_bytes_per_page == 0 and lay.index_layer_ids == ()
    assert lay.kv_row_bytes * lay.layer_num == pool.kv_bytes_per_token()
    with pytest.raises(Exception):
        lay.layer_num = 4  # frozen
    (kv,) = pool.page_payloads(1)
    assert kv.name == "kv" and tuple(kv.buffer.shape) == (lay.num_pages + 1, 16 * (RANK + ROPE))
    kv.buffer[2] = 1.0  # a view: page 2 of layer 1 is the pool's page 2
    assert pool.get_kv_pages(1, torch.tensor([2])).eq(1).all() and pool.kv_buffer[0].eq(0).all()


@pytest.mark.parametrize("mode", ["fp8_e4m3", "bfloat16"])
def test_nsa_layout_and_payloads_follow_index_cache(mode):
    pool = nsa(layer_num=4, index_layer_ids=[0, 1, 3], index_k_dtype=mode)
    lay = pool.layout()
    assert lay.index_layer_ids == (0, 1, 3)
    assert lay.index_k_bytes_per_page == pool.index_k_with_scale_buffer[0].shape[1] == 16 * pool.index_bytes_per_token
    total = lay.layer_num * lay.kv_row_bytes + len(lay.index_layer_ids) * lay.index_k_bytes_per_page // lay.page_size
    assert total == pool.kv_bytes_per_token()
    for layer in range(4):
        payloads = pool.page_payloads(layer)
        names = [p.name for p in payloads]
        assert names == (["kv", "index_k"] if layer in lay.index_layer_ids else ["kv"]), layer  # shared: no index K
        for p in payloads:
            assert p.buffer.shape[0] == lay.num_pages + 1
        if layer in lay.index_layer_ids:
            idx = payloads[1].buffer
            assert idx.dtype == torch.uint8 and idx.shape[1] == lay.index_k_bytes_per_page
            assert idx.data_ptr() == pool.get_index_k_buffer(layer).data_ptr()


def test_payloads_round_trip_moves_every_byte_of_a_page():
    """Copying page payloads of one pool into another reproduces the layer's KV and index K."""
    a, b = nsa(layer_num=2, index_layer_ids=[1]), nsa(layer_num=2, index_layer_ids=[1])
    loc = torch.arange(16, 32)
    a.set_mla_kv_buffer(1, loc, torch.randn(16, RANK, generator=gen()), torch.randn(16, ROPE, generator=gen(1)))
    a.set_index_k(1, loc, torch.randn(16, 128, generator=gen(2)))
    for src, dst in zip(a.page_payloads(1), b.page_payloads(1)):
        dst.buffer[1] = src.buffer[1]
    assert torch.equal(a.get_key_buffer(1), b.get_key_buffer(1))
    assert torch.equal(a.get_index_k(1, loc), b.get_index_k(1, loc))


# -- layer-end hooks --------------------------------------------------------------------------------
def test_layer_end_hooks_order_suspend_and_views():
    pool = nsa(layer_num=3)
    pool.on_layer_end(0)  # none registered: a no-op
    seen = []
    pool.register_layer_end_callback(lambda i: seen.append(("a", i)))
    pool.register_layer_end_callback(lambda i: seen.append(("b", i)))
    pool.on_layer_end(2)
    assert seen == [("a", 2), ("b", 2)]
    seen.clear()
    with pool.suspend_layer_end_hooks():
        with pool.suspend_layer_end_hooks():  # nests
            pool.on_layer_end(0)
        pool.on_layer_end(1)
    assert seen == []
    with pytest.raises(RuntimeError):
        with pool.suspend_layer_end_hooks():
            raise RuntimeError
    pool.on_layer_end(1)  # resumed even after an exception
    assert seen == [("a", 1), ("b", 1)]
    # a CP layer view is transient: hooks stay with the rank's own pool
    view = pool.layer_view(0, kv=torch.zeros(32, 1, RANK + ROPE, dtype=torch.bfloat16))
    seen.clear()
    view.on_layer_end(0)
    assert seen == []
    other = nsa(layer_num=3)
    other.on_layer_end(0)  # callbacks are per pool
    assert seen == []


def test_store_buffers_are_the_pool_storage():
    pool = nsa(layer_num=3, index_layer_ids=[0, 2])
    assert pool.get_kv_store_buffer(1) is pool.kv_buffer[1]
    assert pool.get_index_k_store_buffer(2) is pool.index_k_with_scale_buffer[1]
    with pytest.raises(KeyError, match="no index-K buffer"):
        pool.get_index_k_store_buffer(1)  # a shared IndexCache layer never writes index K
