"""The FP8 MLA KV format (mem_cache/kv_fp8_format.py) and the pool in that mode: exact byte layout
(656 B/token for V3.2 dims), quantise / dequantise round trip within the derived e4m3 bound,
raw page moves, layout() / page_payloads() describing the bytes, ~2x capacity per byte budget."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache import kv_fp8_format as fmt
from sglang.srt.mem_cache.index_k_format import fp8_to_float
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool


def test_row_layout_is_deepseeks_656_bytes():
    assert fmt.row_bytes(512, 64) == 656
    assert (fmt.scale_offset(512), fmt.rope_offset(512), fmt.num_scales(512)) == (512, 528, 4)
    assert fmt.row_bytes(64, 16) == 64 + 4 + 32  # rank < 128: one scale for the whole latent
    assert fmt.num_scales(320) == 3  # ragged: blocks [0,128) [128,256) [256,320)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        fmt.check_dims(66, 16)


@pytest.mark.parametrize("c,r", [(512, 64), (64, 16), (320, 32)])
def test_pack_unpack_bytes_and_round_trip_bound(c, r):
    g = torch.Generator().manual_seed(c)
    lat = torch.randn(37, c, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    lat[3, :5] = 0.0  # zeros must stay zeros
    rope = torch.randn(37, r, generator=g)
    rows = fmt.pack(lat, rope)
    assert rows.dtype == torch.uint8 and rows.shape == (37, fmt.row_bytes(c, r))
    q, s, rp = fmt.unpack(rows, c, r)
    # the byte layout, read back by hand: e4m3 latent, then fp32 scales, then bf16 rope
    assert torch.equal(rows[:, :c], q.view(torch.uint8))
    assert torch.equal(rows[:, c : c + 4 * fmt.num_scales(c)].contiguous().view(torch.float32), s)
    assert torch.equal(rp, rope.to(torch.bfloat16))
    blk = 128 if c > 128 else c
    exp_scale = torch.nn.functional.pad(lat.abs(), (0, -c % blk)).view(37, -1, blk).amax(-1).clamp_min(1e-10) / 448
    assert torch.equal(s, exp_scale)
    deq, rope_deq = fmt.dequantize(rows, c, r)
    err = (deq - lat).abs()
    assert (err <= fmt.error_bound(lat)).all(), (err / fmt.error_bound(lat)).max()
    assert deq[3, :5].eq(0).all()
    assert torch.equal(rope_deq, rope.to(torch.bfloat16).float())
    # relative to the block max the error is <= 2^-4 (the bound the parity tests build on)
    assert (err / lat.abs().amax(-1, keepdim=True)).max() <= 2**-4
    # quantised values are exactly e4m3 values times the scale
    if c % blk == 0:
        assert torch.equal(deq, (fp8_to_float(q).view(37, -1, blk) * s[..., None]).view(37, c))


@pytest.mark.parametrize("cls", [MLATokenToKVPool, NSATokenToKVPool])
def test_pool_fp8_layout_payloads_and_pages(cls):
    extra = dict(index_head_dim=64) if cls is NSATokenToKVPool else {}
    pool = cls(64, 4, torch.float32, 64, 16, 2, kv_cache_dtype="fp8_e4m3", **extra)
    auto = cls(64, 4, torch.float32, 64, 16, 2, **extra)
    lo = pool.layout()
    assert (lo.dtype, lo.kv_cache_dim, lo.kv_row_bytes, lo.kv_cache_dtype) == (torch.uint8, 100, 100, "fp8_e4m3")
    assert lo.kv_bytes_per_page == 400
    assert auto.layout().kv_row_bytes == 80 * 4 and auto.layout().kv_cache_dtype == "auto"
    kv = pool.page_payloads(1)[0]
    assert kv.name == "kv" and kv.buffer.dtype == torch.uint8 and kv.buffer.shape == (17, 400)
    g = torch.Generator().manual_seed(0)
    loc = torch.tensor([4, 5, 9, 30])
    lat, rope = torch.randn(4, 64, generator=g), torch.randn(4, 16, generator=g)
    pool.set_mla_kv_buffer(1, loc, lat, rope)
    assert torch.equal(pool.get_key_buffer(1)[loc, 0], fmt.pack(lat, rope))
    got_lat, got_rope = pool.get_mla_kv(1, loc)
    ref_lat, ref_rope = fmt.round_trip(lat, rope)
    assert torch.equal(got_lat, ref_lat) and torch.equal(got_rope, ref_rope)
    # page moves are raw bytes (HiCache / PD / CP): copy pages 1, 2 of layer 1 to pages 5, 6 of another pool
    other = cls(64, 4, torch.float32, 64, 16, 2, kv_cache_dtype="fp8_e4m3", **extra)
    pages = pool.get_kv_pages(1, torch.tensor([1, 2]))
    assert pages.dtype == torch.uint8 and pages.shape == (2, 4, 100)
    other.set_kv_pages(1, torch.tensor([5, 6]), pages)
    assert torch.equal(other.get_mla_kv(1, torch.tensor([20, 21, 25]))[0], pool.get_mla_kv(1, loc[:3])[0])
    with pytest.raises(ValueError, match="raw uint8"):
        other.set_kv_pages(1, torch.tensor([5, 6]), pages.float())
    # bytes per token: MLA part 100 vs 320 B per layer
    idx = pool.kv_bytes_per_token() - 2 * 100
    assert auto.kv_bytes_per_token() - idx == 2 * 320
    assert pool.get_kv_size_bytes() == sum(b.numel() for b in pool.kv_buffer) + (
        sum(b.numel() for b in pool.index_k_with_scale_buffer) if extra else 0)


def test_capacity_doubles_for_v32_shapes_in_bf16():
    """Same byte budget: tokens(fp8) / tokens(auto) = (1152 + 132) / (656 + 132) = 1.63 per layer for a bf16
    V3.2 layer with its FP8 index K, 1.76x without index K (dense layers / IndexCache shared layers)."""
    kw = dict(size=64, page_size=64, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=2)
    a = MLATokenToKVPool(**kw).kv_bytes_per_token()
    f = MLATokenToKVPool(**kw, kv_cache_dtype="fp8_e4m3").kv_bytes_per_token()
    assert (a, f) == (2 * 1152, 2 * 656)
    na = NSATokenToKVPool(**kw, index_head_dim=128).kv_bytes_per_token()
    nf = NSATokenToKVPool(**kw, index_head_dim=128, kv_cache_dtype="fp8_e4m3").kv_bytes_per_token()
    assert (na, nf) == (2 * (1152 + 132), 2 * (656 + 132))
    budget = 2**30
    assert budget // f / (budget // a) == pytest.approx(1152 / 656, rel=1e-3)


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first"])
def test_host_mirror_moves_fp8_pages_as_raw_bytes(mem_layout):
    """A HiCache host mirror built from layout() holds exactly the FP8 page bytes; a round trip through
    it restores the device rows bit for bit; an auto-dtype pool is refused as a target."""
    from sglang.srt.mem_cache.memory_pool_host import HostKVPool

    dev = NSATokenToKVPool(32, 4, torch.bfloat16, 64, 16, 2, index_head_dim=64, kv_cache_dtype="fp8_e4m3")
    host = HostKVPool(dev, 16, mem_layout, pin_memory=False)
    g = torch.Generator().manual_seed(1)
    loc = torch.arange(4, 12)
    dev.set_mla_kv_buffer(0, loc, torch.randn(8, 64, generator=g), torch.randn(8, 16, generator=g))
    for p in dev.page_payloads(0):
        h = host.payload(0, p.name)
        assert h.dtype == p.buffer.dtype and h.shape[1] == p.buffer.shape[1], p.name
        h[torch.tensor([2, 3])] = p.buffer[torch.tensor([1, 2])].cpu()
    other = NSATokenToKVPool(32, 4, torch.bfloat16, 64, 16, 2, index_head_dim=64, kv_cache_dtype="fp8_e4m3")
    host.check_device_pool(other)
    other.page_payloads(0)[0].buffer[torch.tensor([5, 6])] = host.payload(0, "kv")[torch.tensor([2, 3])]
    assert torch.equal(other.get_key_buffer(0)[20:28], dev.get_key_buffer(0)[4:12])
    with pytest.raises(ValueError, match="does not mirror"):
        host.check_device_pool(NSATokenToKVPool(32, 4, torch.bfloat16, 64, 16, 2, index_head_dim=64))
