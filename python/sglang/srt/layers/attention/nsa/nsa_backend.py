"""Native sparse attention (DSA) backend, torch reference implementation.

MLA over the paged latent cache, dense (DeepSeek-V3) or restricted to the indexer's top-k
(DeepSeek-V3.2 / GLM-5). Two equivalent formulations:
- plain ("MHA"): expand the cached latents with kv_b_proj into per-head K/V, then attend;
- absorbed ("MQA"): fold kv_b_proj's K half into q and its V half into the output, and attend
  directly over the latent cache (what decode kernels such as FlashMLA do).
`mla_path="auto"` uses absorbed wherever the indexer selected keys (decode, and extend with top-k:
the selected latents are gathered per query, as FlashMLA's sparse prefill does, so attention costs
O(tokens x index_topk) rather than O(tokens x context)) and plain for dense extend. Forcing "plain"
keeps the dense masked formulation, the reference the gathered path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

MLA_PATHS = ("auto", "plain", "absorbed")
# Queries of one request are processed in chunks so a [heads, chunk, kv_len] score block stays
# within this many elements (long prefills would otherwise need O(L^2) memory). GPUs get larger
# blocks: at 128K context the CPU figure leaves a handful of queries per block, launch-bound.
SCORE_BLOCK_ELEMS = 2**26
SCORE_BLOCK_ELEMS_CUDA = 2**29


def query_chunk(num_heads: int, kv_len: int, device: torch.device | str = "cpu") -> int:
    elems = SCORE_BLOCK_ELEMS_CUDA if torch.device(device).type == "cuda" else SCORE_BLOCK_ELEMS
    return max(1, elems // max(num_heads * kv_len, 1))


@dataclass
class NSAMetadata:
    """Per-forward KV layout, shared by every layer (and by the DSA indexer)."""

    kv_indices: list[torch.Tensor]  # per request: KV slots of positions [0, seq_len)
    kv_indices_padded: torch.Tensor  # [B, Lmax], padding slot 0
    kv_valid: torch.Tensor  # [B, Lmax] bool
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    starts: list[int]


def build_nsa_metadata(forward_batch: ForwardBatch) -> NSAMetadata:
    r2t = forward_batch.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens_cpu
    b = forward_batch.batch_size
    lmax = max(seq_lens) if seq_lens else 0
    padded = r2t[forward_batch.req_pool_indices, :lmax] if b else r2t[:0, :0]
    ar = torch.arange(lmax, device=padded.device)
    valid = ar[None, :] < forward_batch.seq_lens[:, None]
    padded = torch.where(valid, padded, torch.zeros_like(padded))
    starts = [0] * b
    acc = 0
    for i, e in enumerate(forward_batch.extend_seq_lens_cpu):
        starts[i] = acc
        acc += e
    return NSAMetadata(
        kv_indices=[padded[i, : seq_lens[i]] for i in range(b)],
        kv_indices_padded=padded,
        kv_valid=valid,
        seq_lens=list(seq_lens),
        prefix_lens=list(forward_batch.extend_prefix_lens_cpu),
        extend_lens=list(forward_batch.extend_seq_lens_cpu),
        starts=starts,
    )


def topk_to_mask(topk: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[..., K] request-local positions (-1 = none) -> [..., num_keys] bool selection mask."""
    idx = torch.where(topk >= 0, topk.long(), torch.full_like(topk, num_keys, dtype=torch.long))
    mask = torch.zeros(*topk.shape[:-1], num_keys + 1, dtype=torch.bool, device=topk.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :num_keys]


class NativeSparseAttnBackend(AttentionBackend):
    def __init__(self, token_to_kv_pool, mla_path: str = "auto") -> None:
        if mla_path not in MLA_PATHS:
            raise ValueError(f"mla_path {mla_path!r} not in {MLA_PATHS}")
        self.pool = token_to_kv_pool
        self.mla_path = mla_path

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = build_nsa_metadata(forward_batch)

    # ------------------------------------------------------------------------------------------
    def forward_mla(
        self,
        layer,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        forward_batch: ForwardBatch,
        topk_indices: torch.Tensor | None = None,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            self.pool.set_mla_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, latent, k_rope)
        md: NSAMetadata = forward_batch.attn_metadata
        absorbed = self.mla_path == "absorbed"  # for dense extend ("auto" -> plain)
        if forward_batch.forward_mode.is_decode():
            slots, valid = ((md.kv_indices_padded, md.kv_valid) if topk_indices is None
                            else self._topk_slots(md.kv_indices_padded, topk_indices))
            return self._attend_sparse(layer, q_nope, q_rope, slots, valid)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], layer.v_head_dim)
        for i in range(forward_batch.batch_size):
            s, e = md.starts[i], md.extend_lens[i]
            if e == 0:
                continue
            if topk_indices is not None and self.mla_path != "plain":
                step = query_chunk(layer.num_local_heads, topk_indices.shape[1], q_nope.device)
                for c in range(s, s + e, step):
                    rows = slice(c, min(c + step, s + e))
                    slots, valid = self._topk_slots(md.kv_indices[i][None], topk_indices[rows])
                    out[rows] = self._attend_sparse(layer, q_nope[rows], q_rope[rows], slots, valid)
                continue
            latent, k_rope = self.pool.get_mla_kv(layer.layer_id, md.kv_indices[i])  # [L, c], [L, r]
            kv = None if absorbed else self._expand_kv(layer, latent, q_nope.dtype)
            step = query_chunk(layer.num_local_heads, md.seq_lens[i], q_nope.device)
            for c in range(0, e, step):
                rows = slice(s + c, s + min(c + step, e))
                topk = topk_indices[rows] if topk_indices is not None else None
                mask = self._extend_mask(md, i, c, rows.stop - rows.start, topk, q_nope.device)
                if absorbed:
                    out[rows] = self._attend_absorbed(layer, q_nope[rows], q_rope[rows], latent[None], k_rope[None],
                                                      mask)
                else:
                    out[rows] = self._attend_plain(layer, q_nope[rows], q_rope[rows], kv, k_rope, mask)
        return out

    @staticmethod
    def _topk_slots(kv_indices: torch.Tensor, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request-local top-k positions [n, K] (-1 = none) -> (KV slots [n, K], valid [n, K]).
        kv_indices is [n, L] (one row per query) or [1, L] (all queries of one request)."""
        idx = topk.long().clamp(min=0)
        slots = kv_indices.expand(idx.shape[0], -1).gather(1, idx)
        return slots, topk >= 0

    # -- masks -----------------------------------------------------------------------------------
    @staticmethod
    def _extend_mask(md: NSAMetadata, i: int, q_off: int, n: int, topk: torch.Tensor | None, device) -> torch.Tensor:
        """[n, L] allowed keys of request i's queries q_off .. q_off + n (causal, and top-k if any)."""
        pl, L = md.prefix_lens[i], md.seq_lens[i]
        qpos = torch.arange(pl + q_off, pl + q_off + n, device=device)
        mask = torch.arange(L, device=device)[None, :] <= qpos[:, None]
        if topk is not None:
            mask &= topk_to_mask(topk, L)
        return mask

    @staticmethod
    def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scores.float().masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1)

    # -- plain (MHA) path ---------------------------------------------------------------------
    @staticmethod
    def _expand_kv(layer, latent: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.nn.functional.linear(latent.to(dtype), layer.kv_b_proj.weight)
        kv = kv.view(latent.shape[0], layer.num_local_heads, layer.qk_nope_head_dim + layer.v_head_dim)
        k_nope, v = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
        return k_nope, v

    def _attend_plain(self, layer, q_nope, q_rope, kv, k_rope, mask) -> torch.Tensor:
        k_nope, v = kv
        scores = torch.einsum("ehd,lhd->hel", q_nope, k_nope)
        scores = scores + torch.einsum("ehr,lr->hel", q_rope, k_rope.to(q_rope.dtype))
        probs = self._softmax(scores * layer.scaling, mask[None])
        return torch.einsum("hel,lhv->ehv", probs.to(v.dtype), v)

    # -- absorbed (MQA) path ------------------------------------------------------------------
    def _attend_absorbed(self, layer, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Absorbed MLA of n queries over keys shared by all of them (latent [1, K, c], k_rope
        [1, K, r]) or gathered per query ([n, K, .]); mask [n, K] says which keys each may see."""
        w_kc, w_vc = layer.absorbed_weights()
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_kc)
        latent = latent.to(q_lat.dtype)
        scores = torch.matmul(q_lat, latent.transpose(-1, -2))  # [n, h, K]
        scores = scores + torch.matmul(q_rope, k_rope.to(q_rope.dtype).transpose(-1, -2))
        probs = self._softmax(scores * layer.scaling, mask[:, None, :])
        return torch.einsum("nhc,hvc->nhv", torch.matmul(probs.to(q_lat.dtype), latent), w_vc)

    def _attend_sparse(self, layer, q_nope, q_rope, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA of n queries, each over its own gathered keys: slots / valid [n, K].
        Top-k indices are causal-valid by construction, so no causal mask is applied here."""
        latent, k_rope = self.pool.get_mla_kv(layer.layer_id, slots)  # [n, K, c], [n, K, r]
        return self._attend_absorbed(layer, q_nope, q_rope, latent, k_rope, valid)
