"""HiCache's page-run copies (mem_cache/hicache_io.py): the plan cuts a transfer into runs of
consecutive host pages (one copy each), device-scattered runs go through bounded staging, and every
path -- direct runs, staged runs, the Triton kernel; layer_first and page_first host views -- moves
exactly the bytes of the plain gather / scatter twin (`copy_pages_reference`) for MLA KV in the model
dtype, FP8 KV rows (656 B) and index K, and touches nothing else. With SGLANG_TEST_DEVICE=cuda the
host side is pinned and the copies are real cudaMemcpyAsync / cudaMemcpy2DAsync calls."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from sgl_kernel.page_copy import copy_pages, copy_pages_reference
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache import hicache_io
from sglang.srt.mem_cache.hicache_io import PageRuns, backup_pages, load_pages, memcpy2d_args
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import HostKVPool, HostPageAllocator
from sglang.srt.testing.sync_guard import HostSyncError, no_host_sync

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
PIN = DEVICE == "cuda"


def _t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# -- the plan ---------------------------------------------------------------------------------------
def test_consecutive_pages_are_one_copy_in_place():
    runs = PageRuns(_t([4, 5, 6, 7]), _t([10, 11, 12, 13]), 64)
    assert runs.direct == [(4, 10, 4)] and runs.chunks == [] and runs.num_host_copies() == 1


def test_pairs_are_ordered_by_host_page():
    runs = PageRuns(_t([7, 6, 5, 4]), _t([13, 12, 11, 10]), 64)  # reversed order, same pairs
    assert runs.direct == [(4, 10, 4)]
    assert runs.host_pages.tolist() == [7, 6, 5, 4]  # observers keep the caller's order


def test_device_scattered_run_is_staged_and_still_one_host_copy():
    runs = PageRuns(_t([3, 4, 5, 6]), _t([9, 2, 30, 3]), 64)
    assert runs.direct == []
    assert len(runs.chunks) == 1 and runs.chunks[0].pieces == [(3, 0, 4)]
    assert runs.chunks[0].dev_pages.tolist() == [9, 2, 30, 3]
    assert runs.num_host_copies() == 1


def test_host_runs_split_where_host_pages_jump():
    runs = PageRuns(_t([0, 1, 5, 6, 9]), _t([1, 2, 3, 4, 8]), 64)
    assert runs.direct == [(0, 1, 2), (5, 3, 2), (9, 8, 1)] and runs.num_host_copies() == 3


def test_staging_is_bounded_in_chunks():
    runs = PageRuns(_t(range(10, 15)), _t([4, 1, 3, 0, 2]), 2)
    assert [c.pieces for c in runs.chunks] == [[(10, 0, 2)], [(12, 0, 2)], [(14, 0, 1)]]
    assert [c.dev_pages.tolist() for c in runs.chunks] == [[4, 1], [3, 0], [2]]


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="one device page per host page"):
        PageRuns(_t([0, 1]), _t([0]), 4)
    with pytest.raises(ValueError, match="max_staged_pages"):
        PageRuns(_t([0]), _t([0]), 0)
    assert PageRuns(_t([]), _t([]), 4).num_host_copies() == 0


def test_host_allocator_hands_out_runs_after_frees():
    """Freed pages are handed out lowest first: a backup after frees gets one host run, not one per
    freed block in free order (regression: the free list used to be consumed in free order)."""
    a = HostPageAllocator(16 * 4, 4)
    x = a.alloc(12 * 4)
    a.free(x[16:32])  # pages 4..7
    a.free(x[0:16])  # pages 0..3
    got = a.alloc(8 * 4)
    pages = got[::4] // 4
    assert pages.tolist() == list(range(8))
    assert PageRuns(pages, torch.arange(1, 9), 64).num_host_copies() == 1


# -- the copies: byte-exact against the plain twin --------------------------------------------------
PAYLOADS = {  # (dtype, elements per page row): V3.2-like rows at page size 4
    "kv_bf16": (torch.bfloat16, 4 * 576),
    "kv_fp32": (torch.float32, 4 * 12),
    "kv_fp8_rows": (torch.uint8, 4 * 656),
    "index_k": (torch.uint8, 4 * 132),
}
MAPS = {  # host pages, device pages (device page 0 is the padding page and never moves)
    "consecutive": ([2, 3, 4, 5, 6], [7, 8, 9, 10, 11]),
    "device_scattered": ([2, 3, 4, 5, 6], [11, 3, 9, 1, 7]),
    "both_scattered": ([9, 0, 5, 6, 2, 3], [4, 12, 5, 6, 1, 8]),
    "mixed": ([0, 1, 2, 3, 8, 9, 11], [5, 6, 1, 2, 9, 10, 3]),
}


def _random(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (shape[0], shape[1] * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)


def _host_view(pages: int, row: int, dtype, page_first: bool) -> torch.Tensor:
    if page_first:  # a [pages, row] view of [pages, layers, row], like HostKVPool.payload(1, ...)
        return torch.zeros((pages, 3, row), dtype=dtype, pin_memory=PIN)[:, 1]
    return torch.zeros((pages, row), dtype=dtype, pin_memory=PIN)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("path", ["direct", "direct_small_staging", "kernel"])
@pytest.mark.parametrize("page_first", [False, True], ids=["layer_first", "page_first"])
@pytest.mark.parametrize("mapping", sorted(MAPS))
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_backup_and_load_equal_the_plain_twin(payload, mapping, page_first, path):
    dtype, row = PAYLOADS[payload]
    hp, dp = (_t(x) for x in MAPS[mapping])
    dev = _random((13, row), dtype, seed=len(payload) + len(mapping)).to(DEVICE)
    runs = PageRuns(hp, dp, 2 if path == "direct_small_staging" else 64)
    host, want = _host_view(12, row, dtype, page_first), _host_view(12, row, dtype, page_first)
    copy_pages_reference(dev, want, dp, hp)
    if path == "kernel":
        h, d = runs.pages_on(dev.device)
        copy_pages(dev, host, d, h)
    else:
        backup_pages(runs, dev, host)
    _sync()
    assert torch.equal(_bytes(host), _bytes(want))  # the pages, and zeros everywhere else
    back, back_want = torch.zeros_like(dev), torch.zeros_like(dev)
    dst = _t(MAPS["device_scattered"][1] + [12, 2])[: len(hp)]  # load into other device pages
    runs_back = PageRuns(hp, dst, 2 if path == "direct_small_staging" else 64)
    copy_pages_reference(want, back_want, hp, dst)
    if path == "kernel":
        h, d = runs_back.pages_on(dev.device)
        copy_pages(host, back, h, d)
    else:  # on CUDA the small-staging case scatters its chunks on a side stream, as the controller does
        scatter = torch.cuda.Stream() if DEVICE == "cuda" and path == "direct_small_staging" else None
        load_pages(runs_back, host, back, scatter)
    _sync()
    assert torch.equal(_bytes(back), _bytes(back_want))
    assert torch.equal(_bytes(back)[dst], _bytes(dev)[dp])


@pytest.mark.parametrize("path", ["direct", "kernel"])
@pytest.mark.parametrize("page_first", [False, True], ids=["layer_first", "page_first"])
def test_planned_copies_queue_without_a_host_sync(page_first, path):
    """Once planned (and the page lists uploaded), a layer's backup and load read nothing back to the
    host (CUDA: sync debug mode "error"; CPU: the guard's patched read-backs), so the copy thread
    queues every layer before it waits once. Staging is forced (device-scattered map, 2-page chunks)."""
    dtype, row = PAYLOADS["kv_bf16"]
    hp, dp = (_t(x) for x in MAPS["mixed"])
    dev = _random((13, row), dtype, seed=11).to(DEVICE)
    host, back = _host_view(12, row, dtype, page_first), torch.zeros_like(dev)
    runs = PageRuns(hp, dp, 2)
    for c in runs.chunks:  # what the first layer of an op does before the guarded layers
        c.on(dev.device)
    h, d = runs.pages_on(dev.device)
    _sync()
    with no_host_sync():
        if path == "kernel":
            copy_pages(dev, host, d, h)
            copy_pages(host, back, h, d)
        else:
            backup_pages(runs, dev, host)
            load_pages(runs, host, back)
    _sync()
    assert torch.equal(_bytes(back)[dp], _bytes(dev)[dp])


def test_the_sync_guard_sees_planning():
    """The guard above can fail: planning reads the page lists on the host (why an op plans once,
    before its layers, and not inside each layer's copies)."""
    with pytest.raises(HostSyncError, match="hicache_io.py"), no_host_sync():
        PageRuns(_t(MAPS["mixed"][0]), _t(MAPS["mixed"][1]), 2)


def test_memcpy2d_descriptor_moves_the_rows_of_a_strided_view():
    """The (dst, dpitch, src, spitch, width, height) of a page_first block, applied row by row on
    the host (what cudaMemcpy2DAsync does with it), equals torch's strided copy."""
    full = torch.zeros((6, 3, 10), dtype=torch.bfloat16)
    dst = full[:, 2][1:5]  # pages 1..4 of layer 2: rows at a stride of 3 rows
    src = _random((4, 10), torch.bfloat16, seed=7)
    d, dpitch, s, spitch, width, height = memcpy2d_args(dst, src)
    assert (dpitch, spitch, width, height) == (60, 20, 20, 4)
    for i in range(height):
        ctypes.memmove(d + i * dpitch, s + i * spitch, width)
    want = torch.zeros_like(full)
    want[:, 2][1:5] = src
    assert torch.equal(full.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous rows"):
        memcpy2d_args(dst, src.t())


def test_mismatched_blocks_are_refused():
    with pytest.raises(ValueError, match="block copy"):
        hicache_io.copy_block(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64))


@pytest.mark.skipif(DEVICE != "cuda", reason="cudaMemcpy2DAsync exists only with CUDA")
def test_page_first_blocks_move_in_one_2d_copy_on_cuda():
    assert hicache_io.memcpy2d_available(), "libcudart not found: page_first would copy page by page"


# -- the controller over an FP8 KV + index K pool ----------------------------------------------------
def _fp8_pool() -> NSATokenToKVPool:
    return NSATokenToKVPool(64, 4, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=3,
                            index_head_dim=128, index_k_dtype="fp8_e4m3", index_layer_ids=[0, 2], device=DEVICE,
                            kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_controller_round_trip_of_fp8_rows_and_index_k(layout, io_backend):
    pool = _fp8_pool()
    assert pool.kv_cache_dim == 656
    g = torch.Generator().manual_seed(3)
    for b in pool.kv_buffer + pool.index_k_with_scale_buffer:
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    ctl = HiCacheController([(pool, HostKVPool(pool, 48, layout))], io_backend)
    ctl.max_staged_pages = 2  # chunked staging on a tiny pool
    slots = lambda pages: (_t(pages)[:, None] * 4 + torch.arange(4)).reshape(-1)  # noqa: E731
    src, host, dst = [3, 9, 4, 5, 6], [2, 3, 4, 0, 1], [15, 2, 8, 9, 1]
    want = {lid: {p.name: p.buffer[_t(src)].cpu().clone() for p in pool.page_payloads(lid)} for lid in range(3)}
    for op in (ctl.backup(slots(src), slots(host)),):
        ctl.wait_idle()
        ctl.poll()
        assert op.error is None
    for b in pool.kv_buffer + pool.index_k_with_scale_buffer:
        b.zero_()
    op = ctl.load(slots(host), slots(dst))
    ctl.wait_idle()
    ctl.poll()
    assert op.error is None
    for lid in range(3):
        got = {p.name: p.buffer[_t(dst)].cpu() for p in pool.page_payloads(lid)}
        assert sorted(got) == (["index_k", "kv"] if lid in (0, 2) else ["kv"])
        for name, rows in got.items():
            assert torch.equal(rows, want[lid][name]), (lid, name)
    ctl.shutdown()
