"""Rotary position embeddings: default, linear and YaRN scaling; interleaved or half-split.

MLA's rope part is stored interleaved (pairs (x0, x1), (x2, x3), ...) in DeepSeek checkpoints;
the DSA indexer of DeepSeek-V3.2 uses the half-split ("neox") layout. The interleaved form is
rotated pairwise and written back de-interleaved ([rotated evens | rotated odds]), exactly as the
transformers reference does: q and k get the same permutation, so dot products are unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters_of(hf_config) -> dict[str, Any]:
    """The rope dict of a config in transformers-5 form (`rope_parameters`), accepting the older
    `rope_scaling` + `rope_theta` spelling that DeepSeek checkpoints ship."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_multiplier(rope_parameters: dict[str, Any] | None) -> float:
    """mscale^2 applied to the MLA softmax scale when YaRN sets `mscale_all_dim`."""
    if not rope_parameters or rope_parameters.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    m = _yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)
    return m * m


def compute_inv_freq(
    rope_parameters: dict[str, Any], dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin attention factor for one rope configuration."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    base = float(rope_parameters.get("rope_theta", 10000.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type == "linear":
        return 1.0 / (pos_freqs * float(rope_parameters["factor"])), 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_type {rope_type!r}: supported are default, linear, yarn")

    orig_max = rope_parameters.get("original_max_position_embeddings", max_position_embeddings)
    factor = rope_parameters.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig_max
    attention_factor = rope_parameters.get("attention_factor")
    mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies rope to the last dim (size `rotary_dim`) of q and k, with a cached cos/sin table."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        interleaved: bool,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        inv_freq, attention_factor = compute_inv_freq(
            rope_parameters, rotary_dim, max_position_embeddings or max_position
        )
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        cache = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions are bounded by the context length on the host (ModelRunner.forward): no check here.
        cs = self.cos_sin_cache[positions].to(dtype)
        cos, sin = cs.chunk(2, dim=-1)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, rotary_dim], k: [T, Hk, rotary_dim] or [T, rotary_dim]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        qc, qs = cos[:, None, :], sin[:, None, :]
        kc, ks = (qc, qs) if k.dim() == 3 else (cos, sin)
        return self._rotate(q, qc, qs), self._rotate(k, kc, ks)
