"""DSA lightning indexer: scores every cached token for each query and keeps the top-k.

    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * D^-0.5),   w = weights_proj(x) * H^-0.5

This module owns the projections (q from the q LoRA, k from the hidden state, rope, and in the FP8
mode the Hadamard rotation DeepSeek applies before quantising); the attention backend owns the
index-K cache access, the scoring kernels and the top-k (`store_index_k`, `index_topk`), because
it owns the batch metadata. The helpers below define the scoring math both backends follow.

Top-k semantics (one rule, `sgl_kernel.topk.fast_topk_ref`): each row's top index_topk causal
positions in ascending order, -1 padded; ties keep the lower position, so the selection depends
only on the row's own scores -- never on the batch it was computed in. A row no longer than
index_topk keeps all its causal positions without scoring.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.attention.nsa.quant import hadamard_rotate
from sglang.srt.layers.layernorm import LayerNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.mem_cache.index_k_format import quantize_fp8_per_block
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class Indexer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        index_n_heads: int,
        index_head_dim: int,
        rope_head_dim: int,
        index_topk: int,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_head_dim = index_n_heads, index_head_dim, rope_head_dim
        self.index_topk, self.layer_id = index_topk, layer_id
        self.softmax_scale = index_head_dim**-0.5
        self.wq_b = ReplicatedLinear(q_lora_rank, index_n_heads * index_head_dim, dtype=dtype)
        self.wk = ReplicatedLinear(hidden_size, index_head_dim, dtype=dtype)
        self.k_norm = LayerNorm(index_head_dim, eps=1e-6)
        # Kept in fp32 like the reference (its output weights the per-head scores).
        self.weights_proj = ReplicatedLinear(hidden_size, index_n_heads, dtype=torch.float32)
        self.rotary_emb = rotary_emb

    def _project(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor):
        t = x.shape[0]
        q = self.wq_b(q_lora).view(t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        r = self.rope_head_dim
        q_rot, k_rot = self.rotary_emb(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)
        return q, k

    def _rotates(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.token_to_kv_pool.index_k_fp8 and not (self.head_dim & (self.head_dim - 1))

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Stores this step's index K and returns top-k positions [T, index_topk] (int32, -1 padded)."""
        q, k = self._project(x, q_lora, positions)
        if self._rotates(forward_batch):
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        backend = forward_batch.attn_backend
        backend.store_index_k(self.layer_id, k, forward_batch)
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5  # [T, H] fp32
        return backend.index_topk(self, q, weights, forward_batch)

    def store_k(self, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> None:
        """Store this step's index K without scoring: a layer that reuses a handed top-k (the NextN
        draft given the target's) still needs its own index K for the steps that score."""
        k = self.k_norm(self.wk(x))
        r = self.rope_head_dim
        cos, sin = self.rotary_emb.cos_sin(positions, k.dtype)
        k = torch.cat([self.rotary_emb._rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        if self._rotates(forward_batch):
            k = hadamard_rotate(k)
        forward_batch.attn_backend.store_index_k(self.layer_id, k, forward_batch)


def causal_topk(positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Every causal position of each token (rows no longer than topk): [T, topk] int32, -1 padded."""
    ar = torch.arange(topk, device=positions.device, dtype=torch.int32)
    return torch.where(ar[None, :] <= positions[:, None], ar[None, :], -1)


def index_score_dtype(pool, device: torch.device) -> torch.dtype:
    """The reference scoring matmul's input dtype. FP8 index K on a GPU scores in bf16 (tensor
    cores; fp32 accumulation): FP8 values are exact in bf16. Exact modes and CPU score in fp32."""
    return torch.bfloat16 if pool.index_k_fp8 and device.type == "cuda" else torch.float32


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """sum_h w[., h] * relu(q[., h] . k * scale): q [B, H, D], k [B or 1, L, D], w [B, H] -> [B, L] fp32.
    Computed in q's dtype (see index_score_dtype); the scale is folded into w (relu commutes with
    a positive scale) so the [B, H, L] block is touched by one matmul, one in-place relu, one matmul."""
    dtype = q.dtype
    scores = torch.relu_(torch.matmul(q, k.to(dtype).transpose(-1, -2)))  # [B, H, L]
    w = (weights.float() * softmax_scale).to(dtype)
    return torch.matmul(w.unsqueeze(1), scores).squeeze(1).float()


def fold_fp8_query(q: torch.Tensor, weights: torch.Tensor, softmax_scale: float,
                   compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 mode for the scoring kernels: quantise q per (token, head) like the index K (one scale
    per vector, index_head_dim <= 128) and fold that scale and the softmax scale into the head
    weights, so the kernel multiplies FP8 values exactly. Returns (q8 values, folded w fp32)."""
    if q.shape[-1] > 128:
        raise ValueError("the FP8 indexer kernel needs index_head_dim <= 128 (one scale per vector)")
    q8, qs = quantize_fp8_per_block(q)
    return q8.to(compute_dtype), weights.float() * softmax_scale * qs[..., 0]
