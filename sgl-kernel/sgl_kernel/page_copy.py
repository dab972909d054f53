"""Page copies between KV buffers in one launch (HiCache `--hicache-io-backend kernel`).

`copy_pages(src, dst, src_pages, dst_pages)`: dst[dst_pages[i]] = src[src_pages[i]] for 2-D
[pages, row] buffers whose rows are contiguous (any row stride: a page_first host view is strided).
On a GPU one side may be pinned host memory: the kernel reads / writes it through its mapped
(unified-address) pointer, so a page set moves with one launch instead of a gather, a copy and a
scatter. The torch twin is `copy_pages_reference` (what `--hicache-io-backend direct` does).
Rows move as the widest word (8, 4, 2 or 1 bytes) that divides the row and the strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.utils import patch_interpreter

patch_interpreter()

BLOCK = 1024


@triton.jit
def _copy_pages_kernel(SRC, DST, SRC_PAGES, DST_PAGES, src_stride, dst_stride, row, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    sp = tl.load(SRC_PAGES + i).to(tl.int64)
    dp = tl.load(DST_PAGES + i).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < row
    x = tl.load(SRC + sp * src_stride + offs, mask=m)
    tl.store(DST + dp * dst_stride + offs, x, mask=m)


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _as_words(t: torch.Tensor, word: int) -> torch.Tensor:
    return t.view(torch.uint8).view(_WORDS[word])


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    if src.dim() != 2 or dst.dim() != 2 or src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("copy_pages needs 2-D [pages, row] buffers with contiguous rows")
    row = src.shape[1] * src.element_size()
    if row != dst.shape[1] * dst.element_size():
        raise ValueError(f"page rows differ: {row} vs {dst.shape[1] * dst.element_size()} bytes")
    n = len(src_pages)
    if n != len(dst_pages):
        raise ValueError("one destination page per source page")
    if n == 0:
        return
    sizes = [row, src.stride(0) * src.element_size(), dst.stride(0) * dst.element_size(),
             src.data_ptr(), dst.data_ptr()]
    word = next(w for w in (8, 4, 2, 1) if all(x % w == 0 for x in sizes))
    s, d = _as_words(src, word), _as_words(dst, word)
    words = row // word
    grid = (n, triton.cdiv(words, BLOCK))
    _copy_pages_kernel[grid](s, d, src_pages, dst_pages, s.stride(0), d.stride(0), words, BLOCK=BLOCK)


def copy_pages_reference(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor,
                         dst_pages: torch.Tensor) -> None:
    dst[dst_pages.to(dst.device)] = src[src_pages.to(src.device)].to(dst.device)
