"""Kernel timing shared by the kernel benchmarks: the median milliseconds of `fn`.

GPU: triton.testing.do_bench (warm-up and repeats inside, median); CPU (the Triton interpreter or
torch's CPU kernels): one untimed call (JIT compile / autotune stay out), then the median of
`repeats` wall-clock calls."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], device: str, repeats: int, gpu_rep_ms: int = 200) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=gpu_rep_ms, return_mode="median")
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_graph(fn: Callable[[], object]):
    """`fn` captured in a CUDA graph, after one run on a side stream (compiles and autotunes stay
    out of the capture): (graph, the eager output, the graph's output buffer), the graph not yet
    replayed. Capturing also proves `fn` has no host syncs and no data-dependent shapes."""
    import torch

    out = fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out = fn()
    return g, out, g_out


L2_BYTES = 50 << 20  # H100 SXM 50 MB, H200 the same: the working set a chain must exceed


def rotations(bytes_per_set: int, at_least: int = 4, at_most: int = 64) -> int:
    """How many input sets a chain rotates through so that the sets together are twice the L2: each
    call then reads its operand from HBM, as a model's layers each read their own weights."""
    return max(at_least, min(at_most, -(-2 * L2_BYTES // max(1, bytes_per_set))))


def chain_graph_ms(calls: list[Callable[[], object]], device: str, repeats: int) -> float | None:
    """Milliseconds per call of `calls` captured back to back in one CUDA graph (each on its own
    inputs): a decode step's view of a microseconds-long kernel. A one-kernel graph's replay also pays
    the graph launch (several us) and serves its operand from L2 after the first replay; METHOD.md:
    capture many launches and rotate among input sets. None off CUDA."""
    if device != "cuda":
        return None
    import torch

    g, _, _ = cuda_graph(lambda: [c() for c in calls])
    g.replay()
    torch.cuda.synchronize()
    ms = median_ms(g.replay, device, repeats)
    del g
    return ms / len(calls)
