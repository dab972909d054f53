"""Activations."""

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up over a fused [..., 2 * d] gate_up tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]
