"""Triton fused MoE (sgl_kernel.moe) against its torch twin, on CPU under TRITON_INTERPRET=1 (or on
the GPU with SGLANG_TEST_DEVICE=cuda).

- `moe_align_block_size` (Triton; bitwise equal to its torch twin): every local assignment placed
  exactly once, in ascending flat order inside contiguous block-aligned expert groups, padding =
  sentinel, consistent expert_ids, and output sizes that depend only on (T*k, E, block_m).
- `fused_experts` vs `fused_experts_ref`: odd sizes (H=48, I=40: tails in N and K), T in {0, 1, 3, 17},
  k in {1, 2, 3}, E in {1, 4, 9}, empty experts, all tokens on one expert, expert parallelism (ids of
  other ranks and -1), fp32 (~1e-5) and bf16 (~1e-2), decode, prefill and heuristic configs. Every
  buffer is poisoned first (NaN, or -7 for the align outputs), so an unwritten row shows up.
- Determinism (bitwise on repeat) and batch invariance (a token alone == its row in a batch, and the
  same across the decode / prefill configs, which share BLOCK_K).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from sgl_kernel import moe

DEVICE = "cuda" if os.environ.get("SGLANG_TEST_DEVICE") == "cuda" else "cpu"
H, I = 48, 40  # neither a multiple of the 32-wide tiles below: exercises the N and K tails
DECODE = moe.MoEConfig(block_m=16, block_n=32, block_k=32)
PREFILL = moe.MoEConfig(block_m=32, block_n=16, block_k=16, group_m=2)  # K=48 even, K=40 odd
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(moe, "_POISON_INTERMEDIATES", True)


def _weights(e: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(e, H, I, generator=g) / I**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _routing(t: int, k: int, e: int, mode: str, offset: int = 0, seed: int = 1):
    """ids [T, k] (distinct per token, like top-k), weights [T, k] fp32."""
    g = torch.Generator().manual_seed(seed)
    if mode == "one_expert":  # every token on expert 0 (other slots on non-local ids)
        ids = torch.full((t, k), -1, dtype=torch.long)
        ids[:, 0] = offset
    elif mode == "ep":  # global ids over 3 ranks' experts + dropped slots; this rank holds [offset, offset+e)
        ids = torch.stack([torch.randperm(3 * e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
        ids = ids.long()
        ids[torch.rand(t, k, generator=g) < 0.15] = -1
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
        ids = ids.long() + offset
    w = torch.rand(t, k, generator=g) + 0.1
    return ids.to(DEVICE), w.to(DEVICE)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    scale = max(ref.float().abs().max().item(), 1e-3)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max err {err:.3g} vs scale {scale:.3g}"


# ---------------------------------------------------------------- moe_align_block_size

@pytest.mark.parametrize("t,k,e,block_m,mode,offset", [
    (1, 1, 1, 16, "random", 0), (3, 2, 4, 16, "random", 0), (17, 3, 9, 16, "random", 0),
    (17, 3, 9, 4, "random", 5), (40, 2, 4, 16, "one_expert", 0), (17, 3, 4, 16, "ep", 4),
    (64, 1, 4, 8, "random", 0), (5, 2, 4, 16, "ep", 0), (300, 8, 256, 64, "random", 0),  # several chunks
    (0, 2, 4, 16, "random", 0),
])
def test_align_properties(t, k, e, block_m, mode, offset):
    ids, _ = _routing(t, k, e, mode, offset)
    sorted_ids, expert_ids, npp = moe.moe_align_block_size(ids, e, block_m, offset)
    for twin in (moe.moe_align_block_size_ref(ids, e, block_m, offset),  # Triton == torch twin, bitwise
                 moe.moe_align_block_size(ids.int(), e, block_m, offset)):  # int32 ids alike
        assert all(torch.equal(a, b) for a, b in zip((sorted_ids, expert_ids, npp), twin))
    n = t * k
    max_rows = moe.max_sorted_rows(n, e, block_m)
    assert sorted_ids.dtype == expert_ids.dtype == npp.dtype == torch.int32
    assert sorted_ids.shape == (max_rows,) and expert_ids.shape == (max_rows // block_m,) and npp.shape == (1,)
    assert max_rows <= n + e * (block_m - 1) + block_m - 1  # never above the classic bound

    local = ids.reshape(-1).cpu() - offset
    is_local = (local >= 0) & (local < e)
    s, ex, total = sorted_ids.cpu(), expert_ids.cpu(), int(npp.item())
    counts = torch.stack([(local == x).sum() for x in range(e)])
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum()) and total % block_m == 0
    if n == 0:
        assert max_rows == 0 and total == 0
        return
    assert (s[total:] == n).all() and (ex[total // block_m:] == -1).all()

    placed = s[:total][s[:total] != n]
    assert sorted(placed.tolist()) == torch.nonzero(is_local).flatten().tolist()  # each exactly once
    row = 0
    for x in range(e):  # groups in ascending expert order, block aligned, real rows first then padding
        c = int(counts[x])
        size = (c + block_m - 1) // block_m * block_m
        group = s[row:row + size]
        assert group[:c].tolist() == torch.nonzero(local == x).flatten().tolist()  # stable: ascending
        assert (group[c:] == n).all()
        assert (ex[row // block_m:(row + size) // block_m] == x).all()
        row += size
    assert row == total

    # Sizes depend on (T*k, E, block_m) only: all-to-one-expert gives the same shapes.
    other = moe.moe_align_block_size(torch.full_like(ids, offset), e, block_m, offset)
    assert [o.shape for o in other] == [sorted_ids.shape, expert_ids.shape, npp.shape]


# ---------------------------------------------------------------- fused_experts vs the reference

CASES = [  # (T, k, E, routing, expert_offset)
    (1, 1, 1, "random", 0),
    (3, 2, 4, "random", 0),
    (17, 3, 9, "random", 0),       # 51 assignments over 9 experts, some with few rows
    (3, 1, 9, "random", 0),        # most experts empty
    (17, 2, 4, "one_expert", 0),   # all tokens on one expert, other slots dropped
    (17, 3, 4, "ep", 4),           # rank 1 of 3: ids of other ranks and -1 contribute nothing
    (3, 3, 9, "ep", 18),           # last rank
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,k,e,mode,offset", CASES)
def test_fused_experts_matches_ref(t, k, e, mode, offset, dtype):
    w13, w2 = _weights(e, dtype)
    ids, w = _routing(t, k, e, mode, offset)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    ref = moe.fused_experts_ref(x, w13, w2, w, ids, offset)
    for cfg in (DECODE, PREFILL, None):
        out = moe.fused_experts(x, w13, w2, w, ids, offset, cfg)
        _close(out, ref, dtype)
    if dtype == torch.bfloat16:  # fp32 accumulation: at least as close to the exact product
        exact = moe.fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, offset)
        _close(out.float(), exact, dtype)
    local = (ids - offset >= 0) & (ids - offset < e)
    assert (out[~local.any(dim=1)] == 0).all()  # tokens with no local expert: exact zeros


def test_int32_ids_and_large_tile_config():
    e, dtype = 4, torch.float32
    w13, w2 = _weights(e, dtype)
    ids, w = _routing(17, 2, e, "random")
    x = torch.randn(17, H).to(DEVICE, dtype)
    ref = moe.fused_experts_ref(x, w13, w2, w, ids)
    _close(moe.fused_experts(x, w13, w2, w, ids.int(), config=moe.MoEConfig(64, 64, 64, num_stages=2)), ref, dtype)


def test_empty_batch():
    w13, w2 = _weights(4, torch.float32)
    x = torch.zeros(0, H, device=DEVICE)
    ids, w = torch.zeros(0, 2, dtype=torch.long, device=DEVICE), torch.zeros(0, 2, device=DEVICE)
    out = moe.fused_experts(x, w13, w2, w, ids)
    assert out.shape == (0, H) and out.dtype == x.dtype


def test_shape_checks():
    w13, w2 = _weights(4, torch.float32)
    x = torch.randn(3, H, device=DEVICE)
    ids, w = _routing(3, 2, 4, "random")
    with pytest.raises(ValueError, match="do not match"):
        moe.fused_experts(x, w13, w2[:, :, :-1], w, ids)
    with pytest.raises(ValueError, match="must both be"):
        moe.fused_experts(x, w13, w2, w[:, :1], ids)
    with pytest.raises(ValueError, match="dtypes differ"):
        moe.fused_experts(x.bfloat16(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="power of two"):
        moe.MoEConfig(block_m=48)


# ---------------------------------------------------------------- determinism, batch invariance

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic_and_batch_invariant(dtype):
    t, k, e = 17, 3, 4
    w13, w2 = _weights(e, dtype)
    ids, w = _routing(t, k, e, "random")
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    batch = moe.fused_experts(x, w13, w2, w, ids)
    assert torch.equal(batch, moe.fused_experts(x, w13, w2, w, ids))  # bitwise on repeat
    for i in (0, 7, t - 1):  # alone (row 0 of its own tile) == its row inside the batch, bitwise
        alone = moe.fused_experts(x[i:i + 1], w13, w2, w[i:i + 1], ids[i:i + 1])
        assert torch.equal(alone[0], batch[i]), i
    # Decode and prefill-style configs share BLOCK_K, so the K order of every row is the same.
    heuristic = [moe.get_moe_config(n, k, 256, 7168, 2048, dtype) for n in (1, 64, 1024, 4096, 32768)]
    for cfg in {c for c in heuristic}:
        small = dataclasses.replace(cfg, block_n=min(cfg.block_n, 64))  # fewer interpreted programs
        assert torch.equal(moe.fused_experts(x, w13, w2, w, ids, config=small), batch), cfg


def test_heuristic_configs():
    for dtype in (torch.bfloat16, torch.float32):
        cfgs = {n: moe.get_moe_config(n, 8, 256, 7168, 2048, dtype) for n in (1, 16, 64, 512, 1024, 4096, 32768)}
        assert all(c.block_m == 16 for n, c in cfgs.items() if n <= 512)  # <= 16 rows per expert
        assert cfgs[4096].block_m == 64 and cfgs[32768].block_m == 128
        assert len({c.block_k for c in cfgs.values()}) == 1  # batch invariance across configs
        size = torch.empty((), dtype=dtype).element_size()
        for c in cfgs.values():  # pipelined gate/up tiles fit the shared memory of one SM
            assert 2 <= c.num_stages and c.num_stages * (c.block_m + 2 * c.block_n) * c.block_k * size <= 160 * 1024
