"""sgl_kernel.mha_prefill (dense causal MHA of short DSA prefills) against its torch twin
(TRITON_INTERPRET on CPU; compiled with SGLANG_TEST_DEVICE=cuda): prefixes, odd head dims, rows
that are not consecutive positions, a block past a request's keys, untouched rows left as they are."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel.mha_prefill import mha_prefill, mha_prefill_ref, plan_q_blocks

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(prefix: list[int], extend: list[int], h: int, dn: int, dr: int, dv: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv_len = [p + e for p, e in zip(prefix, extend)]
    starts = [sum(extend[:i]) for i in range(len(extend))]
    kv_start = [sum(kv_len[:i]) for i in range(len(kv_len))]
    t, L = sum(extend), sum(kv_len)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    q_nope, q_rope = r(t, h, dn), r(t, h, dr)
    kv = r(L, h, dn + dv)  # a kv_b_proj output: K_nope and V are strided views of one buffer
    k_rope = r(L, dr)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)]).to(DEVICE)
    return dict(q_nope=q_nope, q_rope=q_rope, k_nope=kv[..., :dn], k_rope=k_rope, v=kv[..., dn:],
                kv_start=torch.tensor(kv_start, dtype=torch.int32, device=DEVICE),
                kv_len=torch.tensor(kv_len, dtype=torch.int32, device=DEVICE), positions=positions,
                starts=starts, extend=extend)


def _run(c: dict, block_m: int, fn, requests=None, sm_scale: float = 0.125) -> torch.Tensor:
    reqs = range(len(c["extend"])) if requests is None else requests
    blocks = [b for b in plan_q_blocks(c["starts"], c["extend"], block_m) if b[2] in reqs]
    qb = torch.tensor(blocks, dtype=torch.int32, device=DEVICE).reshape(-1, 3)
    t, h = c["q_nope"].shape[:2]
    out = torch.full((t, h, c["v"].shape[-1]), 7.0, dtype=c["q_nope"].dtype, device=DEVICE)  # poisoned
    kw = dict(block_m=block_m, block_n=16) if fn is mha_prefill else {}
    return fn(c["q_nope"], c["q_rope"], c["k_nope"], c["k_rope"], c["v"], qb, c["kv_start"], c["kv_len"],
              c["positions"], sm_scale, out, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix,extend", [([0], [5]), ([0, 0, 3], [17, 1, 40]), ([33, 0], [9, 20])])
def test_equals_twin(dtype, prefix, extend):
    c = _case(prefix, extend, h=3, dn=32, dr=16, dv=24, dtype=dtype)  # v 24: a masked head dim
    got = _run(c, 16, mha_prefill)
    ref = _run(c, 16, mha_prefill_ref)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert (got != 7.0).all()  # every row of every request written


def test_rows_outside_the_blocks_are_untouched_and_a_row_sees_only_its_past():
    c = _case([4, 0], [12, 6], h=2, dn=16, dr=16, dv=16, dtype=torch.float32, seed=3)
    got = _run(c, 8, mha_prefill, requests=[1])
    assert (got[:12] == 7.0).all() and (got[12:] != 7.0).all()
    # a future key changed: rows before it keep their output bit for bit
    before = _run(c, 8, mha_prefill)
    c["v"][4 + 12 + 3] += 1.0  # request 1's key at position 3 (its keys start after request 0's 16)
    after = _run(c, 8, mha_prefill)
    assert torch.equal(before[12:15], after[12:15]) and not torch.equal(before[15:], after[15:])
    assert torch.equal(before[:12], after[:12])


def test_rows_need_not_be_consecutive_positions():
    """A CP rank's lane holds rows of a request at scattered positions: the bound is per row."""
    c = _case([0], [20], h=2, dn=16, dr=16, dv=16, dtype=torch.float32, seed=5)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    c["positions"] = c["positions"][perm]
    torch.testing.assert_close(_run(c, 8, mha_prefill), _run(c, 8, mha_prefill_ref), atol=2e-5, rtol=2e-5)


def test_equals_the_absorbed_form_over_every_causal_key():
    """The point of the path: expanded K/V attention equals absorbed MLA over the latents."""
    g = torch.Generator().manual_seed(7)
    h, c_lat, dn, dr, dv, n = 2, 24, 16, 16, 16, 11
    w = torch.randn(h * (dn + dv), c_lat, generator=g) / c_lat**0.5
    latent, k_rope = torch.randn(n, c_lat, generator=g), torch.randn(n, dr, generator=g)
    q_nope, q_rope = torch.randn(n, h, dn, generator=g), torch.randn(n, h, dr, generator=g)
    kv = torch.nn.functional.linear(latent, w).view(n, h, dn + dv)
    out = torch.zeros(n, h, dv, device=DEVICE)
    qb = torch.tensor(plan_q_blocks([0], [n], 16), dtype=torch.int32)
    mha_prefill(q_nope.to(DEVICE), q_rope.to(DEVICE), kv[..., :dn].to(DEVICE), k_rope.to(DEVICE),
                kv[..., dn:].to(DEVICE), qb.to(DEVICE), torch.tensor([0], dtype=torch.int32, device=DEVICE),
                torch.tensor([n], dtype=torch.int32, device=DEVICE), torch.arange(n, device=DEVICE), 0.2,
                out, block_m=16, block_n=16)
    wk, wv = w.view(h, dn + dv, c_lat).split([dn, dv], dim=1)
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope, wk)
    s = (torch.einsum("nhc,lc->hnl", q_lat, latent) + torch.einsum("nhr,lr->hnl", q_rope, k_rope)) * 0.2
    s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n)[:, None], float("-inf"))
    o_lat = torch.einsum("hnl,lc->nhc", torch.softmax(s, -1), latent)
    ref = torch.einsum("nhc,hvc->nhv", o_lat, wv)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


def test_plan_q_blocks():
    assert plan_q_blocks([0, 5], [5, 3], 4) == [(0, 4, 0), (4, 1, 0), (5, 3, 1)]
    assert plan_q_blocks([], [], 4) == []
