"""RMSNorm / LayerNorm as the DeepSeek reference computes them (fp32 statistics)."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers import batch_invariant


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add.

    `forward(x)` returns the normalised tensor; `forward(x, residual)` first adds the
    residual (in the input dtype, as the reference decoder layer does) and returns
    `(normed, new_residual)`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return batch_invariant.rms_norm(x, self.weight, self.variance_epsilon, self._norm)
        x = x + residual
        return batch_invariant.rms_norm(x, self.weight, self.variance_epsilon, self._norm), x


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the DSA indexer's k_norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
