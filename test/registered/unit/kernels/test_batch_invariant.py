"""sgl_kernel.batch_invariant (--enable-deterministic-inference) against its torch twins, and the
property it exists for: a row's result is byte-identical whatever the number of rows in the call
(TRITON_INTERPRET on CPU; compiled with SGLANG_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel.batch_invariant import matmul, rms_norm
from sgl_kernel.utils import triton_available
from sglang.srt.layers import batch_invariant
from sglang.srt.layers.layernorm import RMSNorm

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs a GPU or TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_torch_and_rows_are_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    k, n = 100, 70  # not multiples of the tiles
    x = torch.randn(67, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    full = matmul(x, w.t(), b)
    assert _rel(full, torch.nn.functional.linear(x.float(), w.float(), b.float())) < TOL[dtype]
    for m in (1, 3, 16, 65):  # the first rows, alone or in fewer / more rows: the same bytes
        assert torch.equal(matmul(x[:m], w.t(), b), full[:m]), m
    assert torch.equal(matmul(x[40:41], w.t(), b)[0], full[40])  # position in the batch does not matter
    assert matmul(x[:0], w.t()).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_matmul_matches_torch_and_rows_are_invariant(dtype):
    """A long K over few output tiles (decode's kv_a / q_a shapes) splits K; the splits' partials
    are summed in a fixed order, so rows stay byte-identical in any batch."""
    from sgl_kernel.batch_invariant import matmul_config

    g = torch.Generator().manual_seed(4)
    k, n = 1000, 70
    assert matmul_config(n, k, dtype, torch.device(DEVICE))["SPLIT_K"] > 1
    x = torch.randn(20, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    full = matmul(x, w.t(), b)
    assert _rel(full, torch.nn.functional.linear(x.float(), w.float(), b.float())) < TOL[dtype]
    for m in (1, 2, 7):
        assert torch.equal(matmul(x[:m], w.t(), b), full[:m]), m
    assert torch.equal(matmul(x[13:14], w.t(), b)[0], full[13])
    a3 = x.view(2, 10, k)
    w3 = torch.stack([w, w.flip(0)]).transpose(1, 2)
    full3 = matmul(a3, w3)
    assert _rel(full3, torch.bmm(a3.float(), w3.float())) < TOL[dtype]
    assert torch.equal(matmul(a3[:, 4:5], w3), full3[:, 4:5])


def test_split_k_is_a_function_of_the_weight_shape_only(monkeypatch):
    import sgl_kernel.batch_invariant as bi
    from sgl_kernel.batch_invariant import SPLIT_K_MAX, matmul_config

    monkeypatch.setattr(bi, "_num_sms", lambda device: 132)  # an H100's SMs
    dev = torch.device(DEVICE)
    kv_a = matmul_config(576, 7168, torch.bfloat16, dev)["SPLIT_K"]
    assert 1 < kv_a <= SPLIT_K_MAX and kv_a & (kv_a - 1) == 0
    assert matmul_config(129280, 7168, torch.bfloat16, dev)["SPLIT_K"] == 1  # lm_head: tiles enough
    assert matmul_config(576, 128, torch.bfloat16, dev)["SPLIT_K"] == 1  # short K: no split


def test_bmm_matches_torch_and_is_invariant():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 20, 48, generator=g).to(DEVICE)
    w = torch.randn(3, 40, 48, generator=g).to(DEVICE)
    full = matmul(a, w.transpose(1, 2))
    assert _rel(full, torch.bmm(a, w.transpose(1, 2))) < 1e-5
    assert torch.equal(matmul(a[:, 5:6], w.transpose(1, 2)), full[:, 5:6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_twin_and_is_invariant(dtype):
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(96, eps=1e-6).to(DEVICE)
    norm.weight.data = torch.rand(96, generator=g).to(DEVICE) + 0.5
    x = (torch.randn(33, 96, generator=g) * 3).to(dtype).to(DEVICE)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    ref = norm._norm(x)
    assert got.dtype == ref.dtype and _rel(got, ref) < TOL[dtype]
    assert torch.equal(rms_norm(x[7:8], norm.weight, 1e-6), got[7:8])


def test_flag_routes_layers_through_the_kernels_and_off_is_the_default_path():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 64, generator=g).to(DEVICE), torch.randn(32, 64, generator=g).to(DEVICE)
    assert not batch_invariant.deterministic_inference()
    off = batch_invariant.linear(x, w)
    assert torch.equal(off, batch_invariant.rows_invariant(lambda a: torch.nn.functional.linear(a, w), x))
    batch_invariant.set_deterministic_inference(True)
    try:
        on = batch_invariant.linear(x, w)
        assert torch.equal(on, matmul(x, w.t()))
        assert _rel(on, off) < 1e-5
    finally:
        batch_invariant.set_deterministic_inference(False)
