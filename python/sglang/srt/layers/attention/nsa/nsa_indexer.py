"""DSA lightning indexer: scores every cached token for each query and keeps the top-k.

    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * D^-0.5),   w = weights_proj(x) * H^-0.5

Index K lives in the NSA pool (FP8 + scales by default). In the FP8 mode q and k are Hadamard
rotated before quantisation and q is quantised too, as the DeepSeek kernels do; the exact modes
(bf16 / fp32 index K) skip both, which is what the transformers reference computes.
Requests whose KV length is at most `index_topk` skip scoring: every causal token is selected.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.attention.nsa.nsa_backend import query_chunk
from sglang.srt.layers.attention.nsa.quant import fp8_round_trip, hadamard_rotate
from sglang.srt.layers.layernorm import LayerNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
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

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor | None:
        """Stores this step's index K and returns top-k positions [T, index_topk] (int32, -1
        padded), or None when no request in the batch is longer than index_topk."""
        pool = forward_batch.token_to_kv_pool
        q, k = self._project(x, q_lora, positions)
        fp8 = pool.is_fp8
        rotate = fp8 and not (self.head_dim & (self.head_dim - 1))
        if rotate:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        pool.set_index_k(self.layer_id, forward_batch.out_cache_loc, k)

        md = forward_batch.attn_metadata
        if not md.seq_lens or max(md.seq_lens) <= self.index_topk:
            return None
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5  # [T, H] fp32
        qf = fp8_round_trip(q) if fp8 else q.float()
        return compute_topk(self.layer_id, qf, weights, self.softmax_scale, self.index_topk, pool, md,
                            positions, forward_batch.forward_mode.is_decode())


def index_score_dtype(pool, device: torch.device) -> torch.dtype:
    """The scoring matmul's input dtype. FP8 index K on a GPU scores in bf16 (tensor cores; fp32
    accumulation, bf16 output), as the FP8 kernels do in fp8: its rounding (2^-9 relative) is far
    below the FP8 quantisation it follows. Exact modes, and any CPU run, score in fp32."""
    return torch.bfloat16 if pool.is_fp8 and device.type == "cuda" else torch.float32


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """sum_h w[., h] * relu(q[., h] . k * scale): q [B, H, D], k [B or 1, L, D], w [B, H] -> [B, L] fp32.
    Computed in q's dtype (see index_score_dtype); the scale is folded into w (relu commutes with
    a positive scale) so the [B, H, L] block is touched by one matmul, one in-place relu, one matmul."""
    dtype = q.dtype
    scores = torch.relu_(torch.matmul(q, k.to(dtype).transpose(-1, -2)))  # [B, H, L]
    w = (weights.float() * softmax_scale).to(dtype)
    return torch.matmul(w.unsqueeze(1), scores).squeeze(1).float()


def compute_topk(layer_id: int, q: torch.Tensor, weights: torch.Tensor, softmax_scale: float, topk: int,
                 pool, md, positions: torch.Tensor, is_decode: bool) -> torch.Tensor:
    """Top-k request-local positions per query token, all causal-valid; -1 where fewer exist."""
    t = q.shape[0]
    q = q.to(index_score_dtype(pool, q.device))
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    ar = torch.arange(topk, device=q.device, dtype=torch.int32)
    if is_decode:
        # One query per request: score the padded [B, Lmax] batch at once.
        lmax = md.kv_indices_padded.shape[1]
        kk = pool.get_index_k(layer_id, md.kv_indices_padded)  # [B, L, D]
        scores = index_scores(q, kk, weights, softmax_scale).masked_fill(~md.kv_valid, float("-inf"))
        k_eff = min(topk, lmax)
        vals, idx = scores.topk(k_eff, dim=-1)
        out[:, :k_eff] = torch.where(torch.isinf(vals), -1, idx).to(torch.int32)
        return out
    for i, (s, e, L) in enumerate(zip(md.starts, md.extend_lens, md.seq_lens)):
        if e == 0:
            continue
        if L <= topk:
            # Short request: no scoring, every causal token (indices stay causal-valid, as sparse
            # kernels expect: they apply no causal mask of their own).
            pos = positions[s : s + e, None]
            out[s : s + e] = torch.where(ar[None, :] <= pos, ar[None, :], -1)
            continue
        kk = pool.get_index_k(layer_id, md.kv_indices[i])[None].to(q.dtype)  # [1, L, D]
        keys = torch.arange(L, device=q.device)[None, :]
        step = query_chunk(q.shape[1], L, q.device)
        for c in range(s, s + e, step):
            rows = slice(c, min(c + step, s + e))
            scores = index_scores(q[rows], kk, weights[rows], softmax_scale)
            vals, idx = scores.masked_fill(keys > positions[rows, None], float("-inf")).topk(topk, dim=-1)
            out[rows] = torch.where(torch.isinf(vals), -1, idx).to(torch.int32)
    return out
