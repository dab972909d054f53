"""Host mirrors of the device KV pools: built from the pool's layout (index K only on index layers),
both host layouts, the host page allocator's rules, and the host-size plan's refusals."""

from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import (
    HostKVPool,
    HostPageAllocator,
    host_bytes_per_token,
    plan_host_tokens,
)
from sglang.srt.server_args import ServerArgsError


DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")


def nsa_pool(page_size: int = 4, index_layer_ids=(0, 1), layers: int = 4, size: int = 64) -> NSATokenToKVPool:
    return NSATokenToKVPool(size, page_size, torch.float32, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=layers,
                            index_head_dim=128, index_k_dtype="fp8_e4m3", index_layer_ids=list(index_layer_ids),
                            device=DEVICE)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pool_mirrors_page_payloads(layout):
    dev = nsa_pool()
    host = HostKVPool(dev, 32, layout)
    assert host.num_pages == 8
    for lid in range(4):
        names = [p.name for p in dev.page_payloads(lid)]
        assert host.payload_names(lid) == names  # index K on the two index layers only
        for p in dev.page_payloads(lid):
            view = host.payload(lid, p.name)
            assert view.shape == (8, p.buffer.shape[1]) and view.dtype == p.buffer.dtype
    with pytest.raises(KeyError, match="no index K"):
        host.payload(2, "index_k")
    with pytest.raises(ValueError, match="outside"):
        host.payload(4, "kv")
    # distinct storage per (layer, page): writing one row touches nothing else
    host.payload(1, "kv")[3] = 1.0
    assert host.payload(1, "kv").sum() == host.payload(1, "kv").shape[1]
    assert host.payload(0, "kv").abs().sum() == 0 and host.payload(2, "kv").abs().sum() == 0
    mla = MLATokenToKVPool(64, 4, torch.float32, 8, 4, 2)
    assert HostKVPool(mla, 16, layout).payload_names(0) == ["kv"]


def test_host_pool_checks_the_device_layout():
    host = HostKVPool(nsa_pool(index_layer_ids=(0, 1)), 16)
    host.check_device_pool(nsa_pool(index_layer_ids=(0, 1)))
    with pytest.raises(ValueError, match="index-K layer layout mismatch"):
        host.check_device_pool(nsa_pool(index_layer_ids=(0, 2)))
    with pytest.raises(ValueError, match="does not mirror"):
        host.check_device_pool(nsa_pool(page_size=8))


def test_host_page_allocator():
    a = HostPageAllocator(16, 4)
    x = a.alloc(8)
    assert x.tolist() == list(range(8)) and a.available_size() == 8
    assert a.alloc(12) is None and a.available_size() == 8  # all or nothing
    with pytest.raises(ValueError, match="whole pages"):
        a.alloc(3)
    a.free(x[:4])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[:4])
    with pytest.raises(RuntimeError, match="out-of-range"):
        a.free(torch.tensor([64]))
    assert a.available_size() == 12


def test_plan_host_tokens():
    lo = nsa_pool().layout()
    per = host_bytes_per_token(lo)
    assert per == 4 * (12 * 4) + 2 * (128 + 4)  # MLA on 4 layers, index K (+ scales) on 2
    assert plan_host_tokens(100, [lo], 2.0, 0.0, 4, available=10**12) == 200
    assert plan_host_tokens(100, [lo, lo], 2.0, 1e-4, 4, available=10**12) == 100_000 // (2 * per) // 4 * 4
    with pytest.raises(ServerArgsError) as e:
        plan_host_tokens(100, [lo], 2.0, 0.0, 4, available=199 * per)
    assert e.value.flag == "hicache_ratio"
    with pytest.raises(ServerArgsError, match="stays free"):  # fits, but would leave the host < 10% free
        plan_host_tokens(100, [lo], 2.0, 0.0, 4, available=210 * per)
    assert plan_host_tokens(100, [lo], 2.0, 0.0, 4, available=223 * per) == 200
    with pytest.raises(ServerArgsError) as e:
        plan_host_tokens(100, [lo], 2.0, 1.0, 4, available=10)
    assert e.value.flag == "hicache_size"
    with pytest.raises(ServerArgsError, match="less than one page"):
        plan_host_tokens(1, [lo], 2.0, 0.0, 4, available=10**12)
