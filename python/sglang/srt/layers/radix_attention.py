"""RadixAttention: an MLA layer's handle to the attention backend.

It carries what a backend needs from the layer -- head geometry, the softmax scale, its slot in
the KV pool and the weight-absorbed projections -- so backends never reach into model modules.

Absorbed MLA: with kv_b_proj split per head into w_kc [H, nope, C] (key half) and w_vc [H, v, C]
(value half), q_nope . (w_kc latent) = (q_nope w_kc) . latent, so attention runs directly over
the cached latents with q_lat = q_nope w_kc, and the output is o_lat w_vc^T.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers import batch_invariant


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id  # the layer's slot in its KV pool
        self.num_local_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.scaling = scaling
        self.kv_b_weight: torch.Tensor | None = None
        self.w_kc: torch.Tensor | None = None  # [H, nope, C]
        self.w_vc: torch.Tensor | None = None  # [H, v, C]

    def set_kv_b_proj(self, weight: torch.Tensor) -> None:
        """Called after weight loading with kv_b_proj's [H * (nope + v), C] weight."""
        w = weight.view(self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.kv_b_weight = weight
        # Views, not copies (the bmms take any batch stride; rows stay contiguous): a copy held a
        # second kv_b per layer, ~2 GB over V3.2's 61 layers unsharded.
        self.w_kc = w[:, : self.qk_nope_head_dim]
        self.w_vc = w[:, self.qk_nope_head_dim :]

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> q_lat [T, H, C]."""
        return batch_invariant.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)

    def project_out(self, o_lat: torch.Tensor) -> torch.Tensor:
        """[T, H, C] -> [T, H, v]."""
        return batch_invariant.bmm(o_lat.transpose(0, 1), self.w_vc.transpose(1, 2)).transpose(0, 1)

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                forward_batch, topk_indices: torch.Tensor | None = None, save_kv_cache: bool = True) -> torch.Tensor:
        return forward_batch.attn_backend.forward_mla(q_nope, q_rope, latent, k_rope, self, forward_batch,
                                                      topk_indices, save_kv_cache)
