"""The decode split rules of the sparse MLA kernel (sgl_kernel.mla_split): fixed by the model under
deterministic inference, by batch size otherwise; and the backend and the memory plan size the
split-K partials from the same rule."""

from __future__ import annotations

import os

import pytest
import torch
from sgl_kernel.mla_split import (
    DECODE_TARGET_PROGRAMS,
    MLA_DECODE,
    MLA_DECODE_WIDE,
    WIDE_MIN_BATCH,
    WIDE_TARGET_PROGRAMS,
    decode_split_keys,
    decode_tile,
    num_splits,
    partial_rows,
    split_keys_for,
)
from sgl_kernel.sparse_mla import mla_attention, mla_attention_ref

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
V32_HEADS, V32_TOPK = 128, 2048


@pytest.mark.parametrize("max_keys", [64, 2048, 163840])
def test_batch_invariant_rule_ignores_the_batch(max_keys):
    fixed = split_keys_for(max_keys, MLA_DECODE_WIDE["block_n"])
    assert {decode_split_keys(b, V32_HEADS, max_keys, True) for b in (1, 2, 7, 64, 256)} == {fixed}
    assert all(decode_tile(b, True) == MLA_DECODE_WIDE for b in (1, 2, 7, 64, 256))  # one tile too


def test_default_rule_at_v32_shapes_is_the_measured_best():
    # H100, 2026-12-07 (f): the fastest (tile, split) at batch 1 / 16 / 64 was (32 heads, 64 keys),
    # (64 heads, 512), (64 heads, none)
    assert [decode_tile(b, False)["block_h"] for b in (1, 16, 64)] == [32, 64, 64]
    assert [decode_split_keys(b, V32_HEADS, V32_TOPK, False) for b in (1, 16, 64)] == [64, 512, 0]
    assert split_keys_for(V32_TOPK, 64) == 256  # deterministic: the wide tile at 8 splits


@pytest.mark.parametrize("heads,max_keys", [(128, 2048), (64, 2048), (16, 64), (128, 163840), (8, 100)])
def test_default_rule_fills_about_the_target_and_never_splits_past_one_key_block(heads, max_keys):
    for batch in range(1, 300):
        tile = decode_tile(batch, False)
        assert tile == (MLA_DECODE_WIDE if batch >= WIDE_MIN_BATCH else MLA_DECODE)
        target = WIDE_TARGET_PROGRAMS if tile is MLA_DECODE_WIDE else DECODE_TARGET_PROGRAMS
        head_blocks, bn = -(-heads // tile["block_h"]), tile["block_n"]
        sk = decode_split_keys(batch, heads, max_keys, False)
        s = num_splits(max_keys, sk)
        assert sk == 0 or (sk % bn == 0 and s > 1)
        assert s * bn < max_keys + bn  # every split holds keys
        programs = batch * head_blocks * s
        assert programs <= max(target, batch * head_blocks)
        if s * bn < max_keys:  # not capped by the keys: doubling would overshoot
            assert 2 * programs > target
        assert partial_rows(batch, heads, max_keys, False) == (batch * heads * s if sk else 0)


def test_every_default_split_equals_the_twin():
    """The kernel at the rule's split for several batch sizes (0 = one chunk, written directly)
    against the torch twin: the rule changes the reduction order, not the result."""
    g = torch.Generator().manual_seed(0)
    h, c, r, k_top, ctx = 16, 64, 16, 192, 256
    for bs in (1, 3, 9):
        sk = decode_split_keys(bs, h, k_top, False, dict(block_h=16, block_n=16))
        slots = bs * ctx + 8
        r2t = torch.randperm(slots, generator=g)[: bs * ctx].view(bs, ctx).int()
        kv = torch.randn(slots, 1, c + r, generator=g)
        q_lat, q_rope = torch.randn(bs, h, c, generator=g), torch.randn(bs, h, r, generator=g)
        pos = torch.randint(k_top // 2, ctx, (bs,), generator=g)
        topk = torch.full((bs, k_top), -1, dtype=torch.int32)  # valid positions first, -1 after
        for i, p in enumerate(pos.tolist()):
            sel = torch.randperm(p + 1, generator=g)[:k_top].sort().values
            topk[i, : len(sel)] = sel.int()
        args = [q_lat, q_rope, kv, c, r2t, torch.arange(bs), torch.arange(bs), pos, topk, 0.1]
        args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        ref = mla_attention_ref(*args)
        got = mla_attention(*args, split_keys=sk, max_keys=k_top, block_h=16, block_n=16)
        assert (got - ref).abs().max().item() < 1e-4, (bs, sk)
