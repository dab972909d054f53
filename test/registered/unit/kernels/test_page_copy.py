"""sgl_kernel.page_copy: the Triton page copy (under TRITON_INTERPRET on CPU, compiled with
SGLANG_TEST_DEVICE=cuda, where one side is pinned host memory) equals its torch twin byte for byte:
model-dtype KV rows and uint8 index-K rows, contiguous and strided (page_first) host views, rows
longer than a block, and word sizes picked from the row length and alignment."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel.page_copy import copy_pages, copy_pages_reference

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")


def _host(shape, dtype, page_first_layers: int = 0) -> torch.Tensor:
    pin = DEVICE == "cuda"
    if page_first_layers:
        full = torch.zeros((shape[0], page_first_layers, shape[1]), dtype=dtype, pin_memory=pin)
        return full[:, 1]  # a strided [pages, row] view, like HostKVPool.payload under page_first
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


@pytest.mark.parametrize("dtype,row", [(torch.float32, 80), (torch.bfloat16, 576 * 4), (torch.uint8, 132 * 4),
                                       (torch.uint8, 6), (torch.float32, 3000)])
@pytest.mark.parametrize("page_first", [0, 3])
def test_round_trip_equals_torch_twin(dtype, row, page_first):
    g = torch.Generator().manual_seed(row)
    dev = torch.randint(0, 256, (9, row * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype).to(DEVICE)
    src_pages, host_pages = torch.tensor([3, 1, 8, 4]), torch.tensor([0, 5, 2, 6])
    host, host_ref = _host((7, row), dtype, page_first), _host((7, row), dtype, page_first)
    d = dev.device
    copy_pages(dev, host, src_pages.to(d), host_pages.to(d))
    copy_pages_reference(dev, host_ref, src_pages, host_pages)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host.view(torch.uint8), host_ref.view(torch.uint8))
    back = torch.zeros_like(dev)
    copy_pages(host, back, host_pages.to(d), torch.tensor([2, 3, 4, 5]).to(d))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    b = back.cpu().view(torch.uint8)  # random bytes: compare bytes (NaN payloads included)
    assert torch.equal(b[2:6], dev.cpu().view(torch.uint8)[src_pages])
    assert int(b[[0, 1, 6, 7, 8]].sum()) == 0  # nothing else written


def test_bad_shapes_are_refused():
    a = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="rows differ"):
        copy_pages(a, torch.zeros(4, 4), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous rows"):
        copy_pages(a.t(), a, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="one destination page"):
        copy_pages(a, a.clone(), torch.tensor([0, 1]), torch.tensor([0]))
