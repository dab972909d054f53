"""When the prefill top-k runs its prefilter, and the scratch that costs (sgl_kernel.topk).

Importing this module imports neither torch nor Triton: the memory plan sizes the prefill's score
chunks with it before any kernel exists, and the NSA Triton backend cuts its chunks by the same
bytes per row.

The prefilter (`fast_topk(..., prefilter=True)`, the fused path) samples PREFILTER_SAMPLE columns of
a row for a threshold, gathers the columns above it into [rows, 2k] value / column scratch and runs
the radix passes over those. On the H100 at V3.2's shapes it took the 32K x 32K top-k (k 2048) from
8.64 to 5.62 ms (2026-12-07 (f)); a row much shorter than the sample gains nothing, so rows narrower
than PREFILTER_MIN_WIDTH keep the plain fused path (the result is the same either way).
"""

from __future__ import annotations

PREFILTER_MIN_WIDTH = 16384  # the measured regime (32K keys); below it the plain fused path


def prefilter_for(width: int, k: int) -> bool:
    """Score rows of `width` columns take the prefilter (a function of the shapes only)."""
    return width >= PREFILTER_MIN_WIDTH and width > 2 * k


def scratch_bytes_per_row(width: int, k: int) -> int:
    """Top-k scratch per score row: the prefilter's fp32 values and int32 columns, 2k of each."""
    return 2 * k * (4 + 4) if prefilter_for(width, k) else 0
