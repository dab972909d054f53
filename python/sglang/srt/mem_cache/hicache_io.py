"""HiCache's host <-> device page copies (`--hicache-io-backend direct`): one copy per run of
consecutive host pages, per layer and payload.

A transfer pairs host page hp[i] with device page dp[i]. Sorted by host page, the pairs fall into
runs of consecutive host pages (`PageRuns`); a run is one block of pinned host memory -- contiguous
under layer_first, rows at one stride under page_first -- so it moves with one cudaMemcpyAsync
(cudaMemcpy2DAsync when strided) at the speed of a plain pinned copy of the same bytes. Where a
run's device pages are consecutive too, the copy reads / writes them in place; otherwise they go
through a contiguous device staging buffer: one gather kernel before a backup's copies, one
scatter kernel after a load's, at HBM speed. Staging holds at most `max_staged_pages` pages per
payload (longer transfers go in chunks); it is allocated on the copy stream, so the caching
allocator reuses it only for work queued after these copies.

The direct path used to gather on the device, copy into pageable memory and scatter on the host
(the reverse for loads) and upload the page list per layer: 3-7% of the pinned copy bandwidth on an
H100 (issue 29). The plain twin is `copy_pages_reference` (sgl_kernel.page_copy); the tests check
that both move the same bytes for every layout and payload (MLA KV, FP8 KV rows, index K).
Nothing here waits: copies are queued on the current stream and the caller syncs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # device staging per payload copy; a 32K-token V3.2 layer is 38 MB of MLA KV
_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses


@dataclass
class _Chunk:
    """Staged runs: their device pages in staging order, and (host page, staging row, pages) pieces."""

    dev_pages: torch.Tensor
    pieces: list[tuple[int, int, int]]
    _on: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> torch.Tensor:
        return _upload(self._on, self.dev_pages, device)


def _upload(cache: dict, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, uploaded once (pinned + non_blocking: the copy thread never waits on it)."""
    device = torch.device(device)
    got = cache.get(device)
    if got is None:
        got = t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
        cache[device] = got
    return got


class PageRuns:
    """The copy plan of one transfer: host pages `host_pages[i]` <-> device pages `device_pages[i]`.

    `direct`: (host page, device page, pages) runs consecutive on both sides, copied in place.
    `chunks`: runs consecutive on the host only, through staging. `host_pages` / `device_pages`
    keep the caller's order (observers pair them with per-page keys)."""

    def __init__(self, host_pages: torch.Tensor, device_pages: torch.Tensor, max_staged_pages: int) -> None:
        hp = host_pages.to("cpu", torch.int64).reshape(-1)
        dp = device_pages.to("cpu", torch.int64).reshape(-1)
        if hp.numel() != dp.numel():
            raise ValueError(f"one device page per host page: {hp.numel()} vs {dp.numel()}")
        if max_staged_pages < 1:
            raise ValueError(f"max_staged_pages must be >= 1, got {max_staged_pages}")
        self.host_pages, self.device_pages = hp, dp
        # numpy, not torch: the plan is made per op on a host thread, and a dozen small torch ops
        # cost ~250 us there -- a tenth of a 32K-token copy at PCIe speed (issue 29)
        h, d = hp.numpy(), dp.numpy()
        order = np.argsort(h, kind="stable")
        h, d = h[order], d[order]
        self.sorted_host, self.sorted_device = torch.from_numpy(h), torch.from_numpy(d)
        self.direct: list[tuple[int, int, int]] = []
        self.chunks: list[_Chunk] = []
        self._on: tuple[dict, dict] = ({}, {})
        if h.size:
            self._cut(h, d, max_staged_pages)

    def _cut(self, hp: np.ndarray, dp: np.ndarray, max_staged: int) -> None:
        n = hp.size
        host_break = np.ones(n, dtype=bool)
        host_break[1:] = hp[1:] != hp[:-1] + 1
        joint = host_break.copy()
        joint[1:] |= dp[1:] != dp[:-1] + 1
        joint_id = np.cumsum(joint)
        starts = np.flatnonzero(host_break)
        ends = np.append(starts[1:], n)
        # a host run is copied in place iff no device break falls inside it
        in_place = (joint_id[ends - 1] == joint_id[starts]).tolist()
        # only the runs' first pages go to Python (a whole-list tolist() was half the plan's cost);
        # host pages are consecutive inside a run, so a piece's first host page is the run's + offset
        staged_idx: list[np.ndarray] = []
        pieces: list[tuple[int, int, int]] = []
        used = 0
        for a, b, direct, h0, d0 in zip(starts.tolist(), ends.tolist(), in_place, hp[starts].tolist(),
                                        dp[starts].tolist()):
            if direct:
                self.direct.append((h0, d0, b - a))
                continue
            run0 = a
            while a < b:
                take = min(b - a, max_staged - used)
                pieces.append((h0 + a - run0, used, take))
                staged_idx.append(dp[a: a + take])
                used, a = used + take, a + take
                if used == max_staged:
                    self.chunks.append(_Chunk(torch.from_numpy(np.concatenate(staged_idx)), pieces))
                    staged_idx, pieces, used = [], [], 0
        if pieces:
            self.chunks.append(_Chunk(torch.from_numpy(np.concatenate(staged_idx)), pieces))

    def __len__(self) -> int:
        return self.host_pages.numel()

    def num_host_copies(self) -> int:
        """cudaMemcpy calls per payload copy (one per run, a run split across chunks counts twice)."""
        return len(self.direct) + sum(len(c.pieces) for c in self.chunks)

    def pages_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(host pages, device pages), sorted by host page, on `device` (the kernel backend's input)."""
        return _upload(self._on[0], self.sorted_host, device), _upload(self._on[1], self.sorted_device, device)


def backup_pages(runs: PageRuns, src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[hp[i]] = src[dp[i]]: device [pages, row] buffer -> host [pages, row] view."""
    for h, d, n in runs.direct:
        copy_block(dst[h: h + n], src[d: d + n])
    for c in runs.chunks:
        staging = src.index_select(0, c.on(src.device))
        for h, s, n in c.pieces:
            copy_block(dst[h: h + n], staging[s: s + n])


def load_pages(runs: PageRuns, src: torch.Tensor, dst: torch.Tensor,
               scatter_stream: torch.cuda.Stream | None = None) -> None:
    """dst[dp[i]] = src[hp[i]]: host [pages, row] view -> device [pages, row] buffer.

    `scatter_stream` (CUDA): staged chunks are scattered there, after their copies, so the copy
    engine goes on with the next chunk / layer while the SMs scatter this one (on one stream each
    scatter held the next copy back: 0.88x of the plain copy for shuffled device pages on an H100).
    The caller then orders readers after `scatter_stream` (`ready_after_scatter`)."""
    for h, d, n in runs.direct:
        copy_block(dst[d: d + n], src[h: h + n])
    for c in runs.chunks:
        staging = torch.empty((len(c.dev_pages), src.shape[1]), dtype=src.dtype, device=dst.device)
        for h, s, n in c.pieces:
            copy_block(staging[s: s + n], src[h: h + n])
        idx = c.on(dst.device)
        if scatter_stream is None:
            dst.index_copy_(0, idx, staging)
            continue
        scatter_stream.wait_stream(torch.cuda.current_stream())  # this chunk's copies (and idx)
        with torch.cuda.stream(scatter_stream):
            dst.index_copy_(0, idx, staging)
        staging.record_stream(scatter_stream)  # not reused before the scatter has read it


def ready_after_scatter(scatter_stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event after everything queued so far on the current stream and on `scatter_stream`: a
    layer's copies and scatters."""
    scatter_stream.wait_stream(torch.cuda.current_stream())
    ev = torch.cuda.Event()
    ev.record(scatter_stream)
    return ev


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src for [n, row] blocks with contiguous rows: one copy, queued on the current stream."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"block copy of {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=True)  # same device, or one contiguous cudaMemcpyAsync
        return
    # A strided host block (page_first): torch would stage it through pageable memory.
    fn = _memcpy2d()
    if fn is None:
        for i in range(dst.shape[0]):  # each page row is contiguous
            dst[i].copy_(src[i], non_blocking=True)
        return
    dev = dst.device if dst.device.type == "cuda" else src.device
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    err = fn(*memcpy2d_args(dst, src), _CUDA_MEMCPY_DEFAULT, stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")


def memcpy2d_args(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(dst, dpitch, src, spitch, width, height) in bytes for cudaMemcpy2DAsync of [n, row] blocks
    whose rows are contiguous (any row stride): one row per page."""
    for t in (dst, src):
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"2-D copies need [n, row] blocks with contiguous rows, got strides {t.stride()}")
    es = dst.element_size()
    n, row = dst.shape
    dpitch = dst.stride(0) * es if n > 1 else row * es
    spitch = src.stride(0) * es if n > 1 else row * es
    return dst.data_ptr(), dpitch, src.data_ptr(), spitch, row * es, n


@functools.lru_cache(maxsize=1)
def _memcpy2d():
    """cudaMemcpy2DAsync from the CUDA runtime torch loaded (torch has no strided cross-device copy);
    None where it cannot be found (then strided blocks move page by page)."""
    lib = _load_cudart()
    if lib is None:
        logger.warning("HiCache: libcudart not found; page_first host blocks are copied page by page")
        return None
    fn = lib.cudaMemcpy2DAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _load_cudart():
    try:
        with open("/proc/self/maps") as f:  # the runtime torch itself uses, whatever its path
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        paths = []
    major = (torch.version.cuda or "").split(".")[0]
    for name in paths + ([f"libcudart.so.{major}"] if major else []) + ["libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def memcpy2d_available() -> bool:
    """Strided (page_first) host blocks move in one cudaMemcpy2DAsync (what the benchmark records)."""
    return torch.cuda.is_available() and _memcpy2d() is not None
