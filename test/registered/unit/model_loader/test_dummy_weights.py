"""--load-format dummy: weights drawn in each parameter's dtype, in place (no float32 copy of a
tensor), deterministic per (seed, parameter name), with the scales the old init used (N(0, 0.02)
matrices, unit norms, zero biases)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from sglang.srt.model_loader import loader
from sglang.srt.model_loader.loader import fill_normal_, init_dummy_weights


class _Toy(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16, experts: int = 4) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.empty(64, 48, dtype=dtype), requires_grad=False)
        self.experts = nn.Parameter(torch.empty(experts, 96, 64, dtype=dtype), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(64, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(64, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts), requires_grad=False)


def _largest_cpu_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_bf16_weights_are_drawn_in_place(monkeypatch):
    """The regression: the old init allocated a float32 tensor of every parameter's size (2x a
    bf16 tensor) plus its cast; a draw in place allocates nothing."""
    monkeypatch.setattr(loader, "DUMMY_CHUNK_ELEMS", 4096)
    m = _Toy(torch.bfloat16, experts=64)  # experts: 393K elements, 768 KB in bf16
    assert _largest_cpu_allocation(lambda: init_dummy_weights(m)) == 0
    assert m.experts.dtype == torch.bfloat16


def test_undrawable_dtype_goes_through_bounded_chunks(monkeypatch):
    """FP8 cannot be drawn into: each chunk is drawn in float32 and rounded in, so the temporary
    is one chunk, not the tensor."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    monkeypatch.setattr(loader, "DUMMY_CHUNK_ELEMS", 4096)
    t = torch.empty(256, 512, dtype=fp8)  # 131K elements
    peak = _largest_cpu_allocation(lambda: fill_normal_(t, 0.02, torch.Generator().manual_seed(0)))
    assert 0 < peak <= 4096 * 4
    v = t.float()
    assert v.abs().max() < 0.2 and 0.015 < v.std() < 0.025


def test_scales_match_the_old_init():
    m = _Toy(torch.float32)
    init_dummy_weights(m)
    for p in (m.proj, m.experts):
        assert abs(p.mean().item()) < 2e-3 and 0.018 < p.std().item() < 0.022
    assert torch.equal(m.norm, torch.ones_like(m.norm))
    assert not m.bias.any() and not m.e_score_correction_bias.any()


def test_deterministic_per_seed_and_name():
    a, b, c = _Toy(), _Toy(), _Toy()
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    init_dummy_weights(c, seed=4)
    assert torch.equal(a.proj, b.proj) and torch.equal(a.experts, b.experts)
    assert not torch.equal(a.proj, c.proj)
    assert not torch.equal(a.proj.flatten()[:64], a.experts.flatten()[:64])  # each name its own stream
    # a parameter's values do not depend on the others: more experts leave proj unchanged
    d = _Toy(experts=16)
    init_dummy_weights(d, seed=3)
    assert torch.equal(a.proj, d.proj)


def test_chunking_does_not_change_a_tensor_of_one_chunk(monkeypatch):
    """Chunks are drawn in order from one generator: values are a function of the chunk size, so
    the size is a constant; a tensor that fits in one chunk is one plain draw."""
    t = torch.empty(8, 16)
    fill_normal_(t, 0.02, torch.Generator().manual_seed(1))
    ref = torch.empty(8, 16).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
    assert torch.equal(t, ref)
