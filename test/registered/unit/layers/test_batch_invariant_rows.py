"""rows_invariant: on CPU a row's matmul result must not depend on how many rows share the call
(the property greedy batch invariance rests on; see test/srt/test_batch_invariance.py). This
checks the BLAS of the machine the suite runs on, so a BLAS that breaks it is caught here."""

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.linear import MIN_INVARIANT_ROWS, ReplicatedLinear, rows_invariant
from sglang.srt.layers.radix_attention import RadixAttention


@pytest.mark.parametrize("k,n", [(128, 256), (64, 128), (256, 128), (128, 1024), (96, 100), (16, 64)])
def test_linear_rows_are_batch_invariant(k, n):
    g = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(n, k, generator=g), torch.randn(300, k, generator=g)
    first = rows_invariant(lambda a: F.linear(a, w), x[:1])
    for m in (1, 2, 3, 7, MIN_INVARIANT_ROWS - 1, MIN_INVARIANT_ROWS, 17, 64, 300):
        assert torch.equal(rows_invariant(lambda a: F.linear(a, w), x[:m])[:1], first), m


def test_layers_use_it():
    """The projections of a decode step (linears, the absorbed MLA bmms) give a request the same
    bits alone as in a batch."""
    g = torch.Generator().manual_seed(0)
    lin = ReplicatedLinear(64, 96)
    lin.weight.data = torch.randn(96, 64, generator=g)
    x = torch.randn(20, 64, generator=g)
    assert torch.equal(lin(x[:1]), lin(x)[:1])
    attn = RadixAttention(0, 4, 16, 8, 16, 32, 0.1)
    attn.set_kv_b_proj(torch.randn(4 * 32, 32, generator=g))
    q, o = torch.randn(20, 4, 16, generator=g), torch.randn(20, 4, 32, generator=g)
    assert torch.equal(attn.absorb_q(q[:1]), attn.absorb_q(q)[:1])
    assert torch.equal(attn.project_out(o[:2]), attn.project_out(o)[:2])


def test_rowwise_pads_rows_to_whole_vectors_in_deterministic_mode():
    """Router scores (8 experts): with --enable-deterministic-inference each row goes through the
    vector path whatever the row count; off, rowwise is the plain call."""
    from sglang.srt.layers import batch_invariant

    x = torch.randn(33, 8, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(batch_invariant.rowwise(torch.sigmoid, x, 0.0), torch.sigmoid(x))
    batch_invariant.set_deterministic_inference(True)
    try:
        full = batch_invariant.rowwise(torch.sigmoid, x, 0.0)
        soft = batch_invariant.rowwise(lambda t: t.softmax(-1), x, float("-inf"))
        for m in (1, 2, 3, 17):
            assert torch.equal(batch_invariant.rowwise(torch.sigmoid, x[:m], 0.0), full[:m]), m
            assert torch.equal(batch_invariant.rowwise(lambda t: t.softmax(-1), x[:m], float("-inf")), soft[:m])
        assert (full - torch.sigmoid(x)).abs().max() < 1e-6 and (soft - x.softmax(-1)).abs().max() < 1e-6
    finally:
        batch_invariant.set_deterministic_inference(False)
