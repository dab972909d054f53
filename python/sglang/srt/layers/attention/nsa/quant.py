"""The Hadamard rotation DeepSeek applies to DSA indexer q/k before quantising (it spreads outliers
over all dims; being orthogonal it leaves q.k unchanged, so the exact mode skips it). The FP8
per-block format itself is the index-K pool's: `sglang.srt.mem_cache.index_k_format`."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(d: int, device: str) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix (symmetric, orthogonal), built once per size."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d**-0.5).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform over the last dim (a power of two), computed in fp32."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {d}")
    from sglang.srt.layers import batch_invariant

    rows = x.float().reshape(-1, d)
    y = batch_invariant.linear(rows, _hadamard_matrix(d, str(x.device)).t()).view(x.shape)
    return y.to(x.dtype) if x.dtype.is_floating_point and x.dtype != torch.float32 else y
